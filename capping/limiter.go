package capping

import (
	"context"
	_ "embed"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/cespare/xxhash/v2"
	"github.com/redis/go-redis/v9"
)

//go:embed decide.lua
var decideSource string

// decideScript is decide.lua as a script: EVAL sends it whole, when a node
// keeps losing the function library (see Decide).
var decideScript = redis.NewScript(decideSource)

// decideLibrary is decide.lua as a Redis 7 function library, loaded on every
// master with FUNCTION LOAD, and decideFunction the name FCALL calls it by.
// A script's chunk runs from the top on every EVALSHA, making its local
// functions anew (0.5 to 0.8 us a call); a library's run once, when it loads.
// Both names carry the script's SHA1, so that workers of two versions share a
// cluster during a rolling upgrade, each calling its own.
var decideFunction, decideLibraryName, decideLibrary = functionLibrary(decideSource, decideScript.Hash())

// functionLibrary makes the library of a script whose first line declares its
// flags and whose last calls run(KEYS, ARGV): the same chunk, with its flags
// on the registration, which takes the place of the last line.
func functionLibrary(src, sha string) (function, library, code string) {
	const flags, last = "#!lua flags=allow-cross-slot-keys\n", "return run(KEYS, ARGV)\n"
	if !strings.HasPrefix(src, flags) || !strings.HasSuffix(src, last) {
		panic("capping: decide.lua must start with " + flags + " and end with " + last)
	}
	v := sha[:16]
	function, library = "capper_decide_"+v, "capper_"+v
	code = "#!lua name=" + library + "\n" + strings.TrimSuffix(strings.TrimPrefix(src, flags), last) +
		"redis.register_function{function_name = '" + function + "', callback = run, flags = {'allow-cross-slot-keys'}}\n"
	return function, library, code
}

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
		c.KeyPrefix = "fc"
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
	cache    *nearCache    // nil when off
	seen     *seenUsers    // nil with ScriptOnly
	calls    atomic.Uint64 // script calls sent
	requests atomic.Uint64 // requests they carried

	newLogs, newLogMisses   atomic.Uint64 // SET NX that recorded a new log, and that found one
	copyAppends, copyMisses atomic.Uint64 // sends decided from a whole copy and appended (mode 4), and those whose log had changed
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
	if !cfg.ScriptOnly {
		l.seen = newSeenUsers()
	}
	if err := l.LoadFunctions(ctx); err != nil {
		return nil, err
	}
	return l, nil
}

// LoadFunctions loads decide.lua's function library on every master. A
// master's replicas get it by replication and keep it, so a replica promoted
// by failover has it (a script cache is neither replicated nor kept). Decide
// loads it by itself on a node that answers "Function not found".
func (l *Limiter) LoadFunctions(ctx context.Context) error {
	if l.cluster != nil {
		return l.cluster.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			return loadFunction(ctx, c, c.Options().Addr)
		})
	}
	return loadFunction(ctx, l.client, "redis")
}

func loadFunction(ctx context.Context, n node, name string) error {
	lib, err := n.FunctionLoadReplace(ctx, decideLibrary).Result()
	if err != nil {
		return fmt.Errorf("capping: load function library %s on %s: %w", decideLibraryName, name, err)
	}
	if lib != decideLibraryName {
		return fmt.Errorf("capping: load function library on %s: loaded %s, want %s", name, lib, decideLibraryName)
	}
	return nil
}

// unloaded reports whether err is a node's answer that it has not the
// function library.
func unloaded(err error) bool { return redis.HasErrorPrefix(err, "Function not found") }

// Key returns the Redis key of a user's log.
func (l *Limiter) Key(userID uint32) string {
	var buf [64]byte // one allocation (the string) for prefixes of up to 50 bytes
	b := append(buf[:0], l.cfg.KeyPrefix...)
	b = append(b, ":{"...)
	b = strconv.AppendUint(b, uint64(userID), 10)
	return string(append(b, '}'))
}

// Offsets of a member's parts (see Member).
const (
	memberChannel  = 8
	memberCampaign = 10
	memberTags     = 14
)

// Member returns the log member of a send: the 8-byte xxhash64 digest of the
// job id, then 16-bit digests of the channel, a 32-bit digest of the campaign,
// and a 16-bit digest per tag, so that any scope a later rule names can be
// counted over the history. A redelivered job has the same member. Two jobs of
// one user inside the longest window collide with a probability of about
// n²/2⁶⁵ for n logged sends.
func Member(jobID, channel, campaign string, tags []string) string {
	return string(appendMember(nil, jobID, channel, campaign, tags))
}

// memberLen is the length of a member with n tags.
func memberLen(n int) int { return memberTags + 2*n }

// appendMember appends the member of a send (see Member) to b.
func appendMember(b []byte, jobID, channel, campaign string, tags []string) []byte {
	b = binary.BigEndian.AppendUint64(b, xxhash.Sum64String(jobID))
	b = binary.BigEndian.AppendUint16(b, uint16(xxhash.Sum64String(channel)))
	b = binary.BigEndian.AppendUint32(b, uint32(xxhash.Sum64String(campaign)))
	for _, t := range tags {
		b = binary.BigEndian.AppendUint16(b, uint16(xxhash.Sum64String(t)))
	}
	return b
}

// digest2 and digest4 are a name's digests as Member writes them, for scopes.
func digest2(s string) string {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], uint16(xxhash.Sum64String(s)))
	return string(b[:])
}

