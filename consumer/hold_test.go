package consumer_test

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/output"
	"github.com/capper-dev/capper/rules"
)

var t0 = time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)

func holdRules(t *testing.T, yaml rules.Config) *rules.Rules {
	t.Helper()
	r, err := rules.Compile(yaml, 1)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func intp(n int) *int { return &n }

func wheel(t *testing.T) *hold.Wheel {
	t.Helper()
	w, err := hold.NewWheel("delay.", []time.Duration{time.Second, 10 * time.Second, time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func withExpiry(m kafka.Message, at time.Time) kafka.Message {
	var v map[string]any
	_ = json.Unmarshal(m.Value, &v)
	v["expires_at"] = at.Format(time.RFC3339)
	m.Value, _ = json.Marshal(v)
	return m
}

// TestCappedJobIsHeld: a capped job under a hold policy goes to the tier that
// fits its retry-at, with an audit record; one that cannot be held is capped
// with the reason.
func TestCappedJobIsHeld(t *testing.T) {
	rs := holdRules(t, rules.Config{
		OnCapped:    &rules.OnCapped{Policy: "hold", MaxHold: rules.Duration(time.Hour)},
		DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: intp(1)}},
	})
	retry := map[string]time.Time{
		"held": t0.Add(90 * time.Second), "never": {}, "late": t0.Add(2 * time.Hour),
		"expiring": t0.Add(90 * time.Second),
	}
	d := &fakeDecider{decide: func(_ int, r capping.Request) (capping.Decision, error) {
		return capping.Decision{Cap: "daily", RetryAt: retry[r.JobID], At: t0}, nil
	}}
	h := start(t, consumer.Config{Rules: rs, Decider: d, Wheel: wheel(t), Clock: func() time.Time { return t0 }})
	h.send(job("held", 1, ""), job("never", 2, ""), job("late", 3, ""), withExpiry(job("expiring", 4, ""), t0.Add(time.Minute)))
	outs := h.waitOutputs(t, 5)
	var tier, audit kafka.Message
	capped := map[string]kafka.Message{}
	for _, o := range outs {
		switch o.Topic {
		case "delay.1m":
			tier = o
		case "held":
			audit = o
		case "capped":
			for id := range byJob([]kafka.Message{o}) {
				capped[id] = o
			}
		default:
			t.Errorf("unexpected output on %s", o.Topic)
		}
	}
	s, ok, err := hold.ParseState(tier.Headers)
	if err != nil || !ok {
		t.Fatalf("tier message without hold state: %v", err)
	}
	want := hold.State{Since: t0, Due: t0.Add(90 * time.Second), Wake: t0.Add(time.Minute), Count: 1, Reason: "daily"}
	if !s.Since.Equal(want.Since) || !s.Due.Equal(want.Due) || !s.Wake.Equal(want.Wake) || s.Count != 1 || s.Reason != "daily" {
		t.Errorf("hold state %+v, want %+v", s, want)
	}
	if header(audit, output.HeaderDecision) != "held" || header(audit, output.HeaderDueAt) != output.FormatTime(want.Due) || header(audit, output.HeaderCap) != "daily" {
		t.Errorf("audit record headers %v", audit.Headers)
	}
	for id, reason := range map[string]string{"never": consumer.ReasonNever, "late": consumer.ReasonMaxHold, "expiring": consumer.ReasonExpired} {
		if got := header(capped[id], output.HeaderReason); got != reason {
			t.Errorf("%s: reason %q, want %q", id, got, reason)
		}
	}
}

// tierMessage is a job on a delay tier with its hold state.
func tierMessage(id string, user uint32, s hold.State) kafka.Message {
	m := job(id, user, "")
	m.Topic = "delay.10s"
	m.Headers = s.AppendHeaders([]kafka.Header{{Key: "trace", Value: []byte("x")}})
	return m
}

// TestTierWorkerMovesOrReleases: a tier's worker moves a job that is not due
// to the tier that fits what is left, without asking Redis, and decides a due
// one again: its output carries how often and how long it was held, and the
// original headers without the hold state.
func TestTierWorkerMovesOrReleases(t *testing.T) {
	rs := holdRules(t, rules.Config{
		OnCapped:    &rules.OnCapped{Policy: "hold", MaxHold: rules.Duration(time.Hour)},
		DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: intp(1)}},
	})
	d := &fakeDecider{decide: func(_ int, r capping.Request) (capping.Decision, error) {
		return capping.Decision{Allowed: true, At: t0}, nil
	}}
	h := start(t, consumer.Config{Rules: rs, Decider: d, Wheel: wheel(t), Tier: "10s", Clock: func() time.Time { return t0 }})
	since := t0.Add(-5 * time.Minute)
	h.send(
		tierMessage("later", 1, hold.State{Since: since, Due: t0.Add(15 * time.Second), Wake: t0, Count: 2, Reason: "daily"}),
		tierMessage("due", 2, hold.State{Since: since, Due: t0.Add(-200 * time.Millisecond), Wake: t0, Count: 2, Reason: "daily"}),
	)
	outs := byJob(h.waitOutputs(t, 2))
	moved, released := outs["later"], outs["due"]
	if moved.Topic != "delay.10s" {
		t.Errorf("a job due in 15 s moved to %q, want delay.10s", moved.Topic)
	}
	if s, _, _ := hold.ParseState(moved.Headers); !s.Wake.Equal(t0.Add(10*time.Second)) || s.Count != 2 {
		t.Errorf("moved job's state %+v: want wake at +10s, count unchanged", s)
	}
	for _, reqs := range d.requests() {
		for _, r := range reqs {
			if r.JobID == "later" {
				t.Errorf("a job that is not due was decided")
			}
		}
	}
	if released.Topic != "allowed" || header(released, output.HeaderHoldCount) != "2" || header(released, output.HeaderHeldFor) != "300.000" ||
		header(released, output.HeaderDueAt) != output.FormatTime(t0.Add(-200*time.Millisecond)) || header(released, "trace") != "x" {
		t.Errorf("released job on %s with headers %v", released.Topic, released.Headers)
	}
	if n := len(released.Headers); header(released, output.HeaderWakeAt) != "" || n != 9 { // trace, 7 of capper's, capper-priority
		t.Errorf("released job keeps its tier state or misses headers: %v", released.Headers)
	}
}

