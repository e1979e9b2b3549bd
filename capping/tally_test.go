package capping_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testclock"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestLifetimeTally: a lifetime cap of 2 per campaign, kept 400 days, beside
// a daily cap, on a fixed clock. Two sends of the campaign pass, however far
// apart; the third is capped for good (no retry-at) and names the cap; a
// redelivery of an allowed send is its duplicate and not counted again;
// another campaign has a count of its own; the tally holds the counts and
// expires with its longest-kept field; a send that matches no tally cap
// leaves no tally; the log keeps only the daily window's sends.
func TestLifetimeTally(t *testing.T) {
	for _, mode := range limiterModes {
		t.Run(mode.name, func(t *testing.T) {
			e := newEnv(t, mode.opt)
			ctx := context.Background()
			life := func(campaign string) capping.Cap {
				return capping.Cap{Name: "welcome-once", Limit: 2, Tally: true, Keep: e.clock.Now().Add(400 * 24 * time.Hour),
					Scope: capping.NewScope(nil, []string{"welcome"}).Campaign(campaign)}
			}
			send := func(user uint32, campaign string) capping.Request {
				r := job(user, "email", daily3, life(campaign))
				r.Campaign, r.Tags = campaign, []string{"welcome"}
				return r
			}
			first := send(31, "w1")
			if d := e.decide(t, first, first); !d[0].Allowed || !d[1].Duplicate {
				t.Fatalf("first send and its redelivery: %+v", d)
			}
			e.clock.Add(200 * 24 * time.Hour)
			if d := e.decide(t, send(31, "w1"))[0]; !d.Allowed || d.Counts[1] != 1 {
				t.Fatalf("second send 200 days later: %+v, want allowed over a count of 1", d)
			}
			e.clock.Add(100 * 24 * time.Hour)
			d := e.decide(t, send(31, "w1"))[0]
			if d.Allowed || d.Cap != "welcome-once" || !d.RetryAt.IsZero() || d.Counts[1] != 2 {
				t.Fatalf("third send: %+v, want capped for good by welcome-once at a count of 2", d)
			}
			w2 := send(31, "w2")
			if d := e.decide(t, w2)[0]; !d.Allowed || d.Counts[1] != 0 {
				t.Fatalf("another campaign: %+v, want allowed over a count of 0", d)
			}
			// Its delivery failed: the log forgets the send, the tally keeps its count.
			if found, err := e.lim.Forget(ctx, 0, 31, w2.JobID); err != nil || !found {
				t.Fatalf("forget %s: %v %v", w2.JobID, found, err)
			}
			tally, err := capping.ReadTally(ctx, e.rdb, e.lim.Key(0, 31))
			if err != nil {
				t.Fatal(err)
			}
			// Each field is kept 400 days from its last send: w1's from day 200, w2's from day 300.
			w2Keep := e.clock.Now().Add(400 * 24 * time.Hour)
			want := map[uint64]TallyWant{life("w1").TallyField(): {2, w2Keep.Add(-100 * 24 * time.Hour)}, life("w2").TallyField(): {1, w2Keep}}
			if len(tally) != 2 {
				t.Fatalf("tally %+v, want 2 fields", tally)
			}
			for _, f := range tally {
				if w := want[f.Field]; w.count != f.Count || len(f.Times) != 0 || !f.Keep.Equal(w.keep) {
					t.Errorf("tally field %+v, want count %d, no times, kept until %v", f, w.count, w.keep)
				}
			}
			// The log is kept until its longest-kept item, plus the retention's slack (an
			// eighth of it, at most an hour): a TTL from the test's clock.
			ttl := e.rdb.PTTL(ctx, e.lim.Key(0, 31)).Val()
			if d := ttl - w2Keep.Sub(e.clock.Now()); d < -time.Minute || d > time.Hour+time.Minute {
				t.Errorf("the log expires in %v, want %v plus an hour at most", ttl, w2Keep.Sub(e.clock.Now()))
			}
			if d := e.decide(t, job(32, "push", daily3, life("w1")))[0]; !d.Allowed || d.Counts[1] != -1 {
				t.Fatalf("a send outside the tally cap's scope: %+v, want allowed, the cap not counted", d)
			}
			if tally, err := capping.ReadTally(ctx, e.rdb, e.lim.Key(0, 32)); err != nil || len(tally) != 0 {
				t.Errorf("a send that matches no tally cap left a tally %+v (%v)", tally, err)
			}
			if ttl := e.rdb.PTTL(ctx, e.lim.Key(0, 32)).Val(); ttl > 2*24*time.Hour {
				t.Errorf("the log of a user without a tally expires in %v: the daily cap's retention is a day", ttl)
			}
			// The daily cap keeps a day of sends (TallyDedupe too): the last one, forgotten; the tally items are no sends.
			if n := testenv.LogLen(t, e.rdb, e.lim.Key(0, 31)); n != 0 {
				t.Errorf("user 31's log holds %d sends, want none", n)
			}
		})
	}
}

// limiterModes are the ways a Limiter decides: with the worker's near cache,
// with new logs written by SET NX and the rest by the script (no cache), and
// every decision by the script.
var limiterModes = []struct {
	name string
	opt  func(*capping.Config)
}{{"near cache", nearCache}, {"new logs", func(*capping.Config) {}}, {"script only", scriptOnly}}