func digest4(s string) string {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], uint32(xxhash.Sum64String(s)))
	return string(b[:])
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
	now := l.cfg.Clock()
	decs := make([]Decision, len(reqs))
	var errs RequestErrors // made at the first failure
	setErr := func(i int, err error) {
		if errs == nil {
			errs = make(RequestErrors, len(reqs))
		}
		errs[i] = err
	}
	cache := l.cache
	if !record {
		cache = nil // a look is never cached, nor answered from the cache
	}
	var gen uint64
	if cache != nil {
		gen = cache.gen.Load()
	}
	fail := func(i int, err error) {
		decs[i] = Decision{} // a failed request's is zero (a copy's decision may be there)
		setErr(i, fmt.Errorf("capping: decide job %q for user %d: %w", reqs[i].JobID, reqs[i].UserID, err))
		if cache != nil { // it may have been recorded: the copy is no longer the log
			cache.drop(reqs[i].UserID)
		}
	}
	var caps *[]Cap // a look counts every cap (capper check shows them all)
	if record {
		caps = capSlab.get()
		defer func() { clear(*caps); capSlab.put(caps) }()
	}
	sc := scratchPool.get()
	defer sc.release()
	b := &batch{l: l, reqs: reqs, record: record, results: grow(&sc.results, len(reqs)), nodes: grow(&sc.nodes, len(reqs)),
		alone: grow(&sc.alone, len(reqs)), args: newArgs(reqs, now, l.cfg.ClockMargin, caps, sc), sc: sc}
	if cache != nil {
		b.maxLog = cacheMaxLog
	}
	pending := grow(&sc.pending, len(reqs))[:0]
	asked := sc.asked[:0] // the requests the near cache may answer
	for i := range reqs {
		if err := reqs[i].validate(); err != nil {
			setErr(i, fmt.Errorf("capping: job %q: %w: %w", reqs[i].JobID, ErrInvalidRequest, err))
			continue
		}
		if n := len(b.args[i].caps); cache != nil && n > 0 && n <= maxCaps && !reqs[i].Candidate {
			asked = append(asked, i)
		}
	}
	sc.asked = asked
	hit := grow(&sc.hit, len(reqs))
	if len(asked) > 0 {
		cache.decideAll(reqs, b.args, asked, decs, hit, grow(&sc.order, len(asked)), grow(&sc.slots, len(asked)), grow(&sc.hints, len(reqs)))
	}
	sent := sc.sent // users with a request for Redis in this batch
	clear(sent)
	hits := 0
	for i := range reqs {
		if errs != nil && errs[i] != nil { // invalid
			continue
		}
		if cache != nil {
			// A later request of a user whose earlier one goes to Redis must
			// see that one's outcome, so it goes too (its answer from the
			// copy is dropped).
			if hit[i] && !sent[reqs[i].UserID] {
				hits++
				continue
			}
			if sent == nil {
				sent = make(map[uint32]bool, len(reqs))
				sc.sent = sent
			}
			if sent[reqs[i].UserID] {
				b.args[i].expect = "" // the copy will not hold the earlier request's outcome
			}
			if b.args[i].expect == "" { // else the copy's decision, for an append (see decideAll)
				decs[i] = Decision{}
			}
			sent[reqs[i].UserID] = true
		}
		pending = append(pending, i)
	}
	if cache != nil {
		cache.hits.Add(uint64(hits))
		cache.misses.Add(uint64(len(asked) - hits))
	}
	l.requests.Add(uint64(len(pending)))
	if l.seen != nil && record {
		b.fresh = l.markNewLogs(reqs, b.args, pending, sc)
	}
	for reloads := 0; len(pending) > 0; reloads++ {
		// After a reload, a node flushed again (or restarted) could answer
		// "Function not found" once more; from the second retry on, the
		// script's body is sent (EVAL), which cannot fail that way.
		b.eval = reloads >= 2
		b.send(ctx, pending)
		// by node: the requests it answered "Function not found"
		unloadedOn := map[node][]int{}
		var split []int // requests of a call refused for another's slot: sent again in calls of their own
		var again []int // sent as new logs and found a log: sent to the script
		reload := false
		for _, i := range pending {
			if b.nodes[i] == nil { // no route: the topology is unknown
				fail(i, b.routeErr)
				reload = true
				continue
			}
			v, err := b.results[i].v, b.results[i].err
			setNX := b.fresh != nil && b.fresh[i]
			inScript := setNX && reqs[i].Preferences // mode 5: written ('='), or else decided in full
			if setNX {
				b.fresh[i] = false // from now on, the script's
				l.seen.add(reqs[i].UserID)
				if !inScript && (errors.Is(err, redis.Nil) || (err != nil && redirected(err))) {
					if errors.Is(err, redis.Nil) {
						l.newLogMisses.Add(1)
					} else {
						reload = true
					}
					again = append(again, i)
					continue
				}
			}
			if err == nil {
				var tail, raw string // the log after the decision: its entries, and whole when known (see install)
				switch a := &b.args[i]; {
				case setNX && !inScript:
					l.newLogs.Add(1)
					decs[i], tail, err = b.newLogDecision(i, now, a.packed)
					raw = a.packed
				case inScript && v == "=":
					l.newLogs.Add(1)
					decs[i], tail, err = b.newLogDecision(i, now, a.named)
					raw = a.named
				case a.expect != "" && v == "=": // recorded by an APPEND to the copy's log
					l.copyAppends.Add(1)
					raw = appendedLog(a) // decs[i]: the copy's decision (see decideAll)
					tail = raw[8:]
				default:
					if a.expect != "" {
						l.copyMisses.Add(1)
					}
					if inScript {
						l.newLogMisses.Add(1)
					}
					decs[i], tail, raw, err = parseReply(v, a.caps, a.member, now, a.counts)
				}
				b.args[i].requestCounts(&decs[i])
				if err == nil && ((decs[i].Allowed && record) || reqs[i].Refused != "") && !b.replicated(b.nodes[i]) {
					decs[i], err = Decision{}, b.waitErr(b.nodes[i])
				}
				if err == nil && reqs[i].DuplicateOnly && !decs[i].Duplicate {
					decs[i] = Decision{At: now} // looked, and not found
				}
				if err == nil && cache != nil && !reqs[i].DuplicateOnly { // a look changes nothing
					if len(tail) > 0 {
						var hint int32
						if len(asked) > 0 {
							hint = sc.hints[i]
						}
						cache.install(&reqs[i], &b.args[i], gen, tail, raw, hint)
					} else {
						cache.drop(reqs[i].UserID)
					}
				}
			} else if unloaded(err) {
				unloadedOn[b.nodes[i]] = append(unloadedOn[b.nodes[i]], i)
				continue
			} else if b.results[i].shared && !b.alone[i] && redirected(err) {
				b.alone[i] = true
				split = append(split, i)
				reload = true
				continue
			}
			if err != nil {
				reload = reload || topologyChanged(err)
				fail(i, err)
			}
		}
		if reload {
			l.reloadTopology(ctx)
		}
		pending = append(append(pending[:0], split...), again...)
		for n, idx := range unloadedOn {
			var reason error
			if reloads >= l.cfg.ScriptReloads {
				reason = fmt.Errorf("function not found after %d reloads of its library", reloads)
			} else if err := loadFunction(ctx, n, nodeName(n)); err != nil {
				reason = err
			} else {
				l.functionLoads.Add(1)
			}
			for _, i := range idx {
				if reason != nil {
					fail(i, reason)
				} else {
					pending = append(pending, i)
				}
			}
		}
	}
	if errs != nil {
		return decs, errs
	}
	return decs, nil
}

