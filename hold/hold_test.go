package hold_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/output"
)

var t0 = time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)

func wheel(t *testing.T, delays ...time.Duration) *hold.Wheel {
	t.Helper()
	w, err := hold.NewWheel("sends.delay.", delays)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func TestRoute(t *testing.T) {
	w := wheel(t, time.Hour, 5*time.Second, time.Minute, 10*time.Minute) // any order
	for _, c := range []struct {
		name  string
		left  time.Duration
		topic string
		wake  time.Duration
	}{
		{"exactly a tier", time.Minute, "sends.delay.1m", time.Minute},
		{"between tiers: the shorter", 59 * time.Second, "sends.delay.5s", 5 * time.Second},
		{"just over a tier", 10*time.Minute + time.Millisecond, "sends.delay.10m", 10 * time.Minute},
		{"beyond the longest", 30 * time.Hour, "sends.delay.1h", time.Hour},
		{"shorter than the shortest: wakes at due", 2 * time.Second, "sends.delay.5s", 2 * time.Second},
		{"already due", -time.Second, "sends.delay.5s", -time.Second},
	} {
		t.Run(c.name, func(t *testing.T) {
			tier, wake := w.Route(t0, t0.Add(c.left))
			if tier.Topic != c.topic || !wake.Equal(t0.Add(c.wake)) {
				t.Errorf("Route(+%v) = %s waking at +%v, want %s at +%v", c.left, tier.Topic, wake.Sub(t0), c.topic, c.wake)
			}
		})
	}
}

// TestRouteHopsEndAtDue follows a job through the wheel: each hop wakes no
// later than due, and the last one exactly at due.
func TestRouteHopsEndAtDue(t *testing.T) {
	w := wheel(t, hold.DefaultDelays...)
	now, due := t0, t0.Add(25*time.Hour+17*time.Minute+3*time.Second+400*time.Millisecond)
	hops := 0
	for now.Before(due) {
		_, wake := w.Route(now, due)
		if wake.After(due) || !wake.After(now) {
			t.Fatalf("hop %d at %v wakes at %v (due %v)", hops, now, wake, due)
		}
		now = wake
		hops++
	}
	if !now.Equal(due) || hops > 30 {
		t.Errorf("%d hops ending at %v, want due %v in at most 30", hops, now, due)
	}
}

func TestNewWheelRejects(t *testing.T) {
	for _, ds := range [][]time.Duration{nil, {time.Second, time.Second}, {10 * time.Millisecond}, {time.Second + time.Microsecond}} {
		if _, err := hold.NewWheel("p.", ds); err == nil {
			t.Errorf("NewWheel(%v) accepted", ds)
		}
	}
	if got := hold.Name(36 * time.Hour); got != "36h" {
		t.Errorf("Name(36h) = %q", got)
	}
	if got := hold.Name(48 * time.Hour); got != "2d" {
		t.Errorf("Name(48h) = %q", got)
	}
	if got := hold.Name(1500 * time.Millisecond); got != "1500ms" {
		t.Errorf("Name(1.5s) = %q", got)
	}
}

func TestStateHeaders(t *testing.T) {
	s := hold.State{Since: t0, Due: t0.Add(time.Minute + 250*time.Millisecond), Wake: t0.Add(time.Minute), Count: 3, Reason: "daily"}
	got, ok, err := hold.ParseState(s.AppendHeaders([]kafka.Header{{Key: "other", Value: []byte("x")}}))
	if err != nil || !ok || !got.Since.Equal(s.Since) || !got.Due.Equal(s.Due) || !got.Wake.Equal(s.Wake) || got.Count != 3 || got.Reason != "daily" {
		t.Errorf("round trip: %+v %v %v, want %+v", got, ok, err, s)
	}
	if _, ok, err := hold.ParseState([]kafka.Header{{Key: "other"}}); ok || err != nil {
		t.Errorf("no hold headers: ok %v err %v", ok, err)
	}
	bad := []kafka.Header{{Key: output.HeaderHoldCount, Value: []byte("2")}, {Key: output.HeaderDueAt, Value: []byte("tomorrow")}}
	if _, _, err := hold.ParseState(bad); err == nil {
		t.Error("a bad due time was accepted")
	}
	if _, _, err := hold.ParseState(bad[:1]); err == nil {
		t.Error("hold headers without a due time were accepted")
	}
}

// source hands out its messages in order.
type source struct{ msgs []kafka.Message }

func (s *source) FetchMessage(ctx context.Context) (kafka.Message, error) {
	if len(s.msgs) == 0 {
		<-ctx.Done()
		return kafka.Message{}, ctx.Err()
	}
	m := s.msgs[0]
	s.msgs = s.msgs[1:]
	return m, nil
}
func (s *source) CommitMessages(context.Context, ...kafka.Message) error { return nil }
func (s *source) Stats() kafka.ReaderStats                               { return kafka.ReaderStats{} }

// TestReaderWaitsForWake: the head is returned at its wake time, not before;
// a wait cut short keeps the message for the next call.
func TestReaderWaitsForWake(t *testing.T) {
	start := time.Now()
	wake := start.Add(300 * time.Millisecond).Truncate(time.Millisecond) // headers keep milliseconds
	s := hold.State{Since: start, Due: start.Add(time.Hour), Wake: wake, Count: 1}
	r := hold.NewReader(&source{msgs: []kafka.Message{{Offset: 7, Headers: s.AppendHeaders(nil)}, {Offset: 8}}}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if r.Waiting() {
		t.Error("waiting before it holds a message")
	}
	if _, err := r.FetchMessage(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("fetch before the wake time: %v, want the context's deadline", err)
	}
	if !r.Waiting() {
		t.Error("not waiting while it holds a message before its wake time (the stall watch would call the tier stalled)")
	}
	m, err := r.FetchMessage(context.Background())
	if r.Waiting() {
		t.Error("still waiting after the message was returned")
	}
	if err != nil || m.Offset != 7 {
		t.Fatalf("fetch: offset %d, %v; want the kept message 7", m.Offset, err)
	}
	if now := time.Now(); now.Before(wake) {
		t.Errorf("returned %v before its wake time", wake.Sub(now))
	}
	if m, err := r.FetchMessage(context.Background()); err != nil || m.Offset != 8 {
		t.Errorf("a message without hold headers: offset %d, %v; want 8 at once", m.Offset, err)
	}
}
