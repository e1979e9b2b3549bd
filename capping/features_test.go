package capping_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestReservedSlotsInTheScript: a cap whose last slot is reserved, as rules
// hand it to a send below the reservation's priority (Limit less the slot,
// Reserved the slot) and to one at or above it (the whole limit), on a fixed
// clock: two low sends pass, the third is capped by the reservation (with
// the retry-at of the smaller limit), a high send takes the reserved slot,
// and after it the cap is full for everyone. Calendar and shadow caps alike.
func TestReservedSlotsInTheScript(t *testing.T) {
	e := newEnv(t)
	low := func(c capping.Cap, slots int) capping.Cap { c.Limit -= slots; c.Reserved = slots; return c }
	daily := capping.Cap{Name: "daily", Window: capping.Daily, Limit: 3}
	h := time.Hour
	steps := []struct {
		at       time.Duration
		cap      capping.Cap
		allowed  bool
		reserved bool
		retry    time.Duration
	}{
		{0, low(daily, 1), true, false, 0},
		{h, low(daily, 1), true, false, 0},                       // count 1: below limit - slots
		{2 * h, low(daily, 1), false, true, 24 * h},              // count 2 = limit - slots: capped by the reservation
		{3 * h, daily, true, false, 0},                           // priority: the reserved slot
		{4 * h, daily, false, false, 24 * h},                     // full for everyone
		{5 * h, low(daily, 1), false, false, 25 * h},             // full: not the reservation's doing
		{24*h + time.Minute, low(daily, 1), false, true, 25 * h}, // one aged out: 2 left in the window, limit - slots
		{25*h + time.Minute, low(daily, 1), true, false, 0},      // two aged out
	}
	for i, s := range steps {
		e.clock.Set(base.Add(s.at))
		d := e.decide(t, job(21, "email", s.cap))[0]
		var retry time.Duration
		if !d.RetryAt.IsZero() {
			retry = d.RetryAt.Sub(base)
		}
		if d.Allowed != s.allowed || d.Reserved != s.reserved || retry != s.retry {
			t.Errorf("step %d at +%v (limit %d, reserved %d): allowed %v reserved %v retry +%v; want %v %v +%v",
				i, s.at, s.cap.Limit, s.cap.Reserved, d.Allowed, d.Reserved, retry, s.allowed, s.reserved, s.retry)
		}
	}

	// A calendar day with 2 slots, 1 reserved: the second low send waits
	// for the next period, the high one goes.
	e.clock.Set(base)
	today := capping.Cap{Name: "today", Since: base.Truncate(24 * h), Until: base.Truncate(24 * h).Add(24 * h), Limit: 2}
	if d := e.decide(t, job(22, "email", low(today, 1)))[0]; !d.Allowed {
		t.Errorf("first low send of the day: %+v", d)
	}
	if d := e.decide(t, job(22, "email", low(today, 1)))[0]; d.Allowed || !d.Reserved || !d.RetryAt.Equal(today.Until) {
		t.Errorf("second low send of the day: %+v, want capped by the reservation until %v", d, today.Until)
	}
	if d := e.decide(t, job(22, "email", today))[0]; !d.Allowed {
		t.Errorf("high send after it: %+v, want allowed", d)
	}

	// A shadow cap with a reservation reports what it would have done to a
	// low send, and blocks nothing.
	shadow := capping.Cap{Name: "shadow", Window: h, Limit: 2, Shadow: true}
	e.decide(t, job(23, "email", daily, shadow))
	if d := e.decide(t, job(23, "email", daily, low(shadow, 1)))[0]; !d.Allowed || len(d.Shadow) != 1 || d.Shadow[0] != "shadow" {
		t.Errorf("low send at a shadow cap's reserved slot: %+v, want allowed, reported by the shadow cap", d)
	}
}