// reqArgs are one request's values for the script (and the cache), computed
// once per call.
type reqArgs struct {
	at        time.Time // the clock reading of the call
	now       int64     // at in ms
	member    string
	retention int64 // ms
	// caps are the caps decided: the request's, or for Decide only those
	// that apply to the send (see newArgs), each named as in the request.
	caps   []Cap
	orig   []int   // per cap decided, its index in the request's Caps; nil when caps are the request's
	since  []int64 // per cap decided: the first ms that counts
	reset  []int64 // per cap decided: a rolling window's ms, or minus a calendar period's end
	counts []int   // per cap decided: their counts
	// applying: caps are only those that apply to the send (Decide; see
	// newArgs), which pack tells the script so that it need not check.
	applying bool
	all      []int // with orig, per cap of the request: the Decision's Counts (-1 where not decided)

	// expect, set by the near cache, is the user's whole log as its copy
	// holds it, from which the send was decided allowed (that decision in
	// the request's Decision until Redis answers): the script appends the
	// send if the log is still that (mode 4, see decide.lua), else decides it.
	expect string

	// Set by send and pack for a call to Redis (the call points at them).
	key, arbKey, prefKey string
	packed               string // decide.lua's ARGV[2], in the batch's slab
	named                string // its ARGV[3]: the refusal's name, or expect
}

// capSlab holds the caps Decide sends when some of a request's do not apply,
// reused from batch to batch (a Decision points at none of them).
var capSlab = make(spares[[]Cap], 4)

// spares keeps a few values for reuse from batch to batch: one per
// concurrent Decide in a daemon (its worker and its delay tiers'). Unlike a
// sync.Pool, the garbage collector does not empty it: the worker collects
// several times a second, and a pool emptied each time left most batches to
// allocate their arrays again (128 MB in 12 s of a blast, as much as 4% of
// what the worker allocates).
type spares[T any] chan *T

func (s spares[T]) get() *T {
	select {
	case v := <-s:
		return v
	default:
		return new(T)
	}
}

func (s spares[T]) put(v *T) {
	select {
	case s <- v:
	default: // enough are kept
	}
}

// scratch holds a batch's working arrays, reused from batch to batch: a
// batch of 2,000 jobs needs about 1 MB of them, which allocated afresh each
// time was a third of the worker's allocations (and of its GC). Nothing the
// caller keeps points into them: a Decision's Counts are allocated apart.
type scratch struct {
	args    []reqArgs
	ints    []int64
	orig    []int
	results []result
	nodes   []node
	alone   []bool
	pending []int
	packed  []byte // the requests' packed values (see pack)
	sent    map[uint32]bool
	users   map[uint32]int32 // requests per user sent to Redis (see Limiter.markNewLogs)
	fresh   []bool
	asked   []int // the near cache's lookups (see run, nearCache.decideAll)
	hit     []bool
	order   []int
	slots   []int32
	hints   []int32 // by request: its copy's slot plus one at the lookup (see nearCache.install)
}

var scratchPool = make(spares[scratch], 4)

