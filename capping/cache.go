package capping

import (
	"encoding/binary"
	"math/bits"
	"sync"
	"sync/atomic"
	"unsafe"
)

// The near cache keeps, for users whom a cap blocks, a copy of their log as
// decide.lua returned it with the decision that filled the cap. Until the log
// changes, the next send of that user is decided from the copy exactly as the
// script would decide it: the same counts, the same cap and retry-at. It
// answers only "capped"; a send the copy would allow, or finds already
// logged, goes to Redis (which records it), and every answer from Redis
// replaces or drops the copy.
//
// Why a copy answers exactly: the log only grows by sends that a decision
// allowed, and every decision this process takes for the user refreshes the
// copy. A send allowed by another process (after the user's partition moved,
// or by a delay tier's worker of another replica) makes the copy a subset of
// the log: every window counts at most what Redis counts, so a cap full in the
// copy is full in Redis too (a capped answer is still right) and its retry-at
// can only be earlier than Redis's (a held job is decided again sooner). A
// failover that loses entries can only make the copy stricter than Redis,
// until the next decision through Redis replaces it. One case is not exact:
// a job allowed by another process under other caps (a replica that runs
// other rules or another segment snapshot) and delivered again here while
// the copy is older than it: the copy may cap what Redis would answer
// duplicate. The copies are dropped when this process's rules or segments
// change (Limiter.InvalidateCache), so that needs two processes with
// different caps for one user within one block.

// cacheShards spreads the cache's lock; a power of two.
const cacheShards = 16

// cacheMaxLog is the longest log the cache keeps a copy of; a longer one is
// always decided by Redis.
const cacheMaxLog = 64

type nearCache struct {
	shards                  [cacheShards]cacheShard
	gen                     atomic.Uint64 // bumped by clear and release: installs of decisions taken before are dropped
	hits, misses, evictions atomic.Uint64
	holds                   atomic.Uint64 // calls of hold
	perShard                int
}

// A shard holds no Go pointers besides its slots and arena: its copies'
// scores and members are in its arena, where entries refer to them by offset.
// The garbage collector marks a shard in two steps, not two objects per copy
// (with a million copies and a few collections a second, marking them was
// several percent of the worker's CPU), and installing a copy allocates
// nothing once the arena has grown.
//
// The slots are the index too: a table by user (see home), probed linearly,
// at most half full. A lookup reads the user's entry where an index (a Go
// map of user to slot) read the map's group and then the slot: one memory
// miss of the two or three a lookup makes (the arena's is the other).
type cacheShard struct {
	mu    sync.Mutex
	slots []cacheEntry // a power of two of them, or none
	shift uint8        // 64 - log2(len(slots)): home's
	live  int          // the live entries in slots
	hand  int
	arena []byte           // the entries' logs, appended; never written over (see items)
	dead  int              // bytes of arena no live entry refers to (see compact)
	held  map[uint64]int32 // users no copy is kept for (see hold), and their holds; nil when none
}

// cacheMinSlots is a shard's first table.
const cacheMinSlots = 64

// home is user's first slot in sh's table (len(sh.slots) > 0): the top bits
// of a multiplicative hash by another constant than shardOf's (with the
// same, a shard's users share their top bits, and one sixteenth of the table
// held them all: lookups 20 times slower).
func (sh *cacheShard) home(user uint64) int {
	return int((user * 0xBF58476D1CE4E5B9) >> sh.shift)
}

// find returns the slot of user's copy, or -1 when it has none.
func (sh *cacheShard) find(user uint64) int32 {
	if len(sh.slots) == 0 {
		return -1
	}
	mask := len(sh.slots) - 1
	for i := sh.home(user); ; i = (i + 1) & mask {
		e := &sh.slots[i]
		if !e.is(entryLive) {
			return -1
		}
		if e.who() == user {
			return int32(i)
		}
	}
}

// insert keeps e, a copy of a user who has none in sh, evicting another
// first when the shard is full (see free).
func (sh *cacheShard) insert(c *nearCache, e cacheEntry) {
	if sh.live >= c.perShard {
		sh.free(c)
	}
	if 2*(sh.live+1) > len(sh.slots) {
		sh.grow()
	}
	mask := len(sh.slots) - 1
	i := sh.home(e.who())
	for sh.slots[i].is(entryLive) {
		i = (i + 1) & mask
	}
	sh.slots[i] = e
	sh.live++
}

