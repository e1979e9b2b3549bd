package loadtest_test

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/loadtest"
	"github.com/capper-dev/capper/jobs"
	"github.com/capper-dev/capper/output"
	"github.com/capper-dev/capper/rules"
)

var t0 = time.Date(2026, 11, 21, 16, 0, 0, 0, time.UTC)

// compile builds rules of default caps only (every user in no segment) with
// the given exempt categories.
func compile(t testing.TB, exempt []string, caps ...rules.Cap) loadtest.Policy {
	return loadtest.Policy{Rules: rules.Config{DefaultCaps: caps, ExemptCategories: exempt}, Segment: func(uint32) (string, bool) { return "", false }}
}

func limit(n int) *int { return &n }

// policy: daily 2, push daily 1; the "transactional" category is exempt.
var policy = compile(nil, []string{"transactional"},
	rules.Cap{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(2)},
	rules.Cap{Name: "push", Window: rules.Duration(24 * time.Hour), Limit: limit(1), Scope: rules.Scope{Channel: "push"}})

// scenario: user 1 gets j1 allowed, j2 allowed, j3 capped, j1 redelivered;
// user 2 an exempt job; one malformed message dead-lettered.
func scenario() ([]loadtest.Sent, []loadtest.Output) {
	sent := []loadtest.Sent{
		{ID: "m1", JobID: "j1", UserID: 1, Channel: "email", Category: "marketing", Kind: loadtest.KindJob},
		{ID: "m2", JobID: "j2", UserID: 1, Channel: "push", Category: "marketing", Kind: loadtest.KindJob},
		{ID: "m3", JobID: "j3", UserID: 1, Channel: "email", Category: "marketing", Kind: loadtest.KindJob},
		{ID: "m4", JobID: "j1", UserID: 1, Channel: "email", Category: "marketing", Kind: loadtest.KindDuplicate},
		{ID: "m5", JobID: "j5", UserID: 2, Channel: "email", Category: "transactional", Kind: loadtest.KindExempt},
		{ID: "m6", Kind: loadtest.KindMalformed},
	}
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	outs := []loadtest.Output{
		{Role: "allowed", ID: "m1", Time: at(10), ProducedAt: at(0), Output: output.Output{Decision: "allowed", Segment: "new"}},
		{Role: "allowed", ID: "m2", Time: at(20), ProducedAt: at(0), Output: output.Output{Decision: "allowed", Segment: "new"}},
		{Role: "capped", ID: "m3", Time: at(30), ProducedAt: at(0), Output: output.Output{Decision: "capped", Segment: "new", Cap: "daily"}},
		{Role: "allowed", ID: "m4", Time: at(40), ProducedAt: at(0), Output: output.Output{Decision: "duplicate", Segment: "new"}},
		{Role: "allowed", ID: "m5", Time: at(50), ProducedAt: at(0), Output: output.Output{Decision: "exempt", Segment: "default"}},
		{Role: "dlq", ID: "m6", Time: at(1000), ProducedAt: at(0), Output: output.Output{Decision: "dlq"}},
	}
	return sent, outs
}

func TestCheckCleanRun(t *testing.T) {
	sent, outs := scenario()
	r := loadtest.Check(sent, outs, policy, t0.Add(time.Hour))
	if !r.OK() || r.Problems != nil {
		t.Fatalf("clean run failed: %+v", r)
	}
	want := loadtest.Result{Jobs: 6, Allowed: 2, Capped: 1, DLQ: 1, Duplicates: 1, Exempt: 1}
	if r.Jobs != want.Jobs || r.Allowed != want.Allowed || r.Capped != want.Capped || r.DLQ != want.DLQ || r.Duplicates != want.Duplicates || r.Exempt != want.Exempt {
		t.Fatalf("counts %+v, want %+v", r, want)
	}
	if r.ByCap["daily"] != 1 || r.BySegment["new"]["allowed"] != 2 {
		t.Fatalf("by cap %v, by segment %v", r.ByCap, r.BySegment)
	}
	if r.JobsPerSec != 6 || r.P50ms != 30 || r.P99ms != 1000 {
		t.Fatalf("jobs/s %v p50 %v p99 %v; want 6 (6 jobs in 1 s), 30, 1000", r.JobsPerSec, r.P50ms, r.P99ms)
	}
}

// TestCheckNeverPassesOnNothing: an empty manifest is a failure that says
// why; jobs with no output read at all are unaccounted and the report says
// that nothing came out of the topics.
func TestCheckNeverPassesOnNothing(t *testing.T) {
	r := loadtest.Check(nil, nil, policy, t0.Add(time.Hour))
	if r.OK() || len(r.Problems) != 1 || !strings.Contains(r.Problems[0], "the manifest lists no jobs") {
		t.Fatalf("an empty manifest: ok %v, problems %q; want a failure naming the empty manifest", r.OK(), r.Problems)
	}
	sent, _ := scenario()
	r = loadtest.Check(sent, nil, policy, t0.Add(time.Hour))
	if r.OK() || r.Unaccounted != len(sent) || len(r.Problems) == 0 || !strings.Contains(r.Problems[0], "no message was read from the output topics") {
		t.Fatalf("no outputs: ok %v, unaccounted %d, problems %q; want every job unaccounted and the empty topics named first", r.OK(), r.Unaccounted, r.Problems)
	}
}

func TestCheckCatchesProblems(t *testing.T) {
	tests := []struct {
		name                    string
		mutate                  func([]loadtest.Sent, []loadtest.Output) ([]loadtest.Sent, []loadtest.Output)
		unaccounted, violations int
		problem                 string
	}{
		{"a job that reached no topic", func(s []loadtest.Sent, o []loadtest.Output) ([]loadtest.Sent, []loadtest.Output) {
			return s, o[1:] // m1 lost (j1 still reached allowed through its redelivery m4)
		}, 1, 0, "m1"},
		{"a cap exceeded", func(s []loadtest.Sent, o []loadtest.Output) ([]loadtest.Sent, []loadtest.Output) {
			o[2].Role, o[2].Decision = "allowed", "allowed" // j3 allowed: 3 sends in a day, cap 2
			return s, o
		}, 0, 1, `cap "daily", which allows 2`},
		{"a channel cap exceeded", func(s []loadtest.Sent, o []loadtest.Output) ([]loadtest.Sent, []loadtest.Output) {
			s[0].Channel = "push" // j1 and j2 both push: cap 1
			return s, o
		}, 0, 1, `cap "push", which allows 1`},
		{"a job in two topics", func(s []loadtest.Sent, o []loadtest.Output) ([]loadtest.Sent, []loadtest.Output) {
			return s, append(o, loadtest.Output{Role: "capped", ID: "m4", Time: t0, Output: output.Output{Decision: "capped"}})
		}, 1, 0, "2 output topics"},
		{"a malformed message forwarded", func(s []loadtest.Sent, o []loadtest.Output) ([]loadtest.Sent, []loadtest.Output) {
			o[5].Role = "allowed"
			return s, o
		}, 0, 1, "malformed"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sent, outs := tt.mutate(scenario())
			r := loadtest.Check(sent, outs, policy, t0.Add(time.Hour))
			if r.OK() || r.Unaccounted != tt.unaccounted || r.Violations != tt.violations {
				t.Fatalf("unaccounted %d violations %d, want %d and %d (problems %v)", r.Unaccounted, r.Violations, tt.unaccounted, tt.violations, r.Problems)
			}
			if !strings.Contains(strings.Join(r.Problems, "\n"), tt.problem) {
				t.Fatalf("problems %v do not mention %q", r.Problems, tt.problem)
			}
		})
	}
}

