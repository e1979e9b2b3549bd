package capping_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testclock"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestNewLogIsTheScriptsLog: a first send to a user with no log, recorded
// with one SET NX, leaves the very bytes and TTL the script writes for the
// same send, and is answered as the script answers it. The near cache keeps
// that log whole: the user's next send is capped from it when a cap is full,
// or, when the copy allows it, recorded by the script's APPEND to the very
// log it holds (mode 4), answered and written as the script alone would.
func TestNewLogIsTheScriptsLog(t *testing.T) {
	ctx := context.Background()
	rdb := testenv.ClusterClient(t)
	clk := testclock.At(base)
	prefix := testenv.Unique("newlog")
	script, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: prefix, Clock: clk.Now, ScriptOnly: true, ClockMargin: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	set, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: prefix, Clock: clk.Now, NearCache: 100, ClockMargin: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	day := base.Truncate(24 * time.Hour)
	calendar := capping.Cap{Name: "today", Since: day, Until: day.Add(24 * time.Hour), Limit: 2}
	shadow0 := capping.Cap{Name: "shadow", Window: time.Hour, Limit: 0, Shadow: true}
	arbitrated2 := capping.Cap{Name: "arb", Window: capping.Daily, Limit: 2, Arbitrated: true}
	const (
		capped   = iota // the next send is capped from the copy
		appended        // the next send is allowed from the copy and appended to it
		decided         // the next send goes to the script in full
	)
	cases := []struct {
		name string
		req  capping.Request
		next int
	}{
		{"rolling caps", capping.Request{Channel: "email", Campaign: "c1", Tags: []string{"promo"}, Caps: []capping.Cap{daily3, weekly5}}, appended},
		{"a scoped cap of 1", capping.Request{Channel: "push", Caps: []capping.Cap{daily3, pushDay1}}, capped},
		{"a calendar cap and a shadow cap of 0", capping.Request{Channel: "sms", Caps: []capping.Cap{calendar, shadow0}}, appended},
		{"an arbitrated cap of 2 (the next send asks for its last slot)", capping.Request{Channel: "email", Caps: []capping.Cap{arbitrated2}, Arbitration: time.Minute, Priority: 5}, decided},
		{"a send made elsewhere", capping.Request{Channel: "inapp", SentAt: base.Add(-time.Hour), Retention: capping.Weekly}, decided},
	}
	same := func(t *testing.T, what string, ua, ub uint32) {
		t.Helper()
		va, err := rdb.Get(ctx, script.Key(0, ua)).Result()
		if err != nil {
			t.Fatal(err)
		}
		vb, err := rdb.Get(ctx, set.Key(0, ub)).Result()
		if err != nil {
			t.Fatal(err)
		}
		if va != vb {
			t.Fatalf("%s: the log's bytes %x, the script's %x", what, vb, va)
		}
		ta, tb := rdb.PTTL(ctx, script.Key(0, ua)).Val(), rdb.PTTL(ctx, set.Key(0, ub)).Val()
		if ta <= 0 || tb <= 0 || tb-ta > time.Second || ta-tb > time.Second {
			t.Fatalf("%s: the log's TTL %v, the script's %v", what, tb, ta)
		}
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			clk.Set(base)
			a, b := c.req, c.req
			a.UserID, a.JobID = uint32(1000+2*i), fmt.Sprintf("j%d", i)
			b.UserID, b.JobID = a.UserID+1, a.JobID
			before := set.Stats()
			want, err := script.Decide(ctx, []capping.Request{a})
			if err != nil {
				t.Fatal(err)
			}
			got, err := set.Decide(ctx, []capping.Request{b})
			if err != nil {
				t.Fatal(err)
			}
			st := set.Stats()
			if st.NewLogs != before.NewLogs+1 || st.ScriptCalls != before.ScriptCalls {
				t.Fatalf("%d new logs, %d script calls, want 1 new log and no call", st.NewLogs-before.NewLogs, st.ScriptCalls-before.ScriptCalls)
			}
			if d := diff(got[0], want[0]); d != "" || !got[0].Allowed {
				t.Fatalf("new log: %s (%+v)", d, got[0])
			}
			same(t, "new log", a.UserID, b.UserID)
			if st.CacheEntries != before.CacheEntries+1 {
				t.Fatalf("%d copies in the near cache after it, want 1 more than %d", st.CacheEntries, before.CacheEntries)
			}
			clk.Add(time.Minute)
			a.JobID, b.JobID = a.JobID+"-next", b.JobID+"-next"
			if !a.SentAt.IsZero() {
				a.SentAt, b.SentAt = clk.Now(), clk.Now()
			}
			want, err = script.Decide(ctx, []capping.Request{a})
			if err != nil {
				t.Fatal(err)
			}
			got, err = set.Decide(ctx, []capping.Request{b})
			if err != nil {
				t.Fatal(err)
			}
			if d := diff(got[0], want[0]); d != "" {
				t.Fatalf("the next send: %s (%+v)", d, got[0])
			}
			st2 := set.Stats()
			hits, appends, calls := st2.CacheHits-st.CacheHits, st2.CopyAppends-st.CopyAppends, st2.ScriptCalls-st.ScriptCalls
			switch {
			case c.next == capped && (hits != 1 || calls != 0 || got[0].Allowed):
				t.Fatalf("the next send: %+v (%d cache hits, %d calls), want capped from the copy", got[0], hits, calls)
			case c.next == appended && (appends != 1 || calls != 1 || !got[0].Allowed):
				t.Fatalf("the next send: %+v (%d appends to the copy's log, %d calls), want allowed and appended", got[0], appends, calls)
			case c.next == decided && (appends != 0 || hits != 0 || calls != 1 || st2.CopyMisses != st.CopyMisses):
				t.Fatalf("the next send: %d cache hits, %d appends, %d calls, want one call deciding in full", hits, appends, calls)
			}
			if c.next != capped {
				same(t, "the next send", a.UserID, b.UserID)
			}
		})
	}
}

