package capping_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testclock"
	"github.com/capper-dev/capper/internal/testenv"
)

// capSets are the cap lists a user may get: one per "segment" and rules
// version. They cover rolling and calendar windows, channel, tag and
// per-campaign scopes, shadow caps, a limit of 0, and tally caps (lifetime
// and rolling).
func capSets(day time.Time, campaign string) [][]capping.Cap {
	d := day.Truncate(24 * time.Hour)
	push := capping.NewScope([]string{"push"}, nil)
	promo := capping.NewScope(nil, []string{"promotional"})
	return [][]capping.Cap{
		{ // "active"
			{Name: "hourly", Window: time.Hour, Limit: 2},
			{Name: "daily", Window: capping.Daily, Limit: 3},
			{Name: "push-daily", Window: capping.Daily, Limit: 1, Scope: push},
			{Name: "promo-today", Since: d, Until: d.AddDate(0, 0, 1), Limit: 2, Scope: promo},
			{Name: "campaign", Window: capping.Weekly, Limit: 1, Scope: capping.NewScope([]string{"push", "sms"}, nil).Campaign(campaign)},
			{Name: "shadow", Window: time.Hour, Limit: 1, Shadow: true},
		},
		{ // "dormant"
			{Name: "daily", Window: capping.Daily, Limit: 1},
			{Name: "weekly", Window: capping.Weekly, Limit: 2},
		},
		{ // after a "rules reload": the daily cap is tighter, a new cap blocks sms, tally caps count campaigns and promotions
			{Name: "daily", Window: capping.Daily, Limit: 2},
			{Name: "sms-never", Window: time.Hour, Limit: 0, Scope: capping.NewScope([]string{"sms"}, nil)},
			{Name: "shadow-push", Window: capping.Daily, Limit: 1, Scope: push, Shadow: true},
			{Name: "campaign-twice-ever", Limit: 2, Tally: true, Keep: day.Add(400 * 24 * time.Hour), Scope: capping.Scope{}.Campaign(campaign)},
			{Name: "promo-3-a-week", Window: capping.Weekly, Limit: 3, Tally: true, Keep: day.Add(8 * 24 * time.Hour), Scope: promo},
		},
		{ // "heavy": loose caps, so that logs grow long (past 512 bytes) beside tally caps
			{Name: "hourly-40", Window: time.Hour, Limit: 40},
			{Name: "campaign-6-ever", Limit: 6, Tally: true, Keep: day.Add(400 * 24 * time.Hour), Scope: capping.Scope{}.Campaign(campaign)},
			{Name: "promo-12-a-week", Window: capping.Weekly, Limit: 12, Tally: true, Keep: day.Add(8 * 24 * time.Hour), Scope: promo},
		},
	}
}

// TestNearCacheDecidesAsRedis is the property the near cache stands on: a
// stream of random jobs decided with the cache on and off, against the real
// cluster (two key prefixes, one clock), gives identical decisions: the same
// outcome, cap, retry-at, counts, shadow caps and record time. The stream
// has repeat sends of hot users (several in one batch), redeliveries of
// allowed and capped jobs, count-only sends, clock jumps across windows and
// days, and mid-stream "segment swaps" and "rules reloads" (users change cap
// lists), half of them with the cache invalidated as the daemon does and half
// without: the copies are exact either way within one process. Half the
// sends read the users' preferences, which some users have and which change
// mid-stream (on both prefixes; SetPreference drops the copy, as the
// daemon's preferences-cache group does). Hot users' tally caps count more
// campaigns than a log holds items, so their tallies move to tally keys.
func TestNearCacheDecidesAsRedis(t *testing.T) {
	batches := 400
	if testing.Short() {
		batches = 100
	}
	rng := rand.New(rand.NewPCG(42, 7))
	cs, spilled := decideStream(t, &stream{rng: rng, users: 40, set: make([]int, 41)}, batches)
	if cs.CopyAppends < 5 || cs.NewLogs == 0 {
		t.Fatalf("%d sends were appended to a copy's log, %d were new logs: the stream does not exercise them", cs.CopyAppends, cs.NewLogs)
	}
	if spilled == 0 && !testing.Short() { // the short stream's users count fewer campaigns
		t.Errorf("no user's tally moved to a tally key: the stream does not exercise it")
	}
}