func TestCheckWindowEdge(t *testing.T) {
	// Two sends exactly 24 h apart are in different windows; 1 ms less and they share one.
	sent := []loadtest.Sent{
		{ID: "a", JobID: "a", UserID: 9, Channel: "email", Category: "marketing", Kind: loadtest.KindJob},
		{ID: "b", JobID: "b", UserID: 9, Channel: "email", Category: "marketing", Kind: loadtest.KindJob},
	}
	one := compile(t, nil, rules.Cap{Name: "d", Window: rules.Duration(24 * time.Hour), Limit: limit(1)})
	for gap, violations := range map[time.Duration]int{24 * time.Hour: 0, 24*time.Hour - time.Millisecond: 1} {
		outs := []loadtest.Output{
			{Role: "allowed", ID: "a", Time: t0, Output: output.Output{Decision: "allowed"}},
			{Role: "allowed", ID: "b", Time: t0.Add(gap), Output: output.Output{Decision: "allowed"}},
		}
		if r := loadtest.Check(sent, outs, one, t0.Add(time.Hour)); r.Violations != violations {
			t.Errorf("gap %v: %d violations, want %d", gap, r.Violations, violations)
		}
	}
}

func TestGenerateAndManifest(t *testing.T) {
	msgs, sent, err := loadtest.Generate(loadtest.GenConfig{Jobs: 5000, Users: 500, Seed: 1, RunID: "r", MalformedShare: 0.01, DuplicateShare: 0.05, ExemptShare: 0.05})
	if err != nil {
		t.Fatal(err)
	}
	if len(msgs) != 5000 || len(sent) != 5000 {
		t.Fatalf("%d messages, %d sent", len(msgs), len(sent))
	}
	kinds := map[string]int{}
	ids := map[string]bool{}
	for i, s := range sent {
		kinds[s.Kind]++
		ids[s.ID] = true
		if string(msgs[i].Headers[0].Value) != s.ID {
			t.Fatalf("message %d carries id %q, manifest says %q", i, msgs[i].Headers[0].Value, s.ID)
		}
		if s.Kind != loadtest.KindMalformed && (s.UserID < 1 || s.UserID > 500) {
			t.Fatalf("user %d out of range", s.UserID)
		}
	}
	for kind, share := range map[string]float64{loadtest.KindMalformed: 0.01, loadtest.KindDuplicate: 0.05, loadtest.KindExempt: 0.05} {
		if n := float64(kinds[kind]) / 5000; n < share/2 || n > share*2 {
			t.Errorf("%s share %.3f, want about %.3f", kind, n, share)
		}
	}
	if len(ids) != 5000 {
		t.Fatal("message ids are not unique")
	}
	var buf bytes.Buffer
	if err := loadtest.WriteManifest(&buf, sent); err != nil {
		t.Fatal(err)
	}
	back, err := loadtest.ReadManifest(&buf)
	if err != nil || back.Len() != len(sent) {
		t.Fatalf("manifest round trip: %v, %d entries", err, back.Len())
	}
	for i := range sent {
		if got := back.Sent(i); !reflect.DeepEqual(got, sent[i]) {
			t.Fatalf("manifest round trip: line %d reads back as %+v, want %+v", i, got, sent[i])
		}
	}
}

// TestCheckUncheckedSends: a send that a fail-open rule let out unchecked is
// counted apart and not held against the caps, while a checked send over the
// cap still is a violation.
func TestCheckUncheckedSends(t *testing.T) {
	sent, outs := scenario()
	// j3 went out unchecked while Redis was down: 3 sends, cap 2, no violation.
	outs[2].Role, outs[2].Decision, outs[2].Cap = "allowed", "unchecked", ""
	r := loadtest.Check(sent, outs, policy, t0.Add(time.Hour))
	if !r.OK() || r.Unchecked != 1 || r.Allowed != 2 {
		t.Fatalf("unchecked send: ok %v, unchecked %d, allowed %d (problems %v); want ok, 1, 2", r.OK(), r.Unchecked, r.Allowed, r.Problems)
	}
	// A checked send over the cap is still caught with unchecked ones around.
	sent = append(sent, loadtest.Sent{ID: "m7", JobID: "j7", UserID: 1, Channel: "email", Category: "marketing", Kind: loadtest.KindJob})
	outs = append(outs, loadtest.Output{Role: "allowed", ID: "m7", Time: t0.Add(time.Second), ProducedAt: t0, Output: output.Output{Decision: "allowed"}})
	if r := loadtest.Check(sent, outs, policy, t0.Add(time.Hour)); r.Violations != 1 {
		t.Fatalf("a checked third send: %d violations, want 1 (problems %v)", r.Violations, r.Problems)
	}
}

// TestCheckExemptionComesFromTheRules: which categories are not counted is
// the worker's configuration, not a fixed name.
func TestCheckExemptionComesFromTheRules(t *testing.T) {
	sent, outs := scenario()
	sent = append(sent, loadtest.Sent{ID: "m8", JobID: "j8", UserID: 1, Channel: "email", Category: "receipts", Kind: loadtest.KindExempt})
	outs = append(outs, loadtest.Output{Role: "allowed", ID: "m8", Time: t0.Add(time.Second), ProducedAt: t0, Output: output.Output{Decision: "exempt"}})
	receipts := compile(t, []string{"receipts"},
		rules.Cap{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(2)},
		rules.Cap{Name: "push", Window: rules.Duration(24 * time.Hour), Limit: limit(1), Scope: rules.Scope{Channel: "push"}})
	if r := loadtest.Check(sent, outs, receipts, t0.Add(time.Hour)); !r.OK() {
		t.Fatalf("receipts exempt: %v, want no violation", r.Problems)
	}
	if r := loadtest.Check(sent, outs, policy, t0.Add(time.Hour)); r.Violations != 1 {
		t.Fatalf("receipts counted (only transactional exempt): %d violations, want 1 (user 1 has 3 sends, cap 2)", r.Violations)
	}
}

