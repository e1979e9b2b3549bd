package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/collapse"
	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/output"
	"github.com/capper-dev/capper/rules"
)

// fakeCollapser fails while down; up, it lets every send go and records the
// sends checked and sent.
type fakeCollapser struct {
	mu            sync.Mutex
	down          bool
	checked, sent []string
	now           func() time.Time
	advance       func() // each failed call takes some of the worker's clock
}

func (c *fakeCollapser) Check(_ context.Context, sends []collapse.Send, _ time.Time) ([]collapse.Verdict, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.down {
		c.advance()
		return nil, errors.New("i/o timeout")
	}
	for _, s := range sends {
		c.checked = append(c.checked, s.Job+"@"+s.Key)
	}
	return make([]collapse.Verdict, len(sends)), nil
}

func (c *fakeCollapser) Sent(_ context.Context, sends []collapse.Send, _ []time.Time, _ time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.down {
		c.advance()
		return errors.New("i/o timeout")
	}
	for _, s := range sends {
		c.sent = append(c.sent, s.Job)
	}
	return nil
}

func keyedJob(id string, user uint32, category, key string) kafka.Message {
	m := job(id, user, category)
	var v map[string]any
	_ = json.Unmarshal(m.Value, &v)
	v["collapse_key"] = key
	m.Value, _ = json.Marshal(v)
	return m
}

// TestCollapseKeysWhileRedisFails: while Redis fails, a keyed send of a
// category that fails open goes out unchecked after its limit (its key
// unchecked too); one that fails closed waits, and once Redis is back is
// checked, decided and, its key having a window, recorded as sent. A send
// without a key is never checked.
func TestCollapseKeysWhileRedisFails(t *testing.T) {
	var mu sync.Mutex
	now := t0
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	col := &fakeCollapser{down: true, advance: func() { mu.Lock(); now = now.Add(10 * time.Millisecond); mu.Unlock() }}
	d := &fakeDecider{decide: func(_ int, r capping.Request) (capping.Decision, error) {
		col.mu.Lock()
		down := col.down
		col.mu.Unlock()
		if down {
			col.advance()
			return capping.Decision{}, errors.New("i/o timeout")
		}
		return capping.Decision{Allowed: true, At: clock()}, nil
	}}
	limit := 10
	rs, err := rules.Compile(rules.Config{DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: &limit}},
		FailOpen: []rules.FailOpen{{Category: "alerts", After: rules.Duration(50 * time.Millisecond)}}, Collapse: &rules.Collapse{Window: rules.Duration(time.Hour)}}, 1)
	if err != nil {
		t.Fatal(err)
	}
	h := start(t, consumer.Config{Decider: d, Rules: rs, BatchSize: 1, Clock: clock, Collapse: col,
		UserKey: func(_ capping.Space, u uint32) string { return fmt.Sprintf("fc:{%d}", u) }})
	h.send(keyedJob("alert", 1, "alerts", "a"))
	outs := h.waitOutputs(t, 1)
	if got := header(outs[0], output.HeaderDecision); got != output.DecisionUnchecked || header(outs[0], output.HeaderCollapseKey) != "a" {
		t.Fatalf("a keyed alert while Redis is down: %q (key %q), want unchecked (key a)", got, header(outs[0], output.HeaderCollapseKey))
	}
	h.send(keyedJob("promo", 1, "marketing", "p"), job("plain", 2, "marketing"))
	for end := time.Now().Add(10 * time.Second); clock().Sub(t0) < 300*time.Millisecond; time.Sleep(time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("the keyed marketing job was not retried in 10 s")
		}
	}
	if n := len(h.w.outputs()); n != 1 {
		t.Fatalf("%d outputs: a fail-closed keyed job went out while Redis was down", n)
	}
	col.mu.Lock()
	col.down = false
	col.mu.Unlock()
	outs = h.waitOutputs(t, 3)
	by := byJob(outs)
	if header(by["promo"], output.HeaderDecision) != output.DecisionAllowed || header(by["plain"], output.HeaderDecision) != output.DecisionAllowed {
		t.Fatalf("after Redis came back: promo %q, plain %q, want both allowed", header(by["promo"], output.HeaderDecision), header(by["plain"], output.HeaderDecision))
	}
	col.mu.Lock()
	defer col.mu.Unlock()
	if fmt.Sprint(col.checked) != "[promo@p]" || fmt.Sprint(col.sent) != "[promo]" {
		t.Errorf("checked %v, sent %v; want only the keyed marketing job, checked and then recorded as sent", col.checked, col.sent)
	}
}
