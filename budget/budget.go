// Package budget enforces global send-rate budgets shared by every replica:
// "at most 300 SMS per second", "at most 10,000 sends of campaign X per
// minute". A budget is a bucketed rolling window in Redis (budget.lua: a few
// counters per window, never one entry per send), and each process leases
// tokens in batches and serves jobs from its local reserve, with at most one
// Redis call in flight per budget key (the others wait for it), as in
// Rockset's batched token reservation.
//
// Tokens are counted in Redis in the bucket that is current when they are
// leased, and a lease expires when that bucket ends, so every send happens
// inside the bucket it was counted in: the sends in any window never exceed
// the limit (with synchronised clocks; a clock that runs ahead by d moves a
// replica's sends by d at most). The cost is underuse: tokens leased and not
// used before their bucket ends lapse, and stay counted until they leave the
// window; Close gives the unused tokens of live leases back.
package budget

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

//go:embed budget.lua
var source string

var script = redis.NewScript(source)

// Spec is one budget: at most Limit sends in any Window.
type Spec struct {
	Name   string // identifies it in metrics and holds
	Limit  int    // (>= 1)
	Window time.Duration
	// Spread makes the budget a token bucket inside its window (budget.lua):
	// tokens accrue at the limit's pace (Limit per Window), up to Burst (an
	// idle budget starts with the whole limit, so a burst below it goes at
	// once); none accrue while the window is full, and when its oldest
	// bucket leaves, at most a bucket's share of its tokens may go at once.
	// So under sustained demand sends go at an even pace, and lumps dissolve;
	// a window delivers about Window / (Window + a bucket) of the limit, 99%
	// (a decision's wait beyond a bucket costs more). Without it
	// the whole limit may go at once, and tokens freed together are taken
	// together again a window and a bucket later, so under sustained demand
	// they travel in lumps that drift across windows: a window in 100 can get
	// none (rules: spread: false).
	Spread bool
}

// PerBucket is a bucket's share with Spread: the limit / Buckets, rounded
// up; 0 (no bound) without. Refused sends are promised at most this many per
// bucket (see promise).
func (s *Spec) PerBucket() int {
	if !s.Spread {
		return 0
	}
	return (s.Limit + Buckets - 1) / Buckets
}

// Burst is the most tokens a spread budget accrues, so grants at once after
// a pause in demand: a fifth of the limit, rounded up (what accrues in a
// fifth of the window at the limit's pace: a pause in decisions up to that
// loses none); 0 without Spread.
func (s *Spec) Burst() int {
	if !s.Spread {
		return 0
	}
	return (s.Limit + 4) / 5
}

// Want asks for one token of a budget key: the budget itself, or one
// campaign's share of a per-campaign budget.
type Want struct {
	Spec *Spec
	Key  string // Spec.Name, or Spec.Name + ":" + the campaign for a per-campaign budget
	// Until is the last moment a refused job can wait for a token (its
	// max_hold, its expiry; now when it cannot be held at all): it is
	// promised a token back only before then. A job told a later time is
	// not coming back, and a token promised to it would wait for nobody
	// while jobs refused after it were promised later ones. Zero: no bound.
	Until time.Time
}

// Grant answers a Want.
type Grant struct {
	OK bool
	// Until, when OK, is when the token's bucket ends: the token is counted
	// in that bucket, so a send that uses it must be decided before Until
	// for the budget to hold by decision time (a later one must wait for a
	// new token: the consumer dates a decision within it, or lets it lapse).
	Until time.Time
	// RetryAt, when not OK, is when a token is expected back for this job:
	// the start of the earliest bucket with a token not yet promised to a job
	// refused before it in this process (see refuse), so released jobs arrive
	// as tokens come back instead of all at once.
	RetryAt time.Time
}

// Config configures Budgets.
type Config struct {
	// Client runs the script (a *redis.ClusterClient or *redis.Client). (Required)
	Client redis.Scripter
	// KeyPrefix of the budget keys: PREFIX:b:{KEY}. Defaults to "fc".
	KeyPrefix string
	// NoLease asks Redis for exactly the tokens a batch needs, never more
	// (one call per batch and key): the baseline of the leasing benchmark.
	NoLease bool
	// Clock defaults to time.Now.
	Clock func() time.Time
	// Registerer receives the budgets' metrics. Optional.
	Registerer prometheus.Registerer
}

// Validate reports whether the configuration is usable.
func (c Config) Validate() error {
	switch {
	case c.Client == nil:
		return errors.New("budget: a Redis client is required")
	case strings.ContainsAny(c.KeyPrefix, "{}"):
		return fmt.Errorf("budget: key prefix %q must not contain { or }: the hash tag is the budget key", c.KeyPrefix)
	}
	return nil
}