// TestCheckCalendarAndScopedCaps: the report evaluates calendar windows in
// the job's zone, tag and per-campaign scopes, count-only sends and shadow
// caps the way the worker does, and fails on a crafted violation of each.
func TestCheckCalendarAndScopedCaps(t *testing.T) {
	p := loadtest.Policy{Rules: rules.Config{
		CountOnlyCategories: []string{"receipt"},
		DefaultCaps: []rules.Cap{
			{Name: "today", Calendar: "day", Limit: limit(2)},
			{Name: "promo-today", Calendar: "day", Limit: limit(1), Scope: rules.Scope{Tags: []string{"promotional"}}},
			{Name: "campaign-week", Calendar: "week", Limit: limit(1), Scope: rules.Scope{PerCampaign: true, Channel: "push"}},
			{Name: "shadow-hour", Window: rules.Duration(time.Hour), Limit: limit(0), Shadow: true},
		}}, Segment: func(uint32) (string, bool) { return "", false }}
	// 18:00 UTC is 23:30 in Kolkata; 19:00 UTC is 00:30 the next day there.
	at := func(h, m int) time.Time { return time.Date(2026, 11, 20, h, m, 0, 0, time.UTC) } // a Friday
	type send struct {
		t                           time.Time
		channel, category, campaign string
		tags                        []string
	}
	for _, tt := range []struct {
		name  string
		sends []send
		cap   string // the violated cap, "" for none
	}{
		{"two sends on one local day", []send{{at(10, 0), "email", "marketing", "c1", nil}, {at(11, 0), "email", "marketing", "c2", nil}}, ""},
		{"three sends on one local day", []send{{at(10, 0), "email", "marketing", "c1", nil}, {at(11, 0), "email", "marketing", "c2", nil}, {at(12, 0), "email", "marketing", "c3", nil}}, "today"},
		{"three sends across local midnight in Kolkata", []send{{at(17, 0), "email", "marketing", "c1", nil}, {at(18, 0), "email", "marketing", "c2", nil}, {at(19, 0), "email", "marketing", "c3", nil}}, ""},
		{"two promotional sends", []send{{at(10, 0), "email", "marketing", "c1", []string{"promotional"}}, {at(11, 0), "sms", "marketing", "c2", []string{"promotional"}}}, "promo-today"},
		{"one promotional send", []send{{at(10, 0), "email", "marketing", "c1", []string{"promotional"}}, {at(11, 0), "sms", "marketing", "c2", []string{"newsletter"}}}, ""},
		{"one campaign pushed twice in a week", []send{{at(10, 0), "push", "marketing", "c1", nil}, {at(10, 0).AddDate(0, 0, 1), "push", "marketing", "c1", nil}}, "campaign-week"},
		{"two campaigns pushed", []send{{at(10, 0), "push", "marketing", "c1", nil}, {at(11, 0), "push", "marketing", "c2", nil}}, ""},
		{"receipts count, and are never capped", []send{{at(9, 0), "email", "receipt", "r", nil}, {at(9, 5), "email", "receipt", "r", nil}, {at(9, 10), "email", "receipt", "r", nil}}, ""},
		{"a send allowed after two receipts", []send{{at(9, 0), "email", "receipt", "r", nil}, {at(9, 5), "email", "receipt", "r", nil}, {at(10, 0), "email", "marketing", "c1", nil}}, "today"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var sent []loadtest.Sent
			var outs []loadtest.Output
			for i, s := range tt.sends {
				id := fmt.Sprint("m", i)
				sent = append(sent, loadtest.Sent{ID: id, JobID: fmt.Sprint("j", i), UserID: 1, Channel: s.channel, Category: s.category,
					Campaign: s.campaign, Tags: s.tags, Timezone: "Asia/Kolkata", Kind: loadtest.KindJob})
				outs = append(outs, loadtest.Output{Role: "allowed", ID: id, Time: s.t, ProducedAt: s.t, Output: output.Output{Decision: "allowed"}})
			}
			res := loadtest.Check(sent, outs, p, t0.Add(time.Hour))
			problems := strings.Join(res.Problems, "\n")
			if tt.cap == "" && res.Violations != 0 {
				t.Fatalf("violations %d, want none: %s", res.Violations, problems)
			}
			if tt.cap != "" && (res.Violations != 1 || !strings.Contains(problems, fmt.Sprintf("cap %q", tt.cap))) {
				t.Fatalf("violations %d (%s), want 1 of cap %q", res.Violations, problems, tt.cap)
			}
		})
	}
}

// TestCheckHeld: held jobs are accounted by their final output, pending
// while due later, lost when due long ago and never released; released early
// and allowed after expiry are violations; release lag is decided minus due.
func TestCheckHeld(t *testing.T) {
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	now := at(60_000)
	job := func(id string) loadtest.Sent {
		return loadtest.Sent{ID: "m-" + id, JobID: id, UserID: 9, Channel: "email", Category: "marketing", Kind: loadtest.KindJob}
	}
	sent := []loadtest.Sent{job("released"), job("pending"), job("lost"), job("early"), job("expired")}
	sent[4].ExpiresAt = at(100)
	outs := []loadtest.Output{
		{Role: "held", ID: "m-released", Output: output.Output{Decision: "held", DueAt: at(5000), HoldCount: 1}},
		{Role: "allowed", ID: "m-released", Time: at(5102), Output: output.Output{Decision: "allowed", DueAt: at(5000), HoldCount: 1, DecidedAt: at(5100)}},
		{Role: "held", ID: "m-pending", Output: output.Output{Decision: "held", DueAt: now.Add(time.Hour), HoldCount: 1}},
		{Role: "held", ID: "m-lost", Output: output.Output{Decision: "held", DueAt: now.Add(-loadtest.ReleaseGrace - time.Second), HoldCount: 1}},
		{Role: "held", ID: "m-early", Output: output.Output{Decision: "held", DueAt: at(9000), HoldCount: 1}},
		{Role: "capped", ID: "m-early", Time: at(8001), Output: output.Output{Decision: "capped", DueAt: at(9000), HoldCount: 1, DecidedAt: at(8000)}},
		{Role: "allowed", ID: "m-expired", Time: at(201), Output: output.Output{Decision: "allowed", DecidedAt: at(200)}},
	}
	r := loadtest.Check(sent, outs, policy, now)
	if r.Held != 4 || r.Released != 2 || r.Pending != 1 || r.Unaccounted != 1 || r.Violations != 2 {
		t.Errorf("held %d released %d pending %d unaccounted %d violations %d, want 4 2 1 1 2; problems %v",
			r.Held, r.Released, r.Pending, r.Unaccounted, r.Violations, r.Problems)
	}
	if r.ReleaseP50ms != -1000 || r.ReleaseP99ms != 100 {
		t.Errorf("release lag p50 %v p99 %v, want -1000 and 100", r.ReleaseP50ms, r.ReleaseP99ms)
	}
	for _, want := range []string{`"lost" was held`, `"early" released`, `"expired" allowed`} {
		if !strings.Contains(strings.Join(r.Problems, "\n"), want) {
			t.Errorf("no problem mentions %s: %v", want, r.Problems)
		}
	}
}