// release clears what points at the batch's requests and replies, and puts sc back.
func (sc *scratch) release() {
	clear(sc.args[:cap(sc.args)])
	clear(sc.results[:cap(sc.results)])
	clear(sc.nodes[:cap(sc.nodes)])
	scratchPool.put(sc)
}

// grow returns (*s)[:n] zeroed, reallocating *s when it is too short. With a
// nil s it allocates.
func grow[T any](s *[]T, n int) []T {
	if s == nil {
		return make([]T, n)
	}
	if cap(*s) < n {
		*s = make([]T, n)
	}
	*s = (*s)[:n]
	clear(*s)
	return *s
}

// newArgs computes the arguments of every request, on a few backing arrays.
// The retention is the longest window plus margin (Config.ClockMargin).
//
// With applying (Decide), a request's caps whose scope the send does not
// match are left out of the decision: they can neither cap the send nor be
// used by it, and counting them is most of what a scoped cap costs the
// script. caps (from capSlab, nil without applying) holds the ones kept of
// such requests. Their counts in the Decision are -1.
//
// The working arrays come from sc (nil: allocated); the counts, which the
// Decisions keep, are always allocated.
func newArgs(reqs []Request, now time.Time, margin time.Duration, caps *[]Cap, sc *scratch) []reqArgs {
	ncaps := 0
	for i := range reqs {
		ncaps += len(reqs[i].Caps)
	}
	// The members, one after the other in arrays of their own (never
	// reused: nothing may write where a member's string points) of 8 KiB, a
	// small allocation (an array above 32 KiB is a large one, zeroed apart:
	// more than the members' own allocations cost).
	var members []byte
	var intsBuf *[]int64
	var origBuf *[]int
	var argsBuf *[]reqArgs
	if sc != nil {
		intsBuf, origBuf, argsBuf = &sc.ints, &sc.orig, &sc.args
	}
	ints := grow(intsBuf, 2*ncaps)
	counts := make([]int, ncaps)
	var orig, all []int
	if caps != nil {
		*caps = (*caps)[:0]
		if cap(*caps) < ncaps { // never grown below: the requests' caps point into it
			*caps = make([]Cap, 0, ncaps)
		}
		orig = grow(origBuf, ncaps)[:0]
	}
	args := grow(argsBuf, len(reqs))
	nowMs := now.UnixMilli()
	for i := range reqs {
		r := &reqs[i]
		a := &args[i]
		a.at, a.now = now, nowMs
		if !r.SentAt.IsZero() {
			a.at, a.now = r.SentAt, r.SentAt.UnixMilli()
		}
		if need := memberLen(len(r.Tags)); cap(members)-len(members) < need {
			members = make([]byte, 0, max(need, 8<<10))
		}
		m := len(members)
		members = appendMember(members, r.JobID, r.Channel, r.Campaign, r.Tags)
		a.member = unsafe.String(&members[m], len(members)-m)
		a.caps = r.Caps
		retention := r.Retention
		for j := range r.Caps {
			c := &r.Caps[j]
			if c.Window > 0 {
				retention = max(retention, c.Window)
			} else {
				retention = max(retention, c.Until.Sub(c.Since))
			}
		}
		a.retention = (retention + margin).Milliseconds()
		if caps != nil { // the indices of the caps that apply; kept only when some do not
			a.applying = true
			start := len(orig)
			for j := range r.Caps {
				if r.Caps[j].appliesTo(a.member) {
					orig = append(orig, j)
				}
			}
			if len(orig)-start == len(r.Caps) {
				orig = orig[:start]
			} else {
				a.orig = orig[start:len(orig):len(orig)]
			}
		}
		if a.orig != nil {
			first := len(*caps)
			for _, j := range a.orig {
				c := r.Caps[j]
				c.Name = c.label(j)
				*caps = append(*caps, c)
			}
			a.caps = (*caps)[first:len(*caps):len(*caps)]
			if all == nil {
				all = make([]int, ncaps)
			}
			a.all, all = all[:len(r.Caps):len(r.Caps)], all[len(r.Caps):]
		}
		n := len(a.caps)
		a.since, a.reset, ints = ints[:n:n], ints[n:2*n:2*n], ints[2*n:]
		a.counts, counts = counts[:n:n], counts[n:]
		for j := range a.caps {
			c := &a.caps[j]
			if c.Window > 0 {
				a.reset[j] = c.Window.Milliseconds()
				a.since[j] = nowMs - a.reset[j] + 1
			} else {
				a.since[j], a.reset[j] = c.Since.UnixMilli(), -c.Until.UnixMilli()
			}
		}
	}
	return args
}

// requestCounts turns d's counts, of the caps decided, into the request's:
// one per cap of the request, -1 for those left out.
func (a *reqArgs) requestCounts(d *Decision) {
	if a.orig == nil || d.Counts == nil {
		return
	}
	for i := range a.all {
		a.all[i] = -1
	}
	for k, j := range a.orig {
		a.all[j] = d.Counts[k]
	}
	d.Counts = a.all
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
	// being that copy (mode 4 of decide.lua); CopyMisses those whose log had
	// changed, which the script decided in full.
	CopyAppends, CopyMisses uint64
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
		CopyAppends: l.copyAppends.Load(), CopyMisses: l.copyMisses.Load(), FunctionLoads: l.functionLoads.Load()}
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