// Budgets leases tokens of many budget keys. Safe for concurrent use.
type Budgets struct {
	cfg     Config
	mu      sync.Mutex
	keys    map[string]*state
	sweepAt int // len(keys) at which idle keys are dropped next
	m       metrics
}

// state is one budget key's local reserve.
type state struct {
	mu       sync.Mutex
	spec     *Spec
	reserve  int       // leased tokens not used yet
	bucket   int64     // the bucket (ms) the reserve is counted in
	expires  time.Time // the reserve lapses at its bucket's end
	size     int       // the next lease's extra tokens, adapted to demand
	used     int       // tokens of the current lease used so far
	leased   int       // size of the current lease
	inflight chan struct{}
	next     time.Time // when tokens come back, from the last refused call
	// frees are when the window's counted tokens come back, oldest first,
	// and room the tokens the window had left, from the last answer of
	// Redis; promised counts the refused jobs told to come back at each
	// bucket's start (see promise).
	frees    []free
	room     int
	promised map[int64]int
	touched  time.Time // the last Take of the key
	// the budget's token counters, resolved once
	usedC, putBackC, lapsedC, grantedC prometheus.Counter
}

// New returns Budgets.
func New(cfg Config) (*Budgets, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.KeyPrefix == "" {
		cfg.KeyPrefix = "fc"
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	b := &Budgets{cfg: cfg, keys: map[string]*state{}, sweepAt: minSweep}
	if err := b.m.register(cfg.Registerer); err != nil {
		return nil, err
	}
	return b, nil
}

// Buckets is how many buckets a window has: a bucket leaves the window
// whole, so a token comes back a window and up to a bucket after it was
// taken, and a lease lasts at most a bucket. Under sustained demand a
// spread budget's tokens are taken as their bucket starts (when the oldest
// leaves), so each is reused every window plus a bucket: a window forwards
// Buckets/(Buckets+1) of its limit, 99% (with 40 buckets it was 97.5%, and
// the windows' jitter from the decisions' waits took some below 95%; with 10
// it was 91%).
const Buckets = 100

// Validate reports whether s is usable.
func (s *Spec) Validate() error {
	const buckets = Buckets
	switch {
	case s.Name == "":
		return errors.New("budget: a name is required")
	case s.Limit < 1:
		return fmt.Errorf("budget %q: limit %d must be at least 1", s.Name, s.Limit)
	case s.Window < time.Duration(buckets)*time.Millisecond || s.Window%(time.Duration(buckets)*time.Millisecond) != 0:
		return fmt.Errorf("budget %q: window %v must be whole milliseconds, a multiple of %d ms (one per bucket)", s.Name, s.Window, buckets)
	}
	return nil
}

// RedisKey returns the Redis key of a budget key.
func (b *Budgets) RedisKey(key string) string { return b.cfg.KeyPrefix + ":b:{" + key + "}" }

func (b *Budgets) state(w Want) *state {
	b.mu.Lock()
	defer b.mu.Unlock()
	st := b.keys[w.Key]
	if st == nil || st.spec != w.Spec { // a rules reload may change the spec
		t := b.m.tokens
		n := w.Spec.Name
		st = &state{spec: w.Spec, size: 1, promised: map[int64]int{}, usedC: t.WithLabelValues(n, "used"), putBackC: t.WithLabelValues(n, "put_back"),
			lapsedC: t.WithLabelValues(n, "lapsed"), grantedC: t.WithLabelValues(n, "granted")}
		if len(b.keys) >= b.sweepAt {
			b.sweep()
		}
		b.keys[w.Key] = st
	}
	return st
}

// minSweep is the fewest keys at which idle ones are dropped.
const minSweep = 1024

// sweep drops the keys that are idle: no live reserve, nothing in flight,
// not asked for over a window, and no refused job's pacing to remember. A
// per-campaign budget makes a key per campaign: without this the map only
// grew. The next sweep comes when the map has doubled. b.mu is held.
func (b *Budgets) sweep() {
	now := b.cfg.Clock()
	for k, st := range b.keys {
		if !st.mu.TryLock() {
			continue // in use
		}
		idle := st.inflight == nil && !now.Before(st.expires) && now.Sub(st.touched) > st.spec.Window &&
			!now.Before(st.next) && !st.promising(now)
		st.mu.Unlock()
		if idle {
			delete(b.keys, k)
		}
	}
	b.sweepAt = max(minSweep, 2*len(b.keys))
}

// Keys returns how many budget keys the process keeps state for.
func (b *Budgets) Keys() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.keys)
}