// TestCheckEarlyRelease: a job whose final output gives an earlier due time
// than its held record (released early) is counted when a budget held it,
// and a violation when anything else did; one released at its due is
// neither.
func TestCheckEarlyRelease(t *testing.T) {
	limit := 5
	p := loadtest.Policy{Rules: rules.Config{
		DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: &limit}},
		Budgets:     []rules.Budget{{Name: "sms", Scope: rules.Scope{Channels: []string{"sms"}}, Limit: &limit, Window: rules.Duration(time.Second)}},
	}, Segment: func(uint32) (string, bool) { return "", false }}
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	var sent []loadtest.Sent
	var outs []loadtest.Output
	for i, c := range []struct {
		id, by   string
		released int // the final output's due time, ms
	}{{"budget", "sms", 8000}, {"cap", "daily", 8000}, {"on-time", "daily", 9000}} {
		sent = append(sent, loadtest.Sent{ID: "m-" + c.id, JobID: c.id, UserID: uint32(i + 1), Channel: "sms", Category: "marketing", Kind: loadtest.KindJob})
		outs = append(outs,
			loadtest.Output{Role: "held", ID: "m-" + c.id, Output: output.Output{Decision: "held", Cap: c.by, DueAt: at(9000), HoldCount: 1}},
			loadtest.Output{Role: "allowed", ID: "m-" + c.id, Output: output.Output{Decision: "allowed", DueAt: at(c.released), HoldCount: 1, DecidedAt: at(c.released + 1)}})
	}
	r := loadtest.Check(sent, outs, p, at(60_000))
	if r.EarlyReleases != 1 || r.Violations != 1 || !strings.Contains(strings.Join(r.Problems, "\n"), `"cap" released before the due time of its hold by "daily"`) {
		t.Errorf("early releases %d, violations %d (%v); want 1 (the budget's) and 1 (the cap's)", r.EarlyReleases, r.Violations, r.Problems)
	}
	// A workspace's own budget holds sends as "NAME/BUDGET".
	p.Rules = p.Rules.InWorkspace("acme", true, nil)
	outs[0].Cap = "acme/sms"
	if r := loadtest.Check(sent, outs, p, at(60_000)); r.EarlyReleases != 1 || r.Violations != 1 {
		t.Errorf("in workspace acme: early releases %d, violations %d (%v); want 1 (acme/sms's) and 1 (the cap's)", r.EarlyReleases, r.Violations, r.Problems)
	}
}

// TestCheckBudget: a budget's sends in any window beyond its limit plus one
// bucket's share are a violation; the other campaign's are not counted in it.
func TestCheckBudget(t *testing.T) {
	limit := 5
	p := loadtest.Policy{Rules: rules.Config{
		DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: &limit}},
		Budgets:     []rules.Budget{{Name: "speed", Scope: rules.Scope{PerCampaign: true}, Limit: &limit, Window: rules.Duration(time.Second)}},
	}, Segment: func(uint32) (string, bool) { return "", false }}
	var sent []loadtest.Sent
	var outs []loadtest.Output
	add := func(campaign string, n int, gap time.Duration) {
		for i := 0; i < n; i++ {
			id := fmt.Sprintf("%s-%d", campaign, len(sent))
			sent = append(sent, loadtest.Sent{ID: id, JobID: id, UserID: uint32(len(sent) + 1), Channel: "push", Category: "marketing", Kind: loadtest.KindJob, Campaign: campaign})
			outs = append(outs, loadtest.Output{Role: "allowed", ID: id, Output: output.Output{Decision: "allowed", DecidedAt: t0.Add(time.Duration(i) * gap)}})
		}
	}
	add("slow", 12, 200*time.Millisecond) // 5 per second
	add("other", 5, time.Millisecond)     // its own budget key
	// Capped in the whole window [1,2): a held send of slow's (counted in
	// it), a send of slow's never held and a held send of other's (not).
	capped := func(campaign string, held bool) {
		id := fmt.Sprintf("%s-capped-%d", campaign, len(sent))
		sent = append(sent, loadtest.Sent{ID: id, JobID: id, UserID: uint32(len(sent) + 1), Channel: "push", Category: "marketing", Kind: loadtest.KindJob, Campaign: campaign})
		o := output.Output{Decision: "capped", Cap: "daily", DecidedAt: t0.Add(1500 * time.Millisecond)}
		if held {
			o.HoldCount, o.DueAt = 1, o.DecidedAt
			outs = append(outs, loadtest.Output{Role: loadtest.RoleHeld, ID: id, Output: output.Output{Decision: "held", Cap: "speed", DueAt: o.DecidedAt}})
		}
		outs = append(outs, loadtest.Output{Role: loadtest.RoleCapped, ID: id, Output: o})
	}
	capped("slow", true)
	capped("slow", false)
	capped("other", true)
	r := loadtest.Check(sent, outs, p, t0.Add(time.Hour))
	if r.Violations != 0 {
		t.Fatalf("within the budget: %v", r.Problems)
	}
	// What each key delivered: per whole window from its first send (t0),
	// the first and the last left out (0..2.2 s: windows [0,1) [1,2) [2,3)),
	// and its held sends capped when they came back, by what capped them.
	got := fmt.Sprint(r.Budgets)
	if want := fmt.Sprintf("[{speed:other 5 1s [] [] [] map[] %[1]d 5} {speed:slow 5 1s [5] [5] [1] map[daily:1] %[1]d 5}]", t0.UnixNano()); got != want {
		t.Errorf("budget delivery %s, want %s", got, want)
	}
	sent, outs = sent[:len(sent)-3], outs[:len(outs)-5]
	// With produce stamps, only the windows that end by the last one count:
	// the demand ended at 1.5 s, before the second window's end.
	outs[0].ProducedAt = t0.Add(1500 * time.Millisecond)
	if got, want := fmt.Sprint(loadtest.Check(sent, outs, p, t0.Add(time.Hour)).Budgets[1].Whole), "[]"; got != want {
		t.Errorf("whole windows while the demand lasted %s, want %s", got, want)
	}
	outs[0].ProducedAt = time.Time{}
	// A burst: 15 jobs produced at once, 5 sent at once and the others held
	// and sent 5 a second: the demand lasted while they waited, until the
	// last held one was sent (2.4 s): window [1,2) is whole.
	first := len(sent)
	add("burst", 15, 0)
	for i := first; i < len(sent); i++ {
		k := i - first
		outs[i].ProducedAt = t0
		outs[i].DecidedAt = t0.Add(time.Duration(k/5)*time.Second + time.Duration(k%5)*100*time.Millisecond)
		if k >= 5 {
			outs[i].HoldCount, outs[i].DueAt = 1, outs[i].DecidedAt
			outs = append(outs, loadtest.Output{Role: loadtest.RoleHeld, ID: sent[i].ID, Output: output.Output{Decision: "held", DueAt: outs[i].DecidedAt}})
		}
	}
	r = loadtest.Check(sent, outs, p, t0.Add(time.Hour))
	if got, want := fmt.Sprint(r.Budgets[0]), fmt.Sprintf("{speed:burst 5 1s [5] [5] [0] map[] %d 5}", t0.UnixNano()); r.Violations != 0 || got != want {
		t.Errorf("a burst: %s (problems %v), want %s", got, r.Problems, want)
	}
	// The burst's end: a window that began with fewer sends to come than the
	// limit could get only those (its demand); one that began with the limit
	// or more to come could get the limit.
	for _, c := range []struct {
		tail []int // sends per window after the first 5 at once
		want string
	}{{[]int{3, 1}, "[3] [4]"}, {[]int{3, 2}, "[3] [5]"}, {[]int{5, 2, 1}, "[5 2] [5 3]"}, {[]int{0, 0, 4}, "[0 0] [4 4]"}} {
		sent, outs = sent[:first], outs[:first]
		n := 5
		for _, k := range c.tail {
			n += k
		}
		add("tail", n, 0)
		k := 0
		for w, m := range append([]int{5}, c.tail...) {
			for j := 0; j < m; j++ {
				i := first + k
				outs[i].ProducedAt = t0
				outs[i].DecidedAt = t0.Add(time.Duration(w)*time.Second + time.Duration(j)*10*time.Millisecond)
				if w > 0 {
					outs[i].HoldCount, outs[i].DueAt = 1, outs[i].DecidedAt
					outs = append(outs, loadtest.Output{Role: loadtest.RoleHeld, ID: sent[i].ID, Output: output.Output{Decision: "held", DueAt: outs[i].DecidedAt}})
				}
				k++
			}
		}
		got := "no budget speed:tail"
		for _, b := range loadtest.Check(sent, outs, p, t0.Add(time.Hour)).Budgets {
			if b.Budget == "speed:tail" {
				got = fmt.Sprint(b.Whole, b.Demand)
			}
		}
		if got != c.want {
			t.Errorf("a burst sent 5, then %v a window: whole windows and their demand %s, want %s", c.tail, got, c.want)
		}
	}
	sent, outs = sent[:first], outs[:first]
	add("fast", 7, 100*time.Millisecond) // 7 in 0.7 s
	if r := loadtest.Check(sent, outs, p, t0.Add(time.Hour)); r.Violations != 1 || !strings.Contains(r.Problems[0], "budget speed:fast") {
		t.Fatalf("violations %d %v, want one for speed:fast", r.Violations, r.Problems)
	}
}

