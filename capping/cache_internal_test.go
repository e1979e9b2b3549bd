package capping

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
	"time"
)

// blocked returns a request whose one daily cap of limit 2 is full in the
// log tail (two sends at now-2h and now-1h), and that tail.
func blocked(user uint32, job string, now time.Time) (*Request, *reqArgs, string) {
	r := &Request{UserID: user, JobID: job, Channel: "email", Campaign: "c", Tags: []string{"marketing"},
		Caps: []Cap{{Name: "daily", Window: Daily, Limit: 2}}}
	a := &newArgs([]Request{*r}, now, 0, nil, nil)[0]
	tail := logEntry(Member("old1", "email", "c", nil), now.Add(-2*time.Hour).UnixMilli()) + logEntry(Member("old2", "email", "c", nil), now.Add(-time.Hour).UnixMilli())
	return r, a, tail
}

// decide asks c about r alone, as Limiter.run asks decideAll about a batch.
func (c *nearCache) decide(r *Request, a *reqArgs, d *Decision) bool {
	decs, hit := make([]Decision, 1), make([]bool, 1)
	c.decideAll([]Request{*r}, []reqArgs{*a}, []int{0}, decs, hit, make([]int, 1), make([]int32, 1), nil)
	*d = decs[0]
	return hit[0]
}

// logEntry packs an entry as decide.lua packs a log's (and a reply's tail).
func logEntry(member string, score int64) string {
	b := binary.BigEndian.AppendUint64(nil, uint64(score))
	b = binary.BigEndian.AppendUint16(b, uint16(len(member)))
	return string(append(b, member...))
}

func TestNearCacheAnswersCappedUntilTheCapPasses(t *testing.T) {
	c := newNearCache(1000)
	r, a, tail := blocked(7, "j", now)
	c.install(r, a, c.gen.Load(), tail, "", 0)
	var d Decision
	if !c.decide(r, a, &d) || d.Allowed || d.Cap != "daily" || !d.RetryAt.Equal(now.Add(22*time.Hour)) || d.Counts[0] != 2 {
		t.Fatalf("decision %+v, want capped by daily until the first send leaves the window (22h)", d)
	}
	// The copy expires when the cap passes again: then Redis decides.
	later := &newArgs([]Request{*r}, now.Add(22*time.Hour), 0, nil, nil)[0]
	if c.decide(r, later, &d) {
		t.Fatalf("answered %+v after the cap passed", d)
	}
	if e, _, _ := c.stats(); e != 0 {
		t.Fatalf("%d copies after expiry, want 0", e)
	}
	// A send the copy finds logged (a redelivery) is for Redis to answer.
	c.install(r, a, c.gen.Load(), tail, "", 0)
	dup := &Request{UserID: 7, JobID: "old1", Channel: "email", Campaign: "c", Caps: r.Caps}
	if c.decide(dup, &newArgs([]Request{*dup}, now, 0, nil, nil)[0], &d) {
		t.Fatal("a redelivered job was answered from the cache")
	}
	// So is a send of another scope that the copy would allow.
	other := *r
	other.Caps = []Cap{{Name: "push", Window: Daily, Limit: 1, Scope: NewScope([]string{"push"}, nil)}}
	if c.decide(&other, &newArgs([]Request{other}, now, 0, nil, nil)[0], &d) {
		t.Fatal("a send the copy allows was answered from the cache")
	}
}

func TestNearCacheKeepsTheNewerCopy(t *testing.T) {
	c := newNearCache(1000)
	r, a, tail := blocked(7, "j", now)
	newer := tail + logEntry(Member("new", "email", "c", nil), now.UnixMilli())
	c.install(r, a, c.gen.Load(), newer, "", 0)
	c.install(r, a, c.gen.Load(), tail, "", 0) // a reply of a decision that ran earlier in Redis
	var d Decision
	if !c.decide(r, a, &d) || d.Counts[0] != 3 {
		t.Fatalf("decision %+v, want the newer copy's count of 3", d)
	}
	gen := c.gen.Load()
	c.clear()
	c.install(r, a, gen, newer, "", 0) // decided before the rules changed
	if e, _, _ := c.stats(); e != 0 {
		t.Fatalf("%d copies: a decision taken before the clear was kept", e)
	}
}