// grow doubles the table (makes the first), its live entries placed again.
func (sh *cacheShard) grow() {
	old := sh.slots
	n := max(cacheMinSlots, 2*len(old))
	sh.slots, sh.shift, sh.hand = make([]cacheEntry, n), uint8(64-bits.TrailingZeros(uint(n))), 0
	mask := n - 1
	for k := range old {
		if e := &old[k]; e.is(entryLive) {
			i := sh.home(e.who())
			for sh.slots[i].is(entryLive) {
				i = (i + 1) & mask
			}
			sh.slots[i] = *e
		}
	}
}

// cacheEntry is a copy of one user's log, oldest first, at
// arena[off:off+size] of its shard: n scores (8 bytes each, little-endian),
// then each member after its length byte; or, when whole, the log itself as
// Redis holds it (its header, then its n entries: see Whole copies).
//
// An entry is 32 bytes, so that no slot straddles two cache lines (at 48
// bytes every other slot did, and its lookup read two lines from memory).
type cacheEntry struct {
	expires int64 // ms: no cap of the decision that made it is full after this
	latest  int64 // the log's latest score, and how many entries have it:
	user    uint32
	off     int32
	size    uint16 // bytes in the arena: at most cacheMaxBytes
	space   Space  // the user's (with user: the table's key, Request.who)
	n       uint8  // entries: at most cacheMaxLog
	nLatest uint8  // the copy's version (a log only grows, at its end)
	flags   entryFlags
}

// entryFlags are a cacheEntry's: four bools would leave no room for its space.
type entryFlags uint8

const (
	entryLive  entryFlags = 1 << iota
	entryRef              // looked up since the clock hand last passed
	entryWhole            // the log as Redis holds it (see Whole copies)
	entryPrefs            // made by a request that read preferences: the user had none
)

func (e *cacheEntry) is(f entryFlags) bool { return e.flags&f == f }

// who is the table's key of e's user (Request.who).
func (e *cacheEntry) who() uint64 { return uint64(e.space)<<32 | uint64(e.user) }

// cacheMaxBytes bounds a copy's bytes in the arena: a whole log of
// cacheMaxLog entries with members of 255 bytes (the longest a copy keeps).
const cacheMaxBytes = 8 + cacheMaxLog*(8+2+255)

// A cacheEntry's fields hold what they must, and it stays 32 bytes.
var (
	_ = uint16(cacheMaxBytes)
	_ = uint8(cacheMaxLog)
	_ [32 - unsafe.Sizeof(cacheEntry{})]byte
	_ [unsafe.Sizeof(cacheEntry{}) - 32]byte
)

// arenaCompactMin is the arena size below which its dead bytes are left.
const arenaCompactMin = 64 << 10

func newNearCache(size int) *nearCache {
	c := &nearCache{perShard: max(1, size/cacheShards)}
	return c
}

func (c *nearCache) shard(user uint64) *cacheShard {
	return &c.shards[shardOf(user)]
}

// shardOf spreads users (Request.who) over the shards; space 0's ids as before spaces.
func shardOf(user uint64) int {
	return int(((uint32(user) ^ uint32(user>>32)*0x85EBCA6B) * 0x9E3779B1) >> 28)
}

// logItem is one entry of a log being evaluated.
type logItem struct {
	member string
	score  int64
}

// items decodes e into buf. Its members are strings over the arena's bytes
// (no allocation): the arena is never written over (install appends, compact
// copies into a new one), so they stay valid.
func (sh *cacheShard) items(e *cacheEntry, buf []logItem) []logItem {
	buf = buf[:0]
	if e.is(entryWhole) {
		raw := unsafe.String(&sh.arena[e.off], int(e.size))
		for p := 8; p < len(raw); {
			m, score, next, _ := nextEntry(raw, p) // checked by install
			buf = append(buf, logItem{m, score})
			p = next
		}
		tallyFirst(buf)
		return buf
	}
	data := sh.arena[e.off : e.off+int32(e.size)]
	p := 8 * int(e.n)
	for i := 0; i < int(e.n); i++ {
		n := int(data[p])
		buf = append(buf, logItem{unsafe.String(&data[p+1], n), int64(binary.LittleEndian.Uint64(data[8*i:]))})
		p += 1 + n
	}
	return buf
}