// TestNearCacheDecidesAsRedisPastTheSpill is TestNearCacheDecidesAsRedis for
// users past the spill: each sends many campaigns under tally caps, reads no
// preferences and is refused nowhere else (a mark keeps a log's copy from
// being whole), so that most of their sends go in mode 7 (the copy decides
// the other caps, the script the tally caps from the tally key) among
// redeliveries, sends made elsewhere, rules reloads and clock jumps.
func TestNearCacheDecidesAsRedisPastTheSpill(t *testing.T) {
	rng := rand.New(rand.NewPCG(43, 7))
	st := &stream{rng: rng, users: 8, set: make([]int, 9), spill: true}
	for u := range st.set {
		st.set[u] = 2 + rng.IntN(2) // the sets with tally caps
	}
	cs, spilled := decideStream(t, st, 300)
	if cs.SpilledAppends < 70 || spilled < st.users/2 {
		t.Errorf("%d of %d users past the spill, %d sends of theirs decided from a copy in mode 7: the stream does not exercise it",
			spilled, st.users, cs.SpilledAppends)
	}
}

// decideStream decides batches of st's random stream with the near cache on
// and off (the script alone, the reference) and fails the test where they
// differ: a decision, a log or a tally key. It returns the cached Limiter's
// stats and how many users' tallies moved to a tally key.
func decideStream(t *testing.T, st *stream, batches int) (capping.Stats, int) {
	t.Helper()
	rdb := testenv.ClusterClient(t)
	clk := testclock.At(base)
	ctx := context.Background()
	newLim := func(cache int) *capping.Limiter {
		// Without the cache, every decision by the script (the reference): no new logs by SET NX either.
		lim, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: testenv.Unique("nc"), Clock: clk.Now, NearCache: cache, ScriptOnly: cache == 0})
		if err != nil {
			t.Fatal(err)
		}
		return lim
	}
	cached, plain := newLim(1000), newLim(0)
	rng, users, set := st.rng, st.users, st.set
	decisions := 0
	setPref := func(u uint32, p capping.Preference, clear bool) {
		for _, l := range []*capping.Limiter{cached, plain} {
			if err := l.SetPreference(ctx, 0, u, p, clear); err != nil {
				t.Fatal(err)
			}
		}
	}
	prefs := func() []capping.Preference {
		return []capping.Preference{
			{Channel: "sms", Limit: 1, Window: capping.Daily},
			{Tag: "promotional", OptOut: true},
			{VIPUntil: clk.Now().Add(time.Duration(1+rng.IntN(3)) * time.Hour)},
		}
	}
	for u := uint32(5); u <= uint32(users) && !st.spill; u += 5 {
		p := prefs()[rng.IntN(3)]
		if u%10 == 5 {
			p = capping.Preference{Tag: "marketing", OptOut: true} // every send of theirs that reads it is refused
		}
		setPref(u, p, false)
	}
	for b := 0; b < batches; b++ {
		switch r := rng.Float64(); {
		case r < 0.015:
			clk.Add(time.Duration(3*24+rng.IntN(48)) * time.Hour) // days: entries and marks age out of the retention
		case r < 0.045: // a segment swap or a rules reload: some users change cap lists
			for u := 1; u <= users; u++ {
				if rng.Float64() < 0.3 {
					set[u] = rng.IntN(4)
					if st.spill {
						set[u] = 2 + rng.IntN(2)
					}
				}
			}
			if rng.IntN(2) == 0 {
				cached.InvalidateCache()
			}
		case r < 0.065 && !st.spill: // a user sets or clears a preference
			setPref(uint32(1+rng.IntN(users)), prefs()[rng.IntN(3)], rng.IntN(3) == 0)
		case r < 0.135:
			clk.Add(time.Duration(rng.IntN(6*3600)) * time.Second) // hours: windows roll, days change
		default:
			clk.Add(time.Duration(rng.IntN(120_000)) * time.Millisecond)
		}
		now := clk.Now()
		reqs := st.batch(b, now)
		want, err := plain.Decide(ctx, reqs)
		if err != nil {
			t.Fatal(err)
		}
		got, err := cached.Decide(ctx, reqs)
		if err != nil {
			t.Fatal(err)
		}
		for i := range reqs {
			decisions++
			if d := diff(got[i], want[i]); d != "" {
				t.Fatalf("batch %d, request %d (user %d, job %s, %s, caps %d): cache on and off differ: %s",
					b, i, reqs[i].UserID, reqs[i].JobID, reqs[i].Channel, set[reqs[i].UserID], d)
			}
		}
	}
	cs := cached.Stats()
	t.Logf("%d decisions: %d from the cache, %d sent to Redis (%d script calls; %d new logs, %d appended to a copy's log (%d their tally in a tally key), %d copies stale) with it vs %d (%d) without; %d copies, %d bytes",
		decisions, cs.CacheHits, cs.Requests, cs.ScriptCalls, cs.NewLogs, cs.CopyAppends, cs.SpilledAppends, cs.CopyMisses,
		plain.Stats().Requests, plain.Stats().ScriptCalls, cs.CacheEntries, cs.CacheBytes)
	if cs.CacheHits < uint64(decisions)/5 {
		t.Fatalf("%d of %d decisions came from the cache: the stream does not exercise it", cs.CacheHits, decisions)
	}
	// What each path wrote is what the script alone wrote: byte for byte
	// without a tally; with one, the same marks and entries in the same
	// order, the same tally items, and a header (the TTL set) that outlasts
	// them (a patch counts items in place and appends new ones after the
	// entries, and sets a new TTL only when the log's no longer covers them).
	spilled := 0
	for u := uint32(1); u <= uint32(users); u++ {
		a, errA := rdb.Get(ctx, cached.Key(0, u)).Result()
		b, errB := rdb.Get(ctx, plain.Key(0, u)).Result()
		ha, sa, ta := splitLog(a)
		_, sb, tb := splitLog(b)
		same := a == b
		if len(ta)+len(tb) > 0 {
			same = slices.Equal(sa, sb) && slices.Equal(ta, tb) && ha >= maxKeep(ta)
		}
		if !same || (errA == nil) != (errB == nil) {
			t.Errorf("user %d's log: %x (%v) with the cache, %x (%v) by the script alone", u, a, errA, b, errB)
		}
		// A tally key is written by the script alone, on both paths.
		ka, errA := rdb.Get(ctx, cached.Key(0, u)+":t").Result()
		kb, errB := rdb.Get(ctx, plain.Key(0, u)+":t").Result()
		if ka != kb || (errA == nil) != (errB == nil) {
			t.Errorf("user %d's tally key: %x (%v) with the cache, %x (%v) by the script alone", u, ka, errA, kb, errB)
		}
		if errB == nil {
			spilled++
		}
	}
	if cs.Requests+cs.CacheHits != plain.Stats().Requests {
		t.Fatalf("%d requests to Redis + %d cache hits, want the %d requests without the cache", cs.Requests, cs.CacheHits, plain.Stats().Requests)
	}
	return cs, spilled
}