// TestArbitration: a daily cap of 2 whose last slot is arbitrated in windows
// of 2 minutes, on a fixed clock. A send that does not need the last slot
// goes at once; the sends that need it become candidates of one window; at
// its end the highest priority wins whichever comes back first (ties: the
// earliest), a redelivered candidate keeps its window, a look writes nothing,
// and a candidate that never comes back does not hold the slot.
func TestArbitration(t *testing.T) {
	e := newEnv(t)
	daily := capping.Cap{Name: "daily", Window: capping.Daily, Limit: 2, Arbitrated: true}
	win := 2 * time.Minute
	send := func(user uint32, id string, priority int, candidate bool) capping.Decision {
		t.Helper()
		return e.decide(t, capping.Request{UserID: user, JobID: id, Channel: "push", Caps: []capping.Cap{daily},
			Arbitration: win, Priority: priority, Candidate: candidate})[0]
	}
	type want struct {
		allowed, candidate bool
		retry              time.Duration // from base; 0: none
	}
	check := func(what string, d capping.Decision, w want) {
		t.Helper()
		var retry time.Duration
		if !d.RetryAt.IsZero() {
			retry = d.RetryAt.Sub(base)
		}
		if d.Allowed != w.allowed || d.Candidate != w.candidate || retry != w.retry || (!d.Allowed && d.Cap != "daily") {
			t.Errorf("%s: allowed %v candidate %v retry +%v cap %q; want %v %v +%v", what, d.Allowed, d.Candidate, retry, d.Cap, w.allowed, w.candidate, w.retry)
		}
	}
	for _, highFirst := range []bool{false, true} {
		u := uint32(31)
		if highFirst {
			u = 32
		}
		e.clock.Set(base)
		check("first send", send(u, "first", 0, false), want{allowed: true})
		e.clock.Set(base.Add(10 * time.Second))
		check("low, at the last slot", send(u, "low", 1, false), want{candidate: true, retry: 10*time.Second + win})
		if d, err := e.lim.Peek(context.Background(), capping.Request{UserID: u, JobID: "peek", Channel: "push", Caps: []capping.Cap{daily}, Arbitration: win, Priority: 5}); err != nil || !d.Candidate {
			t.Errorf("a look at the last slot: %+v %v, want a candidate", d, err)
		}
		e.clock.Set(base.Add(40 * time.Second))
		check("high, in the same window", send(u, "high", 9, false), want{candidate: true, retry: 10*time.Second + win})
		e.clock.Set(base.Add(70 * time.Second))
		check("low redelivered", send(u, "low", 1, false), want{candidate: true, retry: 10*time.Second + win})
		e.clock.Set(base.Add(10*time.Second + win + 50*time.Millisecond))
		if highFirst {
			check("high back", send(u, "high", 9, true), want{allowed: true})
			check("low back", send(u, "low", 1, true), want{retry: capping.Daily})
		} else {
			check("low back", send(u, "low", 1, true), want{retry: capping.Daily})
			check("high back", send(u, "high", 9, true), want{allowed: true})
		}
		check("the peek was not registered", send(u, "peek", 5, true), want{retry: capping.Daily})
	}

	// Ties go to the earliest; a candidate that never comes back is forgotten.
	e.clock.Set(base)
	send(33, "first", 0, false)
	check("a", send(33, "a", 5, false), want{candidate: true, retry: win})
	e.clock.Set(base.Add(time.Second))
	check("b", send(33, "b", 5, false), want{candidate: true, retry: win})
	e.clock.Set(base.Add(win))
	check("b back: a was earlier", send(33, "b", 5, true), want{retry: capping.Daily})
	e.clock.Set(base.Add(2*win + time.Minute)) // a never came back; its window and grace are over
	check("c, after a was forgotten", send(33, "c", 1, false), want{candidate: true, retry: 3*win + time.Minute})
	e.clock.Set(base.Add(3*win + time.Minute))
	check("c back", send(33, "c", 1, true), want{allowed: true})

	// Ties in one millisecond go to the order of registration (a user's jobs
	// come in input order), not to the job ids' digests: here the second's
	// digest is the smaller, and the first still wins.
	first, second := "tie-0", ""
	for i := 1; second == ""; i++ {
		if id := fmt.Sprint("tie-", i); capping.Member(id, "push", "", nil) < capping.Member(first, "push", "", nil) {
			second = id
		}
	}
	e.clock.Set(base)
	send(34, "first", 0, false)
	ds := e.decide(t,
		capping.Request{UserID: 34, JobID: first, Channel: "push", Caps: []capping.Cap{daily}, Arbitration: win, Priority: 5},
		capping.Request{UserID: 34, JobID: second, Channel: "push", Caps: []capping.Cap{daily}, Arbitration: win, Priority: 5})
	check("tie, registered first", ds[0], want{candidate: true, retry: win})
	check("tie, registered second", ds[1], want{candidate: true, retry: win})
	e.clock.Set(base.Add(win))
	check("the second back: the first was registered before it", send(34, second, 5, true), want{retry: capping.Daily})
	check("the first back", send(34, first, 5, true), want{allowed: true})
}