// decideAll answers each request at idx from its user's copy when the
// script would cap it: hit[i] reports that decs[i] holds the answer. (A send
// the copy allows and the script can record with an append, a.expect set,
// has its decision in decs[i] too, for Redis to confirm: see run.)
// Otherwise (no copy, an expired one, or a send the copy would allow or finds
// logged) the request is for Redis. It counts neither hits nor misses (the
// caller may still send a hit to Redis). The requests are taken shard by
// shard, under one lock each, each found in the shard's table first: a
// lookup is mostly memory misses (the slot, the arena), and without a lock's
// atomic between them the table's misses overlap (BenchmarkNearCacheLookup:
// 12% less per lookup than one at a time, with a map for the index; reading
// the copies' arena ahead as well gained nothing). An answer that removes an
// expired copy can move others (see remove): answer finds them again. order
// and slots are scratch of len(idx).
//
// hints (by request, nil: none) gets each looked-up request's slot plus one
// (0: no copy), which saves install a lookup (see install).
func (c *nearCache) decideAll(reqs []Request, args []reqArgs, idx []int, decs []Decision, hit []bool, order []int, slots []int32, hints []int32) {
	var start [cacheShards + 1]int
	for _, i := range idx {
		start[shardOf(reqs[i].who())+1]++
	}
	for s := 1; s <= cacheShards; s++ {
		start[s] += start[s-1]
	}
	next := start
	for _, i := range idx {
		s := shardOf(reqs[i].who())
		order[next[s]] = i
		next[s]++
	}
	var items [cacheMaxLog]logItem // answer's decoded copy, zeroed once per batch, not per lookup
	for s := range c.shards {
		group, slot := order[start[s]:start[s+1]], slots[start[s]:start[s+1]]
		if len(group) == 0 {
			continue
		}
		sh := &c.shards[s]
		sh.mu.Lock()
		for k, i := range group {
			slot[k] = sh.find(reqs[i].who())
		}
		for k, i := range group {
			hit[i] = slot[k] >= 0 && sh.answer(slot[k], &reqs[i], &args[i], &decs[i], items[:0])
			if hints != nil {
				hints[i] = slot[k] + 1
			}
		}
		sh.mu.Unlock()
	}
}

// answer decides r from the copy at slot (sh locked): see decideAll. buf
// holds the copy's items while it decides (capacity cacheMaxLog).
func (sh *cacheShard) answer(slot int32, r *Request, a *reqArgs, d *Decision, buf []logItem) bool {
	e := &sh.slots[slot]
	if e.who() != r.who() { // moved since the lookup: an earlier answer removed a copy
		if slot = sh.find(r.who()); slot < 0 {
			return false
		}
		e = &sh.slots[slot]
	}
	if !e.is(entryLive) || a.now >= e.expires {
		sh.remove(slot)
		return false
	}
	if r.Preferences && !e.is(entryPrefs) { // the user may have preferences since: the script reads them
		return false
	}
	e.flags |= entryRef
	log := sh.items(e, buf)
	spill := a.tally && spilled(log) // its tally caps count from the tally key, which the copy lacks
	if spill && !e.is(entryWhole) {
		return false
	}
	var head [3 + maxCaps]int64
	h := evaluate(log, a.caps, a, head[:3+len(a.caps)])
	if h[0] == 1 && e.is(entryWhole) {
		raw := unsafe.String(&sh.arena[e.off], int(e.size))
		switch {
		case spill: // allowed by its other caps: the script counts its tally caps (mode 7)
			if int64(be64(raw, 0))-a.now >= a.retention && spillOnly(log) && appendable(log, h, r, a) {
				a.expect, a.spill = raw, true
				*d, _ = decisionOf(h, a.caps, a.member, a.at, a.counts, a.labels) // its tally caps' counts come with the reply
				a.after = afterSend(e, h, a, 0)
			}
		case a.tally: // its tally items change: a patch, never a plain append
			if appendable(log, h, r, a) {
				var items int
				if a.patch, a.patched, items = patch(raw, log, a); a.patch != "" {
					a.expect = raw
					*d, _ = decisionOf(h, a.caps, a.member, a.at, a.counts, a.labels) // kept for the patch: see run
					a.after = afterSend(e, h, a, items)
				}
			}
		case int64(be64(raw, 0))-a.now >= a.retention && appendable(log, h, r, a):
			a.expect = raw
			*d, _ = decisionOf(h, a.caps, a.member, a.at, a.counts, a.labels) // kept for the append: see run
			a.after = afterSend(e, h, a, 0)
		}
		return false
	}
	if h[0] != 0 || spill { // a capped answer needs its tally caps' counts
		return false
	}
	var err error
	if *d, err = decisionOf(h, a.caps, a.member, a.at, a.counts, a.labels); err != nil {
		return false // cannot happen: evaluate returns a valid head
	}
	a.requestCounts(d)
	return true
}