// TestJudgeIsIndependent: capper report reads the rules itself (judge.go),
// so a bug in the worker's rules is caught rather than repeated. A worker is
// simulated here with the production rules (rules.Plan, capping.Member,
// Scope.Matches) over four random nights of sends to a user in Kolkata: as it is, the report
// agrees with every decision; with a deliberate bug (calendar days bounded
// in UTC rather than the user's zone; the category left out of the tags a
// scope matches; every send taken for important, so reserved slots go to
// any) it allows sends the report flags.
func TestJudgeIsIndependent(t *testing.T) {
	cfg := rules.Config{Priorities: []rules.Priority{{Campaign: "c0", Priority: 8}, {Tag: "promotional", Priority: 2}}, DefaultCaps: []rules.Cap{
		{Name: "today", Calendar: "day", Limit: limit(3), Reserve: &rules.Reserve{Slots: 1, MinPriority: 7}},
		{Name: "promo-today", Calendar: "day", Limit: limit(1), Scope: rules.Scope{Tags: []string{"promotional"}}},
		{Name: "push-hour", Window: rules.Duration(time.Hour), Limit: limit(1), Scope: rules.Scope{Channel: "push"}},
	}}
	rs, err := rules.Compile(cfg, 1)
	if err != nil {
		t.Fatal(err)
	}
	p := loadtest.Policy{Rules: cfg, Segment: func(uint32) (string, bool) { return "", false }}
	rnd := rand.New(rand.NewPCG(1, 2))
	var sent []loadtest.Sent
	var times []time.Time
	// Each evening and night from 19:00 to 03:00 UTC: 00:30 to 08:30 in
	// Kolkata, one local day across two UTC days.
	for day := range 4 {
		evening := time.Date(2026, 11, 20+day, 19, 0, 0, 0, time.UTC)
		for range 30 {
			times = append(times, evening.Add(time.Duration(rnd.IntN(8*3600))*time.Second))
		}
	}
	slices.SortFunc(times, func(a, b time.Time) int { return a.Compare(b) })
	for i := range times {
		sent = append(sent, loadtest.Sent{ID: fmt.Sprint("m", i), JobID: fmt.Sprint("j", i), UserID: 1, Channel: []string{"email", "push", "sms"}[rnd.IntN(3)],
			Category: []string{"marketing", "promotional"}[rnd.IntN(2)], Campaign: fmt.Sprint("c", rnd.IntN(5)), Timezone: "Asia/Kolkata", Kind: loadtest.KindJob})
		if rnd.IntN(4) == 0 {
			sent[i].Priority, sent[i].HasPriority = rnd.IntN(10), true
		}
	}
	type entry struct {
		t      time.Time
		member string
	}
	worker := func(bug string) []loadtest.Output {
		var log []entry
		var outs []loadtest.Output
		for i := range sent {
			s, now := &sent[i], times[i]
			zone, _ := rules.Location(s.Timezone)
			tags := jobs.AllTags(s.Category, s.Tags)
			job := rules.Job{Channel: s.Channel, Category: s.Category, Tags: tags, Campaign: s.Campaign, Zone: zone, Priority: s.Priority, HasPriority: s.HasPriority}
			switch bug {
			case "utc":
				job.Zone = time.UTC
			case "category":
				job.Tags = s.Tags
			case "no reservations":
				job.Priority, job.HasPriority = rules.MaxPriority, true
			}
			member := capping.Member(s.JobID, s.Channel, s.Campaign, job.Tags)
			plan := rs.Plan(job, now, nil)
			ok := true
			for _, c := range plan.Caps {
				if !c.Scope.Matches(member) {
					continue
				}
				since := c.Since
				if c.Window > 0 {
					since = now.Add(-c.Window + time.Millisecond)
				}
				n := 0
				for _, e := range log {
					if !e.t.Before(since) && c.Scope.Matches(e.member) {
						n++
					}
				}
				ok = ok && n < c.Limit
			}
			o := loadtest.Output{Role: "capped", ID: s.ID, Time: now, ProducedAt: now, Output: output.Output{Decision: "capped", DecidedAt: now}}
			if ok {
				log = append(log, entry{now, member})
				o.Role, o.Decision = "allowed", "allowed"
			}
			outs = append(outs, o)
		}
		return outs
	}
	for _, c := range []struct {
		bug, cap string // the cap a buggy worker lets through ("" : none)
	}{{"", ""}, {"utc", `cap "today"`}, {"category", `cap "promo-today"`}, {"no reservations", `reserved for priority 7`}} {
		outs := worker(c.bug)
		allowed := 0
		for _, o := range outs {
			if o.Decision == "allowed" {
				allowed++
			}
		}
		r := loadtest.Check(sent, outs, p, times[len(times)-1].Add(time.Hour))
		problems := strings.Join(r.Problems, "\n")
		switch {
		case allowed < 6 || allowed == len(outs):
			t.Fatalf("worker %q allowed %d of %d: the day does not exercise the caps", c.bug, allowed, len(outs))
		case c.bug == "" && r.Violations != 0:
			t.Errorf("the production rules and the report disagree on %d sends:\n%s", r.Violations, problems)
		case c.bug != "" && (r.Violations == 0 || !strings.Contains(problems, c.cap)):
			t.Errorf("a worker with bug %q allowed %d sends, and the report found %d violations (want %s): %s", c.bug, allowed, r.Violations, c.cap, problems)
		}
	}
}

