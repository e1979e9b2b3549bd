package capping

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Client is what a Limiter needs of Redis: a *redis.ClusterClient, or a
// *redis.Client for a single node. With a cluster client the Limiter groups
// each batch by the master that owns each user itself (so that a WAIT can
// follow the calls on the same connection), reloads the cluster topology as
// soon as a node fails or redirects, and loads the function library on a node
// that does not have it (a node restarted without persistence, a FUNCTION
// FLUSH).
type Client interface {
	Pipeline() redis.Pipeliner
	FunctionLoadReplace(ctx context.Context, code string) *redis.StringCmd
}

// node is one Redis server a pipeline goes to: a cluster master's client, or
// the single-node Client itself. It needs what a Client offers.
type node = Client

// DefaultKeyPrefix is Config.KeyPrefix's default.
const DefaultKeyPrefix = "fc"

// Config configures a Limiter. A zero value means the default of each field.
type Config struct {
	// KeyPrefix starts every key; a user's log is PREFIX:{USER_ID}. Defaults to "fc".
	KeyPrefix string
	// Clock returns the time decisions are taken at. Defaults to time.Now.
	// Workers' clocks must agree within ClockMargin (see the package doc).
	Clock func() time.Time
	// ClockMargin keeps log entries this much longer than the longest window
	// before evicting them, and the key's TTL as much longer, so that a
	// replica whose clock runs ahead by up to ClockMargin never deletes entries
	// that a correctly clocked replica still counts. Set it to the largest
	// clock skew tolerated (the daemon uses max_clock_skew). Defaults to 0.
	ClockMargin time.Duration
	// Timeout bounds one Decide or Peek call (one attempt), script reloads and
	// the replica WAIT included. Defaults to 3s; a negative value means no
	// timeout beyond the context's.
	Timeout time.Duration
	// ScriptReloads is how many times one call loads the function library
	// again on a node that answers "Function not found" (a node restarted
	// without persistence, a FUNCTION FLUSH) and retries the failed requests;
	// from the second retry on the script's body is sent (EVAL). Defaults to 3.
	ScriptReloads int
	// Pipelines splits a batch into up to this many pipelines by user, sent
	// concurrently (each still grouped per node), so Redis is not idle while one
	// is in flight. A user's requests stay in one pipeline, in order. Batches of
	// fewer than 64 requests use one pipeline. Defaults to 4.
	Pipelines int
	// MinReplicasAcked, when above 0, makes decisions durable: each node's
	// pipeline ends with WAIT MinReplicasAcked, on the same connection, and a
	// request that recorded a send (or found it recorded) on a node whose WAIT
	// falls short fails with ErrNotReplicated instead of being answered allowed.
	// Retrying it is safe (the job id makes it a duplicate). Defaults to 0: the
	// answer does not wait for replication, and a master that crashes before
	// replicating can lose recorded sends (see the package doc).
	MinReplicasAcked int
	// ReplicaTimeout bounds the WAIT when MinReplicasAcked is set. Defaults to 500ms.
	ReplicaTimeout time.Duration
	// NearCache is how many users' logs the near cache may keep (see the
	// package doc): copies of the logs of users whom a cap blocks, from which
	// their next sends are answered "capped" without a call, exactly as the
	// script would answer. Least recently used copies go first. 0: no cache.
	NearCache int
	// ScriptOnly sends every decision to the script. By default a send to a
	// user who has no log is recorded with one SET NX PX of the log the
	// script would write (see newlog.go), and decided by the script only if
	// the user turns out to have one.
	ScriptOnly bool
}