// twoWorkers returns two Limiters on one key prefix and clock: mine, with a
// near cache, and another worker's, which decides by the script alone.
func twoWorkers(t *testing.T, rdb *redis.ClusterClient, clk *testclock.Clock, name string) (mine, other *capping.Limiter) {
	t.Helper()
	prefix := testenv.Unique(name)
	mine, err := capping.New(context.Background(), rdb, capping.Config{KeyPrefix: prefix, Clock: clk.Now, NearCache: 100})
	if err != nil {
		t.Fatal(err)
	}
	other, err = capping.New(context.Background(), rdb, capping.Config{KeyPrefix: prefix, Clock: clk.Now, ScriptOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	return mine, other
}

// TestCopyAppendFindsTheLogChanged: a copy gone stale (another worker wrote
// the user's log since) is never appended to: the script finds the log is
// not the copy and decides the send in full, in the same call, against the
// log as it is (here: capped by the other worker's send, which the copy
// does not hold).
func TestCopyAppendFindsTheLogChanged(t *testing.T) {
	ctx, rdb, clk := context.Background(), testenv.ClusterClient(t), testclock.At(base)
	mine, other := twoWorkers(t, rdb, clk, "copystale")
	two := capping.Cap{Name: "two", Window: capping.Daily, Limit: 2}
	send := func(l *capping.Limiter, id string) capping.Decision {
		t.Helper()
		clk.Add(time.Second)
		d, err := l.Decide(ctx, []capping.Request{{UserID: 9, JobID: id, Channel: "email", Caps: []capping.Cap{two}}})
		if err != nil {
			t.Fatal(err)
		}
		return d[0]
	}
	if d := send(mine, "a"); !d.Allowed {
		t.Fatalf("first send: %+v", d)
	}
	if d := send(other, "b"); !d.Allowed || d.Counts[0] != 1 {
		t.Fatalf("the other worker's send: %+v, want allowed, 1 counted", d)
	}
	st := mine.Stats()
	if d := send(mine, "c"); d.Allowed || d.Cap != "two" || d.Counts[0] != 2 {
		t.Fatalf("a send from the stale copy: %+v, want capped with 2 counted (the log, not the copy)", d)
	}
	if st2 := mine.Stats(); st2.CopyMisses != st.CopyMisses+1 || st2.CopyAppends != st.CopyAppends || st2.ScriptCalls != st.ScriptCalls+1 {
		t.Fatalf("%+v: want one call that found the log changed and decided it", st2)
	}
	if n := testenv.LogLen(t, rdb, mine.Key(0, 9)); n != 2 {
		t.Fatalf("%d sends logged, want 2", n)
	}
}

// TestCopyAppendReadsPreferences: a send that reads preferences, of a user
// who has none, is recorded by an APPEND to the copy's log; once the user has
// one (set by another worker: this one's copy is not dropped yet), the script
// finds it and decides in full, so the preference applies.
func TestCopyAppendReadsPreferences(t *testing.T) {
	ctx, rdb, clk := context.Background(), testenv.ClusterClient(t), testclock.At(base)
	mine, other := twoWorkers(t, rdb, clk, "copyprefs")
	three := capping.Cap{Name: "three", Window: capping.Daily, Limit: 3}
	send := func(id string) capping.Decision {
		t.Helper()
		clk.Add(time.Second)
		d, err := mine.Decide(ctx, []capping.Request{{UserID: 9, JobID: id, Channel: "email", Caps: []capping.Cap{three}, Preferences: true}})
		if err != nil {
			t.Fatal(err)
		}
		return d[0]
	}
	if d := send("a"); !d.Allowed {
		t.Fatalf("first send: %+v", d)
	}
	st := mine.Stats()
	if d := send("b"); !d.Allowed || d.Counts[0] != 1 {
		t.Fatalf("second send: %+v, want allowed with 1 counted", d)
	}
	if st2 := mine.Stats(); st2.CopyAppends != st.CopyAppends+1 || st2.CopyMisses != st.CopyMisses {
		t.Fatalf("%+v: want the second send appended to the copy's log", st2)
	}
	if err := other.SetPreference(ctx, 0, 9, capping.Preference{Channel: "email", OptOut: true}, false); err != nil {
		t.Fatal(err)
	}
	st = mine.Stats()
	if d := send("c"); d.Allowed || d.Cap != "preference:channel:email" {
		t.Fatalf("a send after the user opted out of email: %+v, want refused by the preference", d)
	}
	if st2 := mine.Stats(); st2.CopyMisses != st.CopyMisses+1 || st2.CopyAppends != st.CopyAppends {
		t.Fatalf("%+v: want one call that found the preference and decided in full", st2)
	}
	if n := testenv.LogLen(t, rdb, mine.Key(0, 9)); n != 2 {
		t.Fatalf("%d sends logged, want 2", n)
	}
}

// TestCountOnlySendAppendsToTheCopy: a send with no caps (a count-only
// category's) of a user whose whole log the near cache holds is recorded
// with an append to that copy, as any allowed send is; the next send is
// decided from the copy with it counted, and its redelivery is a duplicate.
func TestCountOnlySendAppendsToTheCopy(t *testing.T) {
	ctx, rdb, clk := context.Background(), testenv.ClusterClient(t), testclock.At(base)
	mine, _ := twoWorkers(t, rdb, clk, "countonly")
	two := capping.Cap{Name: "two", Window: capping.Daily, Limit: 2}
	send := func(r capping.Request) capping.Decision {
		t.Helper()
		clk.Add(time.Second)
		d, err := mine.Decide(ctx, []capping.Request{r})
		if err != nil {
			t.Fatal(err)
		}
		return d[0]
	}
	if d := send(capping.Request{UserID: 9, JobID: "a", Channel: "email", Caps: []capping.Cap{two}}); !d.Allowed {
		t.Fatalf("first send: %+v", d)
	}
	receipt := capping.Request{UserID: 9, JobID: "r", Channel: "email", Tags: []string{"receipt"}, Retention: capping.Daily}
	st := mine.Stats()
	if d := send(receipt); !d.Allowed || d.Duplicate {
		t.Fatalf("count-only send: %+v, want allowed", d)
	}
	if st2 := mine.Stats(); st2.CopyAppends != st.CopyAppends+1 || st2.CopyMisses != st.CopyMisses || st2.Requests != st.Requests+1 {
		t.Fatalf("%+v: want the count-only send appended to the copy's log", st2)
	}
	st = mine.Stats()
	if d := send(capping.Request{UserID: 9, JobID: "b", Channel: "email", Caps: []capping.Cap{two}}); d.Allowed || d.Cap != "two" || d.Counts[0] != 2 {
		t.Fatalf("third send: %+v, want capped by two with the count-only send counted", d)
	}
	if st2 := mine.Stats(); st2.CacheHits != st.CacheHits+1 || st2.Requests != st.Requests {
		t.Fatalf("%+v: want the third send capped from the copy", st2)
	}
	if d := send(receipt); !d.Duplicate {
		t.Fatalf("count-only send delivered again: %+v, want its duplicate", d)
	}
	if n := testenv.LogLen(t, rdb, mine.Key(0, 9)); n != 2 {
		t.Fatalf("%d sends logged, want 2", n)
	}
}

// TestNewLogFindsALog: a Limiter that has never seen a user sends its first
// send as a new log; the user has a log (another worker's), so the SET NX
// writes nothing and the script decides, in the same Decide: capped by the
// send already there, a redelivered job a duplicate.
func TestNewLogFindsALog(t *testing.T) {
	ctx := context.Background()
	rdb := testenv.ClusterClient(t)
	clk := testclock.At(base)
	prefix := testenv.Unique("newlogfound")
	limiter := func() *capping.Limiter {
		l, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: prefix, Clock: clk.Now})
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	first := job(7, "push", pushDay1)
	if d, err := limiter().Decide(ctx, []capping.Request{first}); err != nil || !d[0].Allowed {
		t.Fatalf("first send: %+v %v", d, err)
	}
	clk.Add(time.Minute)
	for _, c := range []struct {
		name string
		req  capping.Request
		want func(capping.Decision) bool
	}{
		{"another send", job(7, "push", pushDay1), func(d capping.Decision) bool {
			return !d.Allowed && d.Cap == "push-daily" && d.Counts[0] == 1 && d.RetryAt.Equal(base.Add(capping.Daily))
		}},
		{"the first send again", first, func(d capping.Decision) bool {
			return d.Allowed && d.Duplicate && d.Recorded.Equal(base)
		}},
	} {
		l := limiter()
		d, err := l.Decide(ctx, []capping.Request{c.req})
		if err != nil || !c.want(d[0]) {
			t.Errorf("%s: %+v %v", c.name, d, err)
		}
		if st := l.Stats(); st.NewLogs != 0 || st.NewLogMisses != 1 || st.ScriptCalls != 1 || st.Requests != 1 {
			t.Errorf("%s: %+v, want one new log missed, then one script call", c.name, st)
		}
	}
	if n := testenv.LogLen(t, rdb, limiter().Key(0, 7)); n != 1 {
		t.Fatalf("%d sends logged, want 1", n)
	}
}

// TestNewLogOnlyWhereNothingElseDecides: the requests whose answer could
// differ from "allowed, nothing counted" for a user with no log go to the
// script: a cap of 0, an arbitrated last slot, the user's preferences, a
// refusal's mark, a duplicate check, and a user's second request in a batch
// (which must see the first).
func TestNewLogOnlyWhereNothingElseDecides(t *testing.T) {
	e := newEnv(t)
	never := capping.Cap{Name: "never", Window: time.Hour, Limit: 0}
	arbitrated1 := capping.Cap{Name: "arb", Window: capping.Daily, Limit: 1, Arbitrated: true}
	twice := job(24, "email", daily3)
	reqs := []capping.Request{
		job(20, "email", never),
		{UserID: 21, JobID: "a", Channel: "email", Caps: []capping.Cap{arbitrated1}, Arbitration: time.Minute},
		{UserID: 22, JobID: "r", Channel: "email", DuplicateOnly: true, Refused: "budget", Retention: time.Hour},
		{UserID: 25, JobID: "d", Channel: "email", DuplicateOnly: true},
		twice, job(24, "email", daily3),
	}
	ds := e.decide(t, reqs...)
	switch {
	case ds[0].Allowed || ds[0].Cap != "never":
		t.Errorf("a cap of 0: %+v, want capped", ds[0])
	case !ds[1].Candidate || ds[1].Cap != "arb":
		t.Errorf("an arbitrated last slot: %+v, want a candidate", ds[1])
	case ds[2].Allowed || ds[2].Duplicate:
		t.Errorf("a refusal: %+v, want marked", ds[2])
	case ds[3].Allowed || ds[3].Duplicate:
		t.Errorf("a duplicate check of a job never sent: %+v", ds[3])
	case !ds[4].Allowed || ds[4].Counts[0] != 0 || !ds[5].Allowed || ds[5].Counts[0] != 1:
		t.Errorf("a user's two sends: %+v, %+v, want both allowed, the second counting the first", ds[4], ds[5])
	}
	if st := e.lim.Stats(); st.NewLogs != 0 || st.NewLogMisses != 0 {
		t.Errorf("%+v: want none as a new log", st)
	}
	// User 24's log was written by the script: its next send goes there directly, not by a SET NX that
	// would find the log.
	if d := e.decide(t, job(24, "email", daily3)); !d[0].Allowed || d[0].Counts[0] != 2 {
		t.Errorf("user 24's third send: %+v, want allowed, 2 counted", d[0])
	}
	if st := e.lim.Stats(); st.NewLogMisses != 0 {
		t.Errorf("%d SET NX found a log: the user whose sends the script decided was not remembered", st.NewLogMisses)
	}
	// The mark is in user 22's log: a user with a log, so a send of the
	// refused job is refused again, by the script.
	if d := e.decide(t, capping.Request{UserID: 22, JobID: "r", Channel: "email", Caps: []capping.Cap{daily3}}); !d[0].RefusedBefore {
		t.Errorf("the refused job sent again: %+v, want refused before", d[0])
	}
}

// TestNewLogReadsPreferences: a first send that reads preferences goes as
// the script's mode 5, one call for the batch: the user's new log written as
// the script alone writes it if the user has no preferences, and decided in
// full (refused, here) if the user has one.
func TestNewLogReadsPreferences(t *testing.T) {
	ctx, rdb, clk := context.Background(), testenv.ClusterClient(t), testclock.At(base)
	mine, _ := twoWorkers(t, rdb, clk, "newlogprefs")
	ref, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: testenv.Unique("newlogprefsref"), Clock: clk.Now, ScriptOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range []*capping.Limiter{mine, ref} {
		if err := l.SetPreference(ctx, 0, 23, capping.Preference{Channel: "email", OptOut: true}, false); err != nil {
			t.Fatal(err)
		}
	}
	reqs := []capping.Request{
		{UserID: 30, JobID: "a", Channel: "email", Caps: []capping.Cap{daily3}, Preferences: true},
		{UserID: 23, JobID: "p", Channel: "email", Caps: []capping.Cap{daily3}, Preferences: true},
	}
	st := mine.Stats()
	got, err := mine.Decide(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	want, err := ref.Decide(ctx, reqs)
	if err != nil {
		t.Fatal(err)
	}
	for i := range reqs {
		if d := diff(got[i], want[i]); d != "" {
			t.Errorf("request %d (user %d): %s", i, reqs[i].UserID, d)
		}
	}
	if !got[0].Allowed || got[1].Allowed || got[1].Cap != "preference:channel:email" {
		t.Errorf("decisions %+v, want the first allowed, the opted-out one refused by its preference", got)
	}
	if st2 := mine.Stats(); st2.NewLogs != st.NewLogs+1 || st2.NewLogMisses != st.NewLogMisses+1 || st2.ScriptCalls != st.ScriptCalls+1 {
		t.Errorf("%+v: want one new log and one that found a preference, in one script call", st2)
	}
	for _, u := range []uint32{30, 23} {
		a, errA := rdb.Get(ctx, mine.Key(0, u)).Result()
		b, errB := rdb.Get(ctx, ref.Key(0, u)).Result()
		if a != b || (errA == nil) != (errB == nil) {
			t.Errorf("user %d's log: %x (%v), by the script alone %x (%v)", u, a, errA, b, errB)
		}
		// Written moments apart in Redis's time: the same TTL within a minute (a TTL in the wrong unit is hours off).
		if pa, pb := rdb.PTTL(ctx, mine.Key(0, u)).Val(), rdb.PTTL(ctx, ref.Key(0, u)).Val(); (pa - pb).Abs() > time.Minute {
			t.Errorf("user %d's log expires in %v, by the script alone in %v", u, pa, pb)
		}
	}
}

// TestNewLogsRacing: workers that have never seen the users (each its own
// Limiter) decide their first sends at once, as SET NX; a cap of 1 lets
// exactly one send of each user through, and a job redelivered to every
// worker at once is recorded once and allowed everywhere.
func TestNewLogsRacing(t *testing.T) {
	ctx := context.Background()
	rdb := testenv.ClusterClient(t)
	prefix := testenv.Unique("newlograce")
	const workers, users = 6, 200
	lims := limiters(t, rdb, workers, capping.Config{KeyPrefix: prefix})
	one := capping.Cap{Name: "one", Window: capping.Daily, Limit: 1}
	for _, redelivered := range []bool{false, true} {
		allowed, dups := make([]int, users), make([]int, users)
		var mu sync.Mutex
		var wg sync.WaitGroup
		for w, l := range lims {
			wg.Add(1)
			go func() {
				defer wg.Done()
				reqs := make([]capping.Request, users)
				for u := range reqs {
					id := fmt.Sprintf("w%d-u%d", w, u)
					if redelivered {
						id = fmt.Sprintf("same-u%d", u)
					}
					reqs[u] = capping.Request{UserID: uint32(u + 1000*btoi(redelivered)), JobID: id, Channel: "email", Caps: []capping.Cap{one}}
				}
				ds, err := l.Decide(ctx, reqs)
				if err != nil {
					t.Errorf("worker %d: %v", w, err)
					return
				}
				mu.Lock()
				defer mu.Unlock()
				for u, d := range ds {
					if d.Allowed {
						allowed[u]++
					}
					if d.Duplicate {
						dups[u]++
					}
				}
			}()
		}
		wg.Wait()
		for u := range users {
			want, wantDups := 1, 0
			if redelivered {
				want, wantDups = workers, workers-1
			}
			if allowed[u] != want || dups[u] != wantDups {
				t.Errorf("redelivered %v, user %d: %d allowed (%d duplicates), want %d (%d)", redelivered, u, allowed[u], dups[u], want, wantDups)
			}
			if n := testenv.LogLen(t, rdb, lims[0].Key(0, uint32(u+1000*btoi(redelivered)))); n != 1 {
				t.Errorf("redelivered %v, user %d: %d sends logged, want 1", redelivered, u, n)
			}
		}
	}
	var sets, misses uint64
	for _, l := range lims {
		sets, misses = sets+l.Stats().NewLogs, misses+l.Stats().NewLogMisses
	}
	if sets != 2*users || misses != 2*users*(workers-1) {
		t.Errorf("%d new logs, %d missed, want %d and %d: every first send went as a new log", sets, misses, 2*users, 2*users*(workers-1))
	}
}

// limiters returns n Limiters of cfg on rdb: n workers, each with its own
// new-log filter and near cache.
func limiters(t *testing.T, rdb *redis.ClusterClient, n int, cfg capping.Config) []*capping.Limiter {
	t.Helper()
	lims := make([]*capping.Limiter, n)
	for w := range lims {
		l, err := capping.New(context.Background(), rdb, cfg)
		if err != nil {
			t.Fatal(err)
		}
		lims[w] = l
	}
	return lims
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestCopiesRacing: workers with near caches send to users each owns (as a
// partition's), while now and then another sends to the same user at once, a
// new job or a redelivery of the owner's last: the owner's copy goes stale
// under it. No user gets more than the cap, every allowed job is logged
// once, and a redelivered job is answered a duplicate wherever it lands.
func TestCopiesRacing(t *testing.T) {
	ctx := context.Background()
	rdb := testenv.ClusterClient(t)
	prefix := testenv.Unique("copyrace")
	const workers, users, rounds, limit = 4, 60, 8, 3
	three := capping.Cap{Name: "three", Window: capping.Daily, Limit: limit}
	lims := limiters(t, rdb, workers, capping.Config{KeyPrefix: prefix, NearCache: 1000})
	var mu sync.Mutex
	allowedJobs := map[string]bool{} // jobs answered allowed, anywhere
	perUser := make([]map[string]bool, users)
	for u := range perUser {
		perUser[u] = map[string]bool{}
	}
	for r := range rounds {
		var wg sync.WaitGroup
		for w, l := range lims {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var reqs []capping.Request
				for u := range users {
					owner := u % workers
					switch {
					case owner == w:
						reqs = append(reqs, capping.Request{UserID: uint32(u), JobID: fmt.Sprintf("r%d-u%d", r, u), Channel: "email", Caps: []capping.Cap{three}})
					case (u+r)%4 == 0 && (owner+1)%workers == w: // another worker sends to the user meanwhile
						id := fmt.Sprintf("r%d-u%d-other", r, u)
						if r%2 == 1 {
							id = fmt.Sprintf("r%d-u%d", r-1, u) // the owner's job of the last round, redelivered here
						}
						reqs = append(reqs, capping.Request{UserID: uint32(u), JobID: id, Channel: "email", Caps: []capping.Cap{three}})
					}
				}
				ds, err := l.Decide(ctx, reqs)
				if err != nil {
					t.Errorf("worker %d: %v", w, err)
					return
				}
				mu.Lock()
				defer mu.Unlock()
				for k, d := range ds {
					u := reqs[k].UserID
					if d.Allowed {
						allowedJobs[reqs[k].JobID] = true
						perUser[u][reqs[k].JobID] = true
					} else if allowedJobs[reqs[k].JobID] {
						t.Errorf("job %s: allowed before, now %+v", reqs[k].JobID, d)
					}
				}
			}()
		}
		wg.Wait()
	}
	for u := range users {
		if n, logged := len(perUser[u]), testenv.LogLen(t, rdb, lims[0].Key(0, uint32(u))); n != limit || logged != limit {
			t.Errorf("user %d: %d jobs allowed, %d logged, want exactly %d", u, n, logged, limit)
		}
	}
	var appends, stale uint64
	for _, l := range lims {
		appends, stale = appends+l.Stats().CopyAppends, stale+l.Stats().CopyMisses
	}
	t.Logf("%d sends appended to a copy's log, %d copies found stale", appends, stale)
	if appends == 0 || stale == 0 {
		t.Errorf("%d appends, %d stale copies: the race does not exercise the copies", appends, stale)
	}
}
