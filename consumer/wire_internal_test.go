package consumer

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/output"
	"github.com/segmentio/kafka-go"
)

// TestEncoderFormatsEachTime: the encoder formats each distinct decision
// and retry-at instant of a batch once and hands it to every job of that
// instant; every message carries its own job's times, whatever their
// order, location or sub-millisecond part.
func TestEncoderFormatsEachTime(t *testing.T) {
	e := newEncoder(Topics{Allowed: "allowed", Capped: "capped", DLQ: "dlq"}, false, 1<<20, 6, 0)
	t0 := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	paris := time.FixedZone("CET", 3600)
	outcomes := []Outcome{
		{Kind: Capped, Cap: "daily", RetryAt: t0.Add(time.Hour), DecidedAt: t0},
		{Kind: Capped, Cap: "daily", RetryAt: t0.Add(2 * time.Hour), DecidedAt: t0.Add(time.Millisecond)},
		{Kind: Capped, Cap: "daily", RetryAt: t0.Add(time.Hour).In(paris), DecidedAt: t0}, // the first's instants
		{Kind: Capped, Cap: "daily", RetryAt: t0.Add(time.Hour + 1500*time.Microsecond), DecidedAt: t0.In(paris)},
		{Kind: Capped, Cap: "never", DecidedAt: t0.Add(time.Millisecond)}, // no retry-at
		{Kind: Allowed, DecidedAt: t0.Add(2 * time.Millisecond)},
	}
	var outs []kafka.Message
	for i := range outcomes {
		outs = e.append(outs, &kafka.Message{Value: []byte("{}")}, "s", &outcomes[i])
	}
	if len(outs) != len(outcomes) {
		t.Fatalf("%d messages for %d outcomes", len(outs), len(outcomes))
	}
	get := func(m kafka.Message, key string) (string, bool) {
		for _, h := range m.Headers {
			if h.Key == key {
				return string(h.Value), true
			}
		}
		return "", false
	}
	for i, o := range outcomes {
		if got, _ := get(outs[i], output.HeaderDecidedAt); got != output.FormatTime(o.DecidedAt) {
			t.Errorf("job %d: decided-at %q, want %q", i, got, output.FormatTime(o.DecidedAt))
		}
		if o.Kind != Capped {
			continue
		}
		want := ""
		if !o.RetryAt.IsZero() {
			want = o.RetryAt.UTC().Format(time.RFC3339Nano)
		}
		if got, ok := get(outs[i], output.HeaderRetryAt); !ok || got != want {
			t.Errorf("job %d: retry-at %q (present %v), want %q", i, got, ok, want)
		}
	}
	if n, m := len(e.hv.decided), len(e.hv.retry); n != 3 || m != 3 {
		t.Errorf("formatted %d decision times and %d retry-at times; want 3 of each, one per instant", n, m)
	}
}

// TestEncoderHeadersOfTheirOwn: the batch's room for headers is cut into
// one part a message; a message with more headers than its part (a released
// send capped and collapsed, with a priority's reservation: 15 of capper's
// and its job's 2) grows its own, and leaves the next message's as it was.
func TestEncoderHeadersOfTheirOwn(t *testing.T) {
	t0 := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	var want [][]kafka.Header
	var outs []kafka.Message
	e := newEncoder(Topics{Allowed: "allowed", Capped: "capped", DLQ: "dlq"}, false, 1<<20, 3, 6)
	for i := range 3 {
		o := Outcome{Kind: Capped, Cap: fmt.Sprint("cap-", i), RetryAt: t0.Add(time.Hour), DecidedAt: t0, Reason: "collapsed",
			CollapsedBy: fmt.Sprint("job-", i+10), CollapseKey: fmt.Sprint("key-", i), Arbitration: "a", ReservedFor: 90,
			Hold: hold.State{Count: 2, Since: t0.Add(-time.Hour), Due: t0}}
		job := []kafka.Header{{Key: "trace", Value: []byte(fmt.Sprint("t", i))}, {Key: "tenant", Value: []byte("x")}}
		outs = e.append(outs, &kafka.Message{Value: []byte("{}"), Headers: job}, "s", &o)
		want = append(want, slices.Clone(outs[i].Headers))
	}
	for i, m := range outs {
		if len(m.Headers) != 17 {
			t.Errorf("job %d: %d headers, want 17", i, len(m.Headers))
		}
		if !slices.EqualFunc(m.Headers, want[i], func(a, b kafka.Header) bool { return a.Key == b.Key && string(a.Value) == string(b.Value) }) {
			t.Errorf("job %d's headers changed after the next jobs were encoded:\n%v\nwant\n%v", i, m.Headers, want[i])
		}
	}
}

// BenchmarkEncode encodes batches of 2,000 outcomes (two thirds capped, a
// third allowed, as a blast's) of jobs with one header each: ns and
// allocations per job.
func BenchmarkEncode(b *testing.B) {
	t0 := time.Date(2026, 11, 26, 12, 0, 0, 0, time.UTC)
	const jobs = 2000
	msgs := make([]kafka.Message, jobs)
	outcomes := make([]Outcome, jobs)
	for i := range jobs {
		msgs[i] = kafka.Message{Key: []byte(fmt.Sprint(i)), Value: []byte(`{"user_id":1}`), Headers: []kafka.Header{{Key: "trace", Value: []byte("t")}}}
		outcomes[i] = Outcome{Kind: Allowed, DecidedAt: t0}
		if i%3 != 0 {
			outcomes[i] = Outcome{Kind: Capped, Cap: "daily", RetryAt: t0.Add(time.Hour), DecidedAt: t0}
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		e := newEncoder(Topics{Allowed: "allowed", Capped: "capped", DLQ: "dlq"}, false, 1<<20, jobs, jobs)
		outs := make([]kafka.Message, 0, jobs)
		for i := range jobs {
			outs = e.append(outs, &msgs[i], "s", &outcomes[i])
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*jobs), "ns/job")
}