// Validate reports whether the configuration is usable.
func (c Config) Validate() error {
	if strings.ContainsAny(c.KeyPrefix, "{}") {
		return fmt.Errorf("capping: key prefix %q must not contain { or }: the hash tag is the user id", c.KeyPrefix)
	}
	if c.ScriptReloads < 0 {
		return fmt.Errorf("capping: script reloads %d must not be negative", c.ScriptReloads)
	}
	if c.Pipelines < 0 || c.Pipelines > 64 {
		return fmt.Errorf("capping: pipelines %d is not in 0..64", c.Pipelines)
	}
	if c.NearCache < 0 {
		return fmt.Errorf("capping: near cache size %d must not be negative", c.NearCache)
	}
	if c.ClockMargin < 0 {
		return fmt.Errorf("capping: clock margin %v must not be negative", c.ClockMargin)
	}
	if c.MinReplicasAcked < 0 || c.ReplicaTimeout < 0 {
		return fmt.Errorf("capping: min replicas acked %d and replica timeout %v must not be negative", c.MinReplicasAcked, c.ReplicaTimeout)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.KeyPrefix == "" {
		c.KeyPrefix = DefaultKeyPrefix
	}
	if c.Clock == nil {
		c.Clock = time.Now
	}
	if c.Timeout == 0 {
		c.Timeout = 3 * time.Second
	}
	if c.ScriptReloads == 0 {
		c.ScriptReloads = 3
	}
	if c.Pipelines == 0 {
		c.Pipelines = 4
	}
	if c.ReplicaTimeout == 0 {
		c.ReplicaTimeout = 500 * time.Millisecond
	}
	return c
}

// Limiter decides sends against caps. It is safe for concurrent use.
type Limiter struct {
	client   Client
	cluster  *redis.ClusterClient // nil for a single node
	cfg      Config
	spaces   atomic.Pointer[[]string] // the key prefix of each Space; grows only (AddSpace)
	spaceMu  sync.Mutex               // serialises AddSpace
	cache    *nearCache               // nil when off
	seen     *seenUsers               // nil with ScriptOnly
	calls    atomic.Uint64            // script calls sent
	requests atomic.Uint64            // requests they carried

	newLogs, newLogMisses   atomic.Uint64 // SET NX that recorded a new log, and that found one
	copyAppends, copyMisses atomic.Uint64 // sends decided from a whole copy and appended (mode 4), and those whose log had changed
	spilledAppends          atomic.Uint64 // of copyAppends, those in mode 7
	functionLoads           atomic.Uint64 // loads of the function library on a node that answered "Function not found"
}

// New returns a Limiter after loading its script on every node of client.
func New(ctx context.Context, client Client, cfg Config) (*Limiter, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	l := &Limiter{client: client, cfg: cfg.withDefaults()}
	l.cluster, _ = client.(*redis.ClusterClient)
	if cfg.NearCache > 0 {
		l.cache = newNearCache(cfg.NearCache)
	}
	if _, err := l.AddSpace(l.cfg.KeyPrefix); err != nil {
		return nil, err
	}
	if !cfg.ScriptOnly {
		l.seen = newSeenUsers()
	}
	if err := l.LoadFunctions(ctx); err != nil {
		return nil, err
	}
	return l, nil
}

// Key returns the Redis key of the log of user userID of space s.
func (l *Limiter) Key(s Space, userID uint32) string {
	var buf [64]byte // one allocation (the string) for prefixes of up to 50 bytes
	return string(l.appendKey(buf[:0], s, userID))
}

// appendKey appends the Key of user userID of space s to b.
func (l *Limiter) appendKey(b []byte, s Space, userID uint32) []byte {
	b = append(b, l.prefix(s)...)
	b = append(b, ":{"...)
	b = strconv.AppendUint(b, uint64(userID), 10)
	return append(b, '}')
}

// Decide decides every request and records the allowed ones. The batch is
// split into up to Config.Pipelines pipelines by user, each grouped by the
// master that owns its users, all sent concurrently: one round trip per
// (pipeline, node). Decisions line up with reqs. Requests of one user are
// decided in order and see each other.
//
// When some requests could not be decided, err is a RequestErrors with a
// non-nil entry for each of them and their Decisions are zero; the others are
// decided and recorded. A request that failed on the network may still have
// been recorded: retrying it is safe, since its job id makes it a duplicate.
// Errors that wrap ErrInvalidRequest are permanent; all others are transient.
func (l *Limiter) Decide(ctx context.Context, reqs []Request) ([]Decision, error) {
	return l.run(ctx, reqs, true)
}

// Peek answers what Decide would answer for req now, without recording or
// evicting anything.
func (l *Limiter) Peek(ctx context.Context, req Request) (Decision, error) {
	d, err := l.run(ctx, []Request{req}, false)
	if err != nil {
		var re RequestErrors
		if errors.As(err, &re) {
			return Decision{}, re[0]
		}
		return Decision{}, err
	}
	return d[0], nil
}

func (l *Limiter) run(ctx context.Context, reqs []Request, record bool) ([]Decision, error) {
	if l.cfg.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, l.cfg.Timeout)
		defer cancel()
	}
	r := &round{l: l, reqs: reqs, record: record, now: l.cfg.Clock(), decs: make([]Decision, len(reqs))}
	if record {
		r.cache = l.cache // a look is never cached, nor answered from the cache
	}
	if r.cache != nil {
		r.gen = r.cache.gen.Load()
	}
	var caps *[]Cap // a look counts every cap (capper check shows them all)
	if record {
		caps = capSlab.get()
		defer func() { clear(*caps); capSlab.put(caps) }()
	}
	sc := scratchPool.get()
	defer sc.release()
	r.b = &batch{l: l, reqs: reqs, record: record, results: grow(&sc.results, len(reqs)), nodes: grow(&sc.nodes, len(reqs)),
		alone: grow(&sc.alone, len(reqs)), args: newArgs(reqs, r.now, l.cfg.ClockMargin, caps, sc), sc: sc}
	if r.cache != nil {
		r.b.maxLog = cacheMaxLog
	}
	pending := r.pending()
	for reloads := 0; len(pending) > 0; reloads++ {
		// After a reload, a node flushed again (or restarted) could answer
		// "Function not found" once more; from the second retry on, the
		// script's body is sent (EVAL), which cannot fail that way.
		r.b.eval = reloads >= 2
		r.b.send(ctx, pending)
		next := r.settle(pending)
		if next.reload {
			l.reloadTopology(ctx)
		}
		pending = append(append(pending[:0], next.split...), next.again...)
		pending = r.reloadFunctions(ctx, next.unloadedOn, reloads, pending)
	}
	if r.errs != nil {
		return r.decs, r.errs
	}
	return r.decs, nil
}