// Take answers each want in order: one token each, from the local reserve of
// its key, refilled from Redis when it runs short (one call per key at a
// time; concurrent callers of the same key wait for it). Keys are served
// concurrently. The tokens of wants that are not needed after all (their
// job was capped) go back with Return. With an error (Redis could not be
// asked for a key), the wants it left unanswered are not granted; the grants
// it returns (some of a failing key's may come from the local reserve) are
// valid, and go back with Return if they are not used.
func (b *Budgets) Take(ctx context.Context, wants []Want) ([]Grant, error) {
	grants := make([]Grant, len(wants))
	byKey := map[string][]int{}
	var order []string
	for i, w := range wants {
		if byKey[w.Key] == nil {
			order = append(order, w.Key)
		}
		byKey[w.Key] = append(byKey[w.Key], i)
	}
	if len(order) == 1 { // the usual case: one budget key in the batch, no goroutine
		return grants, b.take(ctx, b.state(wants[0]), order[0], byKey[order[0]], wants, grants)
	}
	errs := make([]error, len(order))
	var wg sync.WaitGroup
	for k, key := range order {
		idx := byKey[key]
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[k] = b.take(ctx, b.state(wants[idx[0]]), key, idx, wants, grants)
		}()
	}
	wg.Wait()
	return grants, errors.Join(errs...)
}

// take serves the wants idx of one key.
func (b *Budgets) take(ctx context.Context, st *state, key string, idx []int, wants []Want, grants []Grant) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	for len(idx) > 0 {
		now := b.cfg.Clock()
		st.touched = now
		if st.reserve > 0 && !now.Before(st.expires) {
			st.lapsedC.Add(float64(st.reserve))
			st.reserve = 0
			st.size = max(1, st.size/2) // leased more than was used in time
		}
		idx = st.grant(idx, grants, min(st.reserve, len(idx))) // the reserve first
		if len(idx) == 0 {
			return nil
		}
		if !st.next.IsZero() && now.Before(st.next) { // Redis said none are left until next
			b.refuse(st, now, idx, wants, grants)
			return nil
		}
		if st.inflight != nil { // another caller is asking Redis: wait for its answer
			ch := st.inflight
			st.mu.Unlock()
			select {
			case <-ch:
			case <-ctx.Done():
				st.mu.Lock()
				return ctx.Err()
			}
			st.mu.Lock()
			continue
		}
		if st.leased > 0 && st.used >= st.leased { // the last lease was used up in time: lease more
			st.size = min(2*st.size, maxLease(st.spec))
		}
		ask := len(idx)
		if !b.cfg.NoLease && !st.spec.Spread { // a spread budget's tokens come at its rate: a lease beyond
			// the demand would lapse them (2% of them under bench-budget's demand) while others wait
			ask = max(ask, st.size)
		}
		ask = min(ask, st.spec.Limit)
		ch := make(chan struct{})
		st.inflight = ch
		st.mu.Unlock()
		granted, bucket, next, frees, room, err := b.call(ctx, key, st.spec, now, ask, 0)
		st.mu.Lock()
		st.inflight = nil
		close(ch)
		if err != nil {
			return err
		}
		st.grantedC.Add(float64(granted))
		width := st.spec.Window / Buckets
		st.reserve, st.bucket, st.expires = granted, bucket, time.UnixMilli(bucket).Add(width)
		st.leased, st.used = granted, 0
		if granted < ask {
			st.next = time.UnixMilli(next)
		} else {
			st.next = time.Time{}
		}
		st.frees, st.room = frees, room
		if granted == 0 {
			b.refuse(st, now, idx, wants, grants)
			return nil
		}
		// The tokens asked for go to the wants that asked, even when their
		// bucket ended during the call (a call late in a 100 ms bucket, or a
		// slow one, would otherwise lapse them all and refuse sends within
		// the budget): they are counted in their bucket, so the limit holds
		// by token time. Only the lease beyond this demand can lapse.
		idx = st.grant(idx, grants, min(granted, len(idx)))
	}
	return nil
}

// grant hands n tokens of the reserve to the first n wants of idx and
// returns the others.
func (st *state) grant(idx []int, grants []Grant, n int) []int {
	for _, i := range idx[:n] {
		grants[i] = Grant{OK: true, Until: st.expires}
	}
	st.reserve -= n
	st.used += n
	st.usedC.Add(float64(n))
	return idx[n:]
}

