package consumer

import (
	"testing"
	"time"

	"github.com/capper-dev/capper/output"
	"github.com/segmentio/kafka-go"
)

// TestEncoderFormatsEachTime: the encoder formats each distinct decision
// and retry-at instant of a batch once and hands it to every job of that
// instant; every message carries its own job's times, whatever their
// order, location or sub-millisecond part.
func TestEncoderFormatsEachTime(t *testing.T) {
	e := newEncoder(Topics{Allowed: "allowed", Capped: "capped", DLQ: "dlq"}, false, 1<<20)
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
