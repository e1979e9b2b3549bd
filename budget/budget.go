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
//
// A refused send is told when a token comes back for it, and that token is
// promised to it in Redis, in the same call, for every replica to see: no
// two sends are promised one token, a send that claims nothing takes none a
// promise counts on, and the held send that comes back at its time
// (Want.Promised) finds its token.
package budget

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"slices"
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
	// Promised is the time a refused job was told (Grant.RetryAt: its hold's
	// due time) when it comes back for its token: it claims the token kept
	// for it then. Zero: a new want.
	Promised time.Time
	// Early, with Promised not due yet, claims a token before the promise:
	// the job was released early because a token was put back (PutBack) or
	// a promise given up that no new send was there to take. It is served
	// after the new wants, as one of them, its own promise not counted
	// against it. Granted (Grant.Claimed), its promise is given up: a token
	// no one is promised, for the next early claim at that time. Refused,
	// it keeps its promise (Grant.RetryAt is Promised, Grant.Promised), or
	// trades it for the next token back that no one is promised when that
	// is sooner (Grant.RetryAt before Promised): released at a promise given
	// up whose token is not back yet, it follows that token.
	Early bool
	// Job names the job (the same for every copy of it: a redelivery, a
	// copy on the delay tiers); "": unnamed. A token is promised to a named
	// job once: a copy of it asking again is told the time its job was
	// promised (or claims that token once due), and a copy asking after
	// another copy claimed it is answered Grant.Copy. At most 64 bytes.
	Job string
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
	// the start of the earliest bucket with a token no replica has promised
	// to another job. So released jobs arrive as tokens come back, as many
	// as come back, and find them.
	RetryAt time.Time
	// Promised, when not OK, says the token expected at RetryAt is kept for
	// the job (in Redis, for its Want.Promised to claim): a new want's when
	// RetryAt is a tenth of a second before its Want.Until (a tenth of a
	// window shorter than a second, a bucket of one longer than 10 s), a
	// claim's that follows its token when it is before its Want.Until. Not
	// promised, the job cannot wait for it: it is capped, and the token goes
	// to a job that can. The room before Until is for a claim whose token
	// comes back late (its previous holder released late) to follow it.
	Promised bool
	// Claimed, when OK, says the token is the one promised to the want
	// (Want.Promised): if its send turns out not to be a new one, Unclaim
	// gives it back and keeps the promise again.
	Claimed bool
	// Copy, when not OK, says another copy of the want's job (Want.Job)
	// claimed the job's token: this one took none and was promised nothing.
	// It is a duplicate of that copy, unless that copy was not forwarded.
	Copy bool
}