// stream is the random stream of TestNearCacheDecidesAsRedis: its users,
// their cap lists ("segments"), and the sends so far, for redeliveries. With
// spill, its users send many campaigns, read no preferences and are refused
// nowhere else (see TestNearCacheDecidesAsRedisPastTheSpill).
type stream struct {
	rng   *rand.Rand
	users int
	set   []int
	sent  []capping.Request
	spill bool
}

var streamChannels = []string{"email", "push", "sms"}

// batch is the b-th batch of requests at now: redeliveries, hot users'
// several sends, count-only sends, refusals marked elsewhere, sends made
// elsewhere back in time, reserved and arbitrated last slots.
func (s *stream) batch(b int, now time.Time) []capping.Request {
	reqs := make([]capping.Request, 1+s.rng.IntN(12))
	for i := range reqs {
		if len(s.sent) > 0 && s.rng.Float64() < 0.1 {
			reqs[i] = s.sent[s.rng.IntN(len(s.sent))] // a redelivery: same job, its caps as computed now
			reqs[i].Caps = capSets(now, reqs[i].Campaign)[s.set[reqs[i].UserID]]
			continue
		}
		u := uint32(1 + s.rng.IntN(s.users))
		if s.rng.Float64() < 0.6 {
			u = uint32(1 + s.rng.IntN(5)) // hot users: several sends in a batch
		}
		campaign := fmt.Sprint("c", s.rng.IntN(3))
		if (u <= 5 && s.rng.IntN(4) == 0) || s.spill { // one of many: a hot user's tally caps count past a log's few items (spillAt)
			campaign = fmt.Sprint("c", 3+s.rng.IntN(40))
		}
		r := capping.Request{UserID: u, JobID: fmt.Sprintf("j%d-%d", b, i), Channel: streamChannels[s.rng.IntN(3)], Campaign: campaign,
			Tags: []string{"marketing"}, Retention: 8 * 24 * time.Hour, Preferences: s.rng.IntN(2) == 0 && !s.spill}
		if s.rng.IntN(2) == 0 {
			r.Tags = append(r.Tags, "promotional")
		}
		switch f := s.rng.Float64(); {
		case f < 0.05:
			r.Tags[0], r.Preferences = "receipt", false // count-only: recorded without a check
		case f < 0.09 && !s.spill: // refused elsewhere (a budget, quiet hours): a mark in the log, which no copy counts
			r.DuplicateOnly, r.Refused = true, "budget"
			reqs[i] = r
			continue
		case f < 0.12: // sent elsewhere, a while ago: an entry among the log's, not after them
			r.SentAt = now.Add(-time.Duration(s.rng.IntN(3_600_000)) * time.Millisecond)
			reqs[i] = r
			continue
		default:
			r.Caps = capSets(now, campaign)[s.set[u]]
			r.Caps = priced(r.Caps, s.rng.IntN(3), s.rng.IntN(4) == 0)
			if r.Caps[0].Arbitrated {
				r.Arbitration, r.Priority = time.Minute, s.rng.IntN(10)
			}
		}
		reqs[i] = r
		s.sent = append(s.sent, r)
	}
	return reqs
}