// TestCheckArbitration: within an arbitration window of a cap's last slot, a
// candidate that won while one of higher priority lost is a violation; the
// higher one winning is not. Priorities come from the job, else the rules.
func TestCheckArbitration(t *testing.T) {
	p := loadtest.Policy{Rules: rules.Config{
		DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(2)}},
		Priorities:  []rules.Priority{{Campaign: "cart", Priority: 9}},
	}, Segment: func(uint32) (string, bool) { return "", false }}
	end := t0.Add(2 * time.Minute)
	for _, c := range []struct {
		name   string
		winner string
		bad    bool
	}{{"the abandoned cart wins", "cart", false}, {"the promotion wins", "promo", true}} {
		sent := []loadtest.Sent{
			{ID: "m-first", JobID: "first", UserID: 5, Channel: "email", Campaign: "news", Kind: loadtest.KindJob},
			{ID: "m-promo", JobID: "promo", UserID: 5, Channel: "email", Campaign: "promo", Kind: loadtest.KindJob},
			{ID: "m-cart", JobID: "cart", UserID: 5, Channel: "push", Campaign: "cart", Kind: loadtest.KindJob},
		}
		held := func(id string) loadtest.Output {
			return loadtest.Output{Role: "held", ID: "m-" + id, Output: output.Output{Decision: "held", Cap: "daily", DueAt: end, HoldCount: 1, Arbitration: "candidate"}}
		}
		final := func(id string) loadtest.Output {
			o := loadtest.Output{Role: "capped", ID: "m-" + id, Time: end, Output: output.Output{Decision: "capped", Cap: "daily", DueAt: end, HoldCount: 1, DecidedAt: end, Arbitration: "lost"}}
			if id == c.winner {
				o.Role, o.Decision, o.Cap, o.Arbitration = "allowed", "allowed", "", "won"
			}
			return o
		}
		outs := []loadtest.Output{{Role: "allowed", ID: "m-first", Time: t0, Output: output.Output{Decision: "allowed", DecidedAt: t0}},
			held("promo"), held("cart"), final("promo"), final("cart")}
		r := loadtest.Check(sent, outs, p, end.Add(time.Minute))
		problems := strings.Join(r.Problems, "\n")
		if r.ArbitrationsWon != 1 || r.ArbitrationsLost != 1 {
			t.Errorf("%s: won %d lost %d, want 1 and 1", c.name, r.ArbitrationsWon, r.ArbitrationsLost)
		}
		if bad := strings.Contains(problems, `job "promo" of priority 0 won the last slot while job "cart" of priority 9 lost`); bad != c.bad || r.Violations != map[bool]int{false: 0, true: 1}[c.bad] {
			t.Errorf("%s: violations %d: %s", c.name, r.Violations, problems)
		}
	}
}

// TestCheckGivenBack: a send whose delivery failed stops counting when its
// feedback was produced: a third send after it is within a cap of 2, one
// before it is not.
func TestCheckGivenBack(t *testing.T) {
	p := loadtest.Policy{Rules: rules.Config{DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(2)}}},
		Segment: func(uint32) (string, bool) { return "", false }, GivenBack: map[string]time.Time{"a": t0.Add(2 * time.Minute)}}
	for _, c := range []struct {
		third      time.Duration
		violations int
	}{{3 * time.Minute, 0}, {time.Minute + 30*time.Second, 1}} {
		var sent []loadtest.Sent
		var outs []loadtest.Output
		for i, at := range []time.Duration{0, time.Minute, c.third} {
			id := string(rune('a' + i))
			sent = append(sent, loadtest.Sent{ID: "m-" + id, JobID: id, UserID: 3, Channel: "email", Kind: loadtest.KindJob})
			outs = append(outs, loadtest.Output{Role: "allowed", ID: "m-" + id, Time: t0.Add(at), Output: output.Output{Decision: "allowed", DecidedAt: t0.Add(at)}})
		}
		if r := loadtest.Check(sent, outs, p, t0.Add(time.Hour)); r.Violations != c.violations {
			t.Errorf("third send %v after the first, feedback for the first at 2m: %d violations, want %d: %v", c.third, r.Violations, c.violations, r.Problems)
		}
	}
	if _, _, evs := loadtest.GenerateEvents([]loadtest.Sent{{ID: "m1", JobID: "j1", UserID: 1, Kind: loadtest.KindJob}}, 1, 1, 1, t0); len(evs) != 2 ||
		evs[0].Kind != loadtest.EventExternal || evs[1].Kind != loadtest.EventFeedback || evs[1].ID != "j1" {
		t.Errorf("events of one job with both shares 1: %+v", evs)
	}
}

// TestCheckPreferences: after a preference was applied, a send beyond the
// user's own limit (the sends before it count too) or of an opted-out tag is
// a violation; before it, or of another channel, it is not.
func TestCheckPreferences(t *testing.T) {
	prefs := loadtest.Prefs([]loadtest.Event{
		{Kind: loadtest.EventPreference, ID: "c:email", UserID: 8, Status: "1:86400000", ProducedAt: t0},
		{Kind: loadtest.EventPreference, ID: "t:promotional", UserID: 9, Status: "0:0", ProducedAt: t0},
	})
	p := loadtest.Policy{Rules: rules.Config{DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(9)}}},
		Segment: func(uint32) (string, bool) { return "", false }, Preferences: prefs}
	type send struct {
		user    uint32
		channel string
		tags    []string
		at      time.Duration
	}
	for _, c := range []struct {
		name  string
		sends []send
		bad   bool
	}{
		{"two emails, the second after the preference", []send{{8, "email", nil, -time.Minute}, {8, "email", nil, time.Minute}}, true},
		{"two emails before it", []send{{8, "email", nil, -2 * time.Minute}, {8, "email", nil, -time.Minute}}, false},
		{"an email and a push", []send{{8, "email", nil, time.Minute}, {8, "push", nil, 2 * time.Minute}}, false},
		{"a promotion after the opt-out", []send{{9, "push", []string{"promotional"}, time.Minute}}, true},
		{"a promotion before it", []send{{9, "push", []string{"promotional"}, -time.Minute}}, false},
	} {
		var sent []loadtest.Sent
		var outs []loadtest.Output
		for i, s := range c.sends {
			id := fmt.Sprint("m", i)
			sent = append(sent, loadtest.Sent{ID: id, JobID: fmt.Sprint("j", i), UserID: s.user, Channel: s.channel, Tags: s.tags, Kind: loadtest.KindJob})
			outs = append(outs, loadtest.Output{Role: "allowed", ID: id, Time: t0.Add(s.at), Output: output.Output{Decision: "allowed", DecidedAt: t0.Add(s.at)}})
		}
		r := loadtest.Check(sent, outs, p, t0.Add(time.Hour))
		if bad := r.Violations > 0; bad != c.bad || (bad && !strings.Contains(strings.Join(r.Problems, ""), "own preference")) {
			t.Errorf("%s: violations %d %v, want a violation: %v", c.name, r.Violations, r.Problems, c.bad)
		}
	}
}

