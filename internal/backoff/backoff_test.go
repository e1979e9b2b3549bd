package backoff_test

import (
	"context"
	"testing"
	"time"

	"github.com/capper-dev/capper/internal/backoff"
)

func TestDoublesUpToMax(t *testing.T) {
	b := backoff.New(100*time.Millisecond, time.Second)
	want := []time.Duration{100, 200, 400, 800, 1000, 1000}
	for i, w := range want {
		if d := b.Next(); d != w*time.Millisecond {
			t.Fatalf("delay %d: %v, want %v", i+1, d, w*time.Millisecond)
		}
	}
	if b.Attempt() != len(want) {
		t.Fatalf("attempt %d, want %d", b.Attempt(), len(want))
	}
	b.Reset()
	if d := b.Next(); d != 100*time.Millisecond || b.Attempt() != 1 {
		t.Fatalf("after Reset: %v, attempt %d", d, b.Attempt())
	}
}

func TestMaxBelowMin(t *testing.T) {
	if d := backoff.New(time.Second, time.Millisecond).Next(); d != time.Second {
		t.Fatalf("delay %v, want the minimum 1s", d)
	}
}

func TestSleepStopsWithTheContext(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if backoff.Sleep(ctx, time.Hour) {
		t.Fatal("Sleep reported a full hour on a cancelled context")
	}
	if !backoff.Sleep(context.Background(), time.Millisecond) {
		t.Fatal("Sleep of 1ms did not complete")
	}
}