// TestNearCacheHoldKeepsNoCopyUntilReleased: a held user's copy is dropped
// and none is installed until every hold is released; a decision begun
// before the release (its generation) installs nothing after it; one begun
// after does.
func TestNearCacheHoldKeepsNoCopyUntilReleased(t *testing.T) {
	c := newNearCache(1000)
	r, a, tail := blocked(7, "j", now)
	other, oa, otail := blocked(8, "k", now)
	c.install(r, a, c.gen.Load(), tail, "", 0)
	c.install(other, oa, c.gen.Load(), otail, "", 0)
	var d Decision
	if !c.decide(r, a, &d) {
		t.Fatal("no answer from the copy before the hold")
	}
	copies := func() int { e, _, _ := c.stats(); return e }
	held := func() int { _, _, h := c.stats(); return h }
	c.hold(7)
	c.hold(7) // two events for the user
	if c.decide(r, a, &d) || copies() != 1 || held() != 1 {
		t.Fatalf("after the holds: answered %v, %d copies (user 8's alone), %d held, want no answer, 1 and 1", d, copies(), held())
	}
	c.install(r, a, c.gen.Load(), tail, "", 0)
	c.release([]uint64{7})
	c.install(r, a, c.gen.Load(), tail, "", 0)
	if c.decide(r, a, &d) || held() != 1 {
		t.Fatalf("a copy installed while held (once, then twice): answered %+v, %d held", d, held())
	}
	before := c.gen.Load() // a decision in flight across the last release
	c.release([]uint64{7})
	c.install(r, a, before, tail, "", 0)
	if c.decide(r, a, &d) || held() != 0 {
		t.Fatalf("a decision begun before the release installed its copy: answered %+v, %d held", d, held())
	}
	if !c.decide(other, oa, &d) {
		t.Fatal("user 8's copy went with user 7's hold")
	}
	c.install(r, a, c.gen.Load(), tail, "", 0)
	if !c.decide(r, a, &d) || d.Allowed {
		t.Fatalf("after the release: answered %+v, want capped from the new copy", d)
	}
}

func TestNearCacheEvictsWhatWasNotLookedUp(t *testing.T) {
	c := newNearCache(cacheShards * 4) // 4 copies per shard
	var users []uint32
	for u := uint32(1); len(users) < 5; u++ { // five users of one shard
		if c.shard(uint64(u)) == c.shard(1) {
			users = append(users, u)
		}
	}
	for _, u := range users[:4] {
		r, a, tail := blocked(u, "j", now)
		c.install(r, a, c.gen.Load(), tail, "", 0)
	}
	var d Decision
	for _, u := range users[1:4] { // looked up since: kept over users[0]
		r, a, _ := blocked(u, "j", now)
		c.decide(r, a, &d)
	}
	r, a, tail := blocked(users[4], "j", now)
	c.install(r, a, c.gen.Load(), tail, "", 0)
	if c.evictions.Load() != 1 {
		t.Fatalf("%d evictions, want 1", c.evictions.Load())
	}
	for i, u := range users {
		r, a, _ := blocked(u, "j", now)
		if got := c.decide(r, a, &d); got != (i != 0) {
			t.Errorf("user %d (%d): cached %v, want %v", i, u, got, i != 0)
		}
	}
}

// TestNearCacheArenaStaysBounded replaces, drops and evicts copies many
// times over: the shards' arenas are compacted (their dead bytes never more
// than half, past the minimum), and every copy left still decides from its
// own log.
func TestNearCacheArenaStaysBounded(t *testing.T) {
	const users = 300
	c := newNearCache(cacheShards * 16) // evictions too: more users than room
	installs := 0
	for round := 0; round < 200; round++ {
		for u := uint32(1); u <= users; u++ {
			r, a, tail := blocked(u, "j", now)
			// A copy's version grows with the round (a newer copy replaces
			// the older), and its length with the user, so that copies differ.
			for k := 0; k < int(u%5)+round%3; k++ {
				tail += logEntry(Member(fmt.Sprintf("r%d-%d", round, k), "email", "c", nil), now.Add(-time.Minute).UnixMilli()+int64(round))
			}
			c.install(r, a, c.gen.Load(), tail, "", 0)
			installs++
			if u%7 == 0 {
				c.drop(uint64(u))
			}
		}
	}
	for i := range c.shards {
		sh := &c.shards[i]
		live := 0
		for j := range sh.slots {
			if sh.slots[j].is(entryLive) {
				live += int(sh.slots[j].size)
			}
		}
		if live != len(sh.arena)-sh.dead {
			t.Fatalf("shard %d: %d live bytes, arena %d with %d dead", i, live, len(sh.arena), sh.dead)
		}
		if sh.dead > arenaCompactMin+len(sh.arena)/4+64*264 {
			t.Fatalf("shard %d: arena of %d bytes, %d dead: not compacted", i, len(sh.arena), sh.dead)
		}
	}
	// Every copy left is the user's last: 2 old sends, then the last round's.
	var d Decision
	checked := 0
	for u := uint32(1); u <= users; u++ {
		r, a, _ := blocked(u, "j", now)
		if !c.decide(r, a, &d) {
			continue
		}
		checked++
		if want := 2 + int(u%5) + 199%3; d.Counts[0] != want {
			t.Fatalf("user %d: count %d, want %d (the last round's copy)", u, d.Counts[0], want)
		}
	}
	if checked < cacheShards*8 {
		t.Fatalf("only %d users answered from the cache after %d installs", checked, installs)
	}
}