// TestExternalSendsAndForget: a send made elsewhere is recorded at its own
// time (before the log's latest entry too), once per id, and counted by the
// caps whose scope it matches from then on; Forget removes a recorded send
// (its slot comes back at once, the near cache's copy too) and finds
// nothing for a job that is not logged.
func TestExternalSendsAndForget(t *testing.T) {
	e := newEnv(t)
	lim, err := capping.New(context.Background(), e.rdb, capping.Config{KeyPrefix: testenv.Unique("t"), Clock: e.clock.Now, NearCache: 100})
	if err != nil {
		t.Fatal(err)
	}
	e.clock.Set(base)
	day := capping.Cap{Name: "daily", Window: capping.Daily, Limit: 2}
	pushDay := capping.Cap{Name: "push", Window: capping.Daily, Limit: 1, Scope: capping.NewScope([]string{"push"}, nil)}
	decide := func(r capping.Request) capping.Decision {
		t.Helper()
		ds, err := lim.Decide(context.Background(), []capping.Request{r})
		if err != nil {
			t.Fatal(err)
		}
		return ds[0]
	}
	if d := decide(capping.Request{UserID: 41, JobID: "own", Channel: "email", Caps: []capping.Cap{day, pushDay}}); !d.Allowed {
		t.Fatalf("own send: %+v", d)
	}
	ext := capping.Request{UserID: 41, JobID: "external:e1", Channel: "push", Retention: capping.Daily, SentAt: base.Add(-time.Hour)}
	for i := range 2 { // the second is a redelivery
		if d := decide(ext); !d.Allowed || d.Duplicate != (i == 1) || !d.Recorded.Equal(base.Add(-time.Hour)) {
			t.Errorf("external send, delivery %d: %+v, want recorded at %v", i+1, d, base.Add(-time.Hour))
		}
	}
	// The log is kept oldest first: the external send went before the own one.
	if log, err := capping.ReadLog(context.Background(), e.rdb, lim.Key(0, 41)); err != nil || len(log) != 2 ||
		log[0].At != base.Add(-time.Hour).UnixMilli() || log[1].At != base.UnixMilli() {
		t.Errorf("log after an own send and an earlier external one: %+v, %v, want the external send first", log, err)
	}
	e.clock.Add(time.Minute)
	d := decide(capping.Request{UserID: 41, JobID: "own2", Channel: "push", Caps: []capping.Cap{day, pushDay}})
	if d.Allowed || d.Counts[0] != 2 || d.Counts[1] != 1 || !d.RetryAt.Equal(base.Add(23*time.Hour)) {
		t.Errorf("a push after an own email and an external push: %+v, want capped, counts 2 and 1, retry at the external send + 24h", d)
	}
	if found, err := lim.Forget(context.Background(), 0, 41, "own"); err != nil || !found {
		t.Fatalf("forget own: %v %v", found, err)
	}
	if found, err := lim.Forget(context.Background(), 0, 41, "never"); err != nil || found {
		t.Errorf("forget a job never logged: %v %v, want not found", found, err)
	}
	d = decide(capping.Request{UserID: 41, JobID: "own3", Channel: "email", Caps: []capping.Cap{day, pushDay}})
	if !d.Allowed || d.Counts[0] != 1 {
		t.Errorf("an email after the failed send was given back: %+v, want allowed (1 counted)", d)
	}
}