type TallyWant struct {
	count int
	keep  time.Time
}

// TestRollingTally: "not again within 90 days" as a tally cap, and one of 2
// in 90 days: the times of the last sends decide, the retry-at is when the
// oldest counted one leaves the window, and a field kept until before now is
// deleted by the next write.
func TestRollingTally(t *testing.T) {
	e := newEnv(t, scriptOnly)
	ctx := context.Background()
	day := 24 * time.Hour
	survey := func(limit int, keep time.Duration) capping.Cap {
		return capping.Cap{Name: "survey", Limit: limit, Window: 90 * day, Tally: true, Keep: e.clock.Now().Add(keep),
			Scope: capping.NewScope(nil, []string{"survey"})}
	}
	send := func(c capping.Cap) capping.Request {
		r := job(41, "email", daily3, c)
		r.Tags = []string{"survey"}
		return r
	}
	if d := e.decide(t, send(survey(1, 90*day)))[0]; !d.Allowed {
		t.Fatalf("first survey: %+v", d)
	}
	e.clock.Add(30 * day)
	d := e.decide(t, send(survey(1, 90*day)))[0]
	if d.Allowed || d.Cap != "survey" || !d.RetryAt.Equal(base.Add(90*day)) {
		t.Fatalf("30 days later: %+v, want capped until 90 days after the first", d)
	}
	if d := e.decide(t, send(survey(2, 90*day)))[0]; !d.Allowed || d.Counts[1] != 1 {
		t.Fatalf("with a limit of 2: %+v, want allowed over a count of 1", d)
	}
	e.clock.Add(61 * day) // the first has left the window, the second not
	if d := e.decide(t, send(survey(1, 90*day)))[0]; d.Allowed || !d.RetryAt.Equal(base.Add(120*day)) {
		t.Fatalf("91 days after the first: %+v, want capped until 90 days after the second", d)
	}
	// A field kept for a day only, then one of another scope written after it has lapsed.
	other := capping.Cap{Name: "other", Limit: 5, Tally: true, Keep: e.clock.Now().Add(day)}
	if d := e.decide(t, job(41, "sms", other))[0]; !d.Allowed {
		t.Fatalf("other: %+v", d)
	}
	if tally, _ := capping.ReadTally(ctx, e.rdb, e.lim.Key(0, 41)); len(tally) != 2 {
		t.Fatalf("tally %+v, want the survey's and other's fields", tally)
	}
	e.clock.Add(100 * day) // survey's field was kept 90 days from its last send: both have lapsed
	if d := e.decide(t, send(survey(1, 90*day)))[0]; !d.Allowed || d.Counts[1] != 0 {
		t.Fatalf("after both fields lapsed: %+v, want allowed over a count of 0", d)
	}
	tally, err := capping.ReadTally(ctx, e.rdb, e.lim.Key(0, 41))
	if err != nil {
		t.Fatal(err)
	}
	if len(tally) != 1 || tally[0].Count != 1 || len(tally[0].Times) != 1 {
		t.Fatalf("tally %+v, want the survey's field alone, one send", tally)
	}
}

// TestTallyInANewLog: a new user's first send, written as a new log by one
// SET NX (no script), carries its tally items: a lifetime cap of 1 and a
// 90-day cap of 2 that count it; the next send is capped by the lifetime cap
// for good, and a send of another campaign counts once more in the 90-day cap.
func TestTallyInANewLog(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	day := 24 * time.Hour
	caps := func(campaign string) []capping.Cap {
		keep := e.clock.Now().Add(400 * day)
		return []capping.Cap{daily3,
			{Name: "once", Limit: 1, Tally: true, Keep: keep, Scope: capping.Scope{}.Campaign(campaign)},
			{Name: "two-90d", Limit: 2, Window: 90 * day, Tally: true, Keep: e.clock.Now().Add(90 * day)}}
	}
	send := func(campaign string) capping.Decision {
		r := job(51, "email", caps(campaign)...)
		r.Campaign = campaign
		return e.decide(t, r)[0]
	}
	newLogs := func() uint64 { return e.lim.Stats().NewLogs }
	before := newLogs()
	if d := send("a"); !d.Allowed {
		t.Fatalf("first send: %+v", d)
	}
	if newLogs() != before+1 {
		t.Fatalf("the first send was not written as a new log (new logs %d, before %d)", newLogs(), before)
	}
	tally, err := capping.ReadTally(ctx, e.rdb, e.lim.Key(0, 51))
	if err != nil || len(tally) != 2 {
		t.Fatalf("tally %+v (%v), want the two caps' items", tally, err)
	}
	for _, c := range tally {
		if c.Count != 1 {
			t.Errorf("tally item %+v, want a count of 1", c)
		}
	}
	e.clock.Add(time.Hour)
	if d := send("a"); d.Allowed || d.Cap != "once" || !d.RetryAt.IsZero() {
		t.Fatalf("second send of campaign a: %+v, want capped by once for good", d)
	}
	if d := send("b"); !d.Allowed || d.Counts[2] != 1 {
		t.Fatalf("campaign b: %+v, want allowed over a 90-day count of 1", d)
	}
	if d := send("c"); d.Allowed || d.Cap != "two-90d" || !d.RetryAt.Equal(base.Add(90*day)) {
		t.Fatalf("campaign c: %+v, want capped by two-90d until 90 days after the first send", d)
	}
}