// TestCheckVIP: while a user's VIP exemption holds, sends beyond the rules'
// caps are not violations, and a job capped or held by a rules cap is; a
// job refused by the user's own preference, or capped before the exemption
// was applied, is not.
func TestCheckVIP(t *testing.T) {
	prefs := loadtest.Prefs([]loadtest.Event{
		{Kind: loadtest.EventPreference, ID: "vip", UserID: 8, Status: fmt.Sprint(t0.Add(time.Hour).UnixMilli()), ProducedAt: t0},
		{Kind: loadtest.EventPreference, ID: "t:promotional", UserID: 8, Status: "0:0", ProducedAt: t0},
	})
	if len(prefs[8]) != 2 || !prefs[8][0].VIPUntil.Equal(t0.Add(time.Hour)) {
		t.Fatalf("preferences read from the events: %+v", prefs)
	}
	p := loadtest.Policy{Rules: rules.Config{DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(1)}}},
		Segment: func(uint32) (string, bool) { return "", false }, Preferences: prefs}
	for _, c := range []struct {
		name string
		outs []out
		bad  string // in the problem, "" for none
	}{
		{"two sends while VIP", []out{{"allowed", "", time.Minute}, {"allowed", "", 2 * time.Minute}}, ""},
		{"two sends, the second after the exemption", []out{{"allowed", "", time.Minute}, {"allowed", "", 61 * time.Minute}}, "which allows 1"},
		{"two sends before it was applied", []out{{"allowed", "", -2 * time.Minute}, {"allowed", "", -time.Minute}}, "which allows 1"},
		{"capped by the rules while VIP", []out{{"allowed", "", time.Minute}, {"capped", "daily", 2 * time.Minute}}, "while the user was VIP"},
		{"held by the rules while VIP", []out{{"allowed", "", time.Minute}, {"held", "daily", 2 * time.Minute}}, "while the user was VIP"},
		{"refused by its own preference while VIP", []out{{"capped", "preference:tag:promotional", time.Minute}}, ""},
		{"capped by the rules before it was applied", []out{{"allowed", "", -2 * time.Minute}, {"capped", "daily", -time.Minute}}, ""},
	} {
		r := checkUser8(c.outs, p)
		problems := strings.Join(r.Problems, "\n")
		if (c.bad == "") != (r.Violations == 0) || !strings.Contains(problems, c.bad) {
			t.Errorf("%s: violations %d (%s), want a violation saying %q", c.name, r.Violations, problems, c.bad)
		}
	}
}

// TestCheckVIPProducedMidway: an exemption sent during a blast was applied
// at some moment between its production (SentAt) and when loadgen saw it
// applied (ProducedAt). A send allowed in between may have been exempt, so it
// is not held to the rules' caps; one capped in between is no violation
// either; the exemption is certain, and judged, only from when it was seen.
func TestCheckVIPProducedMidway(t *testing.T) {
	var buf bytes.Buffer
	if err := loadtest.WriteEvents(&buf, []loadtest.Event{{Kind: loadtest.EventPreference, ID: "vip", UserID: 8,
		Status: fmt.Sprint(t0.Add(time.Hour).UnixMilli()), SentAt: t0.Add(-30 * time.Second), ProducedAt: t0}}); err != nil {
		t.Fatal(err)
	}
	evs, err := loadtest.ReadEvents(&buf)
	if err != nil || len(evs) != 1 || !evs[0].SentAt.Equal(t0.Add(-30*time.Second)) || !evs[0].ProducedAt.Equal(t0) {
		t.Fatalf("events manifest read back: %+v %v", evs, err)
	}
	p := loadtest.Policy{Rules: rules.Config{DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(1)}}},
		Segment: func(uint32) (string, bool) { return "", false }, Preferences: loadtest.Prefs(evs)}
	for _, c := range []struct {
		name   string
		outs   []out
		bad    string // in the problem, "" for none
		judged int    // sends decided while the user was certainly VIP
	}{
		{"a second send allowed between its production and its application", []out{{"allowed", "", -2 * time.Minute}, {"allowed", "", -10 * time.Second}}, "", 0},
		{"a second send capped between them", []out{{"allowed", "", -2 * time.Minute}, {"capped", "daily", -10 * time.Second}}, "", 0},
		{"two sends before it was produced", []out{{"allowed", "", -2 * time.Minute}, {"allowed", "", -time.Minute}}, "which allows 1", 0},
		{"capped by the rules once seen applied", []out{{"allowed", "", -2 * time.Minute}, {"capped", "daily", time.Second}}, "while the user was VIP", 1},
		{"allowed once seen applied", []out{{"allowed", "", -2 * time.Minute}, {"allowed", "", time.Second}, {"allowed", "", 2 * time.Second}}, "", 2},
	} {
		r := checkUser8(c.outs, p)
		problems := strings.Join(r.Problems, "\n")
		if (c.bad == "") != (r.Violations == 0) || !strings.Contains(problems, c.bad) || r.VIPJudged != c.judged {
			t.Errorf("%s: violations %d (%s), %d judged as VIP; want a violation saying %q, %d judged", c.name, r.Violations, problems, r.VIPJudged, c.bad, c.judged)
		}
	}
}

// out is one output of a job of user 8 (an email), decided at t0 + at.
type out struct {
	role, cap string
	at        time.Duration
}

// checkUser8 runs the report's check on outs, one job each.
func checkUser8(outs []out, p loadtest.Policy) loadtest.Result {
	var sent []loadtest.Sent
	var os []loadtest.Output
	for i, o := range outs {
		id := fmt.Sprint("m", i)
		sent = append(sent, loadtest.Sent{ID: id, JobID: fmt.Sprint("j", i), UserID: 8, Channel: "email", Kind: loadtest.KindJob})
		os = append(os, loadtest.Output{Role: o.role, ID: id, Time: t0.Add(o.at),
			Output: output.Output{Decision: o.role, Cap: o.cap, DecidedAt: t0.Add(o.at), DueAt: t0.Add(2 * time.Hour)}})
	}
	return loadtest.Check(sent, os, p, t0.Add(time.Hour))
}