// priced is caps as rules hand them to a send of some priority: with kind
// 1 the first cap's last slot is reserved for more important sends (a
// smaller limit), with kind 2 it is not (the whole limit); and arbitrated.
func priced(caps []capping.Cap, kind int, arbitrated bool) []capping.Cap {
	out := slices.Clone(caps)
	if kind == 1 && out[0].Limit > 0 {
		out[0].Limit, out[0].Reserved = out[0].Limit-1, 1
	}
	out[0].Arbitrated = arbitrated
	return out
}

// diff describes how two decisions differ, "" when they do not.
func diff(a, b capping.Decision) string {
	switch {
	case a.Reserved != b.Reserved || a.Candidate != b.Candidate || !slices.Equal(a.Exceeded, b.Exceeded):
		return fmt.Sprintf("reserved %v candidate %v exceeded %v, want %v %v %v", a.Reserved, a.Candidate, a.Exceeded, b.Reserved, b.Candidate, b.Exceeded)
	case a.Allowed != b.Allowed || a.Duplicate != b.Duplicate:
		return fmt.Sprintf("allowed %v duplicate %v, want %v %v", a.Allowed, a.Duplicate, b.Allowed, b.Duplicate)
	case a.Cap != b.Cap || !a.RetryAt.Equal(b.RetryAt):
		return fmt.Sprintf("cap %q retry at %v, want %q %v", a.Cap, a.RetryAt, b.Cap, b.RetryAt)
	case !slices.Equal(a.Counts, b.Counts):
		return fmt.Sprintf("counts %v, want %v", a.Counts, b.Counts)
	case !slices.Equal(a.Shadow, b.Shadow):
		return fmt.Sprintf("shadow %v, want %v", a.Shadow, b.Shadow)
	case !a.Recorded.Equal(b.Recorded) || !a.At.Equal(b.At):
		return fmt.Sprintf("recorded %v at %v, want %v %v", a.Recorded, a.At, b.Recorded, b.At)
	}
	return ""
}