// TestLifetimeCapOfALongLog: with the near cache, a user with a long log (24
// sends of other campaigns, more than 512 bytes) gets two sends of a campaign
// capped at once ever: the second is capped. (A copy of such a log, longer
// than the near cache then swapped in, once took the first send as a plain
// append, its tally item never written, and let the second through.)
func TestLifetimeCapOfALongLog(t *testing.T) {
	e := newEnv(t, func(c *capping.Config) { c.NearCache = 1000 })
	const user = 71
	send := func(campaign string) capping.Decision {
		t.Helper()
		r := job(user, "email", capping.Cap{Name: "daily-100", Window: capping.Daily, Limit: 100},
			capping.Cap{Name: "once-ever", Limit: 1, Tally: true, Keep: e.clock.Now().Add(400 * 24 * time.Hour), Scope: capping.Scope{}.Campaign("w")})
		r.Campaign = campaign
		e.clock.Add(time.Second)
		return e.decide(t, r)[0]
	}
	for range 24 {
		if d := send("other"); !d.Allowed {
			t.Fatalf("a send of another campaign: %+v, want allowed", d)
		}
	}
	if d := send("w"); !d.Allowed {
		t.Fatalf("the first send of w: %+v, want allowed", d)
	}
	if d := send("w"); d.Allowed || d.Cap != "once-ever" {
		t.Fatalf("the second send of w: %+v, want capped by once-ever", d)
	}
	if s := e.lim.Stats(); s.CopyAppends == 0 {
		t.Fatalf("no send was appended to the near cache's copy (%+v): the test does not exercise it", s)
	}
}

