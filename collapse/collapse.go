// Package collapse keeps, per user and collapse key, the newest send seen
// and the last one forwarded, in Redis, so that of a series of sends that
// replace each other ("the price drop of product 42") only the newest goes:
// a send older than another of its key (by submission time), held or late,
// collapses, and with a window a send whose key reached the user within it
// does too.
//
// One hash per user (PREFIX:{USER_ID}:k, in the slot of the user's log, so
// that what removes a user's keys removes it too), one field per key of a
// few dozen bytes, kept for the rules' retain after the user's last keyed
// send. Check registers a send and answers whether it collapses (collapse.lua:
// a call carries up to 32 sends of one node, the nodes' pipelines sent at once); Sent
// records a forwarded send, only when a window needs it. A user's sends of one key are checked
// newest first within a call, so that of those a batch holds only the newest
// goes.
package collapse

import (
	"cmp"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

//go:embed collapse.lua
var source string

var script = redis.NewScript(source)

// Client is what Registry needs of a Redis client (a *redis.ClusterClient
// or a *redis.Client).
type Client interface {
	redis.Scripter
}

// Config configures a Registry.
type Config struct {
	// Client runs the script (a *redis.ClusterClient or *redis.Client). (Required)
	Client Client
	// Timeout bounds each call (one attempt); 0: none.
	Timeout time.Duration
	// MinReplicasAcked, when above 0, makes each node's pipeline end with
	// WAIT MinReplicasAcked, ReplicaTimeout, and a call fails unless it is
	// reached: what a call wrote survives a failover (as the decisions' own
	// capping.Config.MinReplicasAcked).
	MinReplicasAcked int
	ReplicaTimeout   time.Duration
}

// Registry is the users' collapse keys in Redis. Safe for concurrent use.
type Registry struct {
	cfg Config
}

// New returns a Registry.
func New(cfg Config) (*Registry, error) {
	if cfg.Client == nil {
		return nil, errors.New("collapse: a Redis client is required")
	}
	if cfg.MinReplicasAcked > 0 && cfg.ReplicaTimeout <= 0 {
		cfg.ReplicaTimeout = 500 * time.Millisecond
	}
	return &Registry{cfg: cfg}, nil
}

// Send is one send with a collapse key.
type Send struct {
	User  string // the user's log key, PREFIX:{USER_ID}: the registry is its ":k"
	Key   string // its collapse key
	Job   string // its job id
	Since time.Time
	// Window and Retain are the rules' (rules.CollapsePlan).
	Window, Retain time.Duration
}

// Verdict is what Check answers of a send.
type Verdict struct {
	// By names the send that replaces it: a newer one of its key ("newer"),
	// or one of its key forwarded within the window ("window"); "": the
	// send may go.
	By  string
	Why string
}

// Collapsed reports whether the send must not go.
func (v Verdict) Collapsed() bool { return v.By != "" }

// Check registers each send as its key's newest unless a newer one was seen,
// and answers whether it collapses, at now. An error leaves the verdicts
// unknown (some sends may be registered: a second Check answers the same).
func (r *Registry) Check(ctx context.Context, sends []Send, now time.Time) ([]Verdict, error) {
	// A batch's sends of one user and key go newest first: the older ones
	// then see it, and collapse.
	order := make([]int, len(sends))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		sa, sb := &sends[a], &sends[b]
		return cmp.Or(cmp.Compare(sa.User, sb.User), cmp.Compare(sa.Key, sb.Key), sb.Since.Compare(sa.Since), cmp.Compare(sb.Job, sa.Job))
	})
	ordered := make([]Send, len(sends))
	for k, i := range order {
		ordered[k] = sends[i]
	}
	replies, err := r.run(ctx, "check", ordered, func(k int) time.Time { return ordered[k].Since }, now)
	if err != nil {
		return nil, err
	}
	out := make([]Verdict, len(sends))
	for k, i := range order {
		out[i] = Verdict{By: replies[2*k], Why: replies[2*k+1]}
	}
	return out, nil
}

// Sent records that each send was forwarded at its time in at (for the
// window).
func (r *Registry) Sent(ctx context.Context, sends []Send, at []time.Time, now time.Time) error {
	_, err := r.run(ctx, "sent", sends, func(k int) time.Time { return at[k] }, now)
	return err
}