// round is one Decide or Peek: its requests, their decisions and errors, and
// the batch that sends them (once, and again for what must be retried).
type round struct {
	l      *Limiter
	b      *batch
	reqs   []Request
	record bool
	now    time.Time
	decs   []Decision
	errs   RequestErrors // made at the first failure
	cache  *nearCache    // nil when off, and for a look
	gen    uint64        // the cache's generation when the round began (see nearCache.install)
	asked  bool          // the near cache looked some requests up (its hints are set)
}

func (r *round) setErr(i int, err error) {
	if r.errs == nil {
		r.errs = make(RequestErrors, len(r.reqs))
	}
	r.errs[i] = err
}

// fail records request i's failure; its decision is zero.
func (r *round) fail(i int, err error) {
	r.decs[i] = Decision{} // a copy's decision may be there
	r.setErr(i, fmt.Errorf("capping: decide job %q for user %d: %w", r.reqs[i].JobID, r.reqs[i].UserID, err))
	if r.cache != nil { // it may have been recorded: the copy is no longer the log
		r.cache.drop(r.reqs[i].who())
	}
}

// pending validates the requests, answers from the near cache those it can,
// marks the sends that may go as new logs, and returns the requests for Redis.
func (r *round) pending() []int {
	l, b, reqs, sc, cache := r.l, r.b, r.reqs, r.b.sc, r.cache
	pending := grow(&sc.pending, len(reqs))[:0]
	asked := sc.asked[:0] // the requests the near cache may answer
	spaces := len(*l.spaces.Load())
	for i := range reqs {
		err := reqs[i].validate()
		if err == nil && int(reqs[i].Space) >= spaces {
			err = fmt.Errorf("key space %d is not known to this process (Limiter.AddSpace)", reqs[i].Space)
		}
		if err != nil {
			r.setErr(i, fmt.Errorf("capping: job %q: %w: %w", reqs[i].JobID, ErrInvalidRequest, err))
			continue
		}
		// A send with no caps (a count-only category's) is looked up too, unless
		// it is a duplicate check, a refusal's mark or a send made elsewhere:
		// its user's whole copy lets the script record it with an append.
		plain := !reqs[i].DuplicateOnly && reqs[i].SentAt.IsZero()
		if n := len(b.args[i].caps); cache != nil && (n > 0 || plain) && n <= maxCaps && !reqs[i].Candidate {
			asked = append(asked, i)
		}
	}
	sc.asked = asked
	hit := grow(&sc.hit, len(reqs))
	if len(asked) > 0 {
		r.asked = true
		cache.decideAll(reqs, b.args, asked, r.decs, hit, grow(&sc.order, len(asked)), grow(&sc.slots, len(asked)), grow(&sc.hints, len(reqs)))
	}
	sent := sc.sent // users with a request for Redis in this batch
	clear(sent)
	hits := 0
	for i := range reqs {
		if r.errs != nil && r.errs[i] != nil { // invalid
			continue
		}
		if cache != nil {
			// A later request of a user whose earlier one goes to Redis must
			// see that one's outcome, so it goes too (its answer from the
			// copy is dropped).
			if hit[i] && !sent[reqs[i].who()] {
				hits++
				continue
			}
			if sent == nil {
				sent = make(map[uint64]bool, len(reqs))
				sc.sent = sent
			}
			if sent[reqs[i].who()] {
				b.args[i].expect, b.args[i].patch, b.args[i].patched, b.args[i].spill = "", "", "", false // the copy will not hold the earlier request's outcome
			}
			if b.args[i].expect == "" { // else the copy's decision, for an append (see decideAll)
				r.decs[i] = Decision{}
			}
			sent[reqs[i].who()] = true
		}
		pending = append(pending, i)
	}
	if cache != nil {
		cache.hits.Add(uint64(hits))
		cache.misses.Add(uint64(len(asked) - hits))
	}
	l.requests.Add(uint64(len(pending)))
	if l.seen != nil && r.record {
		b.fresh = l.markNewLogs(reqs, b.args, pending, sc)
	}
	return pending
}