// free is when n tokens come back (a counted bucket leaves the window).
type free struct {
	at int64 // ms
	n  int
}

// maxLease bounds a lease: one bucket's share of the limit.
func maxLease(s *Spec) int { return max(1, s.Limit/Buckets) }

// refuse answers the wants idx with the times tokens come back: each refused
// job is promised the start of the earliest bucket that has a token for it
// (promise), so held jobs come back when tokens do, as many as come back, and
// a budget under over-demand is used as soon as its tokens are free (jobs
// spread evenly at the budget's rate came back into buckets with no token and
// were held again, while tokens waited).
func (b *Budgets) refuse(st *state, now time.Time, idx []int, wants []Want, grants []Grant) {
	nowMs := now.UnixMilli()
	for at := range st.promised {
		if at < nowMs {
			delete(st.promised, at)
		}
	}
	until := func(j int) int64 {
		if u := wants[idx[j]].Until; !u.IsZero() { // rounded up: a bucket's start before it in ms is before it
			return (u.UnixNano() + int64(time.Millisecond) - 1) / int64(time.Millisecond)
		}
		return 0
	}
	st.promise(nowMs, len(idx), until, func(j int, at int64) { grants[idx[j]] = Grant{RetryAt: time.UnixMilli(at)} })
	b.m.refused.WithLabelValues(st.spec.Name).Add(float64(len(idx)))
}

// promising reports whether a refused job was promised a time after now.
func (st *state) promising(now time.Time) bool {
	ms := now.UnixMilli()
	for at := range st.promised {
		if at >= ms {
			return true
		}
	}
	return false
}

// promiseHorizon bounds how many windows ahead promise looks for a token.
const promiseHorizon = 64

// promise promises n refused jobs, in order, the starts (ms) of the earliest
// buckets after now's that have a token for them, and tells each its time
// through set. It walks the buckets once from there with a pool of tokens:
// the room the window had left, the tokens each counted bucket frees as it
// leaves the window (frees), and those taken by the jobs promised each
// bucket, which come back a window and a bucket after it; a bucket serves at
// most PerBucket (with Spread). A job whose earliest bucket is not before its
// until (ms; 0: no bound) is told that bucket but promised nothing: it will
// not come back (capped beyond max_hold, expired), and its token goes to the
// next job. Past promiseHorizon windows (nothing counted and no room: only
// after a failed call), the next bucket.
func (st *state) promise(now int64, n int, until func(j int) int64, set func(j int, at int64)) {
	width := st.spec.Window.Milliseconds() / Buckets
	per := st.spec.PerBucket()
	var back [Buckets + 2]int // tokens coming back, by bucket index modulo the ring
	pool, fi, j := st.room, 0, 0
	first := now - now%width + width
	for k := 0; k < promiseHorizon*Buckets && j < n; k++ {
		t := first + int64(k)*width
		for fi < len(st.frees) && st.frees[fi].at <= t {
			pool += st.frees[fi].n
			fi++
		}
		pool += back[k%len(back)]
		back[k%len(back)] = 0
		capacity := pool
		if per > 0 {
			capacity = min(capacity, per)
		}
		for ; j < n && st.promised[t] < capacity; j++ {
			set(j, t)
			if u := until(j); u == 0 || t < u {
				st.promised[t]++
			}
		}
		used := max(0, min(st.promised[t], capacity))
		pool -= used
		back[(k+Buckets+1)%len(back)] += used
	}
	for ; j < n; j++ {
		st.promised[first]++
		set(j, first)
	}
}

// Return puts back n tokens of key that Take granted and were not used (the
// job was capped after all): the next Take of the key uses them first.
func (b *Budgets) Return(w Want, n int) {
	st := b.state(w)
	st.mu.Lock()
	defer st.mu.Unlock()
	if b.cfg.Clock().Before(st.expires) {
		st.reserve += n
		st.used -= n
		st.putBackC.Add(float64(n))
	}
}

// Lapse counts n tokens of w that were granted and not used before their
// bucket ended (Grant.Until): they stay counted in Redis until they leave
// the window, and are never used.
func (b *Budgets) Lapse(w Want, n int) {
	b.state(w).lapsedC.Add(float64(n))
}