// perCall is the most sends of one call: a call's own cost and its
// arguments' parsing are paid once for them.
const perCall = 32

// run sends op for sends, at at(k), in calls of up to perCall sends of one
// node, a pipeline per node (ending with a WAIT when durable), the nodes'
// pipelines at once, and returns
// the reply pairs in order. A node that did not know the script (new,
// restarted) gets it on every master, and the calls are sent again: both
// operations answer the same twice. A send whose key another node holds
// (the cluster moved its slot) fails the attempt: the caller's retry finds
// its node.
func (r *Registry) run(ctx context.Context, op string, sends []Send, at func(int) time.Time, now time.Time) ([]string, error) {
	if len(sends) == 0 {
		return nil, nil
	}
	if r.cfg.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, r.cfg.Timeout)
		defer cancel()
	}
	for attempt := 0; ; attempt++ {
		replies, err := r.send(ctx, op, sends, at, now)
		if err == nil || attempt > 0 || !redis.HasErrorPrefix(err, "NOSCRIPT") {
			return replies, err
		}
		if err := r.load(ctx); err != nil {
			return nil, fmt.Errorf("collapse: loading the script: %w", err)
		}
	}
}

// call is one script call: the sends of one node it carries.
type call struct {
	cmd   *redis.Cmd
	sends []int
}

// nodeCalls are one node's pipeline: its calls, and its WAIT when durable.
type nodeCalls struct {
	node  *redis.Client
	pipe  redis.Pipeliner
	calls []call
	wait  *redis.IntCmd
}

func (r *Registry) send(ctx context.Context, op string, sends []Send, at func(int) time.Time, now time.Time) ([]string, error) {
	byNode := map[*redis.Client][]int{}
	var nodes []*redis.Client // in the order first met
	for k := range sends {
		c, err := r.master(ctx, sends[k].User+":k")
		if err != nil {
			r.reload(ctx)
			return nil, fmt.Errorf("collapse: %w", err)
		}
		if byNode[c] == nil {
			nodes = append(nodes, c)
		}
		byNode[c] = append(byNode[c], k)
	}
	pipes := make([]nodeCalls, len(nodes))
	for i, c := range nodes {
		p := &pipes[i]
		p.node, p.pipe = c, c.Pipeline()
		for ks := byNode[c]; len(ks) > 0; {
			n := min(len(ks), perCall)
			args := make([]any, 0, 2+6*n)
			args = append(args, op, now.UnixMilli())
			for _, k := range ks[:n] {
				s := &sends[k]
				args = append(args, s.User+":k", s.Key, s.Job, at(k).UnixMilli(), s.Window.Milliseconds(),
					max(s.Retain, s.Window, time.Millisecond).Milliseconds())
			}
			p.calls = append(p.calls, call{cmd: script.EvalSha(ctx, p.pipe, []string{sends[ks[0]].User + ":k"}, args...), sends: ks[:n]})
			ks = ks[n:]
		}
		if r.cfg.MinReplicasAcked > 0 {
			p.wait = redis.NewIntCmd(ctx, "wait", r.cfg.MinReplicasAcked, r.cfg.ReplicaTimeout.Milliseconds())
			_ = p.pipe.Process(ctx, p.wait)
		}
	}
	var wg sync.WaitGroup // the nodes' pipelines at once: a round trip for all, not one per node
	for i := range pipes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _ = pipes[i].pipe.Exec(ctx) // errors are read per call
		}()
	}
	wg.Wait()
	for i := range pipes { // a node that lost the script first: run loads it and sends every call again
		for _, cl := range pipes[i].calls {
			if err := cl.cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
				return nil, err
			}
		}
	}
	replies := make([]string, 2*len(sends))
	for i := range pipes {
		p := &pipes[i]
		addr := p.node.Options().Addr
		for _, cl := range p.calls {
			v, err := cl.cmd.StringSlice()
			switch {
			case err != nil:
				r.reload(ctx)
				return nil, fmt.Errorf("collapse: %s on %s: %w", op, addr, err)
			case len(v) != 2*len(cl.sends):
				return nil, fmt.Errorf("collapse: %s on %s: %d replies for %d sends", op, addr, len(v), len(cl.sends))
			}
			for j, k := range cl.sends {
				if v[2*j] == "!" {
					r.reload(ctx)
					return nil, fmt.Errorf("collapse: %s of user key %s on %s: %s", op, sends[k].User, addr, v[2*j+1])
				}
				replies[2*k], replies[2*k+1] = v[2*j], v[2*j+1]
			}
		}
		if p.wait != nil {
			if acked, err := p.wait.Result(); err != nil || acked < int64(r.cfg.MinReplicasAcked) {
				return nil, fmt.Errorf("collapse: %d of %d replicas of %s acknowledged within %v (%v)", acked, r.cfg.MinReplicasAcked, addr, r.cfg.ReplicaTimeout, err)
			}
		}
	}
	return replies, nil
}