// batch is one attempt at deciding a set of requests.
type batch struct {
	l        *Limiter
	reqs     []Request
	args     []reqArgs // by request
	maxLog   int       // maxlog of the packed values: the longest log the script returns for the cache
	record   bool
	results  []result // by request
	nodes    []node   // by request: where it was sent; nil when it could not be routed
	alone    []bool   // by request: sent in a call of its own (a call with it was redirected)
	calls    []call   // this attempt's
	sets     []set    // this attempt's SET NX of new logs
	routeErr error
	fresh    []bool                   // by request: sent as a new log (SET NX, see newlog.go) this attempt; nil: none
	eval     bool                     // send EVAL with the script's body instead of FCALL
	waits    map[node][]*redis.IntCmd // by node: the WAITs of its pipelines
	sc       *scratch                 // the working arrays above, reused by the next batch
}

type pipeKey struct {
	n node
	p int
}

// perCall is the most requests one call of decide.lua carries. A call's own
// cost (~1.7 us of a master's CPU: parsing, the Lua call, the reply) is paid
// once for them, and the node runs the call for a few hundred microseconds at
// most (a request costs it ~10 us).
const perCall = 32

// call is one call of decide.lua and the requests it carries, in order.
type call struct {
	cmd  *redis.Cmd
	reqs []int
}

// set is the SET NX of request i's new log.
type set struct {
	cmd *redis.StatusCmd
	i   int
}

// result is what a request's call answered for it.
type result struct {
	v      any
	err    error
	shared bool // the call carried other requests
}

// send queues pending requests on one pipeline per (user group, master), in
// calls of up to perCall requests (one each for those marked alone), and
// executes them concurrently; results and errors land in b.results.
func (b *batch) send(ctx context.Context, pending []int) {
	l := b.l
	n := l.cfg.Pipelines
	if len(pending) < 64 {
		n = 1
	}
	type open struct {
		p    redis.Pipeliner
		reqs []int // the requests of its next call
	}
	pipes := map[pipeKey]*open{}
	b.waits = map[node][]*redis.IntCmd{}
	b.calls = b.calls[:0]
	b.sets = b.sets[:0]
	bytes := 0
	for _, i := range pending {
		fresh := b.fresh != nil && b.fresh[i]
		if fresh {
			bytes += newLogLen(&b.args[i])
		}
		if !fresh || b.reqs[i].Preferences {
			bytes += packedLen(&b.args[i])
		}
	}
	packed := grow(&b.sc.packed, bytes) // every request's packed values
	flush := func(o *open) {
		if len(o.reqs) == 0 {
			return
		}
		c := call{cmd: redis.NewCmd(ctx, callArgs(b.eval, b.reqs, b.args, o.reqs)...), reqs: o.reqs}
		_ = o.p.Process(ctx, c.cmd) // queued; the result is read per call
		b.calls = append(b.calls, c)
		o.reqs = nil
	}
	for _, i := range pending {
		r := &b.reqs[i]
		a := &b.args[i]
		a.key = l.Key(r.UserID)
		nd, err := l.route(ctx, a.key)
		if err != nil {
			b.nodes[i], b.routeErr = nil, err
			continue
		}
		b.nodes[i] = nd
		k := pipeKey{nd, int(r.UserID % uint32(n))}
		o := pipes[k]
		if o == nil {
			o = &open{p: nd.Pipeline()}
			pipes[k] = o
		}
		// A new log, the bytes the script would write: by SET NX PX, or (a send
		// that reads preferences) by the script's mode 5, fresh.
		var fresh string
		if b.fresh != nil && b.fresh[i] {
			m := newLogLen(a)
			var ttl int64
			fresh, ttl = newLog(packed[:0:m], a)
			packed = packed[m:]
			if !r.Preferences {
				a.packed = fresh
				cmd := redis.NewStatusCmd(ctx, "set", &a.key, &a.packed, "nx", "px", ttl)
				_ = o.p.Process(ctx, cmd)
				b.sets = append(b.sets, set{cmd, i})
				continue
			}
		}
		record, maxLog := b.record, b.maxLog
		if r.DuplicateOnly {
			record, maxLog = false, 0
		}
		m := packedLen(a)
		pack(packed[:0:m], r, a, record, maxLog, fresh)
		packed = packed[m:]
		if b.alone[i] {
			flush(o)
		}
		if o.reqs == nil {
			o.reqs = make([]int, 0, perCall)
		}
		o.reqs = append(o.reqs, i)
		if b.alone[i] || len(o.reqs) == perCall {
			flush(o)
		}
	}
	for _, o := range pipes {
		flush(o)
	}
	l.calls.Add(uint64(len(b.calls)))
	var wg sync.WaitGroup
	for k, o := range pipes {
		if l.cfg.MinReplicasAcked > 0 && b.record {
			w := redis.NewIntCmd(ctx, "wait", l.cfg.MinReplicasAcked, l.cfg.ReplicaTimeout.Milliseconds())
			_ = o.p.Process(ctx, w)
			b.waits[k.n] = append(b.waits[k.n], w)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _ = o.p.Exec(ctx) // errors are read per call
		}()
	}
	wg.Wait()
	for _, st := range b.sets {
		b.results[st.i] = result{v: st.cmd.Val(), err: st.cmd.Err()}
	}
	for _, c := range b.calls {
		v, err := c.cmd.Result()
		var replies []any
		if err == nil {
			var ok bool
			if replies, ok = v.([]any); !ok || len(replies) != len(c.reqs) {
				err = fmt.Errorf("unexpected script reply %#v: want %d replies", v, len(c.reqs))
			}
		}
		for j, i := range c.reqs {
			switch {
			case err != nil:
				b.results[i] = result{err: err, shared: len(c.reqs) > 1}
			default:
				if e, ok := replies[j].(error); ok { // this request's own failure
					b.results[i] = result{err: e, shared: len(c.reqs) > 1}
				} else {
					b.results[i] = result{v: replies[j]}
				}
			}
		}
	}
}

