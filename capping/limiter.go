package capping

import (
	"context"
	"crypto/sha1"
	_ "embed"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/redis/go-redis/v9"
)

//go:embed decide.lua
var decideScript string

// decideSHA is the SHA1 of decide.lua, the name EVALSHA calls it by.
var decideSHA = func() string {
	sum := sha1.Sum([]byte(decideScript))
	return hex.EncodeToString(sum[:])
}()

// Client is what a Limiter needs of Redis. *redis.Client, *redis.ClusterClient
// and *redis.Ring satisfy it. When the client also has ForEachShard (cluster
// and ring clients do), scripts are loaded on every node, replicas included.
type Client interface {
	Pipeline() redis.Pipeliner
	ScriptLoad(ctx context.Context, script string) *redis.StringCmd
}

type shardedClient interface {
	ForEachShard(ctx context.Context, fn func(ctx context.Context, client *redis.Client) error) error
}

// Config configures a Limiter.
type Config struct {
	// KeyPrefix starts every key; a user's log is PREFIX:{USER_ID}. Defaults to "fc".
	KeyPrefix string
	// Clock returns the time decisions are taken at. Defaults to time.Now.
	// Workers' clocks are assumed to be NTP-synchronised (see the package doc).
	Clock func() time.Time
	// Timeout bounds one Decide or Peek call, script reloads included.
	// Defaults to 2s; a negative value means no timeout beyond the context's.
	Timeout time.Duration
	// ScriptReloads is how many times one call reloads the script after NOSCRIPT
	// (a failover, restart or SCRIPT FLUSH) and retries the failed requests. Defaults to 3.
	ScriptReloads int
	// Pipelines splits a batch into up to this many pipelines by user, sent
	// concurrently (each still grouped per node), so Redis is not idle while one
	// is in flight. A user's requests stay in one pipeline, in order. Batches of
	// fewer than 64 requests use one pipeline. Defaults to 4.
	Pipelines int
}

// Validate reports whether the configuration is usable.
func (c *Config) Validate() error {
	if strings.ContainsAny(c.KeyPrefix, "{}") {
		return fmt.Errorf("capping: key prefix %q must not contain { or }: the hash tag is the user id", c.KeyPrefix)
	}
	if c.ScriptReloads < 0 {
		return fmt.Errorf("capping: script reloads %d must not be negative", c.ScriptReloads)
	}
	if c.Pipelines < 0 || c.Pipelines > 64 {
		return fmt.Errorf("capping: pipelines %d is not in 0..64", c.Pipelines)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.KeyPrefix == "" {
		c.KeyPrefix = "fc"
	}
	if c.Clock == nil {
		c.Clock = time.Now
	}
	if c.Timeout == 0 {
		c.Timeout = 2 * time.Second
	}
	if c.ScriptReloads == 0 {
		c.ScriptReloads = 3
	}
	if c.Pipelines == 0 {
		c.Pipelines = 4
	}
	return c
}

// Limiter decides sends against caps. It is safe for concurrent use.
type Limiter struct {
	client Client
	cfg    Config
}

// New returns a Limiter after loading its script on every node of client.
func New(ctx context.Context, client Client, cfg Config) (*Limiter, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	l := &Limiter{client: client, cfg: cfg.withDefaults()}
	if err := l.LoadScripts(ctx); err != nil {
		return nil, err
	}
	return l, nil
}

// LoadScripts loads the script on every node (masters and replicas, since a
// replica promoted by failover has no script cache). Decide calls it by itself
// on NOSCRIPT.
func (l *Limiter) LoadScripts(ctx context.Context) error {
	load := func(ctx context.Context, c interface {
		ScriptLoad(context.Context, string) *redis.StringCmd
	}, node string) error {
		sha, err := c.ScriptLoad(ctx, decideScript).Result()
		if err != nil {
			return fmt.Errorf("capping: load script on %s: %w", node, err)
		}
		if sha != decideSHA {
			return fmt.Errorf("capping: load script on %s: sha %s, want %s", node, sha, decideSHA)
		}
		return nil
	}
	if sc, ok := l.client.(shardedClient); ok {
		return sc.ForEachShard(ctx, func(ctx context.Context, c *redis.Client) error {
			return load(ctx, c, c.Options().Addr)
		})
	}
	return load(ctx, l.client, "redis")
}

// Key returns the Redis key of a user's log.
func (l *Limiter) Key(userID uint32) string {
	return l.cfg.KeyPrefix + ":{" + strconv.FormatUint(uint64(userID), 10) + "}"
}

// Member returns the log member of a job: the 8-byte xxhash64 digest of the job
// id followed by the channel. A collision between two jobs of one user inside the
// longest window has a probability of about n²/2⁶⁵ for n logged sends.
func Member(jobID, channel string) string {
	b := make([]byte, 8+len(channel))
	binary.BigEndian.PutUint64(b, xxhash.Sum64String(jobID))
	copy(b[8:], channel)
	return string(b)
}

// Decide decides every request and records the allowed ones, in one pipeline
// (one round trip per node that owns a user of the batch). Decisions line up
// with reqs. Requests of one user are decided in order and see each other.
//
// When some requests could not be decided, err is a RequestErrors with a
// non-nil entry for each of them and their Decisions are zero; the others are
// decided and recorded. A request that failed on the network may still have
// been recorded: retrying it is safe, since its job id makes it a duplicate.
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
	now := l.cfg.Clock()
	decs := make([]Decision, len(reqs))
	errs := make(RequestErrors, len(reqs))
	failed := 0
	pending := make([]int, 0, len(reqs))
	for i := range reqs {
		if err := reqs[i].validate(); err != nil {
			errs[i] = fmt.Errorf("capping: job %q: %w: %w", reqs[i].JobID, ErrInvalidRequest, err)
			failed++
			continue
		}
		pending = append(pending, i)
	}
	recordArg := "0"
	if record {
		recordArg = "1"
	}
	cmds := make([]*redis.Cmd, len(reqs))
	for reloads := 0; len(pending) > 0; reloads++ {
		l.send(ctx, reqs, pending, cmds, now, recordArg)
		var noscript []int
		for _, i := range pending {
			v, err := cmds[i].Result()
			if err == nil {
				decs[i], err = parseReply(v, len(reqs[i].Caps), now)
			} else if isNoScript(err) {
				noscript = append(noscript, i)
				continue
			}
			if err != nil {
				errs[i] = fmt.Errorf("capping: decide job %q for user %d: %w", reqs[i].JobID, reqs[i].UserID, err)
				failed++
			}
		}
		pending = noscript
		if len(pending) == 0 {
			break
		}
		var reason error
		if reloads >= l.cfg.ScriptReloads {
			reason = fmt.Errorf("NOSCRIPT after %d script reloads", reloads)
		} else if err := l.LoadScripts(ctx); err != nil {
			reason = err
		}
		if reason != nil {
			for _, i := range pending {
				errs[i] = fmt.Errorf("capping: decide job %q for user %d: %w", reqs[i].JobID, reqs[i].UserID, reason)
				failed++
			}
			break
		}
	}
	if failed > 0 {
		return decs, errs
	}
	return decs, nil
}

