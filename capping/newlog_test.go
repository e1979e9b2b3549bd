package capping_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestNewLogIsTheScriptsLog: a first send to a user with no log, recorded
// with one SET NX, leaves the very bytes and TTL the script writes for the
// same send, and is answered as the script answers it; a cap it fills leaves
// the near cache the copy the script would return.
func TestNewLogIsTheScriptsLog(t *testing.T) {
	ctx := context.Background()
	rdb := testenv.ClusterClient(t)
	clk := &clock{t: base}
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
	cases := []struct {
		name string
		req  capping.Request
		full bool // a cap is full after it: its user's next send is capped from the near cache
	}{
		{"rolling caps", capping.Request{Channel: "email", Campaign: "c1", Tags: []string{"promo"}, Caps: []capping.Cap{daily3, weekly5}}, false},
		{"a scoped cap of 1", capping.Request{Channel: "push", Caps: []capping.Cap{daily3, pushDay1}}, true},
		{"a calendar cap and a shadow cap of 0", capping.Request{Channel: "sms", Caps: []capping.Cap{calendar, shadow0}}, false},
		{"an arbitrated cap of 2", capping.Request{Channel: "email", Caps: []capping.Cap{arbitrated2}, Arbitration: time.Minute, Priority: 5}, false},
		{"a send made elsewhere", capping.Request{Channel: "inapp", SentAt: base.Add(-time.Hour), Retention: capping.Weekly}, false},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
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
			va, err := rdb.Get(ctx, script.Key(a.UserID)).Result()
			if err != nil {
				t.Fatal(err)
			}
			vb, err := rdb.Get(ctx, set.Key(b.UserID)).Result()
			if err != nil {
				t.Fatal(err)
			}
			if va != vb {
				t.Fatalf("the new log's bytes %x, the script's %x", vb, va)
			}
			ta, tb := rdb.PTTL(ctx, script.Key(a.UserID)).Val(), rdb.PTTL(ctx, set.Key(b.UserID)).Val()
			if ta <= 0 || tb <= 0 || tb-ta > time.Second || ta-tb > time.Second {
				t.Fatalf("the new log's TTL %v, the script's %v", tb, ta)
			}
			if st.CacheEntries != before.CacheEntries+map[bool]int{true: 1}[c.full] {
				t.Fatalf("%d copies in the near cache after it, want %d more than %d", st.CacheEntries, map[bool]int{true: 1}[c.full], before.CacheEntries)
			}
			if !c.full {
				return
			}
			next := b
			next.JobID += "-next"
			d, err := set.Decide(ctx, []capping.Request{next})
			if err != nil {
				t.Fatal(err)
			}
			if st2 := set.Stats(); st2.CacheHits != st.CacheHits+1 || d[0].Allowed || d[0].Counts[1] != 1 {
				t.Fatalf("the next send: %+v (%d cache hits), want capped from the copy", d[0], st2.CacheHits-st.CacheHits)
			}
		})
	}
}

// TestNewLogFindsALog: a Limiter that has never seen a user sends its first
// send as a new log; the user has a log (another worker's), so the SET NX
// writes nothing and the script decides, in the same Decide: capped by the
// send already there, a redelivered job a duplicate.
func TestNewLogFindsALog(t *testing.T) {
	ctx := context.Background()
	rdb := testenv.ClusterClient(t)
	clk := &clock{t: base}
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
	if n := testenv.LogLen(t, rdb, limiter().Key(7)); n != 1 {
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
	ctx := context.Background()
	if err := e.lim.SetPreference(ctx, 23, capping.Preference{Channel: "email", OptOut: true}, false); err != nil {
		t.Fatal(err)
	}
	never := capping.Cap{Name: "never", Window: time.Hour, Limit: 0}
	arbitrated1 := capping.Cap{Name: "arb", Window: capping.Daily, Limit: 1, Arbitrated: true}
	twice := job(24, "email", daily3)
	reqs := []capping.Request{
		job(20, "email", never),
		{UserID: 21, JobID: "a", Channel: "email", Caps: []capping.Cap{arbitrated1}, Arbitration: time.Minute},
		{UserID: 22, JobID: "r", Channel: "email", DuplicateOnly: true, Refused: "budget", Retention: time.Hour},
		{UserID: 23, JobID: "p", Channel: "email", Caps: []capping.Cap{daily3}, Preferences: true},
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
	case ds[3].Allowed || ds[3].Cap != "preference:channel:email":
		t.Errorf("an opted-out channel: %+v, want capped by the preference", ds[3])
	case ds[4].Allowed || ds[4].Duplicate:
		t.Errorf("a duplicate check of a job never sent: %+v", ds[4])
	case !ds[5].Allowed || ds[5].Counts[0] != 0 || !ds[6].Allowed || ds[6].Counts[0] != 1:
		t.Errorf("a user's two sends: %+v, %+v, want both allowed, the second counting the first", ds[5], ds[6])
	}
	if st := e.lim.Stats(); st.NewLogs != 0 || st.NewLogMisses != 0 {
		t.Errorf("%+v: want none as a new log", st)
	}
	// The mark is in user 22's log: a user with a log, so a send of the
	// refused job is refused again, by the script.
	if d := e.decide(t, capping.Request{UserID: 22, JobID: "r", Channel: "email", Caps: []capping.Cap{daily3}}); !d[0].RefusedBefore {
		t.Errorf("the refused job sent again: %+v, want refused before", d[0])
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
	lims := make([]*capping.Limiter, workers)
	for w := range lims {
		l, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		lims[w] = l
	}
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
			if n := testenv.LogLen(t, rdb, lims[0].Key(uint32(u+1000*btoi(redelivered)))); n != 1 {
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

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}