// retries is what one attempt left to send again.
type retries struct {
	unloadedOn map[node][]int // by node: the requests it answered "Function not found"
	split      []int          // requests of a call refused for another's slot: sent again in calls of their own
	again      []int          // sent as new logs and found a log: sent to the script
	reload     bool           // the topology may have changed
}

// settle reads the answer to each pending request of the last attempt: a
// decision (installed in the near cache), a failure, or a retry.
func (r *round) settle(pending []int) retries {
	l, b := r.l, r.b
	next := retries{unloadedOn: map[node][]int{}}
	for _, i := range pending {
		if b.nodes[i] == nil { // no route: the topology is unknown
			r.fail(i, b.routeErr)
			next.reload = true
			continue
		}
		err := b.results[i].err
		setNX := b.fresh != nil && b.fresh[i]
		inScript := setNX && r.reqs[i].Preferences // modeNewLog: written ('='), or else decided in full
		if setNX {
			b.fresh[i] = false // from now on, the script's
			l.seen.add(r.reqs[i].who())
			if !inScript && (errors.Is(err, redis.Nil) || (err != nil && redirected(err))) {
				if errors.Is(err, redis.Nil) {
					l.newLogMisses.Add(1)
				} else {
					next.reload = true
				}
				next.again = append(next.again, i)
				continue
			}
		}
		switch {
		case err == nil:
			err = r.decided(i, setNX, inScript)
		case unloaded(err):
			next.unloadedOn[b.nodes[i]] = append(next.unloadedOn[b.nodes[i]], i)
			continue
		case b.results[i].shared && !b.alone[i] && redirected(err):
			b.alone[i] = true
			next.split = append(next.split, i)
			next.reload = true
			continue
		}
		if err != nil {
			next.reload = next.reload || topologyChanged(err)
			r.fail(i, err)
		}
	}
	return next
}