// Whole copies. A copy whose log the cache knows whole, byte for byte as Redis
// holds it (header included: the log this process wrote as a new log, then
// appended to), lets the worker decide an allowed send too: evaluate is the
// script's decision, and the script's mode 4 records the send with one
// APPEND only if the log is still exactly the copy (a GET and a string
// compare), or else decides it in full. So a send the copy allows costs Redis
// a GET and an APPEND instead of the script's reading and counting, and
// nothing is decided on a stale copy.
//
// A copy holds the log's tally items too (read first: see tallyFirst), and
// evaluate counts a tally cap from them. A send with tally caps changes its
// items, which a plain APPEND cannot: the worker makes a patch of the copy
// (see patch) that counts each item in place and appends a new scope's item
// with the entry, and mode 6 applies it if the log is still the copy. A patch
// costs Redis what an append costs, a SETRANGE more per item counted in
// place, where writing the log whole (a swap of the copy for the new log)
// costs it the log's bytes again: BenchmarkLifetime/lifetime/
// warm/cache made 0.67 of the decisions/s of /none/warm/cache with patches
// against 0.55 with swaps (medians of 5 alternated rounds; /cold/cache 0.84
// and 0.83, its users mostly new logs).
//
// A user past spillAt tally items keeps them in a tally key, which the copy
// lacks (its one item says so: see spilledField). The copy still decides the
// send's other caps; a send they allow goes in mode 7 with the copy, and the
// script, if the log is still the copy, counts the tally caps from the key
// and records the send without walking the log's entries, or else decides
// it in full. The copy never answers such a send capped (its counts are the
// script's). With every user past the spill (BenchmarkLifetime's warm rows
// at 24 sends of 24 campaigns a user), /lifetime/warm/cache made 1.35x the
// decisions/s of the same row deciding them in full (medians of 3
// alternated rounds: 70.6k against 52.2k; 0.44 of /none/warm/cache against
// 0.35).

// appendable reports whether the script, given the copy's log (log, with the
// raw header checked by the caller), would record r's send (allowed by
// evaluate: head) with one APPEND at a.now: the send is a plain one
// (mode 1, not a candidate), no entry has aged out or comes after now, and
// no arbitrated cap would give the send its last slot. (The caller checks
// that the header's TTL covers the retention: see save in decide.lua. A
// request that reads preferences is appended only if the user still has
// none: the script checks.)
func appendable(log []logItem, head []int64, r *Request, a *reqArgs) bool {
	if r.Candidate || r.DuplicateOnly || r.Refused != "" || !r.SentAt.IsZero() {
		return false
	}
	tally, log := splitTally(log) // a tally cap's items are written by a patch (see patch), the others kept
	for _, it := range tally {
		if len(it.member) < 20 || int64(be64(it.member, 12)) < a.now { // lapsed: the script drops it, rewriting the log
			return false
		}
	}
	if n := len(log); n > 0 && (log[0].score <= a.now-a.retention || log[n-1].score > a.now) {
		return false
	}
	if r.Arbitration > 0 {
		for i := range a.caps {
			c := &a.caps[i]
			if c.Arbitrated && !c.Shadow && head[3+i] == int64(c.Limit)-1 {
				return false
			}
		}
	}
	return true
}