// send queues pending requests on up to Pipelines pipelines, split by user,
// and executes them concurrently; results and errors land in cmds.
func (l *Limiter) send(ctx context.Context, reqs []Request, pending []int, cmds []*redis.Cmd, now time.Time, record string) {
	n := l.cfg.Pipelines
	if len(pending) < 64 {
		n = 1
	}
	pipes := make([]redis.Pipeliner, n)
	for _, i := range pending {
		p := int(reqs[i].UserID % uint32(n))
		if pipes[p] == nil {
			pipes[p] = l.client.Pipeline()
		}
		cmds[i] = pipes[p].EvalSha(ctx, decideSHA, []string{l.Key(reqs[i].UserID)}, scriptArgs(&reqs[i], now, record)...)
	}
	var wg sync.WaitGroup
	for _, p := range pipes {
		if p == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _ = p.Exec(ctx) // errors are read per command
		}()
	}
	wg.Wait()
}

func scriptArgs(r *Request, now time.Time, record string) []any {
	args := make([]any, 5, 5+3*len(r.Caps))
	var retention time.Duration
	for _, c := range r.Caps {
		retention = max(retention, c.Window)
		args = append(args, c.Window.Milliseconds(), c.Limit, c.Channel)
	}
	args[0] = now.UnixMilli()
	args[1] = Member(r.JobID, r.Channel)
	args[2] = r.Channel
	args[3] = record
	args[4] = retention.Milliseconds()
	return args
}

func isNoScript(err error) bool {
	return strings.HasPrefix(err.Error(), "NOSCRIPT")
}

// parseReply checks the script's reply shape; it never panics on a bad reply.
func parseReply(v any, ncaps int, now time.Time) (Decision, error) {
	arr, ok := v.([]any)
	if !ok || len(arr) != 3+ncaps {
		return Decision{}, fmt.Errorf("unexpected script reply %#v: want an array of %d integers", v, 3+ncaps)
	}
	ints := make([]int64, len(arr))
	for i, x := range arr {
		n, ok := x.(int64)
		if !ok {
			return Decision{}, fmt.Errorf("unexpected script reply %#v: element %d is %T, want an integer", v, i, x)
		}
		ints[i] = n
	}
	d := Decision{Cap: -1, At: now, Counts: make([]int, ncaps)}
	for i := range d.Counts {
		d.Counts[i] = int(ints[3+i])
	}
	switch ints[0] {
	case 1:
		d.Allowed = true
	case 2:
		d.Allowed, d.Duplicate = true, true
	case 0:
		if ints[1] < 1 || int(ints[1]) > ncaps {
			return Decision{}, fmt.Errorf("unexpected script reply %v: cap index %d out of range", ints, ints[1])
		}
		d.Cap = int(ints[1]) - 1
		if ints[2] > 0 {
			d.RetryAt = time.UnixMilli(ints[2])
		}
	default:
		return Decision{}, fmt.Errorf("unexpected script reply %v: status %d", ints, ints[0])
	}
	return d, nil
}