// TestPreferences: a user's own limit of a channel, an opt-out of a tag and
// a VIP exemption from the rules' caps, read in the same script call, on a
// fixed clock; a request that does not ask for preferences ignores them, and
// a user with preferences is never in the near cache.
func TestPreferences(t *testing.T) {
	e := newEnv(t)
	lim, err := capping.New(context.Background(), e.rdb, capping.Config{KeyPrefix: testenv.Unique("t"), Clock: e.clock.Now, NearCache: 100})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	e.clock.Set(base)
	for _, p := range []capping.Preference{
		{Channel: "email", Limit: 1, Window: capping.Daily},
		{Tag: "promotional", OptOut: true},
		{VIPUntil: base.Add(time.Hour)},
	} {
		if err := lim.SetPreference(ctx, 0, 51, p, false); err != nil {
			t.Fatal(err)
		}
	}
	got, err := lim.Preferences(ctx, 0, 51)
	if err != nil || len(got) != 3 || got[0].Channel != "email" || got[0].Limit != 1 || got[0].Window != capping.Daily ||
		!got[1].OptOut || got[1].Tag != "promotional" || !got[2].VIPUntil.Equal(base.Add(time.Hour)) {
		t.Fatalf("preferences read back: %+v %v", got, err)
	}
	daily1 := capping.Cap{Name: "daily", Window: capping.Daily, Limit: 1}
	send := func(id, channel string, tags []string, prefs bool) capping.Decision {
		t.Helper()
		ds, err := lim.Decide(ctx, []capping.Request{{UserID: 51, JobID: id, Channel: channel, Tags: tags, Caps: []capping.Cap{daily1}, Preferences: prefs}})
		if err != nil {
			t.Fatal(err)
		}
		return ds[0]
	}
	check := func(what string, d capping.Decision, allowed bool, cap string, retry time.Duration) {
		t.Helper()
		var r time.Duration
		if !d.RetryAt.IsZero() {
			r = d.RetryAt.Sub(base)
		}
		if d.Allowed != allowed || d.Cap != cap || r != retry {
			t.Errorf("%s: allowed %v cap %q retry +%v; want %v %q +%v", what, d.Allowed, d.Cap, r, allowed, cap, retry)
		}
	}
	check("an email, VIP", send("e1", "email", []string{"marketing"}, true), true, "", 0)
	e.clock.Add(time.Minute)
	check("a second email: the user's own limit", send("e2", "email", []string{"marketing"}, true), false, "preference:channel:email", capping.Daily)
	check("a push, VIP: past the daily cap of 1", send("p1", "push", []string{"marketing"}, true), true, "", 0)
	check("a promotion: opted out", send("p2", "push", []string{"marketing", "promotional"}, true), false, "preference:tag:promotional", 0)
	if d := send("p1", "push", []string{"marketing"}, true); !d.Duplicate {
		t.Errorf("p1 again: %+v, want a duplicate", d)
	}
	if st := lim.Stats(); st.CacheEntries != 0 {
		t.Errorf("%d copies in the near cache, want none for a user with preferences (a duplicate's reply included)", st.CacheEntries)
	}
	check("another push, VIP", send("p5", "push", []string{"marketing"}, true), true, "", 0)
	// A cap's last slot is not arbitrated for a VIP user: the cap does not apply.
	arbitrated := capping.Cap{Name: "arb", Window: capping.Daily, Limit: 9, Arbitrated: true}
	for n := range 9 {
		ds, err := lim.Decide(ctx, []capping.Request{{UserID: 51, JobID: fmt.Sprint("arb", n), Channel: "push", Tags: []string{"marketing"},
			Caps: []capping.Cap{arbitrated}, Arbitration: time.Minute, Preferences: true}})
		if err != nil {
			t.Fatal(err)
		}
		if d := ds[0]; !d.Allowed || d.Candidate {
			t.Errorf("VIP send %d under an arbitrated cap of 9 (%d counted): allowed %v candidate %v, want allowed outright", n, d.Counts[0], d.Allowed, d.Candidate)
		}
	}
	e.clock.Set(base.Add(2 * time.Hour)) // no longer VIP
	check("a push after the exemption", send("p4", "push", []string{"marketing"}, true), false, "daily", capping.Daily+time.Minute)
	check("the same without preferences", send("p3", "push", []string{"marketing", "promotional"}, false), false, "daily", capping.Daily+time.Minute)
	if err := lim.SetPreference(ctx, 0, 51, capping.Preference{Tag: "promotional"}, true); err != nil {
		t.Fatal(err)
	}
	if got, _ := lim.Preferences(ctx, 0, 51); len(got) != 2 {
		t.Errorf("after clearing the opt-out: %+v", got)
	}
	if err := (capping.Preference{Channel: "sms"}).Validate(); err == nil {
		t.Error("a limit of 0 without opt-out validated")
	}
}