// redirected reports whether err is a node's refusal of a call, or of a
// request in it, for a slot it does not serve (now): the requests of a call
// with several users' keys are then sent again one per call (their own key
// declared, so that the node redirects the call), and one moving slot holds
// up only its own users.
func redirected(err error) bool {
	for _, p := range []string{"MOVED", "ASK", "CROSSSLOT", "TRYAGAIN"} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return strings.Contains(err.Error(), "non local key")
}

// replicated reports whether every WAIT sent to n this attempt reached
// MinReplicasAcked (always true when durability is off).
func (b *batch) replicated(n node) bool {
	for _, w := range b.waits[n] {
		if acked, err := w.Result(); err != nil || acked < int64(b.l.cfg.MinReplicasAcked) {
			return false
		}
	}
	return true
}

func (b *batch) waitErr(n node) error {
	for _, w := range b.waits[n] {
		acked, err := w.Result()
		if err != nil {
			return fmt.Errorf("%w: WAIT on %s: %w", ErrNotReplicated, nodeName(n), err)
		}
		if acked < int64(b.l.cfg.MinReplicasAcked) {
			return fmt.Errorf("%w: %d of %d replicas of %s acknowledged within %v", ErrNotReplicated, acked, b.l.cfg.MinReplicasAcked, nodeName(n), b.l.cfg.ReplicaTimeout)
		}
	}
	return ErrNotReplicated
}

// route returns the node that owns key: its master in a cluster, the client itself otherwise.
func (l *Limiter) route(ctx context.Context, key string) (node, error) {
	if l.cluster == nil {
		return l.client, nil
	}
	c, err := l.cluster.MasterForKey(ctx, key)
	if err != nil {
		return nil, fmt.Errorf("no master known for %s: %w", key, err)
	}
	return c, nil
}

// reloadTopology asks the cluster client to reload the slot map now rather
// than at its next periodic reload: after a crash the promoted replica is
// found as soon as the cluster has promoted it. go-redis runs one reload at a
// time with a 200ms cool-down, so calling this on every failed attempt is cheap.
func (l *Limiter) reloadTopology(ctx context.Context) {
	if l.cluster == nil {
		return
	}
	l.cluster.ReloadState(ctx)
}

// topologyChanged reports whether err suggests the slot map is stale: the
// node could not be reached (crashed, frozen, restarting), or it redirected
// or refused because it is no longer (or not yet) the slot's master.
func topologyChanged(err error) bool {
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return !errors.Is(err, ErrNotReplicated) // network errors, timeouts, closed pools
	}
	for _, p := range []string{"MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN", "READONLY", "LOADING", "MASTERDOWN"} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
}

func nodeName(n node) string {
	if c, ok := n.(*redis.Client); ok {
		return c.Options().Addr
	}
	return "redis"
}

// ArbitrationKey returns the Redis key of a user's arbitration candidates.
func (l *Limiter) ArbitrationKey(userID uint32) string { return l.Key(userID) + ":arb" }

// The first two values of a call, boxed once: FCALL and the function's name,
// or EVAL and the script's body.
var (
	fcallHead = [2]any{"fcall", decideFunction}
	evalHead  = [2]any{"eval", decideSource}
)

// keyCount is how many keys a request of r has in a call: its log, its
// arbitration candidates and its preferences.
func keyCount(r *Request) int {
	n := 1
	if r.Arbitration > 0 {
		n++
	}
	if r.Preferences {
		n++
	}
	return n
}

// callArgs returns one call of decide.lua, FCALL (or EVAL with its body
// when eval is set), for the requests idx of reqs, whose args pack filled:
// the first one's log as its one declared key, then the packed values, the
// member, the refusal's name and the keys of each, in order (see the script's
// header). The values are pointers to the args' and requests' fields
// (go-redis writes a *string as its value): a string put in an interface
// would be copied to the heap, a pointer is not. So they must not change
// until the call is sent.
func callArgs(eval bool, reqs []Request, args []reqArgs, idx []int) []any {
	n := 4
	for _, i := range idx {
		n += 3 + keyCount(&reqs[i])
	}
	v := make([]any, 4, n)
	head := &fcallHead
	if eval {
		head = &evalHead
	}
	v[0], v[1], v[2], v[3] = head[0], head[1], 1, &args[idx[0]].key
	for _, i := range idx {
		a := &args[i]
		v = append(v, &a.packed, &a.member, &a.named, &a.key)
		if reqs[i].Arbitration > 0 {
			v = append(v, &a.arbKey)
		}
		if reqs[i].Preferences {
			v = append(v, &a.prefKey)
		}
	}
	return v
}

// The sizes of decide.lua's packed values (its ARGV[2]): the call's, then each cap's before its filter.
const (
	packedHead = 8 + 1 + 8 + 2 + 8 + 1 + 1 // now, mode, retention, maxlog, window, priority, prefs
	packedCap  = 8 + 4 + 8                 // since, limit, reset
)