// TestTallyPatchedInPlace: with the near cache, a user's sends of three
// campaigns, each capped at 3 ever, are decided from the cache's copy and
// recorded by patches (a campaign's first send appends its item after the
// entries, the next ones count it in place), some after jumps of the clock
// past the log's TTL. Each decision, each count and the tally in Redis are
// the model's; a worker without the cache decides the next sends the same,
// patching the log as the cache does until its entries age out (then it
// writes the log whole, items first), and the cache then goes on from the
// rewritten log.
func TestTallyPatchedInPlace(t *testing.T) {
	var prefix string
	e := newEnv(t, func(c *capping.Config) { c.NearCache = 1000; prefix = c.KeyPrefix })
	script, err := capping.New(context.Background(), e.rdb, capping.Config{KeyPrefix: prefix, Clock: e.clock.Now, ScriptOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	const user = 83
	count := map[string]int{}
	send := func(lim *capping.Limiter, campaign string) {
		t.Helper()
		r := job(user, "email", capping.Cap{Name: "daily-100", Window: capping.Daily, Limit: 100},
			capping.Cap{Name: "thrice-ever", Limit: 3, Tally: true, Keep: e.clock.Now().Add(400 * 24 * time.Hour), Scope: capping.Scope{}.Campaign(campaign)})
		r.Campaign = campaign
		e.clock.Add(time.Second)
		ds, err := lim.Decide(ctx, []capping.Request{r})
		if err != nil {
			t.Fatal(err)
		}
		d := ds[0]
		if want := count[campaign] < 3; d.Allowed != want || d.Counts[1] != count[campaign] {
			t.Fatalf("send %d of %s: %+v, want allowed %v over a count of %d", count[campaign]+1, campaign, d, want, count[campaign])
		}
		if d.Allowed {
			count[campaign]++
		}
		tally, err := capping.ReadTally(ctx, e.rdb, e.lim.Key(0, user))
		if err != nil {
			t.Fatal(err)
		}
		got := 0
		for _, c := range tally {
			got += c.Count
		}
		want := 0
		for _, n := range count {
			want += n
		}
		if got != want || len(tally) != len(count) {
			t.Fatalf("after a send of %s: tally %+v, want %d sends in %d items", campaign, tally, want, len(count))
		}
	}
	send(e.lim, "a") // a new log
	for _, c := range []string{"b", "a", "c", "b", "a", "a", "c"} {
		send(e.lim, c)
	}
	if s := e.lim.Stats(); s.CopyAppends < 6 {
		t.Fatalf("%d sends patched the cache's copy, want 6 (%+v)", s.CopyAppends, s)
	}
	raw, err := e.rdb.Get(ctx, e.lim.Key(0, user)).Result()
	if err != nil {
		t.Fatal(err)
	}
	if !itemAfterEntry(raw) {
		t.Fatalf("no tally item follows an entry in %x: no new item was appended by a patch", raw)
	}
	e.clock.Add(2 * time.Hour) // the next keeps outlast the log's TTL: a patch sets a new one
	send(e.lim, "c")
	send(e.lim, "b")
	if exp := int64(binary.BigEndian.Uint64([]byte(mustGet(t, e, user)[:8]))); exp < e.clock.Now().Add(400*24*time.Hour).UnixMilli() {
		t.Fatalf("the log's header says it expires at %d, before its last item's keep", exp)
	}
	send(script, "b") // capped: the script reads the patched log
	send(script, "d") // allowed: the script patches the log too, its new item after the entries
	if !itemAfterEntry(mustGet(t, e, user)) {
		t.Fatal("the script wrote the log whole to count a send, where a patch would do")
	}
	e.clock.Add(3 * 24 * time.Hour) // every entry ages out: the script writes the log whole, items first
	send(script, "e")
	raw = mustGet(t, e, user)
	if itemAfterEntry(raw) {
		t.Fatal("the script wrote the log whole with an item after an entry")
	}
	for p := 8; p < len(raw); { // a count's item is 22 bytes (contract.md)
		_, score, next, _ := capping.NextEntry(raw, p)
		if score == 0 && next-p != 22 {
			t.Fatalf("a tally item of %d bytes in %x, want 22", next-p, raw)
		}
		p = next
	}
	before := e.lim.Stats().CopyAppends
	for _, c := range []string{"c", "d", "e", "f", "a"} {
		send(e.lim, c)
	}
	if s := e.lim.Stats(); s.CopyAppends == before {
		t.Fatalf("no send after the script's rewrite was patched (%+v)", s)
	}
}

func mustGet(t *testing.T, e *env, user uint32) string {
	t.Helper()
	raw, err := e.rdb.Get(context.Background(), e.lim.Key(0, user)).Result()
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

// itemAfterEntry reports whether a log (its value) holds a tally item after an entry.
func itemAfterEntry(raw string) bool {
	entry := false
	for p := 8; p < len(raw); {
		_, score, next, ok := capping.NextEntry(raw, p)
		if !ok {
			panic(fmt.Sprintf("a log truncated at byte %d of %d: %x", p, len(raw), raw))
		}
		if score == 0 && entry {
			return true
		}
		entry = entry || score != 0
		p = next
	}
	return false
}

// TestNearCacheCopiesTheTallyThatFillsACap: the send that takes a lifetime
// cap's last slot, decided by the script on a log with a mark (so not a whole
// copy), leaves the near cache the log's tally items with that send counted:
// the campaign's next send is capped from the copy, with no request to Redis,
// as Redis caps it.
func TestNearCacheCopiesTheTallyThatFillsACap(t *testing.T) {
	e := newEnv(t, func(c *capping.Config) { c.NearCache = 100 })
	const user = 12
	week := 8 * 24 * time.Hour
	if d := e.decide(t, capping.Request{UserID: user, JobID: "refused", Channel: "email", DuplicateOnly: true, Refused: "budget", Retention: week})[0]; d.Duplicate {
		t.Fatalf("the refused send: %+v, want it marked", d)
	}
	twice := capping.Cap{Name: "twice-ever", Limit: 2, Tally: true, Keep: e.clock.Now().Add(400 * 24 * time.Hour), Scope: capping.Scope{}.Campaign("welcome")}
	send := func() capping.Decision {
		t.Helper()
		r := job(user, "email", daily3, twice)
		r.Campaign = "welcome"
		e.clock.Add(time.Minute)
		return e.decide(t, r)[0]
	}
	if d := send(); !d.Allowed {
		t.Fatalf("first send: %+v, want allowed", d)
	}
	before := e.lim.Stats()
	if d := send(); !d.Allowed || d.Counts[1] != 1 {
		t.Fatalf("second send: %+v, want allowed over a count of 1 (the last slot)", d)
	}
	if st := e.lim.Stats(); st.CacheEntries != 1 || st.Requests != before.Requests+1 {
		t.Fatalf("after the last slot: %d copies, %d requests sent, want 1 copy, 1 request", st.CacheEntries, st.Requests-before.Requests)
	}
	d := send()
	if st := e.lim.Stats(); st.CacheHits != before.CacheHits+1 || st.Requests != before.Requests+1 {
		t.Fatalf("the third send went to Redis (%d hits, %d requests since): the copy does not count the send that filled the cap",
			st.CacheHits-before.CacheHits, st.Requests-before.Requests)
	}
	if d.Allowed || d.Cap != "twice-ever" || d.Counts[1] != 2 || !d.RetryAt.IsZero() {
		t.Fatalf("the third send from the copy: %+v, want capped for good by twice-ever over a count of 2", d)
	}
	tally, err := capping.ReadTally(context.Background(), e.rdb, e.lim.Key(0, user))
	if err != nil || len(tally) != 1 || tally[0].Count != 2 {
		t.Fatalf("the tally in Redis: %+v (%v), want one count of 2", tally, err)
	}
}

// TestNoCopyOfALogPastTheCacheLimit: a user sent 10 campaigns under a
// per-campaign lifetime cap and 49 other sends, a minute apart, has 10 tally
// items and 59 entries. Asked for a copy as a Limiter with a near cache asks,
// the script answers the next send's decision alone: the near cache keeps no
// copy of more than 64 entries and items together (the script counts both:
// 60 entries alone would be copied).
func TestNoCopyOfALogPastTheCacheLimit(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	const user = 31
	keep := e.clock.Now().Add(400 * 24 * time.Hour)
	day := capping.Cap{Name: "daily", Window: capping.Daily, Limit: 100}
	send := func(k int) capping.Request {
		if k >= 10 && k < 59 {
			return job(user, "email", day)
		}
		campaign := fmt.Sprint("weekly-", k)
		r := job(user, "email", day, capping.Cap{Name: "once", Limit: 1, Tally: true, Keep: keep, Scope: capping.Scope{}.Campaign(campaign)})
		r.Campaign = campaign
		return r
	}
	for k := range 59 {
		if d := e.decide(t, send(k))[0]; !d.Allowed {
			t.Fatalf("send %d: %+v, want allowed", k, d)
		}
		e.clock.Add(time.Minute)
	}
	call, err := capping.CachedCall([]string{e.lim.Key(0, user)}, []capping.Request{send(59)}, e.clock.Now())
	if err != nil {
		t.Fatal(err)
	}
	v, err := e.rdb.Do(ctx, call...).Slice()
	if err != nil || len(v) != 1 {
		t.Fatalf("the call: %v, %v", v, err)
	}
	r, ok := v[0].(string)
	if !ok || len(r) == 0 {
		t.Fatalf("the 60th send's reply: %v, want a decision", v[0])
	}
	if len(r) != 19 || r[0] != 1 { // status 1, cap, retry_at, two counts (decide.lua)
		t.Errorf("the 60th send's reply: %d bytes, status %d; want its decision alone (allowed, two counts), no copy of the log", len(r), r[0])
	}
	if n := testenv.LogLen(t, e.rdb, e.lim.Key(0, user)); n != 60 {
		t.Fatalf("the log holds %d sends, want 60", n)
	}
}

// oncePerCampaign returns a lifetime cap of one send of a campaign, kept
// until keep, and a send of user's under it.
func oncePerCampaign(user uint32, keep time.Time) (once func(campaign string) capping.Cap, send func(campaign string) capping.Request) {
	once = func(c string) capping.Cap {
		return capping.Cap{Name: "once", Limit: 1, Tally: true, Keep: keep, Scope: capping.NewScope(nil, nil).Campaign(c)}
	}
	send = func(c string) capping.Request {
		r := job(user, "email", once(c))
		r.Campaign = c
		return r
	}
	return once, send
}

// TestManyScopesSpill: a user sent 40 campaigns under a lifetime cap of one
// per campaign. Past 16 tally items the log moves them to the user's tally
// key and keeps one item that says so; every count stays exact after it: a
// campaign sent once is capped for good at a count of 1, a new one is allowed
// once, a redelivery is its duplicate, a rolling tally cap counts its times,
// and a send that counts no tally leaves the tally key as it was.
func TestManyScopesSpill(t *testing.T) {
	for _, mode := range limiterModes {
		t.Run(mode.name, func(t *testing.T) {
			e := newEnv(t, mode.opt)
			ctx := context.Background()
			const user = 61
			key := e.lim.Key(0, user)
			keep := e.clock.Now().Add(400 * 24 * time.Hour)
			_, send := oncePerCampaign(user, keep)
			items := func() int {
				raw, err := e.rdb.Get(ctx, key).Result()
				if err != nil {
					t.Fatal(err)
				}
				n := 0
				for p := 8; p < len(raw); {
					_, score, next, ok := capping.NextEntry(raw, p)
					if !ok {
						t.Fatalf("the log is cut at byte %d of %d", p, len(raw))
					}
					if score == 0 {
						n++
					}
					p = next
				}
				return n
			}
			var sent []capping.Request
			for i := range 40 {
				r := send(fmt.Sprintf("c%d", i))
				sent = append(sent, r)
				if d := e.decide(t, r)[0]; !d.Allowed || d.Counts[0] != 0 {
					t.Fatalf("campaign c%d's first send: %+v, want allowed over a count of 0", i, d)
				}
				want := i + 1
				if i >= 16 {
					want = 1 // the spill item alone
				}
				if n := items(); n != want {
					t.Fatalf("after %d campaigns the log holds %d tally items, want %d", i+1, n, want)
				}
				e.clock.Add(time.Minute)
			}
			for range 2 { // the second time from the near cache's copy, when it has one
				if d := e.decide(t, send("c5"))[0]; d.Allowed || d.Cap != "once" || !d.RetryAt.IsZero() || d.Counts[0] != 1 {
					t.Fatalf("campaign c5 again: %+v, want capped for good by once at a count of 1", d)
				}
			}
			if d := e.decide(t, sent[7])[0]; !d.Duplicate {
				t.Fatalf("a redelivery of c7's send: %+v, want its duplicate", d)
			}
			if d := e.decide(t, send("c40"))[0]; !d.Allowed || d.Counts[0] != 0 {
				t.Fatalf("a new campaign: %+v, want allowed over a count of 0", d)
			}
			for range 2 {
				if d := e.decide(t, send("c40"))[0]; d.Allowed || d.Counts[0] != 1 {
					t.Fatalf("the new campaign again: %+v, want capped at a count of 1", d)
				}
			}
			surveyKeep := e.clock.Now().Add(100 * 24 * time.Hour)
			survey := capping.Cap{Name: "survey", Limit: 2, Window: 90 * 24 * time.Hour, Tally: true, Keep: surveyKeep,
				Scope: capping.NewScope(nil, []string{"survey"})}
			first := e.clock.Now()
			for i := range 3 {
				r := job(user, "email", survey)
				r.Tags = []string{"survey"}
				d := e.decide(t, r)[0]
				if i < 2 && (!d.Allowed || d.Counts[0] != i) {
					t.Fatalf("survey %d: %+v, want allowed over a count of %d", i+1, d, i)
				}
				if i == 2 && (d.Allowed || !d.RetryAt.Equal(first.Add(90*24*time.Hour))) {
					t.Fatalf("survey 3: %+v, want capped until 90 days after the first", d)
				}
				e.clock.Add(time.Hour)
			}
			tally, err := capping.ReadTally(ctx, e.rdb, key)
			if err != nil {
				t.Fatal(err)
			}
			if len(tally) != 42 {
				t.Fatalf("the tally holds %d fields, want 41 campaigns and the survey", len(tally))
			}
			for _, f := range tally {
				want, until := 1, keep
				if f.Field == survey.TallyField() {
					want, until = 2, surveyKeep
				}
				if f.Count != want || !f.Keep.Equal(until) {
					t.Errorf("tally field %+v, want a count of %d kept until %v", f, want, until)
				}
			}
			before := e.rdb.Get(ctx, key+":t").Val()
			if d := e.decide(t, job(user, "push", capping.Cap{Name: "daily", Window: capping.Daily, Limit: 100}))[0]; !d.Allowed {
				t.Fatalf("a send without a tally cap: %+v", d)
			}
			if after := e.rdb.Get(ctx, key+":t").Val(); after != before {
				t.Errorf("a send without a tally cap changed the tally key")
			}
			// Both keys outlive the tally's keep: TTLs set by writes up to 4 hours of the test's clock ago, with
			// the retention's slack of an hour at most.
			for _, k := range []string{key, key + ":t"} {
				if ttl, left := e.rdb.PTTL(ctx, k).Val(), keep.Sub(e.clock.Now()); ttl < left || ttl > left+5*time.Hour {
					t.Errorf("%s expires in %v, want the tally's keep, %v, and 5 hours at most", k, ttl, left)
				}
			}
			// Past the survey's keep its count lapsed: a survey is allowed over a count of 0, and the tally key
			// holds its new count (written whole: the survey's item is shorter, one time of a send for two).
			e.clock.Add(101 * 24 * time.Hour)
			survey.Keep = e.clock.Now().Add(100 * 24 * time.Hour)
			r := job(user, "email", survey)
			r.Tags = []string{"survey"}
			if d := e.decide(t, r)[0]; !d.Allowed || d.Counts[0] != 0 {
				t.Fatalf("a survey past its count's keep: %+v, want allowed over a count of 0", d)
			}
			tally, err = capping.ReadTally(ctx, e.rdb, key)
			if err != nil || len(tally) != 42 {
				t.Fatalf("the tally after it: %d fields (%v), want 42", len(tally), err)
			}
			for _, f := range tally {
				if f.Field == survey.TallyField() && (f.Count != 1 || len(f.Times) != 1 || !f.Keep.Equal(survey.Keep)) {
					t.Errorf("the survey's count after it: %+v, want 1, kept until %v", f, survey.Keep)
				}
			}
		})
	}
}

// TestSpilledSendsFromTheCopy: a user whose tally moved to the tally key
// (more campaigns than a log keeps items) sends on with the near cache on.
// Each send its copy allows by the other caps goes to the script as
// modeSpilled, its tally caps counted from the tally key, and is decided as
// the script alone decides it (the reference: another prefix, the same sends
// on the same clock): the same decisions, counts and shadow caps, the same
// entries, items and tally key. The sends cross raises of the spill item's
// keep (the keeps move with the clock), a rolling tally cap (the tally key
// written whole as its item grows), a shadow tally cap past its limit, a
// lifetime cap reached, a rolling one full and an arbitrated one's last slot
// (each left by the script to a decision in full), a redelivery, and a send
// by another process between two (the copy stale: decided in full).
func TestSpilledSendsFromTheCopy(t *testing.T) {
	ctx := context.Background()
	clk := testclock.At(base)
	rdb := testenv.ClusterClient(t)
	prefix := testenv.Unique("spillcopy")
	newLim := func(prefix string, cache int) *capping.Limiter {
		lim, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: prefix, Clock: clk.Now, NearCache: cache, ScriptOnly: cache == 0})
		if err != nil {
			t.Fatal(err)
		}
		return lim
	}
	cached, other, plain := newLim(prefix, 1000), newLim(prefix, 0), newLim(prefix+"ref", 0)
	const user = 7
	promo := capping.NewScope(nil, []string{"promotional"})
	send := func(k int, campaign, channel string) capping.Request {
		now := clk.Now()
		r := capping.Request{UserID: user, JobID: fmt.Sprint("s", k), Channel: channel, Campaign: campaign,
			Tags: []string{"marketing"}, Retention: 8 * 24 * time.Hour, Caps: []capping.Cap{
				{Name: "hourly", Window: time.Hour, Limit: 50},
				{Name: "once", Limit: 1, Tally: true, Keep: now.Add(400 * 24 * time.Hour), Scope: capping.Scope{}.Campaign(campaign)},
				{Name: "promo-week", Window: capping.Weekly, Limit: capping.MaxTallyTimes, Tally: true, Keep: now.Add(8 * 24 * time.Hour), Scope: promo},
				{Name: "push-thrice-ever", Limit: 3, Tally: true, Shadow: true, Keep: now.Add(400 * 24 * time.Hour),
					Scope: capping.NewScope([]string{"push"}, nil)},
			}}
		if k%2 == 0 {
			r.Tags = append(r.Tags, "promotional")
		}
		return r
	}
	both := func(what string, r capping.Request, lims ...*capping.Limiter) capping.Decision {
		t.Helper()
		var ds []capping.Decision
		for _, l := range append(lims, plain) {
			d, err := l.Decide(ctx, []capping.Request{r})
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			ds = append(ds, d[0])
		}
		if d := diff(ds[0], ds[len(ds)-1]); d != "" {
			t.Fatalf("%s: with the cache and by the script alone differ: %s", what, d)
		}
		return ds[0]
	}
	for k := range 44 {
		channel := "email"
		if k%3 == 0 {
			channel = "push"
		}
		d := both(fmt.Sprint("campaign c", k), send(k, fmt.Sprint("c", k), channel), cached)
		if promos := k/2 + 1; k%2 == 0 && promos > capping.MaxTallyTimes { // the week's promotions are spent
			if d.Allowed || d.Cap != "promo-week" {
				t.Fatalf("campaign c%d, promotion %d of the week: %+v, want capped by promo-week", k, promos, d)
			}
		} else if !d.Allowed {
			t.Fatalf("campaign c%d: %+v, want allowed", k, d)
		}
		if k == 30 { // another process sends: the copy is stale for the next send
			both("another process's send", send(1000, "c1000", "email"), other)
		}
		clk.Add(7 * time.Minute) // the keeps move past the spill item's slack every few sends
	}
	if d := both("campaign c3 again", send(2000, "c3", "email"), cached); d.Allowed || d.Cap != "once" {
		t.Fatalf("campaign c3 again: %+v, want capped for good by once", d)
	}
	if d := both("a redelivery", send(5, "c5", "email"), cached); !d.Duplicate {
		t.Fatalf("a redelivery of c5's send: %+v, want its duplicate", d)
	}
	if d := both("a push past the shadow cap", send(3001, "c3001", "push"), cached); !d.Allowed || len(d.Shadow) != 1 {
		t.Fatalf("a push past the shadow cap: %+v, want allowed, the shadow cap named", d)
	}
	arbitrated := func(k int) capping.Request { // the last of two SMS ever goes to an arbitration
		r := send(k, fmt.Sprint("c", k), "sms")
		r.Caps = append(r.Caps, capping.Cap{Name: "twice-ever", Limit: 2, Tally: true, Arbitrated: true,
			Keep: clk.Now().Add(400 * 24 * time.Hour), Scope: capping.NewScope([]string{"sms"}, nil)})
		r.Arbitration, r.Priority = time.Minute, 5
		return r
	}
	if d := both("an arbitrated cap's first send", arbitrated(4001), cached); !d.Allowed {
		t.Fatalf("an arbitrated cap's first send: %+v, want allowed", d)
	}
	if d := both("an arbitrated cap's last slot", arbitrated(4003), cached); !d.Candidate || d.Cap != "twice-ever" {
		t.Fatalf("an arbitrated cap's last slot: %+v, want a candidate of twice-ever's arbitration", d)
	}
	st := cached.Stats()
	t.Logf("with the cache: %d requests to Redis, %d appended to a copy (%d their tally in a tally key), %d copies stale",
		st.Requests, st.CopyAppends, st.SpilledAppends, st.CopyMisses)
	if st.SpilledAppends < 20 || st.CopyMisses == 0 {
		t.Errorf("%d sends counted in the tally key from a copy, %d copies stale: want most of the 27 after the spill, and the stale one",
			st.SpilledAppends, st.CopyMisses)
	}
	a, err := rdb.Get(ctx, cached.Key(0, user)).Result()
	if err != nil {
		t.Fatal(err)
	}
	b, err := rdb.Get(ctx, plain.Key(0, user)).Result()
	if err != nil {
		t.Fatal(err)
	}
	ha, sa, ta := splitLog(a)
	_, sb, tb := splitLog(b)
	if len(ta) != 1 || !slices.Equal(sa, sb) || !slices.Equal(ta, tb) || ha < maxKeep(ta) {
		t.Errorf("the log with the cache: %x, by the script alone: %x; want the same entries and spill item, the header after its keep", a, b)
	}
	ka, errA := rdb.Get(ctx, cached.Key(0, user)+":t").Result()
	kb, errB := rdb.Get(ctx, plain.Key(0, user)+":t").Result()
	if errA != nil || errB != nil || ka != kb {
		t.Errorf("the tally key with the cache: %x (%v), by the script alone: %x (%v)", ka, errA, kb, errB)
	}
}

// TestTallyKeyItemsByTheirFrame: a spilled user's tally key is searched for a
// field's bytes, not walked item by item; bytes that match the field inside
// another item (here a long-window count's send time) are not its item. The
// campaign never sent is allowed over a count of 0, its new item appended,
// and the other item is left as it was.
func TestTallyKeyItemsByTheirFrame(t *testing.T) {
	for _, mode := range limiterModes {
		t.Run(mode.name, func(t *testing.T) {
			e := newEnv(t, mode.opt)
			ctx := context.Background()
			const user = 62
			key, keep, once, send := spilledUser(t, e, user)
			// The tally key holds one item: another field's count of 1 with two send times, the second of which
			// is c20's field's 8 bytes (the first ends in two zero bytes: no item's head).
			target := once("c20").TallyField()
			keepMs := uint64(keep.UnixMilli())
			other := binary.BigEndian.AppendUint64(nil, 0x7a7a7a7a7a7a7a7a)
			other = binary.BigEndian.AppendUint32(other, 1)
			other = binary.BigEndian.AppendUint64(other, keepMs)
			other = binary.BigEndian.AppendUint64(other, uint64(e.clock.Now().UnixMilli())&^0xffff)
			other = binary.BigEndian.AppendUint64(other, target)
			forged := append([]byte{1, byte(len(other))}, other...)
			if err := e.rdb.Set(ctx, key+":t", forged, time.Hour).Err(); err != nil {
				t.Fatal(err)
			}
			if d := e.decide(t, send("c20"))[0]; !d.Allowed || d.Counts[0] != 0 {
				t.Fatalf("campaign c20, never sent: %+v, want allowed over a count of 0", d)
			}
			if d := e.decide(t, send("c20"))[0]; d.Allowed || d.Counts[0] != 1 {
				t.Fatalf("campaign c20 again: %+v, want capped at a count of 1", d)
			}
			raw := e.rdb.Get(ctx, key+":t").Val()
			if len(raw) < len(forged) || raw[:len(forged)] != string(forged) {
				t.Fatalf("the other item changed: %x, want %x first", raw, forged)
			}
			tally, err := capping.ReadTally(ctx, e.rdb, key)
			if err != nil || len(tally) != 2 {
				t.Fatalf("the tally: %+v (%v), want the other field and c20's", tally, err)
			}
			for _, f := range tally {
				if f.Field == target && (f.Count != 1 || !f.Keep.Equal(keep)) {
					t.Errorf("c20's count: %+v, want 1 kept until %v", f, keep)
				}
			}
		})
	}
}

// spilledUser sends user's first sends of 17 campaigns under a lifetime cap
// of one per campaign kept 400 days (oncePerCampaign), past spillAt: the
// user's tally moves to the tally key. It returns the user's log key, the
// keep, the cap and the send.
func spilledUser(t *testing.T, e *env, user uint32) (key string, keep time.Time, once func(string) capping.Cap, send func(string) capping.Request) {
	t.Helper()
	key, keep = e.lim.Key(0, user), e.clock.Now().Add(400*24*time.Hour)
	once, send = oncePerCampaign(user, keep)
	for i := range 17 {
		if d := e.decide(t, send(fmt.Sprintf("c%d", i)))[0]; !d.Allowed {
			t.Fatalf("campaign c%d's first send: %+v", i, d)
		}
	}
	if n := e.rdb.Exists(context.Background(), key+":t").Val(); n != 1 {
		t.Fatalf("no tally key after 17 campaigns")
	}
	return key, keep, once, send
}

// TestTallyKeyTTL: a spilled user's tally key outlives its items' keeps. Its
// TTL is set with the log's spill item, when a send's keep passes that
// item's, not by every send; a tally key gone (deleted here, as when its
// items lapsed) comes back with a TTL. The spill item's keep rises with them:
// past the first keep, the log still says its tally is in the key.
func TestTallyKeyTTL(t *testing.T) {
	for _, mode := range limiterModes {
		t.Run(mode.name, func(t *testing.T) {
			e := newEnv(t, mode.opt)
			ctx := context.Background()
			const user = 63
			key, keep, _, send := spilledUser(t, e, user)
			covers := func(what string, keep time.Time) {
				t.Helper()
				if ttl, left := e.rdb.PTTL(ctx, key+":t").Val(), keep.Sub(e.clock.Now()); ttl < left || ttl > left+5*time.Hour {
					t.Errorf("%s: the tally key expires in %v, want its keep, %v, and 5 hours at most", what, ttl, left)
				}
			}
			covers("spilled", keep)
			if err := e.rdb.Del(ctx, key+":t").Err(); err != nil {
				t.Fatal(err)
			}
			if d := e.decide(t, send("c20"))[0]; !d.Allowed || d.Counts[0] != 0 {
				t.Fatalf("a new campaign with the tally key gone: %+v", d)
			}
			covers("written again", keep)
			for i, later := range []time.Duration{time.Minute, 30 * 24 * time.Hour} {
				_, sendLater := oncePerCampaign(user, keep.Add(later))
				if d := e.decide(t, sendLater(fmt.Sprint("c", 21+i)))[0]; !d.Allowed {
					t.Fatalf("a send kept %v later: %+v", later, d)
				}
				covers(fmt.Sprintf("a keep %v later", later), keep.Add(later))
			}
			// A day past the first keep, the log's spill item (raised with the later keeps) still says the
			// tally is in the key: the campaign sent with the latest keep is counted, and capped.
			e.clock.Add(keep.Sub(e.clock.Now()) + 24*time.Hour)
			_, sendLater := oncePerCampaign(user, keep.Add(30*24*time.Hour))
			if d := e.decide(t, sendLater("c22"))[0]; d.Allowed || d.Cap != "once" || d.Counts[0] != 1 {
				t.Fatalf("campaign c22 again, past the first keep: %+v, want capped by once at a count of 1", d)
			}
		})
	}
}