// TestReportMemoryPerJob: capper report judges a blast in a few dozen bytes
// per job, so that ten million jobs fit in well under a gigabyte. A blast of
// loadgen's shape is read from its manifest and judged on one allowed output
// per message (most jobs allowed: the most the report keeps); what stays on
// the heap after the verdict, per job, is bounded. The verdict itself must
// be the one a slice of the outputs gives.
func TestReportMemoryPerJob(t *testing.T) {
	const jobs = 200_000
	_, sent, err := loadtest.Generate(loadtest.GenConfig{Jobs: jobs, Users: jobs / 5, Seed: 3, ExpireShare: 0.1, PriorityShare: 0.1})
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	if err := loadtest.WriteManifest(&buf, sent); err != nil {
		t.Fatal(err)
	}
	outputOf := func(i int) loadtest.Output {
		o := loadtest.Output{Role: loadtest.RoleAllowed, ID: sent[i].ID, Time: t0.Add(time.Duration(i) * time.Millisecond), ProducedAt: t0,
			Output: output.Output{Decision: output.DecisionAllowed}}
		switch {
		case sent[i].Kind == loadtest.KindMalformed:
			o.Role, o.Decision = loadtest.RoleDLQ, output.DecisionDLQ
		case sent[i].Kind == loadtest.KindDuplicate:
			o.Decision = output.DecisionDuplicate
		}
		return o
	}
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	none := compile(t, []string{"transactional"}) // no caps: every allowed send is fine
	before := heap()
	m, err := loadtest.ReadManifest(&buf)
	if err != nil || m.Len() != jobs {
		t.Fatalf("manifest: %v, %d lines", err, m.Len())
	}
	c := loadtest.NewChecker(m, none)
	for i := range jobs {
		o := outputOf(i)
		c.Add(&o)
	}
	r := c.Result(t0.Add(time.Hour))
	perJob := (float64(heap()) - float64(before)) / jobs
	runtime.KeepAlive(c)
	runtime.KeepAlive(&buf) // the manifest's bytes were on the heap before: they count neither way
	if !r.OK() || r.Allowed+r.Duplicates+r.Exempt+r.DLQ != jobs {
		t.Fatalf("verdict %+v (problems %q); want every job accounted for", r, r.Problems)
	}
	outs := make([]loadtest.Output, jobs)
	for i := range outs {
		outs[i] = outputOf(i)
	}
	if whole := loadtest.Check(sent, outs, none, t0.Add(time.Hour)); !reflect.DeepEqual(whole, r) {
		t.Fatalf("judged one output at a time: %+v\nfrom a slice: %+v", r, whole)
	}
	t.Logf("the manifest and the verdict keep %.1f bytes per job", perJob)
	if perJob > 48 {
		t.Fatalf("the report keeps %.1f bytes per job; ten million jobs would take %.0f MB (want at most 48 bytes per job)", perJob, perJob*10)
	}
}

// TestCheckCollapse: of a user's sends with one collapse key, the newest
// held one released and the others collapsed by it pass; a send released
// after a newer one was held, a collapse naming an older send or another
// key's, and two sends of a key within the window are violations.
func TestCheckCollapse(t *testing.T) {
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	job := func(id string, user uint32) loadtest.Sent {
		return loadtest.Sent{ID: "m-" + id, JobID: id, UserID: user, Channel: "push", Category: "marketing", Kind: loadtest.KindJob}
	}
	held := func(id, key string, since int) loadtest.Output {
		return loadtest.Output{Role: "held", ID: "m-" + id, Time: at(since), Output: output.Output{Decision: "held", Cap: "quiet_hours", HoldCount: 1,
			HeldSince: at(since), DueAt: at(100), DecidedAt: at(since), CollapseKey: key}}
	}
	released := func(id, key string, since, decided int) loadtest.Output {
		return loadtest.Output{Role: "allowed", ID: "m-" + id, Time: at(decided), Output: output.Output{Decision: "allowed", HoldCount: 1,
			HeldSince: at(since), DueAt: at(100), DecidedAt: at(decided), CollapseKey: key}}
	}
	collapsed := func(id, key, by string, since, decided int) loadtest.Output {
		return loadtest.Output{Role: "capped", ID: "m-" + id, Time: at(decided), Output: output.Output{Decision: "capped", Cap: "collapsed", Reason: "collapsed",
			HoldCount: 1, HeldSince: at(since), DueAt: at(100), DecidedAt: at(decided), CollapseKey: key, CollapsedBy: by}}
	}
	fresh := func(id, key string, produced, decided int) loadtest.Output {
		return loadtest.Output{Role: "allowed", ID: "m-" + id, Time: at(decided), ProducedAt: at(produced), Output: output.Output{Decision: "allowed", DecidedAt: at(decided), CollapseKey: key}}
	}
	pol := compile(t, nil, rules.Cap{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(10)})
	pol.Rules.Collapse = &rules.Collapse{Window: rules.Duration(time.Hour)}
	sent := []loadtest.Sent{job("a1", 1), job("a2", 1), job("a3", 1), job("b1", 2), job("b2", 2), job("c1", 3), job("c2", 3), job("d1", 4), job("d2", 4), job("e1", 5), job("e2", 5)}
	good := []loadtest.Output{
		held("a1", "deal", 1), held("a2", "deal", 2), held("a3", "deal", 3),
		released("a3", "deal", 3, 100), collapsed("a1", "deal", "a3", 1, 100), collapsed("a2", "deal", "a3", 2, 101),
		fresh("e1", "news", 1, 1), fresh("e2", "news", 1800, 1800), // a key's second send, collapsed below
	}
	good[len(good)-1] = loadtest.Output{Role: "capped", ID: "m-e2", Time: at(1800), ProducedAt: at(1800), Output: output.Output{Decision: "capped", Cap: "collapsed",
		Reason: "collapsed", DecidedAt: at(1800), CollapseKey: "news", CollapsedBy: "e1"}}
	if r := loadtest.Check(sent[:3], good[:6], pol, at(200)); r.Violations != 0 {
		t.Errorf("newest released, the others collapsed by it: %d violations %v", r.Violations, r.Problems)
	}
	if r := loadtest.Check(append(slices.Clone(sent[:3]), sent[9:]...), good, pol, at(2000)); r.Violations != 0 {
		t.Errorf("a send collapsed by one sent within the window: %d violations %v", r.Violations, r.Problems)
	}
	// A resend of f1 (a new message of the job, produced after f2) is the key's newest: f2 collapses by it.
	resent := []loadtest.Sent{job("f1", 6), job("f2", 6), job("f1", 6)}
	resent[2].ID, resent[2].Kind = "m-f1-again", loadtest.KindDuplicate
	again := fresh("f1", "deal", 3, 3)
	again.ID = "m-f1-again"
	f2 := collapsed("f2", "deal", "f1", 2, 3)
	f2.HoldCount, f2.DueAt, f2.ProducedAt = 0, time.Time{}, at(2)
	f2.HeldSince = time.Time{}
	outs := []loadtest.Output{fresh("f1", "deal", 1, 1), f2, again}
	outs[2].Decision = "duplicate"
	if r := loadtest.Check(resent, outs, pol, at(200)); r.Violations != 0 {
		t.Errorf("a send collapsed by a resend of an older job: %d violations %v", r.Violations, r.Problems)
	}
	bad := []loadtest.Output{
		// b1 released after b2, newer, was held
		held("b1", "deal", 1), held("b2", "deal", 2), released("b1", "deal", 1, 100), released("b2", "deal", 2, 100),
		// c2 collapsed by c1, older and never sent
		held("c1", "deal", 1), held("c2", "deal", 2), collapsed("c1", "deal", "c2", 1, 100), collapsed("c2", "deal", "c1", 2, 100),
		// d1 and d2 sent 30 min apart within the hour's window
		fresh("d1", "news", 0, 0), fresh("d2", "news", 1800, 1800),
	}
	r := loadtest.Check(sent[3:9], bad, pol, at(2000))
	for _, want := range []string{`job "b1" of key "deal" sent`, `job "c2" collapsed by "c1", which is neither newer`, `jobs "d1" and "d2" of key "news" sent 30m0s apart`} {
		if !strings.Contains(strings.Join(r.Problems, "\n"), want) {
			t.Errorf("no problem mentions %s: %v", want, r.Problems)
		}
	}
	if r.Violations != 3 {
		t.Errorf("%d violations, want 3: %v", r.Violations, r.Problems)
	}
}
