package loadtest_test

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/loadtest"
)

var t0 = time.Date(2026, 11, 21, 16, 0, 0, 0, time.UTC)

func caps(uint32) []capping.Cap {
	return []capping.Cap{{Name: "daily", Window: 24 * time.Hour, Limit: 2}, {Name: "push", Window: 24 * time.Hour, Limit: 1, Channel: "push"}}
}

// policy: the caps above; the "transactional" category is exempt.
var policy = loadtest.Policy{Caps: caps, Exempt: func(c string) bool { return c == "transactional" }}

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
		{Role: "allowed", ID: "m1", Decision: "allowed", Segment: "new", Time: at(10), ProducedAt: at(0)},
		{Role: "allowed", ID: "m2", Decision: "allowed", Segment: "new", Time: at(20), ProducedAt: at(0)},
		{Role: "capped", ID: "m3", Decision: "capped", Segment: "new", Cap: "daily", Time: at(30), ProducedAt: at(0)},
		{Role: "allowed", ID: "m4", Decision: "duplicate", Segment: "new", Time: at(40), ProducedAt: at(0)},
		{Role: "allowed", ID: "m5", Decision: "exempt", Segment: "default", Time: at(50), ProducedAt: at(0)},
		{Role: "dlq", ID: "m6", Decision: "dlq", Time: at(1000), ProducedAt: at(0)},
	}
	return sent, outs
}

func TestCheckCleanRun(t *testing.T) {
	sent, outs := scenario()
	r := loadtest.Check(sent, outs, policy)
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
		}, 0, 1, `cap "daily" allows 2`},
		{"a channel cap exceeded", func(s []loadtest.Sent, o []loadtest.Output) ([]loadtest.Sent, []loadtest.Output) {
			s[0].Channel = "push" // j1 and j2 both push: cap 1
			return s, o
		}, 0, 1, `cap "push" allows 1`},
		{"a job in two topics", func(s []loadtest.Sent, o []loadtest.Output) ([]loadtest.Sent, []loadtest.Output) {
			return s, append(o, loadtest.Output{Role: "capped", ID: "m4", Decision: "capped", Time: t0})
		}, 1, 0, "2 output topics"},
		{"a malformed message forwarded", func(s []loadtest.Sent, o []loadtest.Output) ([]loadtest.Sent, []loadtest.Output) {
			o[5].Role = "allowed"
			return s, o
		}, 0, 1, "malformed"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sent, outs := tt.mutate(scenario())
			r := loadtest.Check(sent, outs, policy)
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
	one := func(uint32) []capping.Cap { return []capping.Cap{{Name: "d", Window: 24 * time.Hour, Limit: 1}} }
	for gap, violations := range map[time.Duration]int{24 * time.Hour: 0, 24*time.Hour - time.Millisecond: 1} {
		outs := []loadtest.Output{
			{Role: "allowed", ID: "a", Decision: "allowed", Time: t0},
			{Role: "allowed", ID: "b", Decision: "allowed", Time: t0.Add(gap)},
		}
		if r := loadtest.Check(sent, outs, loadtest.Policy{Caps: one}); r.Violations != violations {
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
	if err != nil || len(back) != len(sent) || back[42] != sent[42] {
		t.Fatalf("manifest round trip: %v, %d entries", err, len(back))
	}
}

// TestCheckUncheckedSends: a send that a fail-open rule let out unchecked is
// counted apart and not held against the caps, while a checked send over the
// cap still is a violation.
func TestCheckUncheckedSends(t *testing.T) {
	sent, outs := scenario()
	// j3 went out unchecked while Redis was down: 3 sends, cap 2, no violation.
	outs[2].Role, outs[2].Decision, outs[2].Cap = "allowed", "unchecked", ""
	r := loadtest.Check(sent, outs, policy)
	if !r.OK() || r.Unchecked != 1 || r.Allowed != 2 {
		t.Fatalf("unchecked send: ok %v, unchecked %d, allowed %d (problems %v); want ok, 1, 2", r.OK(), r.Unchecked, r.Allowed, r.Problems)
	}
	// A checked send over the cap is still caught with unchecked ones around.
	sent = append(sent, loadtest.Sent{ID: "m7", JobID: "j7", UserID: 1, Channel: "email", Category: "marketing", Kind: loadtest.KindJob})
	outs = append(outs, loadtest.Output{Role: "allowed", ID: "m7", Decision: "allowed", Time: t0.Add(time.Second), ProducedAt: t0})
	if r := loadtest.Check(sent, outs, policy); r.Violations != 1 {
		t.Fatalf("a checked third send: %d violations, want 1 (problems %v)", r.Violations, r.Problems)
	}
}

// TestCheckExemptionComesFromTheRules: which categories are not counted is
// the worker's configuration, not a fixed name.
func TestCheckExemptionComesFromTheRules(t *testing.T) {
	sent, outs := scenario()
	sent = append(sent, loadtest.Sent{ID: "m8", JobID: "j8", UserID: 1, Channel: "email", Category: "receipts", Kind: loadtest.KindExempt})
	outs = append(outs, loadtest.Output{Role: "allowed", ID: "m8", Decision: "exempt", Time: t0.Add(time.Second), ProducedAt: t0})
	receipts := loadtest.Policy{Caps: caps, Exempt: func(c string) bool { return c == "receipts" }}
	if r := loadtest.Check(sent, outs, receipts); !r.OK() {
		t.Fatalf("receipts exempt: %v, want no violation", r.Problems)
	}
	if r := loadtest.Check(sent, outs, policy); r.Violations != 1 {
		t.Fatalf("receipts counted (only transactional exempt): %d violations, want 1 (user 1 has 3 sends, cap 2)", r.Violations)
	}
}