// copyAfter is what install needs of a whole copy after a send appended to
// it (see afterSend): known says the rest holds.
type copyAfter struct {
	known   bool
	n       int   // entries and items
	latest  int64 // as cacheEntry's
	nLatest int
}

// afterSend returns what the copy e (whose log evaluate allowed a's send
// from, its counts in head) holds after the send is appended with items new
// tally items: install then keeps it without reading it again. It is not
// known when a blocking cap is full after the send (install finds until
// when from the log), a rolling tally cap counts it (its times may drop
// one), or the copy would outgrow the cache's limits.
func afterSend(e *cacheEntry, head []int64, a *reqArgs, items int) copyAfter {
	n := int(e.n) + 1 + items
	if n > cacheMaxLog || len(a.member) > 255 {
		return copyAfter{}
	}
	for i := range a.caps {
		c := &a.caps[i]
		if c.Shadow {
			continue
		}
		count := head[3+i]
		if c.appliesTo(a.member) {
			count++
		}
		if count >= int64(c.Limit) || (c.Tally && a.reset[i] > 0) {
			return copyAfter{}
		}
	}
	after := copyAfter{known: true, n: n, latest: a.now, nLatest: 1}
	if e.latest == a.now {
		after.nLatest = int(e.nLatest) + 1
	}
	return after
}

// rawUntil returns until when a whole copy (raw, the log's bytes) can take
// an appended send: its header's TTL less the retention (then the script
// writes the log whole with a new TTL), or 0 for bytes that are not a log
// without marks.
func rawUntil(raw string, a *reqArgs) int64 {
	if len(raw) < 8 || (len(raw) >= 16 && int64(be64(raw, 8)) < 0) { // no header, or a mark first
		return 0
	}
	return int64(be64(raw, 0)) - a.retention
}

// maxCaps bounds the caps of a request the cache decides on the stack; a
// request with more goes to Redis.
const maxCaps = 32

// evaluate is decide.lua's decision in record mode over a copy of the log
// (oldest first), written into head: status, cap, retry_at, then the counts.
// It must stay line for line what the script does; TestNearCacheDecidesAsRedis
// (the same requests to the cache and to Redis, with random clocks, caps and
// reloads) holds them together.
func evaluate(log []logItem, caps []Cap, a *reqArgs, head []int64) []int64 {
	tally, log := splitTally(log)
	horizon := a.now - a.retention
	first := 0
	for first < len(log) && log[first].score <= horizon {
		first++
	}
	log = log[first:]
	status, recorded := int64(statusAllowed), int64(0)
	for _, it := range log {
		if it.member == a.member {
			status, recorded = statusDuplicate, it.score
			break
		}
	}
	hit, retryAt, never := int64(0), int64(0), false
	for i := range caps {
		c := &caps[i]
		since, reset := a.since[i], a.reset[i]
		scoped := !c.Scope.any()
		count, oldest := int64(0), int64(0)
		limit := int64(c.Limit)
		if c.Tally {
			t := tallyItem(tally, c.tallyField())
			count = tallyCount(t, since, reset)
			if count >= limit && limit > 0 && reset > 0 {
				oldest = tallyKth(t, since, count-limit+1)
			}
		} else {
			for _, it := range log {
				if it.score >= since && (!scoped || c.Scope.Matches(it.member)) {
					count++
				}
			}
			if count >= limit && limit > 0 && reset > 0 {
				oldest = nth(log, c, scoped, since, count-limit+1)
			}
		}
		head[3+i] = count
		if !c.Shadow && status != statusDuplicate && count >= limit && (!scoped || c.Scope.Matches(a.member)) {
			status = statusCapped
			at := -reset
			if reset > 0 {
				at = oldest + reset
			}
			if limit == 0 || (c.Tally && reset == 0) { // a lifetime cap reached never passes again
				if !never {
					hit = int64(i + 1)
				}
				never = true
			} else if !never && at > retryAt {
				hit, retryAt = int64(i+1), at
			}
		}
	}
	if never {
		retryAt = 0
	}
	if status == statusDuplicate {
		retryAt = recorded
	}
	if status == statusAllowed {
		retryAt = a.now
		if len(log) > 0 && log[len(log)-1].score > a.now {
			retryAt = log[len(log)-1].score
		}
	}
	head[0], head[1], head[2] = status, hit, retryAt
	return head
}