// TestSortedSetLogIsReadAndRewritten: a log an older capper kept as a sorted
// set (score = send time, member; a refused send's mark with minus the
// refusal's time) is decided on as it is, and the first decision that records
// rewrites it as the string decide.lua keeps, every entry and mark kept; a
// capped decision writes nothing; Forget removes a send from either form;
// a string that is not a log fails its request with a clear error.
func TestSortedSetLogIsReadAndRewritten(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	key := e.lim.Key(0, 5)
	old1, old2 := capping.Member("old1", "email", "", nil), capping.Member("old2", "email", "", nil)
	refused := capping.Member("refused1", "email", "", nil)
	mark := string(rune(len(refused))) + refused + "sms-budget"
	if err := e.rdb.ZAdd(ctx, key,
		redis.Z{Score: float64(base.Add(-2 * time.Hour).UnixMilli()), Member: old1},
		redis.Z{Score: float64(base.Add(-time.Hour).UnixMilli()), Member: old2},
		redis.Z{Score: -float64(base.Add(-30 * time.Minute).UnixMilli()), Member: mark}).Err(); err != nil {
		t.Fatal(err)
	}
	d := e.decide(t, job(5, "email", daily3))[0]
	if !d.Allowed || d.Counts[0] != 2 {
		t.Fatalf("a send over a sorted-set log of 2: %+v, want allowed with 2 counted", d)
	}
	if typ := e.rdb.Type(ctx, key).Val(); typ != "string" {
		t.Fatalf("the log is a %s after a recorded send, want a string", typ)
	}
	log, err := capping.ReadLog(ctx, e.rdb, key)
	if err != nil || len(log) != 4 || log[0].Member != mark || log[0].At != -base.Add(-30*time.Minute).UnixMilli() ||
		log[1].Member != old1 || log[2].Member != old2 || log[3].At != base.UnixMilli() {
		t.Fatalf("rewritten log: %+v, %v, want the mark, old1, old2, the new send", log, err)
	}
	ds := e.decide(t, capping.Request{UserID: 5, JobID: "old1", Channel: "email", Caps: []capping.Cap{daily3}},
		capping.Request{UserID: 5, JobID: "refused1", Channel: "email", Caps: []capping.Cap{daily3}})
	if !ds[0].Duplicate || !ds[0].Recorded.Equal(base.Add(-2*time.Hour)) {
		t.Errorf("old1 again: %+v, want a duplicate recorded 2h before", ds[0])
	}
	if ds[1].Allowed || !ds[1].RefusedBefore || ds[1].Cap != "sms-budget" {
		t.Errorf("refused1 again: %+v, want refused before by sms-budget", ds[1])
	}

	// A capped decision leaves a sorted set as it is; Forget removes from it.
	full := e.lim.Key(0, 6)
	for i := range 3 {
		if err := e.rdb.ZAdd(ctx, full, redis.Z{Score: float64(base.Add(-time.Duration(i+1) * time.Minute).UnixMilli()),
			Member: capping.Member(fmt.Sprint("f", i), "email", "", nil)}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if d := e.decide(t, job(6, "email", daily3))[0]; d.Allowed || d.Counts[0] != 3 {
		t.Errorf("a send over a full sorted-set log: %+v, want capped with 3 counted", d)
	}
	if typ := e.rdb.Type(ctx, full).Val(); typ != "zset" {
		t.Errorf("the log is a %s after a capped decision, want the sorted set untouched", typ)
	}
	if found, err := e.lim.Forget(ctx, 0, 6, "f0"); err != nil || !found || testenv.LogLen(t, e.rdb, full) != 2 {
		t.Errorf("forget f0 from a sorted set: %v %v, %d left, want found, 2 left", found, err, testenv.LogLen(t, e.rdb, full))
	}
	if found, err := e.lim.Forget(ctx, 0, 5, "old2"); err != nil || !found || testenv.LogLen(t, e.rdb, key) != 3 {
		t.Errorf("forget old2 from a string log: %v %v, %d left, want found, 3 left", found, err, testenv.LogLen(t, e.rdb, key))
	}

	if err := e.rdb.Set(ctx, e.lim.Key(0, 8), "not a log", time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	_, err = e.lim.Decide(ctx, []capping.Request{job(8, "email", daily3)})
	if err == nil || !strings.Contains(err.Error(), "is not a log capper wrote") {
		t.Errorf("a send over a string that is not a log: %v, want its request failed as not a log", err)
	}
	if _, err := capping.ReadLog(ctx, e.rdb, e.lim.Key(0, 8)); err == nil || !strings.Contains(err.Error(), "truncated at byte 8") {
		t.Errorf("ReadLog of a string that is not a log: %v, want it truncated after its header", err)
	}
}