// master is the node that owns key.
func (r *Registry) master(ctx context.Context, key string) (*redis.Client, error) {
	switch c := r.cfg.Client.(type) {
	case *redis.ClusterClient:
		return c.MasterForKey(ctx, key)
	case *redis.Client:
		return c, nil
	}
	return nil, fmt.Errorf("cannot find the node of a key with a %T", r.cfg.Client)
}

// reload makes a cluster client read the cluster's slots again (a
// failover moved some: the next attempt finds their new masters).
func (r *Registry) reload(ctx context.Context) {
	if c, ok := r.cfg.Client.(*redis.ClusterClient); ok {
		c.ReloadState(ctx)
	}
}

// load loads the script on every master.
func (r *Registry) load(ctx context.Context) error {
	if c, ok := r.cfg.Client.(*redis.ClusterClient); ok {
		return c.ForEachMaster(ctx, func(ctx context.Context, n *redis.Client) error { return script.Load(ctx, n).Err() })
	}
	return script.Load(ctx, r.cfg.Client).Err()
}

// Entry is one collapse key of a user, as capper check shows it.
type Entry struct {
	Key       string
	Newest    string    // the job id of its newest send seen
	Since     time.Time // that send's submission time
	Sent      string    // the job id of its last send forwarded (recorded with a window); "": none
	SentAt    time.Time
	ExpiresIn time.Duration // the user's keys are kept this much longer
}

// Keys returns user's collapse keys (user: the user's log key), sorted.
func (r *Registry) Keys(ctx context.Context, user string) ([]Entry, error) {
	c, ok := r.cfg.Client.(redis.Cmdable)
	if !ok {
		return nil, fmt.Errorf("collapse: cannot read keys with a %T", r.cfg.Client)
	}
	all, err := c.HGetAll(ctx, user+":k").Result()
	if err != nil {
		return nil, fmt.Errorf("collapse: %w", err)
	}
	ttl, err := c.PTTL(ctx, user+":k").Result()
	if err != nil {
		return nil, fmt.Errorf("collapse: %w", err)
	}
	out := make([]Entry, 0, len(all))
	for k, v := range all {
		e, err := parse(k, v)
		if err != nil {
			return nil, err
		}
		e.ExpiresIn = ttl
		out = append(out, e)
	}
	slices.SortFunc(out, func(a, b Entry) int { return cmp.Compare(a.Key, b.Key) })
	return out, nil
}

// parse reads a field's value (see collapse.lua).
func parse(key, v string) (Entry, error) {
	if len(v) < 18 {
		return Entry{}, fmt.Errorf("collapse: key %q: a value of %d bytes", key, len(v))
	}
	be := func(b string) int64 {
		var n uint64
		for i := range 8 {
			n = n<<8 | uint64(b[i])
		}
		return int64(n)
	}
	n := int(v[16])<<8 | int(v[17])
	if len(v) < 18+n {
		return Entry{}, fmt.Errorf("collapse: key %q: a value of %d bytes", key, len(v))
	}
	e := Entry{Key: key, Newest: v[18 : 18+n], Since: time.UnixMilli(be(v[:8])), Sent: v[18+n:]}
	if d := be(v[8:16]); d > 0 {
		e.SentAt = time.UnixMilli(d)
	}
	return e, nil
}

// String is the entry as capper check prints it.
func (e Entry) String() string {
	s := "newest " + strconv.Quote(e.Newest) + " submitted " + e.Since.UTC().Format(time.RFC3339Nano)
	if e.Sent != "" {
		s += ", last forwarded " + strconv.Quote(e.Sent) + " at " + e.SentAt.UTC().Format(time.RFC3339Nano)
	}
	return s
}