// nth returns the score of the k-th (1-based) entry of c's scope at or after since.
func nth(log []logItem, c *Cap, scoped bool, since, k int64) int64 {
	for _, it := range log {
		if it.score >= since && (!scoped || c.Scope.Matches(it.member)) {
			if k--; k == 0 {
				return it.score
			}
		}
	}
	return 0
}

// install keeps the log a Redis decision returned (its entries packed as
// the log packs them: see parseReply) for r's user, unless the cache was
// cleared since the decision's gen, or holds a newer copy. The copy expires
// when the last of r's caps that are full after the decision passes again,
// or, with raw (the log whole, see Whole copies), when it can no longer take
// an appended send if that is later. hint is the slot plus one where the
// user's copy was at the batch's lookup (0: none, or unknown): if that slot
// still holds the user's copy, the table is not probed (each user has at
// most one live slot).
func (c *nearCache) install(r *Request, a *reqArgs, gen uint64, tail, raw string, hint int32) {
	var buf [cacheMaxLog]logItem
	c.installWith(r, a, gen, tail, raw, hint, buf[:0])
}

// installWith is install with buf (capacity cacheMaxLog) to read the log
// into: a round's, which a Decide's installs share, where an array of its
// own on the stack was zeroed for each (1.5 KB).
func (c *nearCache) installWith(r *Request, a *reqArgs, gen uint64, tail, raw string, hint int32, buf []logItem) {
	log, size := buf[:0], 0
	for p := 0; p < len(tail); {
		m, score, next, ok := nextEntry(tail, p)
		if !ok || len(log) == cacheMaxLog || len(m) > 255 {
			c.drop(r.who())
			return
		}
		log = append(log, logItem{m, score})
		size += 8 + 1 + len(m)
		p = next
	}
	tallyFirst(log)
	n := len(log)
	expires := fullUntil(log, a.caps, a)
	if until := rawUntil(raw, a); until > expires {
		expires = until
	} else if until <= a.now {
		raw = ""
	}
	if expires <= a.now {
		c.drop(r.who())
		return
	}
	if raw != "" { // kept whole: its entries are read from it
		size = len(raw)
	}
	if size > cacheMaxBytes { // cannot be: the entries are at most cacheMaxLog, their members 255 bytes
		c.drop(r.who())
		return
	}
	e := cacheEntry{expires: expires, n: uint8(n), size: uint16(size)}
	if n > 0 {
		e.latest = log[n-1].score
		for i := n - 1; i >= 0 && log[i].score == e.latest; i-- {
			e.nLatest++
		}
	}
	if raw != "" {
		e.flags = entryWhole
	}
	c.place(r, e, gen, log, raw, hint, nil)
}

// installAfter keeps raw, the whole log after a send Redis confirmed as
// appended to the copy it was decided from (or its patch), as install
// would, from what a.after knows of it. An empty raw is the copy, a.expect,
// with the send's entry appended (mode 4 or 7), which the arena is given
// piece by piece: no string of it is made.
func (c *nearCache) installAfter(r *Request, a *reqArgs, gen uint64, raw string, hint int32) {
	f := &a.after
	head, size, send := raw, len(raw), false
	if raw == "" {
		head, size, send = a.expect, len(a.expect)+entryLen(a.member), true
	}
	expires := rawUntil(head, a) // no cap is full after the send (see afterSend); an append leaves the header
	if expires <= a.now || size > cacheMaxBytes {
		c.drop(r.who())
		return
	}
	e := cacheEntry{expires: expires, n: uint8(f.n), size: uint16(size), latest: f.latest, nLatest: uint8(f.nLatest), flags: entryWhole}
	if send {
		c.place(r, e, gen, nil, head, hint, a)
		return
	}
	c.place(r, e, gen, nil, raw, hint, nil)
}