// DefaultGrace is Config.Grace's default: twice the default max_clock_skew.
const DefaultGrace = 2 * time.Second

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
	// Grace is how far a call's clock may read behind an earlier call's (of
	// any replica) with its grants still counted right: Redis keeps each
	// bucket that long after it leaves the window. A worker may use tokens
	// up to its token grace after their bucket (a call delayed that long
	// after its clock was read), and replicas' clocks differ by up to the
	// clocks' skew: the daemon sets twice max_clock_skew. Defaults to
	// DefaultGrace.
	Grace time.Duration
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
	touched  time.Time // the last Take of the key
	// the budget's token counters, resolved once
	usedC, putBackC, lapsedC, grantedC prometheus.Counter
	claimsC                            [3]prometheus.Counter // claims made, missed, and made early
	copiesC                            prometheus.Counter    // wants answered Copy
	refusedC                           prometheus.Counter    // wants refused (held)
	refusedAt                          time.Time             // when a call last refused a want (PutBack)
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
	if cfg.Grace <= 0 {
		cfg.Grace = DefaultGrace
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
	if st == nil || *st.spec != *w.Spec { // a rules reload may change the spec (workspaces that share a budget have equal ones)
		t := b.m.tokens
		n := w.Spec.Name
		st = &state{spec: w.Spec, size: 1, usedC: t.WithLabelValues(n, "used"), putBackC: t.WithLabelValues(n, "put_back"),
			lapsedC: t.WithLabelValues(n, "lapsed"), grantedC: t.WithLabelValues(n, "granted"),
			claimsC: [3]prometheus.Counter{b.m.claims.WithLabelValues(n, "made"), b.m.claims.WithLabelValues(n, "missed"),
				b.m.claims.WithLabelValues(n, "early")},
			copiesC: b.m.claims.WithLabelValues(n, "copy"), refusedC: b.m.refused.WithLabelValues(n)}
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
// not asked for over a window (promises are kept in Redis). A
// per-campaign budget makes a key per campaign: without this the map only
// grew. The next sweep comes when the map has doubled. b.mu is held.
func (b *Budgets) sweep() {
	now := b.cfg.Clock()
	for k, st := range b.keys {
		if !st.mu.TryLock() {
			continue // in use
		}
		idle := st.inflight == nil && !now.Before(st.expires) && now.Sub(st.touched) > st.spec.Window
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

// take serves the wants idx of one key: new wants from the local reserve
// first, then everything else in one call (claims of promised tokens always
// go to Redis, where their tokens are kept).
func (b *Budgets) take(ctx context.Context, st *state, key string, idx []int, wants []Want, grants []Grant) error {
	st.mu.Lock()
	defer st.mu.Unlock()
	var claims, fresh []int
	for _, i := range idx {
		if wants[i].Promised.IsZero() {
			fresh = append(fresh, i)
		} else {
			claims = append(claims, i)
		}
	}
	for {
		now := b.cfg.Clock()
		st.touched = now
		if st.reserve > 0 && !now.Before(st.expires) {
			st.lapsedC.Add(float64(st.reserve))
			st.reserve = 0
			st.size = max(1, st.size/2) // leased more than was used in time
		}
		fresh = st.grant(fresh, grants, min(st.reserve, len(fresh))) // the reserve first
		if len(fresh) == 0 && len(claims) == 0 {
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
		ask := len(fresh)
		if ask > 0 && !b.cfg.NoLease && !st.spec.Spread { // a spread budget's tokens come at its rate: a lease beyond
			// the demand would lapse them (2% of them under bench-budget's demand) while others wait
			ask = max(ask, st.size)
		}
		ask = min(ask, st.spec.Limit)
		asked := slices.Concat(claims, fresh)
		ch := make(chan struct{})
		st.inflight = ch
		st.mu.Unlock()
		r, err := b.call(ctx, key, st.spec, now, ask, 0, wants, asked, false)
		st.mu.Lock()
		st.inflight = nil
		close(ch)
		if err != nil {
			return err
		}
		// The tokens go to the wants that asked, even when their bucket ended
		// during the call (a call late in a bucket, or a slow one, would
		// otherwise lapse them all and refuse sends within the budget): they
		// are counted in their bucket, so the limit holds by token time. Only
		// the lease beyond this demand can lapse.
		st.bucket, st.expires = r.bucket, time.UnixMilli(r.bucket).Add(st.spec.Window/Buckets)
		took := st.answer(r, wants, asked, len(claims), now, st.expires, grants)
		st.reserve, st.leased, st.used = r.extra, r.extra+took, took
		st.grantedC.Add(float64(r.extra))
		return nil
	}
}

// answer fills grants from r, the answers to the wants asked (the first
// nclaims of them claims) by a call at now, granted tokens lasting until, and
// counts them; it returns the tokens the wants took.
func (st *state) answer(r reply, wants []Want, asked []int, nclaims int, now, until time.Time, grants []Grant) (took int) {
	refused := 0
	for k, i := range asked {
		switch at := r.wants[k]; {
		case k >= nclaims:
		case wants[i].Early: // an early claim refused waits for its promise: no claim missed
			if at == claimedOwn {
				st.claimsC[2].Inc()
			}
		default:
			st.claimsC[0].Inc()
			if at > 0 || at < copyOf {
				st.claimsC[1].Inc()
			}
		}
		if r.wants[k] == copyOf { // another copy of its job claimed the job's token
			grants[i] = Grant{Copy: true}
			st.copiesC.Inc()
			continue
		}
		if at := r.wants[k]; at == 0 || at == claimedOwn {
			grants[i] = Grant{OK: true, Until: until, Claimed: at == claimedOwn}
			took++
		} else { // the time it may come back: promised to it, or (less than 0) not
			grants[i] = Grant{RetryAt: time.UnixMilli(max(at, -at)), Promised: at > 0}
			refused++
		}
	}
	st.grantedC.Add(float64(took))
	st.usedC.Add(float64(took))
	if refused > 0 {
		st.refusedC.Add(float64(refused))
		st.refusedAt = now
	}
	return took
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

// maxLease bounds a lease: one bucket's share of the limit.
func maxLease(s *Spec) int { return max(1, s.Limit/Buckets) }

// promiseLapse is how long after its time a promised token is kept for its
// job: a held job comes back a few milliseconds after its due time (p99 13
// to 20 ms), later only while its tier's group rebalances. A job later than
// this (or not coming back: capped by another cap, or held on a replica that
// died) finds its token gone to whoever asked first, and is first in line
// for the next free one. A token kept for a late job comes back late: the
// job promised it next finds it missing and its promise follows it to the
// next token back (budget.lua). While a dead replica's tier partitions wait
// for the group, a third of the promises (with three replicas) wait for
// nobody until they lapse: 1 s, where 5 s left the two live replicas 16 to
// 22% of the limit in their worst window, against 26 to 28%. 200 ms (tried)
// shrank the lump the sends due during a rebalance make when it ends to those
// due in its last 200 ms (10 of 50; budget.lua's follow spreads it), raised
// hold records per job to 1.05-1.13 in a burst with a SIGKILL, and delivered
// 827 tokens where 900 are due in TestLateClaimsKeepTheBound (claims up to
// 950 ms late).
func promiseLapse(s *Spec) time.Duration { return max(time.Second, 2*s.Window/Buckets) }

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

// PutBack gives back n tokens of w that Take granted until until (their
// Grant.Until) and that were not used: their send was capped after all (by a
// cap of its user's, as a duplicate). While the key is short (a call of this
// process refused a want within the last window: the last call alone is no
// sign, a tier's claims are granted while the input's new wants are refused),
// or when w is a held send's claim (Promised set: the budget has promised
// tokens, though once new sends stop it refuses none), they go back to Redis,
// to the bucket they are counted in, as spare tokens:
// for a tenth of a second the next new send of any replica may take them
// whatever the promises after them count on (budget.lua), in the capped
// send's place. In the reserve they lapsed at their bucket's end (10 ms of a
// 1 s window) unless this process asked again within it, and each such
// capped send cost its window a send (BenchmarkCappedClaims). A token given
// back was counted and never sent, so the windows' bound holds. Otherwise
// (the key not short, or Redis failing) they go to the reserve, as Return.
func (b *Budgets) PutBack(ctx context.Context, w Want, until time.Time, n int) {
	st := b.state(w)
	now := b.cfg.Clock()
	st.mu.Lock()
	short := !st.refusedAt.IsZero() && now.Sub(st.refusedAt) < st.spec.Window || !w.Promised.IsZero()
	st.mu.Unlock()
	if !short || n < 1 {
		b.Return(w, n)
		return
	}
	bucket := until.Add(-w.Spec.Window / Buckets).UnixMilli()
	if _, err := b.call(ctx, w.Key, w.Spec, now, -n, bucket, nil, nil, true); err != nil {
		b.Return(w, n)
		return
	}
	st.mu.Lock()
	st.used -= n
	st.mu.Unlock()
	st.putBackC.Add(float64(n))
}

// Unclaim gives back the token a claim of w took (Grant.Claimed, counted in
// the bucket that ends at until) when its send was not a new one: a
// duplicate, the job copied on the delay tiers (a tier's message delivered
// again after a rebalance) and decided before. That claim took the token
// promised to another job at the same time; the token goes back to its
// bucket in Redis and the promise is kept again for that job, which would
// otherwise come back to nothing and wait a window more.
func (b *Budgets) Unclaim(ctx context.Context, w Want, until time.Time) error {
	bucket := until.Add(-w.Spec.Window / Buckets).UnixMilli()
	if _, err := b.call(ctx, w.Key, w.Spec, b.cfg.Clock(), -1, bucket, []Want{w}, []int{0}, false); err != nil {
		return err
	}
	b.m.tokens.WithLabelValues(w.Spec.Name, "unclaimed").Inc()
	return nil
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
		if _, err := b.call(ctx, key, st.spec, b.cfg.Clock(), -n, bucket, nil, nil, false); err != nil {
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
	r, err := b.call(ctx, w.Key, w.Spec, b.cfg.Clock(), 0, 0, nil, nil, false)
	if err != nil {
		return Usage{}, err
	}
	var next time.Time
	if r.next > 0 {
		next = time.UnixMilli(r.next)
	}
	return Usage{Used: r.used, Next: next}, nil
}

// copyOf is budget.lua's answer to a want whose job's token another copy of
// it claimed.
const copyOf = -2

// claimedOwn is budget.lua's answer to a claim granted the token promised to
// it.
const claimedOwn = -1

// reply is budget.lua's answer to a call.
type reply struct {
	extra  int   // tokens taken beyond the wants: a lease
	used   int   // tokens counted in the window
	bucket int64 // the bucket (ms) the tokens are counted in
	next   int64 // ms at which tokens come back; 0: none counted
	wants  []int64
}

// call runs the script for delta tokens (a new want's and a lease's; < 0:
// give -delta back to bucket, kept for new wants a while when spare) and the
// wants asked, in order; each want's answer is 0 (granted) or the ms at which
// it may come back.
func (b *Budgets) call(ctx context.Context, key string, s *Spec, now time.Time, delta int, bucket int64, wants []Want, asked []int, spare bool) (reply, error) {
	width := s.Window.Milliseconds() / Buckets
	b.m.calls.WithLabelValues(s.Name).Inc()
	k := b.RedisKey(key)
	args := make([]any, 0, 10+3*len(asked))
	args = append(args, now.UnixMilli(), s.Window.Milliseconds(), width, s.Limit, delta, strconv.FormatInt(bucket, 10), s.Burst(),
		promiseLapse(s).Milliseconds(), len(asked))
	for _, i := range asked {
		var promised, until int64
		if w := wants[i]; !w.Promised.IsZero() {
			promised = w.Promised.UnixMilli()
			if w.Early {
				promised = -promised
			}
		}
		if u := wants[i].Until; !u.IsZero() { // rounded up: a time before it in ms is before it
			until = (u.UnixNano() + int64(time.Millisecond) - 1) / int64(time.Millisecond)
		}
		args = append(args, promised, until, wants[i].Job)
	}
	args = append(args, b.cfg.Grace.Milliseconds())
	if spare {
		args = append(args, 1)
	}
	start := time.Now() // the call's own time, whatever the budgets' clock
	v, err := script.Run(ctx, b.cfg.Client, []string{k, k + ":r", k + ":p", k + ":j", k + ":c"}, args...).Result()
	b.m.seconds.WithLabelValues(s.Name).Observe(time.Since(start).Seconds())
	if err != nil {
		return reply{}, fmt.Errorf("budget %s: %w", key, err)
	}
	arr, ok := v.([]any)
	if !ok || len(arr) != 4+len(asked) {
		return reply{}, fmt.Errorf("budget %s: unexpected script reply %#v", key, v)
	}
	out := make([]int64, len(arr))
	for i, x := range arr {
		n, ok := x.(int64)
		if !ok {
			return reply{}, fmt.Errorf("budget %s: unexpected script reply %#v", key, v)
		}
		out[i] = n
	}
	return reply{extra: int(out[0]), used: int(out[1]), bucket: out[2], next: out[3], wants: out[4:]}, nil
}

type metrics struct {
	claims  *prometheus.CounterVec
	tokens  *prometheus.CounterVec
	calls   *prometheus.CounterVec
	seconds *prometheus.HistogramVec
	refused *prometheus.CounterVec
}

func (m *metrics) register(reg prometheus.Registerer) error {
	m.tokens = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_budget_tokens_total", Help: "Budget tokens by budget and kind: granted (leased from Redis), used (taken by a job), put_back (taken by a job that was then capped: back in the reserve, or, while the budget refuses sends, in Redis for any replica's next send; used - put_back were forwarded), lapsed (the lease's bucket ended first), returned (given back to Redis at shutdown), unclaimed (a claim's token given back to Redis and its promise kept again: the send was a duplicate).",
	}, []string{"budget", "kind"})
	m.claims = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_budget_claims_total", Help: "Held sends back for the token a budget promised them, by budget and result: made (every claim), missed (the token was not there: the promise lapsed, or the window was full; the send is promised another), copy (any want, a claim or not, of a job whose token another copy of it claimed: it takes none and is checked as a duplicate), early (held sends released before their promise that took a token put back or given up: not counted in made).",
	}, []string{"budget", "result"})
	m.calls = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_budget_redis_calls_total", Help: "Redis calls for budgets, by budget.",
	}, []string{"budget"})
	m.seconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "capper_budget_call_seconds", Help: "Redis calls for budgets, by budget: from the call to its answer (the budget's node's queue and the script's run). The process's other calls of the budget wait for it, and a held send claiming its token is released that much later.",
		Buckets: prometheus.ExponentialBuckets(0.0005, 2, 12), // 0.5 ms to 1 s
	}, []string{"budget"})
	m.refused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_budget_refused_total", Help: "Jobs that found a budget exhausted (and were held), by budget.",
	}, []string{"budget"})
	if reg == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{m.claims, m.tokens, m.calls, m.seconds, m.refused} {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("budget: register metrics: %w", err)
		}
	}
	return nil
}