// packedLen is the length of a's packed values (see pack).
func packedLen(a *reqArgs) int {
	n := packedHead
	for i := range a.caps {
		n += packedCap + a.caps[i].filterLen()
	}
	return n
}

// pack fills a's other keys (from a.key) and packs r's values for decide.lua
// (its ARGV[2]) into buf, of capacity packedLen(a) at least and not written
// again until the call is sent: a.packed points into it. fresh, when not
// empty, is the new log to write in mode 5 (see newlog.go).
func pack(buf []byte, r *Request, a *reqArgs, record bool, maxLog int, fresh string) {
	if r.Arbitration > 0 {
		a.arbKey = a.key + ":arb"
	}
	if r.Preferences {
		a.prefKey = a.key + ":prefs"
	}
	mode := byte(0)
	a.named = r.Refused
	switch {
	case r.Refused != "":
		mode = 3
	case record && a.expect != "":
		mode, a.named = 4, a.expect
	case record && fresh != "":
		mode, a.named = 5, fresh
	case record && !r.SentAt.IsZero():
		mode = 2
	case record:
		mode = 1
	}
	b := binary.BigEndian.AppendUint64(buf[:0], uint64(a.now))
	b = append(b, mode)
	b = binary.BigEndian.AppendUint64(b, uint64(a.retention))
	b = binary.BigEndian.AppendUint16(b, uint16(maxLog))
	b = binary.BigEndian.AppendUint64(b, uint64(r.Arbitration.Milliseconds()))
	prefs := byte(0)
	if r.Preferences {
		prefs = 1
	}
	b = append(b, byte(r.Priority), prefs)
	for i := range a.caps {
		c := &a.caps[i]
		b = binary.BigEndian.AppendUint64(b, uint64(a.since[i]))
		b = binary.BigEndian.AppendUint32(b, uint32(c.Limit))
		b = binary.BigEndian.AppendUint64(b, uint64(a.reset[i]))
		b = c.appendFilter(b, a.applying)
	}
	a.packed = unsafe.String(unsafe.SliceData(b), len(b))
}

// parseReply checks the script's reply (one packed string, see decide.lua)
// against the request's caps and returns its decision and the log entries
// that follow it, as the log packs them (empty if none), and, when the
// script sent the log whole (status + 128), that log (its header, then the
// same entries); it never panics on a bad reply. member is the send's, to tell which shadow caps apply; counts
// (of len(caps)) becomes the Decision's Counts, or nil.
func parseReply(v any, caps []Cap, member string, now time.Time, counts []int) (d Decision, tail, whole string, err error) {
	ncaps := len(caps)
	s, ok := v.(string)
	head := replyHead + 4*ncaps
	if !ok || len(s) < head {
		return Decision{}, "", "", fmt.Errorf("unexpected script reply %q: want a string of %d bytes or more (status, cap, retry_at, %d counts)", v, head, ncaps)
	}
	var buf [3 + maxCaps]int64
	ints := buf[:0]
	if 3+ncaps > len(buf) {
		ints = make([]int64, 0, 3+ncaps)
	}
	ints = ints[:3+ncaps]
	status, isWhole := s[0], s[0] >= 128 // status + 128: the log whole follows
	if isWhole {
		status -= 128
	}
	ints[0], ints[1], ints[2] = int64(status), int64(be16(s, 1)), int64(be64(s, 3))
	for i := range ncaps {
		ints[3+i] = int64(be32(s, replyHead+4*i))
	}
	if d, err = decisionOf(ints, caps, member, now, counts); err != nil {
		return Decision{}, "", "", fmt.Errorf("unexpected script reply %v: %w", slices.Clone(ints), err)
	}
	rest := s[head:]
	switch {
	case (ints[0] == 4 || ints[0] == 5) && !isWhole: // capped by a preference, or refused before: its name last
		if rest == "" {
			return Decision{}, "", "", fmt.Errorf("unexpected script reply %q: no preference or refusal named", s)
		}
		if d.RefusedBefore {
			d.Cap = rest
			return d, "", "", nil
		}
		d.Cap = PreferenceCap(rest)
		d.Exceeded = []string{d.Cap}
		return d, "", "", nil
	case isWhole && rest == "": // no log
		return d, "", "", nil
	case isWhole && (ints[0] == 4 || ints[0] == 5 || len(rest) < 8 || countEntries(rest[8:]) < 0):
		return Decision{}, "", "", fmt.Errorf("unexpected script reply %q: the log after its counts is not a header and packed entries", s)
	case isWhole:
		return d, rest[8:], rest, nil
	case countEntries(rest) < 0:
		return Decision{}, "", "", fmt.Errorf("unexpected script reply %q: the log after its counts is not packed entries", s)
	}
	return d, rest, "", nil
}

// replyHead is the size of a reply's status, cap and retry_at (decide.lua).
const replyHead = 1 + 2 + 8

// countEntries returns how many entries log holds, packed as decide.lua
// packs a log's (see nextEntry), or -1 if it is not such entries.
func countEntries(log string) int {
	n := 0
	for p := 0; p < len(log); n++ {
		var ok bool
		if _, _, p, ok = nextEntry(log, p); !ok {
			return -1
		}
	}
	return n
}

// nextEntry reads the entry at log[p:], packed as decide.lua packs a log's
// entries (score int64, member length uint16, member; big-endian), and
// returns it and where the next one starts; ok is false if log ends within
// it.
func nextEntry(log string, p int) (member string, score int64, next int, ok bool) {
	if len(log)-p < 10 {
		return "", 0, p, false
	}
	next = p + 10 + int(be16(log, p+8))
	if next > len(log) {
		return "", 0, p, false
	}
	return log[p+10 : next], int64(be64(log, p)), next, true
}