// TestNearCacheConcurrentUse installs, looks up, drops and clears copies
// from several goroutines at once (as a worker's consumer and its delay
// tiers' do), with arenas compacted under them: run with -race (scripts/test.sh
// does), and every answer must be one of the copies installed.
func TestNearCacheConcurrentUse(t *testing.T) {
	c := newNearCache(cacheShards * 8)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			var d Decision
			for i := 0; i < 20000; i++ {
				u := uint32(1 + rng.IntN(300))
				r, a, tail := blocked(u, "j", now)
				switch k := rng.IntN(20); {
				case k < 10:
					for j := 0; j < k; j++ { // 2 + k entries, all in the window
						tail += logEntry(Member(fmt.Sprintf("g%d-%d-%d", g, i, j), "email", "c", nil), now.Add(-time.Minute).UnixMilli())
					}
					c.install(r, a, c.gen.Load(), tail, "", 0)
				case k < 14:
					if c.decide(r, a, &d) && (d.Allowed || d.Counts[0] < 2 || d.Counts[0] > 11) {
						errs <- fmt.Errorf("user %d: decision %+v, want capped with 2 to 11 sends", u, d)
						return
					}
				case k < 18: // a batch of four, one user perhaps twice, as Limiter.run asks
					reqs := make([]Request, 4)
					for j := range reqs {
						reqs[j] = *r
						if j < 3 {
							reqs[j].UserID = uint32(1 + rng.IntN(300))
						}
					}
					decs, hit := make([]Decision, 4), make([]bool, 4)
					c.decideAll(reqs, newArgs(reqs, now, 0, nil, nil), []int{0, 1, 2, 3}, decs, hit, make([]int, 4), make([]int32, 4), nil)
					for j, d := range decs {
						if hit[j] && (d.Allowed || d.Counts[0] < 2 || d.Counts[0] > 11) {
							errs <- fmt.Errorf("user %d in a batch: decision %+v, want capped with 2 to 11 sends", reqs[j].UserID, d)
							return
						}
					}
				case k < 19:
					c.drop(uint64(u))
				default:
					if rng.IntN(1000) == 0 {
						c.clear()
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
}

// BenchmarkNearCacheBytes fills a cache with copies of a typical blocked log
// (a daily cap of 2 full: two entries with one tag) and reports the heap per
// copy next to the cache's own estimate (capper_near_cache_bytes).
func BenchmarkNearCacheBytes(b *testing.B) {
	const n = 200_000
	for b.Loop() {
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		c := newNearCache(n)
		for u := uint32(1); u <= n; u++ {
			r, a, tail := blocked(u, fmt.Sprint("j", u), now)
			c.install(r, a, c.gen.Load(), tail, "", 0)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		entries, est, _ := c.stats()
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(entries), "heap-bytes/copy")
		b.ReportMetric(float64(est)/float64(entries), "estimated-bytes/copy")
		runtime.KeepAlive(c)
	}
}

// BenchmarkNearCacheLookup: what a batch of 2,000 lookups costs the near
// cache, per lookup, with 500,000 copies and a new batch of random users each
// time (most lookups miss the CPU's caches, as in a blast): one at a time
// (a lock per lookup, as before decideAll took batches) and shard by shard
// (decideAll, as Limiter.run asks). Half the users have a copy that caps
// their send.
func BenchmarkNearCacheLookup(b *testing.B) {
	const n, batch, batches = 500_000, 2000, 100
	c := newNearCache(n)
	for u := uint32(1); u <= n; u += 2 {
		r, a, tail := blocked(u, fmt.Sprint("j", u), now)
		c.install(r, a, c.gen.Load(), tail, "", 0)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	reqs, args := make([][]Request, batches), make([][]reqArgs, batches)
	for k := range reqs {
		reqs[k] = make([]Request, batch)
		for i := range reqs[k] {
			r, _, _ := blocked(uint32(1+rng.IntN(n)), fmt.Sprint("k", i), now)
			reqs[k][i] = *r
		}
		args[k] = newArgs(reqs[k], now, 0, nil, nil)
	}
	idx := make([]int, batch)
	for i := range idx {
		idx[i] = i
	}
	decs, hit := make([]Decision, batch), make([]bool, batch)
	order, slots := make([]int, batch), make([]int32, batch)
	b.Run("one-at-a-time", func(b *testing.B) {
		k := 0
		for b.Loop() {
			k = (k + 1) % batches
			for i := range reqs[k] {
				c.decideAll(reqs[k][i:i+1], args[k][i:i+1], idx[:1], decs[i:i+1], hit[i:i+1], order[:1], slots[:1], nil)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/lookup")
	})
	b.Run("by-shard", func(b *testing.B) {
		k := 0
		for b.Loop() {
			k = (k + 1) % batches
			c.decideAll(reqs[k], args[k], idx, decs, hit, order, slots, nil)
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/lookup")
	})
	// A returning user's copy, whole (as Redis holds it: what a worker keeps
	// of the logs it wrote): 40 sends of the last day and 20 tally items,
	// each lookup capped after reading all of them.
	w := newNearCache(n)
	const users = 50_000
	for u := uint32(1); u <= users; u++ {
		r, a, _ := blocked(u, fmt.Sprint("j", u), now)
		raw := binary.BigEndian.AppendUint64(nil, uint64(now.Add(Daily).UnixMilli()))
		for k := range 20 {
			m := binary.BigEndian.AppendUint64(nil, uint64(k+1))
			m = binary.BigEndian.AppendUint32(m, 1)
			m = binary.BigEndian.AppendUint64(m, uint64(now.Add(400*Daily).UnixMilli()))
			raw = appendItem(raw, string(m))
		}
		for k := range 40 {
			raw = appendEntry(raw, now.Add(time.Duration(k-40)*time.Minute).UnixMilli(), Member(fmt.Sprint("s", k), "email", "c", nil))
		}
		w.install(r, a, w.gen.Load(), string(raw[8:]), string(raw), 0)
	}
	for k := range reqs {
		for i := range reqs[k] {
			r, _, _ := blocked(uint32(1+rng.IntN(users)), fmt.Sprint("k", i), now)
			reqs[k][i] = *r
		}
		args[k] = newArgs(reqs[k], now, 0, nil, nil)
	}
	b.Run("whole-long", func(b *testing.B) {
		k := 0
		for b.Loop() {
			k = (k + 1) % batches
			w.decideAll(reqs[k], args[k], idx, decs, hit, order, slots, nil)
			if !hit[0] || decs[0].Allowed {
				b.Fatalf("%+v: not capped by the copy", decs[0])
			}
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*batch), "ns/lookup")
	})
}

// TestNearCacheInstallHintGoneStale: a hint of a slot that another user's
// copy took since the lookup is not followed: the install looks the user up,
// and every copy stays its own user's, found where a lookup probes.
func TestNearCacheInstallHintGoneStale(t *testing.T) {
	c := newNearCache(2 * cacheShards) // two copies per shard
	install := func(user uint32, hint int32) {
		r, args, tail := blocked(user, "j", now)
		c.install(r, args, c.gen.Load(), tail, "", hint)
	}
	install(1, 0)
	sh := c.shard(1)
	var x uint32 // a user of the shard with a's first slot
	for u := uint32(2); x == 0; u++ {
		if shardOf(uint64(u)) == shardOf(1) && sh.home(uint64(u)) == sh.home(1) {
			x = u
		}
	}
	const a = 1
	hintA := sh.find(a) + 1 // a's slot, as a lookup saw it
	c.drop(a)
	install(x, 0) // takes a's slot
	if sh.find(uint64(x))+1 != hintA {
		t.Fatalf("x in slot %d, want a's old slot %d (the test's premise)", sh.find(uint64(x)), hintA-1)
	}
	install(a, hintA)
	live := 0
	for j := range sh.slots {
		if e := &sh.slots[j]; e.is(entryLive) {
			live++
			if got := sh.find(e.who()); got != int32(j) {
				t.Errorf("user %d's copy in slot %d, found in %d", e.who(), j, got)
			}
		}
	}
	if sh.find(a) < 0 || live != 2 || sh.live != 2 {
		t.Fatalf("a found in slot %d, %d live copies (counted %d): want a's copy beside x's", sh.find(a), live, sh.live)
	}
	// A hint still right is followed: a's copy is replaced in place.
	slot := sh.find(a)
	install(a, slot+1)
	if sh.find(a) != slot || sh.live != 2 {
		t.Errorf("a in slot %d (was %d), %d copies, want it replaced in place among 2", sh.find(a), slot, sh.live)
	}
}

// TestInstallAfterKeepsWhatInstallReads: a copy kept after a send Redis
// confirmed (installAfter, from what the lookup knew) is the copy install
// keeps from reading the log after it: the same expiry, size, entries and
// version. Random whole logs of a few sends and tally items, sends under a
// daily cap whose limit the send may fill, and a lifetime cap of its
// campaign; both kinds (known and not) must occur.
func TestInstallAfterKeepsWhatInstallReads(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 9))
	keep := now.Add(400 * 24 * time.Hour)
	known, unknown := 0, 0
	for i := range 2000 {
		campaign := fmt.Sprint("c", rng.IntN(4))
		caps := []Cap{{Name: "daily", Window: Daily, Limit: 1 + rng.IntN(6)}}
		if rng.IntN(2) == 0 {
			caps = append(caps, Cap{Name: "once", Limit: 1 << 20, Tally: true, Keep: keep, Scope: NewScope(nil, nil).Campaign(campaign)})
		}
		r := Request{UserID: uint32(i), JobID: fmt.Sprint("j", i), Channel: "email", Campaign: campaign, Caps: caps}
		args := newArgs([]Request{r}, now, 0, nil, nil)
		a := &args[0]
		// The log: a header good for the retention and up to 2 hours (a full daily cap passes later), then its
		// sends (one in the last millisecond, at times), then tally items (one of the send's campaign, at times).
		raw := binary.BigEndian.AppendUint64(nil, uint64(a.now+a.retention+rng.Int64N(2*3600_000)))
		sends := rng.IntN(5)
		for k := range sends {
			at := now.Add(-time.Duration(sends-k) * time.Minute)
			if k == sends-1 && rng.IntN(3) == 0 {
				at = now
			}
			raw = appendEntry(raw, at.UnixMilli(), Member(fmt.Sprint("old", k), "email", fmt.Sprint("c", rng.IntN(4)), nil))
		}
		if len(caps) == 2 && rng.IntN(2) == 0 {
			c := &caps[1]
			raw = appendItem(raw, countItem("", c.tallyField(), keep.UnixMilli(), false, a.now-1000))
		}
		c := newNearCache(100)
		c.install(&r, a, c.gen.Load(), string(raw[8:]), string(raw), 0)
		decs, hit := make([]Decision, 1), make([]bool, 1)
		c.decideAll([]Request{r}, args, []int{0}, decs, hit, make([]int, 1), make([]int32, 1), nil)
		if a.expect == "" {
			continue // capped, or not appendable: no send to confirm
		}
		after := a.patched
		if after == "" {
			after = appendedLog(a)
		}
		if !a.after.known {
			unknown++
			continue
		}
		known++
		read := newNearCache(100)
		read.install(&r, a, read.gen.Load(), after[8:], after, 0)
		c.installAfter(&r, a, c.gen.Load(), a.patched, 0) // a plain append's copy made in the arena
		got, want := copyOf(c, r.who()), copyOf(read, r.who())
		gotBytes, wantBytes := copyBytes(c, got), copyBytes(read, want)
		got.off, want.off = 0, 0
		if got != want || gotBytes != wantBytes {
			t.Fatalf("send %d (%d sends, caps %+v): installAfter kept %+v %q, install %+v %q", i, sends, caps, got, gotBytes, want, wantBytes)
		}
	}
	if known < 100 || unknown < 100 {
		t.Fatalf("%d sends confirmed with known copies and %d without: want both", known, unknown)
	}
}

// BenchmarkReadWholeCopy: reading a whole copy of 30 entries entry by entry
// (nextEntry), as a lookup reads it.
func BenchmarkReadWholeCopy(b *testing.B) {
	buf := make([]byte, 8, 8+30*26)
	for i := range 30 {
		buf = appendEntry(buf, int64(1_795_000_000_000+i), "0123456789abcdef")
	}
	log := string(buf)
	var sum int64
	for b.Loop() {
		for p := 8; p < len(log); {
			_, score, next, _ := nextEntry(log, p)
			sum += score
			p = next
		}
	}
	if sum == 0 {
		b.Fatal("no entry read")
	}
}

// copyBytes is the arena's bytes of e, a copy in c.
func copyBytes(c *nearCache, e cacheEntry) string {
	sh := c.shard(e.who())
	return string(sh.arena[e.off : e.off+int32(e.size)])
}

// copyOf returns user's entry in c, or none.
func copyOf(c *nearCache, user uint64) cacheEntry {
	sh := c.shard(user)
	if slot := sh.find(user); slot >= 0 {
		return sh.slots[slot]
	}
	return cacheEntry{}
}

// TestNearCacheTableStaysFindable churns a shard's table (installs, replaces,
// drops, holds, evictions, copies found expired by a batch's lookups, the
// batch's later lookups after such a removal) and checks after each step that every copy is found
// in its slot by a lookup, the live count is right, no user has two copies,
// each copy is the user's last install, and no dropped user has one.
func TestNearCacheTableStaysFindable(t *testing.T) {
	const users = 3000
	c := newNearCache(cacheShards * 40) // 40 copies a shard: most installs evict
	rng := rand.New(rand.NewPCG(3, 4))
	last := map[uint64]int64{} // user -> the version (latest score) of their last install; absent: dropped or never
	check := func(step int) {
		t.Helper()
		for s := range c.shards {
			sh := &c.shards[s]
			live := 0
			for j := range sh.slots {
				e := &sh.slots[j]
				if !e.is(entryLive) {
					continue
				}
				live++
				if got := sh.find(e.who()); got != int32(j) {
					t.Fatalf("step %d: user %d's copy in slot %d of shard %d, a lookup finds %d", step, e.who(), j, s, got)
				}
				if v, ok := last[e.who()]; !ok || v != e.latest {
					t.Fatalf("step %d: user %d has a copy of version %d, last installed %d (%v)", step, e.who(), e.latest, v, ok)
				}
			}
			if live != sh.live || live > c.perShard || 2*live > len(sh.slots) && live > 0 {
				t.Fatalf("step %d: shard %d holds %d copies, counts %d, at most %d in %d slots", step, s, live, sh.live, c.perShard, len(sh.slots))
			}
		}
	}
	evicted := uint64(0)
	for step := 0; step < 20000; step++ {
		u := uint32(1 + rng.IntN(users))
		switch op := rng.IntN(10); {
		case op < 6: // install (a newer version each time)
			r, a, _ := blocked(u, "j", now)
			v := now.Add(-time.Hour).UnixMilli() + int64(step)
			tail := logEntry(Member("old1", "email", "c", nil), now.Add(-2*time.Hour).UnixMilli()) + logEntry(Member("x", "email", "c", nil), v)
			c.install(r, a, c.gen.Load(), tail, "", 0)
			last[r.who()] = v
		case op < 8:
			c.drop(uint64(u))
			delete(last, uint64(u))
		case op < 9:
			c.hold(uint64(u))
			delete(last, uint64(u))
			c.release([]uint64{uint64(u)})
		default: // a batch's lookups, some finding copies expired (removed, moving others)
			reqs, args := make([]Request, 64), make([]reqArgs, 64)
			for i := range reqs {
				r, _, _ := blocked(uint32(1+rng.IntN(users)), "k", now)
				reqs[i] = *r
			}
			later := now.Add(time.Duration(rng.IntN(30)) * time.Hour)
			args = newArgs(reqs, later, 0, nil, nil)
			idx := make([]int, len(reqs))
			for i := range idx {
				idx[i] = i
			}
			decs, hit := make([]Decision, len(reqs)), make([]bool, len(reqs))
			c.decideAll(reqs, args, idx, decs, hit, make([]int, len(reqs)), make([]int32, len(reqs)), make([]int32, len(reqs)))
			for i := range reqs { // a removed copy is gone from the model too
				if sh := c.shard(reqs[i].who()); sh.find(reqs[i].who()) < 0 {
					delete(last, reqs[i].who())
				}
			}
		}
		gone := 0
		for who := range last { // evicted copies leave the model, and only they
			if c.shard(who).find(who) < 0 {
				delete(last, who)
				gone++
			}
		}
		if ev := c.evictions.Load(); uint64(gone) != ev-evicted {
			t.Fatalf("step %d: %d copies gone, %d evicted", step, gone, ev-evicted)
		}
		evicted = c.evictions.Load()
		check(step)
	}
	if ev := c.evictions.Load(); ev < 1000 {
		t.Fatalf("%d evictions: want the churn to evict", ev)
	}
}