// TestNearCacheCopiesTheLogThatFillsACap: the decision that takes a cap's
// last slot leaves the near cache a copy of the user's log with that send in
// it, and without the marks of refused sends: the user's next send is
// answered capped from the copy, with Redis' count and retry-at. The log has
// a mark first and a send made elsewhere recorded before the user's first
// (written back whole), so the copy is cut from the middle of a log.
func TestNearCacheCopiesTheLogThatFillsACap(t *testing.T) {
	ctx := context.Background()
	clk := testclock.At(base)
	lim, err := capping.New(ctx, testenv.ClusterClient(t), capping.Config{KeyPrefix: testenv.Unique("ncfill"), Clock: clk.Now, NearCache: 100})
	if err != nil {
		t.Fatal(err)
	}
	decide := func(r capping.Request) capping.Decision {
		t.Helper()
		ds, err := lim.Decide(ctx, []capping.Request{r})
		if err != nil {
			t.Fatal(err)
		}
		return ds[0]
	}
	const user = 7
	week := 8 * 24 * time.Hour
	if d := decide(capping.Request{UserID: user, JobID: "refused", Channel: "email", DuplicateOnly: true, Refused: "budget", Retention: week}); d.Duplicate {
		t.Fatalf("the refused send: %+v, want it marked", d)
	}
	first := job(user, "email", daily3)
	if d := decide(first); !d.Allowed {
		t.Fatalf("first send: %+v, want allowed", d)
	}
	earlier := clk.Now().Add(-time.Hour)
	if d := decide(capping.Request{UserID: user, JobID: "elsewhere", Channel: "email", SentAt: earlier, Retention: week}); !d.Allowed {
		t.Fatalf("the send made elsewhere: %+v, want recorded", d)
	}
	clk.Add(time.Minute)
	before := lim.Stats()
	if d := decide(job(user, "email", daily3)); !d.Allowed || d.Counts[0] != 2 {
		t.Fatalf("third send: %+v, want allowed with 2 counted (the last slot)", d)
	}
	if st := lim.Stats(); st.CacheEntries != 1 || st.Requests != before.Requests+1 {
		t.Fatalf("after the last slot: %d copies, %d requests sent, want 1 copy, 1 request", st.CacheEntries, st.Requests-before.Requests)
	}
	clk.Add(time.Minute)
	d := decide(job(user, "email", daily3))
	if st := lim.Stats(); st.CacheHits != before.CacheHits+1 || st.Requests != before.Requests+1 {
		t.Fatalf("the fourth send went to Redis (%d hits, %d requests since): the copy does not hold the send that filled the cap",
			st.CacheHits-before.CacheHits, st.Requests-before.Requests)
	}
	if d.Allowed || d.Cap != "daily" || d.Counts[0] != 3 || !d.RetryAt.Equal(earlier.Add(capping.Daily)) {
		t.Fatalf("the fourth send from the copy: %+v, want capped by daily, 3 counted, until the send made elsewhere leaves the day (%v)",
			d, earlier.Add(capping.Daily))
	}
	// What Redis answers for the same send (the copy dropped): the same.
	lim.InvalidateCache()
	r := job(user, "email", daily3)
	if want := decide(r); want.Allowed || want.Cap != d.Cap || want.Counts[0] != d.Counts[0] || !want.RetryAt.Equal(d.RetryAt) {
		t.Fatalf("Redis: %+v, the copy: %+v", want, d)
	}
}

// splitLog splits a log's value into its header (until when its TTL was
// set), its marks and entries in order, and its tally items sorted.
func splitLog(raw string) (header int64, items, tally []string) {
	if len(raw) < 8 {
		return 0, nil, nil
	}
	header = int64(binary.BigEndian.Uint64([]byte(raw[:8])))
	for p := 8; p < len(raw); {
		_, score, next, ok := capping.NextEntry(raw, p)
		if !ok {
			panic(fmt.Sprintf("a log truncated at byte %d of %d: %x", p, len(raw), raw))
		}
		if score == 0 {
			tally = append(tally, raw[p:next])
		} else {
			items = append(items, raw[p:next])
		}
		p = next
	}
	slices.Sort(tally)
	return header, items, tally
}

// maxKeep is the latest keep of tally items (as splitLog returns them).
func maxKeep(tally []string) int64 {
	k := int64(0)
	for _, t := range tally {
		m, _, _, _ := capping.NextEntry(t, 0)
		k = max(k, int64(binary.BigEndian.Uint64([]byte(m[12:]))))
	}
	return k
}