// appendEntry appends an entry packed as decide.lua packs a log's (see
// nextEntry, which reads it back).
func appendEntry(b []byte, score int64, member string) []byte {
	b = binary.BigEndian.AppendUint64(b, uint64(score))
	b = binary.BigEndian.AppendUint16(b, uint16(len(member)))
	return append(b, member...)
}

func be16(s string, i int) uint16 { return uint16(s[i])<<8 | uint16(s[i+1]) }
func be32(s string, i int) uint32 { return uint32(be16(s, i))<<16 | uint32(be16(s, i+2)) }
func be64(s string, i int) uint64 { return uint64(be32(s, i))<<32 | uint64(be32(s, i+4)) }

// decisionOf turns a script's answer (status, cap, retry_at, counts...),
// from Redis or the near cache, into a Decision. Its Counts are counts when
// that has one per cap (the caller's array: no allocation per decision).
func decisionOf(ints []int64, caps []Cap, member string, now time.Time, counts []int) (Decision, error) {
	ncaps := len(caps)
	if len(counts) != ncaps {
		counts = make([]int, ncaps)
	}
	d := Decision{At: now, Counts: counts}
	for i := range d.Counts {
		d.Counts[i] = int(ints[3+i])
	}
	for i, c := range caps {
		if c.Shadow && ints[0] != 2 && d.Counts[i] >= c.Limit && c.Scope.Matches(member) {
			d.Shadow = append(d.Shadow, c.label(i))
		}
	}
	switch ints[0] {
	case 1:
		d.Allowed = true
		if ints[2] > 0 {
			d.Recorded = time.UnixMilli(ints[2])
		}
	case 2:
		d.Allowed, d.Duplicate = true, true
		d.Recorded = time.UnixMilli(ints[2])
	case 5: // Cap is the refusal's: the caller names it
		d.RefusedBefore = true
	case 4: // Cap is the preference's: the caller names it
		if ints[2] > 0 {
			d.RetryAt = time.UnixMilli(ints[2])
		}
	case 3:
		if ints[1] < 1 || int(ints[1]) > ncaps {
			return Decision{}, fmt.Errorf("cap index %d out of range", ints[1])
		}
		d.Candidate, d.Cap, d.RetryAt = true, caps[ints[1]-1].label(int(ints[1]-1)), time.UnixMilli(ints[2])
	case 0:
		if ints[1] < 1 || int(ints[1]) > ncaps {
			return Decision{}, fmt.Errorf("cap index %d out of range", ints[1])
		}
		i := int(ints[1]) - 1
		d.Cap = caps[i].label(i)
		d.Reserved = caps[i].Reserved > 0 && d.Counts[i] < caps[i].Limit+caps[i].Reserved
		for j, c := range caps {
			if !c.Shadow && d.Counts[j] >= c.Limit && c.Scope.Matches(member) {
				d.Exceeded = append(d.Exceeded, c.label(j))
			}
		}
		if ints[2] > 0 {
			d.RetryAt = time.UnixMilli(ints[2])
		}
	default:
		return Decision{}, fmt.Errorf("status %d", ints[0])
	}
	return d, nil
}

// ScriptCall returns the values of the decide.lua call that Decide sends to
// record reqs at now, keys[i] being the log of reqs[i] (FCALL first; the
// near cache's log not asked for), for tools that call the script themselves:
// capper-devstack calls, which scripts/bench-calls.sh and bench-capping.sh
// measure. The members and the packed values are binary, so no text tool
// (redis-benchmark) can send them.
func ScriptCall(keys []string, reqs []Request, now time.Time) ([]any, error) {
	return callOfScript(keys, reqs, nil, now)
}

// CopyCall is ScriptCall for sends the near cache decided allowed from its
// whole copies of the users' logs, logs[i] being reqs[i]'s (decide.lua's
// mode 4: appended if the log is the copy, else decided in full).
func CopyCall(keys []string, reqs []Request, logs []string, now time.Time) ([]any, error) {
	if len(logs) != len(reqs) {
		return nil, fmt.Errorf("capping: %d logs for %d requests", len(logs), len(reqs))
	}
	return callOfScript(keys, reqs, logs, now)
}

func callOfScript(keys []string, reqs []Request, logs []string, now time.Time) ([]any, error) {
	if len(keys) != len(reqs) {
		return nil, fmt.Errorf("capping: %d keys for %d requests", len(keys), len(reqs))
	}
	idx := make([]int, len(reqs))
	for i := range reqs {
		if err := reqs[i].validate(); err != nil {
			return nil, fmt.Errorf("capping: %w: %w", ErrInvalidRequest, err)
		}
		idx[i] = i
	}
	var caps []Cap
	args := newArgs(reqs, now, 0, &caps, nil)
	for i := range args {
		args[i].key = keys[i]
		if logs != nil {
			args[i].expect = logs[i]
		}
		pack(make([]byte, 0, packedLen(&args[i])), &reqs[i], &args[i], true, 0, "")
	}
	v := callArgs(false, reqs, args, idx)
	for i, x := range v { // the values themselves: args and reqs are this call's
		if p, ok := x.(*string); ok {
			v[i] = *p
		}
	}
	return v, nil
}