// Close gives the unused tokens of every live lease back to Redis, so that
// a replica that stops does not hold tokens until they age out.
func (b *Budgets) Close(ctx context.Context) error {
	b.mu.Lock()
	keys := make(map[string]*state, len(b.keys))
	for k, st := range b.keys {
		keys[k] = st
	}
	b.mu.Unlock()
	var errs []error
	for key, st := range keys {
		st.mu.Lock()
		n, bucket, live := st.reserve, st.bucket, b.cfg.Clock().Before(st.expires)
		st.reserve = 0
		st.mu.Unlock()
		if n == 0 || !live {
			continue
		}
		if _, _, _, _, _, err := b.call(ctx, key, st.spec, b.cfg.Clock(), -n, bucket); err != nil {
			errs = append(errs, err)
			continue
		}
		b.m.tokens.WithLabelValues(st.spec.Name, "returned").Add(float64(n))
	}
	return errors.Join(errs...)
}

// Usage is a budget key's state in Redis.
type Usage struct {
	Used int       // tokens counted in the window now
	Next time.Time // when the oldest counted bucket leaves the window; zero when none
}

// Peek reads a budget key's usage without taking a token.
func (b *Budgets) Peek(ctx context.Context, w Want) (Usage, error) {
	u, err := b.script(ctx, w.Key, w.Spec, b.cfg.Clock(), 0, 0)
	if err != nil {
		return Usage{}, err
	}
	var next time.Time
	if u[3] > 0 {
		next = time.UnixMilli(u[3])
	}
	return Usage{Used: int(u[1]), Next: next}, nil
}

// call runs the script for delta tokens; it returns the tokens granted, the
// bucket they are counted in and when tokens come back: next, the first
// time, frees, each time and how many, oldest first, and room, the tokens
// the window has left.
func (b *Budgets) call(ctx context.Context, key string, s *Spec, now time.Time, delta int, bucket int64) (granted int, at int64, next int64, frees []free, room int, err error) {
	r, err := b.script(ctx, key, s, now, delta, bucket)
	if err != nil {
		return 0, 0, 0, nil, 0, err
	}
	width := s.Window.Milliseconds() / Buckets
	for i := 4; i+1 < len(r); i += 2 {
		frees = append(frees, free{at: r[i] + width + s.Window.Milliseconds(), n: int(r[i+1])})
	}
	sort.Slice(frees, func(i, j int) bool { return frees[i].at < frees[j].at })
	return int(r[0]), r[2], r[3], frees, max(0, s.Limit-int(r[1])), nil
}

// script runs budget.lua once, outside any pipeline: go-redis's Script.Run
// sends EVALSHA and, on NOSCRIPT (a promoted replica, a restarted node), EVAL
// with the body, which caches it again. capping calls decide.lua as a
// function library instead (FCALL), which it loads by hand where a node lost
// it: its calls are pipelined, and an error inside a pipeline is not retried
// for it.
func (b *Budgets) script(ctx context.Context, key string, s *Spec, now time.Time, delta int, bucket int64) ([]int64, error) {
	width := s.Window.Milliseconds() / Buckets
	b.m.calls.WithLabelValues(s.Name).Inc()
	k := b.RedisKey(key)
	v, err := script.Run(ctx, b.cfg.Client, []string{k, k + ":r"},
		now.UnixMilli(), s.Window.Milliseconds(), width, s.Limit, delta, strconv.FormatInt(bucket, 10), s.Burst()).Result()
	if err != nil {
		return nil, fmt.Errorf("budget %s: %w", key, err)
	}
	arr, ok := v.([]any)
	if !ok || len(arr) < 4 || len(arr)%2 != 0 {
		return nil, fmt.Errorf("budget %s: unexpected script reply %#v", key, v)
	}
	out := make([]int64, len(arr))
	for i, x := range arr {
		n, ok := x.(int64)
		if !ok {
			return nil, fmt.Errorf("budget %s: unexpected script reply %#v", key, v)
		}
		out[i] = n
	}
	return out, nil
}

type metrics struct {
	tokens  *prometheus.CounterVec
	calls   *prometheus.CounterVec
	refused *prometheus.CounterVec
}

func (m *metrics) register(reg prometheus.Registerer) error {
	m.tokens = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_budget_tokens_total", Help: "Budget tokens by budget and kind: granted (leased from Redis), used (taken by a job), put_back (taken by a job that was then capped, back in the reserve: used - put_back were forwarded), lapsed (the lease's bucket ended first), returned (given back to Redis at shutdown).",
	}, []string{"budget", "kind"})
	m.calls = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_budget_redis_calls_total", Help: "Redis calls for budgets, by budget.",
	}, []string{"budget"})
	m.refused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_budget_refused_total", Help: "Jobs that found a budget exhausted (and were held), by budget.",
	}, []string{"budget"})
	if reg == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{m.tokens, m.calls, m.refused} {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("budget: register metrics: %w", err)
		}
	}
	return nil
}