// TestQuietHoursAndExpiry: quiet hours hold a send without asking Redis, or
// under drop refuse it after a duplicate check; an expired job is refused
// likewise.
func TestQuietHoursAndExpiry(t *testing.T) {
	rs := holdRules(t, rules.Config{
		DefaultCaps:       []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: intp(3)}},
		DefaultQuietHours: &rules.QuietHours{From: "11:00", To: "12:30"},
		Categories: []rules.Category{
			{Name: "promo", OnCapped: &rules.OnCapped{Policy: "hold", MaxHold: rules.Duration(time.Hour)}},
			{Name: "digest", OnCapped: &rules.OnCapped{Policy: "drop"}},
		},
	})
	d := &fakeDecider{decide: func(_ int, r capping.Request) (capping.Decision, error) {
		if len(r.Caps) == 1 && r.Caps[0].Limit == 0 { // a refusal: not a duplicate here
			return capping.Decision{Cap: r.Caps[0].Name, At: t0}, nil
		}
		return capping.Decision{Allowed: true, At: t0}, nil
	}}
	h := start(t, consumer.Config{Rules: rs, Decider: d, Wheel: wheel(t), Clock: func() time.Time { return t0 }})
	h.send(job("promo", 1, "promo"), job("digest", 2, "digest"), withExpiry(job("old", 3, "promo"), t0.Add(-time.Second)),
		job("receipt", 4, "transactional"))
	outs := h.waitOutputs(t, 5)
	topics := map[string][]string{}
	for _, o := range outs {
		for id := range byJob([]kafka.Message{o}) {
			topics[id] = append(topics[id], o.Topic)
			if o.Topic == "capped" {
				topics[id] = append(topics[id], header(o, output.HeaderCap)+"/"+header(o, output.HeaderReason))
			}
			if o.Topic == "held" && header(o, output.HeaderDueAt) != output.FormatTime(t0.Add(30*time.Minute)) {
				t.Errorf("held until %s, want the end of quiet hours", header(o, output.HeaderDueAt))
			}
		}
	}
	want := map[string]string{"promo": "[delay.1m held]", "digest": "[capped quiet_hours/quiet_hours]", "old": "[capped expired/expired]", "receipt": "[allowed]"}
	for id, w := range want {
		if got := fmtList(topics[id]); got != w {
			t.Errorf("%s: %s, want %s", id, got, w)
		}
	}
	for _, reqs := range d.requests() {
		for _, r := range reqs {
			if r.JobID == "promo" || r.JobID == "receipt" {
				t.Errorf("%s went to Redis", r.JobID)
			}
		}
	}
}

func fmtList(s []string) string { return fmt.Sprint(s) }
