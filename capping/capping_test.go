package capping_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testclock"
	"github.com/capper-dev/capper/internal/testenv"
)

// base is a Monday 10:00 UTC; the steps below cross day and week boundaries.
var base = time.Date(2026, 11, 16, 10, 0, 0, 0, time.UTC)

type env struct {
	rdb   *redis.ClusterClient
	lim   *capping.Limiter
	clock *testclock.Clock
}

// newEnv returns a Limiter on the test cluster with its own key prefix, on a
// clock set at base; opts change its Config.
func newEnv(t *testing.T, opts ...func(*capping.Config)) *env {
	t.Helper()
	rdb := testenv.ClusterClient(t)
	clk := testclock.At(base)
	cfg := capping.Config{KeyPrefix: testenv.Unique("t"), Clock: clk.Now}
	for _, o := range opts {
		o(&cfg)
	}
	lim, err := capping.New(context.Background(), rdb, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &env{rdb: rdb, lim: lim, clock: clk}
}

func (e *env) decide(t *testing.T, reqs ...capping.Request) []capping.Decision {
	t.Helper()
	ds, err := e.lim.Decide(context.Background(), reqs)
	if err != nil {
		t.Fatalf("decide: %v", err)
	}
	return ds
}

var jobSeq int

func job(user uint32, channel string, caps ...capping.Cap) capping.Request {
	jobSeq++
	return capping.Request{UserID: user, JobID: fmt.Sprintf("job-%d", jobSeq), Channel: channel, Caps: caps}
}

var (
	daily3   = capping.Cap{Name: "daily", Window: capping.Daily, Limit: 3}
	weekly5  = capping.Cap{Name: "weekly", Window: capping.Weekly, Limit: 5}
	pushDay1 = capping.Cap{Name: "push-daily", Window: capping.Daily, Limit: 1, Scope: capping.NewScope([]string{"push"}, nil)}
)

// step is one send at an offset from base.
type step struct {
	at      time.Duration
	channel string
	caps    []capping.Cap
	allowed bool
	cap     int           // expected cap index when capped (Decision.Cap names it)
	retry   time.Duration // expected RetryAt - base when capped; -1 for "never" (zero time)
}

func TestDecideWindows(t *testing.T) {
	h := time.Hour
	d := 24 * time.Hour
	std := []capping.Cap{daily3, weekly5}
	tests := []struct {
		name  string
		steps []step
	}{
		{"daily cap and its exact boundary", []step{
			{at: 0, caps: std, allowed: true},
			{at: 1 * h, caps: std, allowed: true},
			{at: 2 * h, caps: std, allowed: true},
			{at: 3 * h, caps: std, cap: 0, retry: 24 * h},
			{at: 24*h - time.Millisecond, caps: std, cap: 0, retry: 24 * h},
			{at: 24 * h, caps: std, allowed: true}, // the first send leaves the window exactly now
			{at: 24*h + 1, caps: std, cap: 0, retry: 25 * h},
		}},
		{"weekly cap across day rollovers and the week boundary", []step{
			{at: 0, caps: std, allowed: true},
			{at: 1 * d, caps: std, allowed: true},
			{at: 2 * d, caps: std, allowed: true},
			{at: 3 * d, caps: std, allowed: true},
			{at: 4 * d, caps: std, allowed: true},
			{at: 5 * d, caps: std, cap: 1, retry: 7 * d},
			{at: 7*d - 1, caps: std, cap: 1, retry: 7 * d},
			{at: 7 * d, caps: std, allowed: true},
			{at: 7*d + h, caps: std, cap: 1, retry: 8 * d},
		}},
		{"several caps exceeded: retry when all pass", []step{
			{at: 0, caps: []capping.Cap{{Window: d, Limit: 2}, {Window: 2 * d, Limit: 2}}, allowed: true},
			{at: h, caps: []capping.Cap{{Window: d, Limit: 2}, {Window: 2 * d, Limit: 2}}, allowed: true},
			{at: 2 * h, caps: []capping.Cap{{Window: d, Limit: 2}, {Window: 2 * d, Limit: 2}}, cap: 1, retry: 2 * d},
		}},
		{"channel cap counts its channel, the all-channel cap counts all", []step{
			{at: 0, channel: "push", caps: []capping.Cap{daily3, pushDay1}, allowed: true},
			{at: h, channel: "push", caps: []capping.Cap{daily3, pushDay1}, cap: 1, retry: 24 * h},
			{at: 2 * h, channel: "email", caps: []capping.Cap{daily3, pushDay1}, allowed: true},
			{at: 3 * h, channel: "email", caps: []capping.Cap{daily3, pushDay1}, allowed: true},
			{at: 4 * h, channel: "email", caps: []capping.Cap{daily3, pushDay1}, cap: 0, retry: 24 * h},
			{at: 24 * h, channel: "push", caps: []capping.Cap{daily3, pushDay1}, allowed: true},
		}},
		{"limit changes between calls keep the history", []step{
			{at: 0, caps: []capping.Cap{{Window: d, Limit: 2}}, allowed: true},
			{at: h, caps: []capping.Cap{{Window: d, Limit: 2}}, allowed: true},
			{at: 2 * h, caps: []capping.Cap{{Window: d, Limit: 2}}, cap: 0, retry: 24 * h},
			{at: 3 * h, caps: []capping.Cap{{Window: d, Limit: 3}}, allowed: true},         // raised
			{at: 4 * h, caps: []capping.Cap{{Window: d, Limit: 1}}, cap: 0, retry: 27 * h}, // lowered: 3 logged, 3 must leave
			{at: 5 * h, caps: []capping.Cap{{Window: d, Limit: 0}}, cap: 0, retry: -1},     // blocked for good
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEnv(t)
			const user = 42
			for i, s := range tt.steps {
				e.clock.Set(base.Add(s.at))
				ch := s.channel
				if ch == "" {
					ch = "email"
				}
				got := e.decide(t, job(user, ch, s.caps...))[0]
				if got.Allowed != s.allowed {
					t.Fatalf("step %d (+%v %s): allowed = %v, want %v (counts %v)", i, s.at, ch, got.Allowed, s.allowed, got.Counts)
				}
				if s.allowed {
					if got.Cap != "" || !got.RetryAt.IsZero() {
						t.Fatalf("step %d: allowed decision with cap %q retry %v", i, got.Cap, got.RetryAt)
					}
					continue
				}
				want := s.caps[s.cap].Name
				if want == "" {
					want = fmt.Sprint("cap", s.cap)
				}
				if got.Cap != want {
					t.Errorf("step %d (+%v): cap = %q, want %q", i, s.at, got.Cap, want)
				}
				if s.retry < 0 {
					if !got.RetryAt.IsZero() {
						t.Errorf("step %d: retry at %v, want never (zero)", i, got.RetryAt)
					}
				} else if want := base.Add(s.retry); !got.RetryAt.Equal(want) {
					t.Errorf("step %d (+%v): retry at +%v, want +%v", i, s.at, got.RetryAt.Sub(base), s.retry)
				}
			}
		})
	}
}

func TestSameMillisecondSendsAreBothCounted(t *testing.T) {
	e := newEnv(t)
	caps := []capping.Cap{{Window: capping.Daily, Limit: 10}}
	ds := e.decide(t, job(7, "email", caps...), job(7, "email", caps...))
	ds = append(ds, e.decide(t, job(7, "email", caps...))...)
	for i, d := range ds {
		if !d.Allowed || d.Duplicate {
			t.Fatalf("decision %d = %+v, want allowed", i, d)
		}
		if d.Counts[0] != i {
			t.Errorf("decision %d counted %d earlier sends, want %d", i, d.Counts[0], i)
		}
	}
	if n := testenv.LogLen(t, e.rdb, e.lim.Key(0, 7)); n != 3 {
		t.Fatalf("log holds %d entries after 3 sends in one millisecond, want 3", n)
	}
}

func TestRedeliveredJobIsNotCountedTwice(t *testing.T) {
	e := newEnv(t)
	caps := []capping.Cap{{Window: capping.Daily, Limit: 2}}
	first := job(9, "push", caps...)
	d := e.decide(t, first, first) // in one batch
	if !d[0].Allowed || d[0].Duplicate || !d[1].Allowed || !d[1].Duplicate {
		t.Fatalf("same job twice in a batch: %+v, want allowed then allowed duplicate", d)
	}
	e.clock.Add(time.Hour)
	if d := e.decide(t, job(9, "push", caps...))[0]; !d.Allowed {
		t.Fatalf("second distinct job: %+v, want allowed", d)
	}
	e.clock.Add(time.Hour)
	// The user is now at the cap; the redelivered first job still gets its original answer.
	if d := e.decide(t, first)[0]; !d.Allowed || !d.Duplicate {
		t.Fatalf("redelivery at the cap: %+v, want allowed duplicate", d)
	}
	if d := e.decide(t, job(9, "push", caps...))[0]; d.Allowed {
		t.Fatalf("third distinct job: %+v, want capped", d)
	}
	if n := testenv.LogLen(t, e.rdb, e.lim.Key(0, 9)); n != 2 {
		t.Fatalf("log holds %d entries, want 2", n)
	}
}

func TestBatchDecidesOneUsersJobsInOrder(t *testing.T) {
	e := newEnv(t)
	caps := []capping.Cap{{Window: capping.Daily, Limit: 3}}
	var reqs []capping.Request
	for i := 0; i < 6; i++ {
		reqs = append(reqs, job(11, "email", caps...), job(uint32(1000+i), "email", caps...))
	}
	ds := e.decide(t, reqs...)
	for i, d := range ds {
		want := i%2 == 1 || i/2 < 3 // other users: always allowed; user 11: the first 3
		if d.Allowed != want {
			t.Errorf("request %d (user %d): allowed %v, want %v", i, reqs[i].UserID, d.Allowed, want)
		}
	}
}

func TestEvictionAndExpiry(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	caps := []capping.Cap{daily3, weekly5}
	e.decide(t, job(5, "email", caps...))
	// A new key gets its TTL from its first write (the script sets it without asking PTTL).
	if ttl := e.rdb.PTTL(ctx, e.lim.Key(0, 5)).Val(); ttl <= 7*24*time.Hour || ttl > 7*24*time.Hour+time.Hour {
		t.Fatalf("PTTL after the first send %v, want the longest window (7 days) and an hour", ttl)
	}
	e.clock.Add(3 * 24 * time.Hour)
	e.decide(t, job(5, "email", caps...))
	key := e.lim.Key(0, 5)
	if n := testenv.LogLen(t, e.rdb, key); n != 2 {
		t.Fatalf("log holds %d entries, want 2", n)
	}
	ttl := e.rdb.PTTL(ctx, key).Val()
	// The retention (the longest window) plus its slack: an eighth, at most an hour.
	if ttl <= 7*24*time.Hour+time.Hour-time.Minute || ttl > 7*24*time.Hour+time.Hour {
		t.Fatalf("PTTL %v, want the longest window (7 days) and an hour", ttl)
	}
	// A send within the slack of the last TTL is appended (the TTL left still covers the retention); one
	// after it writes the log with a new TTL. The log's header says when the TTL was set: a TTL shortened
	// behind capper's back is seen only then.
	if err := e.rdb.PExpire(ctx, key, 24*time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	e.clock.Add(30 * time.Minute)
	e.decide(t, job(5, "email", caps...))
	if ttl := e.rdb.PTTL(ctx, key).Val(); ttl > 24*time.Hour {
		t.Fatalf("PTTL %v after a send 30 minutes after the TTL was set, want it untouched (a day)", ttl)
	}
	e.clock.Add(time.Hour)
	e.decide(t, job(5, "email", caps...))
	if ttl := e.rdb.PTTL(ctx, key).Val(); ttl <= 7*24*time.Hour+time.Hour-time.Minute || ttl > 7*24*time.Hour+time.Hour {
		t.Fatalf("PTTL %v after a send 90 minutes after the TTL was set, want the longest window (7 days) and an hour", ttl)
	}
	e.clock.Add(5 * 24 * time.Hour) // the first send is now 8 days old
	e.decide(t, job(5, "email", caps...))
	if n := testenv.LogLen(t, e.rdb, key); n != 4 {
		t.Fatalf("log holds %d entries after eviction, want 4 (the 8-day-old one evicted)", n)
	}
}

func TestPeekRecordsNothing(t *testing.T) {
	e := newEnv(t)
	caps := []capping.Cap{{Window: capping.Daily, Limit: 1}}
	p, err := e.lim.Peek(context.Background(), job(3, "email", caps...))
	if err != nil || !p.Allowed {
		t.Fatalf("peek on an empty log: %+v, %v", p, err)
	}
	if n := e.rdb.Exists(context.Background(), e.lim.Key(0, 3)).Val(); n != 0 {
		t.Fatal("peek created the user's log")
	}
	e.decide(t, job(3, "email", caps...))
	p, err = e.lim.Peek(context.Background(), job(3, "email", caps...))
	if err != nil || p.Allowed || p.Counts[0] != 1 || !p.RetryAt.Equal(base.Add(capping.Daily)) {
		t.Fatalf("peek at the cap: %+v, %v", p, err)
	}
}

// TestOneCallPerNode: the requests of a batch for one node go in calls of up
// to 32 (one call for 10 users of one master, two for 40), each decided as
// alone; a request whose key holds another type fails alone, the others of
// its call are decided and recorded.
// scriptOnly sends every decision to the script (no new logs by SET NX).
func scriptOnly(c *capping.Config) { c.ScriptOnly = true }

// nearCache gives a Limiter the near cache the worker runs with.
func nearCache(c *capping.Config) { c.NearCache = 1000 }

func TestOneCallPerNode(t *testing.T) {
	e := newEnv(t, scriptOnly)
	ctx := context.Background()
	bad := uint32(500)
	master, err := e.rdb.MasterForKey(ctx, e.lim.Key(0, bad))
	if err != nil {
		t.Fatal(err)
	}
	users := []uint32{bad}
	for u := bad + 1; len(users) < 40; u++ {
		if m, err := e.rdb.MasterForKey(ctx, e.lim.Key(0, u)); err == nil && m.Options().Addr == master.Options().Addr {
			users = append(users, u)
		}
	}
	if err := e.rdb.HSet(ctx, e.lim.Key(0, bad), "not", "a log").Err(); err != nil {
		t.Fatal(err)
	}
	reqs := make([]capping.Request, 0, 40)
	for _, u := range users[:10] {
		reqs = append(reqs, job(u, "email", daily3))
	}
	before := e.lim.Stats()
	ds, err := e.lim.Decide(ctx, reqs)
	var re capping.RequestErrors
	if !errors.As(err, &re) || re[0] == nil || !strings.Contains(re[0].Error(), "WRONGTYPE") {
		t.Fatalf("err = %v, want the first request's WRONGTYPE alone", err)
	}
	for i := 1; i < len(reqs); i++ {
		if re[i] != nil || !ds[i].Allowed || ds[i].Counts[0] != 0 {
			t.Errorf("request %d beside the failing one: %+v, %v, want allowed", i, ds[i], re[i])
		}
	}
	if st := e.lim.Stats(); st.ScriptCalls-before.ScriptCalls != 1 || st.Requests-before.Requests != 10 {
		t.Errorf("%d script calls for %d requests, want 1 for 10 (one node)", st.ScriptCalls-before.ScriptCalls, st.Requests-before.Requests)
	}
	// Each was recorded: a second send of each of the 9 counts the first; the 30 other users had none.
	reqs = reqs[:0]
	for _, u := range users[1:] {
		reqs = append(reqs, job(u, "email", daily3))
	}
	before = e.lim.Stats()
	for i, d := range e.decide(t, reqs...) {
		want := 0
		if i < 9 {
			want = 1
		}
		if !d.Allowed || d.Counts[0] != want {
			t.Errorf("user %d's send: %+v, want allowed with %d counted", users[1+i], d, want)
		}
	}
	if st := e.lim.Stats(); st.ScriptCalls-before.ScriptCalls != 2 {
		t.Errorf("%d script calls for 39 requests of one node, want 2 (32 at most per call)", st.ScriptCalls-before.ScriptCalls)
	}
	// A key of another node's slot in a call fails its request alone ("non local key": Decide then sends
	// it again in a call of its own), the others are decided.
	var other uint32
	for u := bad + 1; other == 0; u++ {
		if m, err := e.rdb.MasterForKey(ctx, e.lim.Key(0, u)); err == nil && m.Options().Addr != master.Options().Addr {
			other = u
		}
	}
	call, err := capping.ScriptCall([]string{e.lim.Key(0, users[1]), e.lim.Key(0, other)},
		[]capping.Request{job(users[1], "email", daily3), job(other, "email", daily3)}, base)
	if err != nil {
		t.Fatal(err)
	}
	v, err := e.rdb.Do(ctx, call...).Slice()
	if err != nil || len(v) != 2 {
		t.Fatalf("a call with a key of another node: %v, %v, want two replies", v, err)
	}
	if r, ok := v[0].(string); !ok || len(r) != 15 || r[0] != 1 { // status 1, cap, retry_at, one count (decide.lua)
		t.Errorf("the local request: %q, want its decision: allowed, one count", v[0])
	}
	if e, ok := v[1].(error); !ok || !strings.Contains(e.Error(), "non local key") {
		t.Errorf("the request of another node's user: %v, want its own error (non local key)", v[1])
	}
}

func TestInvalidRequestsFailAlone(t *testing.T) {
	e := newEnv(t)
	reqs := []capping.Request{
		job(1, "email", daily3),
		{UserID: 2, JobID: "", Channel: "email", Caps: []capping.Cap{daily3}},
		{UserID: 3, JobID: "x", Channel: "email"},
		{UserID: 4, JobID: "y", Channel: "email", Caps: []capping.Cap{{Window: 0, Limit: 1}}},
		job(5, "email", daily3),
		{UserID: 6, JobID: "z", Channel: "email", Caps: []capping.Cap{daily3}, Priority: 101},
		{UserID: 7, JobID: "w", Channel: "email", Caps: []capping.Cap{{Window: time.Hour, Limit: 1 << 31}}},
		{UserID: 8, JobID: "v", Channel: "email", DuplicateOnly: true, Refused: "budget"},
	}
	ds, err := e.lim.Decide(context.Background(), reqs)
	var re capping.RequestErrors
	if !errors.As(err, &re) {
		t.Fatalf("err = %v, want RequestErrors", err)
	}
	// the last three: priority above 100, limit above 2^31-1, a refusal without a retention (its mark's TTL)
	for i, wantErr := range []bool{false, true, true, true, false, true, true, true} {
		if (re[i] != nil) != wantErr || wantErr && !errors.Is(re[i], capping.ErrInvalidRequest) {
			t.Errorf("request %d: err %v, want error: %v", i, re[i], wantErr)
		}
		if !wantErr && !ds[i].Allowed {
			t.Errorf("request %d: %+v, want allowed", i, ds[i])
		}
	}
}

// TestLogKeepsDecisionOrder: two workers decide for one user with clocks
// read in the opposite order of their scripts (a released job and a new one):
// the later script records at the earlier script's time, not before it, and
// says so; a redelivery reports when the job was recorded.
func TestLogKeepsDecisionOrder(t *testing.T) {
	e := newEnv(t)
	caps := []capping.Cap{{Name: "daily", Window: capping.Daily, Limit: 5}}
	e.clock.Set(base.Add(time.Second))
	first := job(12, "push", caps...)
	if d := e.decide(t, first)[0]; !d.Allowed || !d.Recorded.Equal(base.Add(time.Second)) {
		t.Fatalf("first: %+v, want allowed and recorded at its clock", d)
	}
	e.clock.Set(base) // the second worker read its clock a second earlier
	d := e.decide(t, job(12, "push", caps...))[0]
	if !d.Allowed || !d.Recorded.Equal(base.Add(time.Second)) || !d.At.Equal(base) {
		t.Fatalf("second: %+v, want allowed, taken at base, recorded with the first at +1s", d)
	}
	e.clock.Set(base.Add(time.Hour))
	if d := e.decide(t, first)[0]; !d.Duplicate || !d.Recorded.Equal(base.Add(time.Second)) {
		t.Fatalf("redelivery: %+v, want a duplicate recorded at +1s", d)
	}
}

// TestDuplicateOnly: a duplicate check finds a job that was allowed, and
// records, counts and evicts nothing for one that was not, with the near
// cache on (it is neither answered from nor changes the cache's copy).
func TestDuplicateOnly(t *testing.T) {
	e := newEnv(t)
	lim, err := capping.New(context.Background(), e.rdb, capping.Config{KeyPrefix: testenv.Unique("t"), Clock: e.clock.Now, NearCache: 100})
	if err != nil {
		t.Fatal(err)
	}
	one := capping.Cap{Name: "one", Window: time.Hour, Limit: 1}
	sent := job(7, "push", one)
	decide := func(reqs ...capping.Request) []capping.Decision {
		t.Helper()
		ds, err := lim.Decide(context.Background(), reqs)
		if err != nil {
			t.Fatal(err)
		}
		return ds
	}
	if d := decide(sent)[0]; !d.Allowed || d.Duplicate {
		t.Fatalf("first send: %+v", d)
	}
	e.clock.Add(time.Minute)
	again := capping.Request{UserID: 7, JobID: sent.JobID, Channel: "push", DuplicateOnly: true}
	other := capping.Request{UserID: 7, JobID: "never-sent", Channel: "push", DuplicateOnly: true}
	ds := decide(again, other)
	if !ds[0].Duplicate || !ds[0].Recorded.Equal(base) {
		t.Errorf("duplicate check of an allowed job: %+v, want a duplicate recorded at %v", ds[0], base)
	}
	if ds[1].Allowed || ds[1].Duplicate || ds[1].Cap != "" {
		t.Errorf("duplicate check of a new job: %+v, want the zero decision", ds[1])
	}
	// nothing was recorded: the user's one slot is still taken by the first
	// send only, and the checked job id is still new
	if d := decide(job(7, "push", one))[0]; d.Allowed || d.Cap != "one" || !d.RetryAt.Equal(base.Add(time.Hour)) {
		t.Errorf("send after the checks: %+v, want capped by one until %v", d, base.Add(time.Hour))
	}
	if d := decide(capping.Request{UserID: 7, JobID: "never-sent", Channel: "push", Caps: []capping.Cap{{Name: "ten", Window: time.Hour, Limit: 10}}})[0]; !d.Allowed || d.Duplicate || d.Counts[0] != 1 {
		t.Errorf("the checked job id sent for real: %+v, want allowed, one earlier send counted", d)
	}
	if _, err := lim.Decide(context.Background(), []capping.Request{{UserID: 7, JobID: "x", Channel: "push", DuplicateOnly: true, Caps: []capping.Cap{one}}}); !errors.Is(err, capping.ErrInvalidRequest) {
		t.Errorf("a duplicate check with caps: %v, want ErrInvalidRequest", err)
	}
}

// TestRefusedMark: a duplicate check that names a refusal (Request.Refused)
// marks a job that is not in the log refused, in the same call; a later copy
// of the job is then refused too (RefusedBefore, with the refusal's name)
// and never recorded, whatever its caps say, so one job keeps one final
// outcome. The mark counts in no cap, is written once, leaves a job that
// went before a duplicate, and ages out with the log.
func TestRefusedMark(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	ten := capping.Cap{Name: "ten", Window: time.Hour, Limit: 10}
	refuse := func(jobID string) capping.Decision {
		t.Helper()
		return e.decide(t, capping.Request{UserID: 9, JobID: jobID, Channel: "sms", DuplicateOnly: true, Refused: "sms-budget", Retention: time.Hour})[0]
	}
	if d := refuse("j1"); d.Allowed || d.Duplicate || d.RefusedBefore || d.Cap != "" {
		t.Fatalf("the first refusal's look: %+v, want the zero decision (not sent before)", d)
	}
	key := e.lim.Key(0, 9)
	if n := testenv.LogLen(t, e.rdb, key); n != 1 {
		t.Fatalf("the log holds %d entries after the refusal, want its mark", n)
	}
	if ttl := e.rdb.PTTL(ctx, key).Val(); ttl <= time.Hour || ttl > time.Hour+time.Hour/8 {
		t.Fatalf("PTTL of a log made by a mark %v, want the retention (an hour) and an eighth", ttl)
	}
	e.clock.Add(time.Second)
	// Another copy of j1 with room under its caps: refused, not recorded.
	d := e.decide(t, capping.Request{UserID: 9, JobID: "j1", Channel: "sms", Caps: []capping.Cap{ten}})[0]
	if d.Allowed || !d.RefusedBefore || d.Cap != "sms-budget" {
		t.Fatalf("a copy of the refused job: %+v, want refused before as sms-budget", d)
	}
	// The mark counts in no cap; another job goes.
	if d := e.decide(t, capping.Request{UserID: 9, JobID: "j2", Channel: "sms", Caps: []capping.Cap{ten}})[0]; !d.Allowed || d.Counts[0] != 0 {
		t.Fatalf("another job: %+v, want allowed with nothing counted before", d)
	}
	// A second refusal of j1 writes no second mark; a refusal of a job that went is a duplicate.
	refuse("j1")
	if d := refuse("j2"); !d.Duplicate {
		t.Errorf("a refusal's look of a job that went: %+v, want a duplicate", d)
	}
	if n := testenv.LogLen(t, e.rdb, key); n != 2 {
		t.Errorf("the log holds %d entries, want j2 and j1's one mark", n)
	}
	// The mark ages out with the log: past the retention, j1 is decided as new.
	e.clock.Add(2 * time.Hour)
	if d := e.decide(t, capping.Request{UserID: 9, JobID: "j1", Channel: "sms", Caps: []capping.Cap{ten}})[0]; !d.Allowed || d.RefusedBefore {
		t.Errorf("j1 after the retention: %+v, want allowed (its mark aged out)", d)
	}
	if n := testenv.LogLen(t, e.rdb, key); n != 1 {
		t.Errorf("the log holds %d entries after the retention, want j1 alone", n)
	}
	if _, err := e.lim.Decide(ctx, []capping.Request{{UserID: 9, JobID: "x", Channel: "sms", Refused: "b", Caps: []capping.Cap{ten}}}); !errors.Is(err, capping.ErrInvalidRequest) {
		t.Errorf("a refusal's name on a decision: %v, want ErrInvalidRequest", err)
	}
}

// TestRefusedMarkKeptForItsHold: a mark made with MarkFor outlives the
// retention by that much, through writes of the user's other sends, and the
// log's TTL covers it: a copy held longer than the caps' history comes back
// to the mark. Past retention and MarkFor it ages out.
func TestRefusedMarkKeptForItsHold(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	minute := capping.Cap{Name: "minute", Window: time.Minute, Limit: 10}
	d := e.decide(t, capping.Request{UserID: 9, JobID: "j1", Channel: "sms", DuplicateOnly: true, Refused: "minute", Retention: time.Minute, MarkFor: time.Hour})[0]
	if d.Allowed || d.RefusedBefore {
		t.Fatalf("the refusal's look: %+v, want the zero decision", d)
	}
	key := e.lim.Key(0, 9)
	if ttl := e.rdb.PTTL(ctx, key).Val(); ttl <= time.Hour+time.Minute {
		t.Fatalf("PTTL of a log made by a mark kept an hour %v, want beyond the hour and the retention", ttl)
	}
	for i := range 3 { // the user's other sends, past the retention each time: the log is written again
		e.clock.Add(2 * time.Minute)
		if d := e.decide(t, capping.Request{UserID: 9, JobID: fmt.Sprint("other-", i), Channel: "sms", Caps: []capping.Cap{minute}})[0]; !d.Allowed {
			t.Fatalf("another job: %+v, want allowed", d)
		}
	}
	if ttl := e.rdb.PTTL(ctx, key).Val(); ttl <= 50*time.Minute {
		t.Errorf("PTTL after the user's other sends %v, want it to cover the mark (about 54 minutes and the retention)", ttl)
	}
	if d := e.decide(t, capping.Request{UserID: 9, JobID: "j1", Channel: "sms", Caps: []capping.Cap{minute}})[0]; d.Allowed || !d.RefusedBefore {
		t.Errorf("a copy of j1 six minutes on: %+v, want refused before (its mark is kept an hour)", d)
	}
	again := capping.Request{UserID: 9, JobID: "j1", Channel: "sms", DuplicateOnly: true, Refused: "minute", Retention: time.Minute, MarkFor: time.Hour}
	if d := e.decide(t, again)[0]; d.Allowed || d.Duplicate || !d.At.Equal(e.clock.Now()) {
		t.Errorf("a copy of j1 refused for good again: %+v, want looked and not found", d)
	}
	if n := testenv.LogLen(t, e.rdb, key); n != 2 {
		t.Errorf("the log holds %d items, want the last other job and j1's one mark", n)
	}
	e.clock.Add(time.Hour)
	if d := e.decide(t, capping.Request{UserID: 9, JobID: "j1", Channel: "sms", Caps: []capping.Cap{minute}})[0]; !d.Allowed || d.RefusedBefore {
		t.Errorf("j1 past the mark's keep and the retention: %+v, want allowed", d)
	}
}

// TestExceededNamesEveryRefusingCap: a send refused by two caps names both
// (the one that decides retry-at first in Cap); a shadow cap and a cap whose
// scope the send is not in are not named.
func TestExceededNamesEveryRefusingCap(t *testing.T) {
	e := newEnv(t)
	hour := capping.Cap{Name: "hour", Window: time.Hour, Limit: 1}
	day := capping.Cap{Name: "day", Window: capping.Daily, Limit: 1}
	shadow := capping.Cap{Name: "shadow", Window: time.Hour, Limit: 1, Shadow: true}
	smsOnly := capping.Cap{Name: "sms", Window: time.Hour, Limit: 0, Scope: capping.NewScope([]string{"sms"}, nil)}
	e.decide(t, job(9, "email", hour, day, shadow, smsOnly))
	d := e.decide(t, job(9, "email", hour, day, shadow, smsOnly))[0]
	if d.Allowed || d.Cap != "day" || !slices.Equal(d.Exceeded, []string{"hour", "day"}) {
		t.Errorf("second send: %+v, want capped by day, exceeding hour and day", d)
	}
}

// TestDecideCountsOnlyTheCapsThatApply: Decide leaves out the caps whose scope
// the send is not in (they cannot cap it) and gives -1 as their counts, while
// Peek counts every cap; an unnamed cap keeps its name in the request (cap1)
// when one before it is left out; a full cap that does not apply lets the send
// through, and still caps the sends it applies to.
func TestDecideCountsOnlyTheCapsThatApply(t *testing.T) {
	e := newEnv(t)
	caps := []capping.Cap{pushDay1, {Window: capping.Daily, Limit: 2}}
	if d := e.decide(t, job(12, "push", caps...))[0]; !d.Allowed || !slices.Equal(d.Counts, []int{0, 0}) {
		t.Fatalf("first push: %+v, want allowed, both caps counted (0, 0)", d)
	}
	d := e.decide(t, job(12, "email", caps...))[0]
	if !d.Allowed || !slices.Equal(d.Counts, []int{-1, 1}) {
		t.Fatalf("an email with push-daily full: %+v, want allowed, counts [-1 1] (push-daily left out)", d)
	}
	if d := e.decide(t, job(12, "push", caps...))[0]; d.Allowed || d.Cap != "push-daily" || !slices.Equal(d.Counts, []int{1, 2}) {
		t.Fatalf("a second push: %+v, want capped by push-daily, counts [1 2]", d)
	}
	d = e.decide(t, job(12, "email", caps...))[0]
	if d.Allowed || d.Cap != "cap1" || !slices.Equal(d.Exceeded, []string{"cap1"}) || !slices.Equal(d.Counts, []int{-1, 2}) ||
		!d.RetryAt.Equal(base.Add(capping.Daily)) {
		t.Fatalf("a second email: %+v, want capped by cap1 (the request's name of the unnamed cap) until the first push leaves the window, counts [-1 2]", d)
	}
	p, err := e.lim.Peek(context.Background(), job(12, "email", caps...))
	if err != nil || p.Allowed || !slices.Equal(p.Counts, []int{1, 2}) {
		t.Fatalf("peek of an email: %+v (%v), want capped with every cap counted [1 2]", p, err)
	}
}