// decided turns request i's answer into its decision, and keeps the log it
// leaves in the near cache (or drops the user's copy).
func (r *round) decided(i int, setNX, inScript bool) error {
	l, b, now := r.l, r.b, r.now
	if r.reqs[i].SentAt.IsZero() {
		now = b.args[i].at // the round's clock, or the request's own At
	}
	v := b.results[i].v
	var tail, raw string // the log after the decision: its entries, and whole when known (see install)
	var err error
	// known: the log is the copy after a confirmed send whose facts the cache
	// knows (see installAfter): raw, or when empty, the copy with the send
	known := false
	switch a := &b.args[i]; {
	case setNX && !inScript:
		l.newLogs.Add(1)
		r.decs[i], tail, err = b.newLogDecision(i, now, a.packed)
		raw = a.packed
	case inScript && v == replyWritten:
		l.newLogs.Add(1)
		r.decs[i], tail, err = b.newLogDecision(i, now, a.named)
		raw = a.named
	case a.expect != "" && a.spill && isSpilledReply(v): // recorded as the copy with the send, its tally caps counted by the script
		l.copyAppends.Add(1)
		l.spilledAppends.Add(1)
		var raised bool
		if r.decs[i], raised, err = a.spilledDecision(v.(string)); err == nil && !raised {
			if known = a.after.known; !known {
				raw = appendedLog(a)
				tail = raw[8:]
			}
		}
	case a.expect != "" && v == replyWritten: // recorded by an APPEND to the copy's log, or its patch
		l.copyAppends.Add(1)
		raw = a.patched // decs[i]: the copy's decision (see decideAll)
		if known = a.after.known; !known {
			if raw == "" {
				raw = appendedLog(a)
			}
			tail = raw[8:]
		}
	default:
		if a.expect != "" {
			l.copyMisses.Add(1)
		}
		if inScript {
			l.newLogMisses.Add(1)
		}
		r.decs[i], tail, raw, err = parseReply(v, a.caps, a.member, now, a.counts, a.labels)
	}
	b.args[i].requestCounts(&r.decs[i])
	if err == nil && ((r.decs[i].Allowed && r.record) || r.reqs[i].Refused != "") && !b.replicated(b.nodes[i]) {
		r.decs[i], err = Decision{}, b.waitErr(b.nodes[i])
	}
	if err == nil && r.reqs[i].DuplicateOnly && !r.decs[i].Duplicate {
		r.decs[i] = Decision{At: now} // looked, and not found
	}
	if c := r.cache; err == nil && c != nil && !r.reqs[i].DuplicateOnly { // a look changes nothing
		var hint int32
		if r.asked {
			hint = b.sc.hints[i]
		}
		switch {
		case known:
			c.installAfter(&r.reqs[i], &b.args[i], r.gen, raw, hint)
		case len(tail) > 0:
			c.installWith(&r.reqs[i], &b.args[i], r.gen, tail, raw, hint, b.sc.items())
		default:
			c.drop(r.reqs[i].who())
		}
	}
	return err
}