// place keeps the copy e (its expiry, size and version set, entryWhole
// when whole; its log in log, or raw when whole, then send's entry when send
// is not nil) for r's user: see install.
func (c *nearCache) place(r *Request, e cacheEntry, gen uint64, log []logItem, raw string, hint int32, send *reqArgs) {
	e.user, e.space = r.UserID, r.Space
	e.flags |= entryLive
	if r.Preferences {
		e.flags |= entryPrefs
	}
	size := int(e.size)
	who := r.who()
	sh := c.shard(who)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if c.gen.Load() != gen {
		return
	}
	if _, held := sh.held[who]; held {
		return
	}
	slot := hint - 1
	if hint <= 0 || int(slot) >= len(sh.slots) || !sh.slots[slot].is(entryLive) || sh.slots[slot].who() != who {
		slot = sh.find(who)
	}
	if slot >= 0 {
		old := &sh.slots[slot]
		if old.latest > e.latest || (old.latest == e.latest && old.nLatest > e.nLatest) {
			return // a decision that ran later in Redis already left a newer copy
		}
		sh.dead += int(old.size)
		old.size = 0 // its bytes are dead: compact must not copy them
		if e.off = sh.put(log, size, raw, send); e.off < 0 {
			sh.remove(slot)
			return
		}
		*old = e
		return
	}
	if e.off = sh.put(log, size, raw, send); e.off < 0 {
		return
	}
	sh.insert(c, e)
}

// put appends log (size bytes encoded, see cacheEntry), or raw when it is
// not empty (the copy kept whole; then send's entry, when send is not nil),
// to the arena and returns its offset; -1 when the arena would outgrow an
// int32 offset (a shard never holds that much: the copy is not kept).
func (sh *cacheShard) put(log []logItem, size int, raw string, send *reqArgs) int32 {
	if sh.dead >= arenaCompactMin && sh.dead > len(sh.arena)/4 {
		sh.compact()
	}
	off := len(sh.arena)
	if off+size > 1<<31-1 {
		return -1
	}
	if raw != "" {
		sh.arena = append(sh.arena, raw...)
		if send != nil {
			sh.arena = appendEntry(sh.arena, send.now, send.member)
		}
		return int32(off)
	}
	for _, it := range log {
		sh.arena = binary.LittleEndian.AppendUint64(sh.arena, uint64(it.score))
	}
	for _, it := range log {
		sh.arena = append(sh.arena, byte(len(it.member)))
		sh.arena = append(sh.arena, it.member...)
	}
	return int32(off)
}

// compact copies the live entries' logs into a new arena, leaving the dead
// bytes behind: called when they are more than a quarter of it, so that an
// arena holds at most a third more than its copies (and room to grow by half
// again), while copying costs three bytes per dead byte: a memmove per
// install, against the copy's own decoding.
func (sh *cacheShard) compact() {
	live := len(sh.arena) - sh.dead
	arena := make([]byte, 0, live+live/2+arenaCompactMin)
	for i := range sh.slots {
		e := &sh.slots[i]
		if !e.is(entryLive) {
			continue
		}
		off := len(arena)
		arena = append(arena, sh.arena[e.off:e.off+int32(e.size)]...)
		e.off = int32(off)
	}
	sh.arena, sh.dead = arena, 0
}

// fullUntil returns when the last of caps that is full in log (a blocking
// cap whose count has reached its limit) passes again; a.now or earlier when
// none is full. A limit of 0 is full until the retention has passed.
func fullUntil(log []logItem, caps []Cap, a *reqArgs) int64 {
	until := int64(0)
	horizon := a.now - a.retention
	tally, log := splitTally(log)
	for i := range caps {
		c := &caps[i]
		if c.Shadow {
			continue
		}
		since, reset := a.since[i], a.reset[i]
		scoped := !c.Scope.any()
		count := int64(0)
		var t string
		if c.Tally {
			t = tallyItem(tally, c.tallyField())
			count = tallyCount(t, since, reset)
		} else {
			for _, it := range log {
				if it.score > horizon && it.score >= since && (!scoped || c.Scope.Matches(it.member)) {
					count++
				}
			}
		}
		limit := int64(c.Limit)
		if count < limit {
			continue
		}
		at := a.now + a.retention // a limit of 0, a lifetime cap reached: until the retention has passed
		switch {
		case limit > 0 && reset > 0 && c.Tally:
			at = tallyKth(t, since, count-limit+1) + reset
		case limit > 0 && reset > 0:
			at = nth(log, c, scoped, max(since, horizon+1), count-limit+1) + reset
		case limit > 0 && !c.Tally:
			at = -reset
		}
		until = max(until, at)
	}
	return until
}