// reloadFunctions loads the function library on each node that answered
// "Function not found" and returns pending with their requests added to be
// sent again, or fails them once the reloads are used up.
func (r *round) reloadFunctions(ctx context.Context, unloadedOn map[node][]int, reloads int, pending []int) []int {
	for n, idx := range unloadedOn {
		var reason error
		if reloads >= r.l.cfg.ScriptReloads {
			reason = fmt.Errorf("function not found after %d reloads of its library", reloads)
		} else if err := loadFunction(ctx, n, nodeName(n)); err != nil {
			reason = err
		} else {
			r.l.functionLoads.Add(1)
		}
		for _, i := range idx {
			if reason != nil {
				r.fail(i, reason)
			} else {
				pending = append(pending, i)
			}
		}
	}
	return pending
}

// Stats are a Limiter's running counts.
type Stats struct {
	// ScriptCalls counts the calls of decide.lua sent (FCALL and EVAL, retries
	// included; a call carries up to 32 requests); Requests counts the
	// requests sent to Redis, once each however often they were tried.
	ScriptCalls, Requests uint64
	// NewLogs counts the sends recorded as their user's new log (one SET NX,
	// no script call: see Config.ScriptOnly; a send that reads preferences in
	// the script's mode 5); NewLogMisses those that found the user had a log
	// (or, in mode 5, preferences): the script decided them.
	NewLogs, NewLogMisses uint64
	// CopyAppends counts the sends the near cache decided allowed from its
	// copy of the whole log and the script recorded with one APPEND, the log
	// being that copy (mode 4 of decide.lua; with tally caps, its patch or
	// mode 7); CopyMisses those whose log had changed, which the script
	// decided in full. SpilledAppends counts those of CopyAppends whose tally
	// caps the script counted from the user's tally key (mode 7: a user past
	// spillAt tally items, whom the copy cannot decide alone).
	CopyAppends, CopyMisses, SpilledAppends uint64
	// FunctionLoads counts the loads of decide.lua's function library on a
	// node that answered "Function not found" (a node restarted without
	// persistence, a FUNCTION FLUSH), after the loads at New.
	FunctionLoads uint64
	// CacheHits counts decisions answered by the near cache, CacheMisses the
	// requests it looked up and sent to Redis, CacheEvictions the copies it
	// dropped to make room, CacheHolds the holds of users' copies (see
	// HoldCopies).
	CacheHits, CacheMisses, CacheEvictions, CacheHolds uint64
	// CacheEntries and CacheBytes are the copies it keeps and their size;
	// CacheHeld the users it keeps none for (see HoldCopies).
	CacheEntries, CacheBytes, CacheHeld int
}

// Stats returns the Limiter's counts so far.
func (l *Limiter) Stats() Stats {
	s := Stats{ScriptCalls: l.calls.Load(), Requests: l.requests.Load(), NewLogs: l.newLogs.Load(), NewLogMisses: l.newLogMisses.Load(),
		CopyAppends: l.copyAppends.Load(), CopyMisses: l.copyMisses.Load(), SpilledAppends: l.spilledAppends.Load(), FunctionLoads: l.functionLoads.Load()}
	if c := l.cache; c != nil {
		s.CacheHits, s.CacheMisses, s.CacheEvictions, s.CacheHolds = c.hits.Load(), c.misses.Load(), c.evictions.Load(), c.holds.Load()
		s.CacheEntries, s.CacheBytes, s.CacheHeld = c.stats()
	}
	return s
}

// InvalidateCache drops every copy of the near cache (and those of decisions
// in flight). Call it when the caps a user gets may have changed: a rules
// reload, a new segment snapshot.
func (l *Limiter) InvalidateCache() {
	if l.cache != nil {
		l.cache.clear()
	}
}

// ErrNotReplicated marks a decision that recorded a send on a master (or
// found it recorded) whose WAIT for Config.MinReplicasAcked replicas fell
// short. It is transient: retry the request.
var ErrNotReplicated = errors.New("recorded send not acknowledged by enough replicas")

// ArbitrationKey returns the Redis key of a user's arbitration candidates.
func (l *Limiter) ArbitrationKey(s Space, userID uint32) string { return l.Key(s, userID) + ":arb" }