// free evicts the first copy the clock hand finds not looked up since its
// last pass (a shard that is full has one).
func (sh *cacheShard) free(c *nearCache) {
	mask := len(sh.slots) - 1
	for {
		sh.hand = (sh.hand + 1) & mask
		e := &sh.slots[sh.hand]
		switch {
		case e.is(entryLive | entryRef):
			e.flags &^= entryRef
		case e.is(entryLive):
			c.evictions.Add(1)
			sh.remove(int32(sh.hand))
			return
		}
	}
}

// remove empties a slot. The copies after it in their probe runs move back
// into the hole that each can fill (so that a lookup still finds every copy
// before the first empty slot), and may move past the clock hand.
func (sh *cacheShard) remove(slot int32) {
	if !sh.slots[slot].is(entryLive) {
		return
	}
	sh.dead += int(sh.slots[slot].size)
	sh.live--
	mask := len(sh.slots) - 1
	hole := int(slot)
	for j := (hole + 1) & mask; sh.slots[j].is(entryLive); j = (j + 1) & mask {
		// The copy at j may fill the hole unless its home lies after the
		// hole, up to j: probing from its home would never reach the hole.
		if (j-sh.home(sh.slots[j].who()))&mask >= (j-hole)&mask {
			sh.slots[hole] = sh.slots[j]
			hole = j
		}
	}
	sh.slots[hole] = cacheEntry{}
}

// drop forgets user's copy: its log changed in a way the cache did not see.
func (c *nearCache) drop(user uint64) {
	sh := c.shard(user)
	sh.mu.Lock()
	if slot := sh.find(user); slot >= 0 {
		sh.remove(slot)
	}
	sh.mu.Unlock()
}

// hold forgets user's copy and keeps none until as many releases: a change
// to the user's log or preferences is on its way to Redis (an event another
// process will apply), and a copy read before it lands must not answer after.
func (c *nearCache) hold(user uint64) {
	sh := c.shard(user)
	sh.mu.Lock()
	if sh.held == nil {
		sh.held = map[uint64]int32{}
	}
	sh.held[user]++
	if slot := sh.find(user); slot >= 0 {
		sh.remove(slot)
	}
	sh.mu.Unlock()
	c.holds.Add(1)
}

// release ends a hold of each of users, once their changes are in Redis. A
// decision in flight may have read a log from before a change and install
// after its release: the generation is bumped first, so that its copy is
// dropped (as after a clear), and the users are let go after.
func (c *nearCache) release(users []uint64) {
	c.gen.Add(1)
	for _, u := range users {
		sh := c.shard(u)
		sh.mu.Lock()
		if n := sh.held[u]; n > 1 {
			sh.held[u] = n - 1
		} else {
			delete(sh.held, u)
		}
		if len(sh.held) == 0 {
			sh.held = nil
		}
		sh.mu.Unlock()
	}
}

// clear forgets every copy, and the copies of decisions in flight (holds
// stay).
func (c *nearCache) clear() {
	c.gen.Add(1)
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		sh.slots, sh.shift, sh.live, sh.hand, sh.arena, sh.dead = nil, 0, 0, 0, nil, 0
		sh.mu.Unlock()
	}
}

// stats counts the cache's entries and its bytes: the tables' (their empty
// slots included) and the arenas' (dead bytes and room to grow included); and the users held.
func (c *nearCache) stats() (entries, bytes, held int) {
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		entries += sh.live
		bytes += len(sh.slots)*int(unsafe.Sizeof(cacheEntry{})) + cap(sh.arena)
		held += len(sh.held)
		sh.mu.Unlock()
	}
	return entries, bytes, held
}

// appendedLog returns a's copy (expect) with a's send appended, as the
// script's mode 4 appends it: the log after it, whole.
func appendedLog(a *reqArgs) string {
	b := appendEntry(append(make([]byte, 0, len(a.expect)+entryLen(a.member)), a.expect...), a.now, a.member)
	return unsafe.String(unsafe.SliceData(b), len(b))
}
