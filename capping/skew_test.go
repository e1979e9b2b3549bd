package capping_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestSkewedClocksUnderCap shows what the package doc (and README) say about
// replicas whose clocks disagree, on the real cluster, with one user and a cap
// of 1 email per 60 s, replicas 10 s apart: each direction lets a second
// email through within the minute; and a replica ahead evicts entries a
// correctly clocked one still counts, unless entries are kept ClockMargin
// longer.
func TestSkewedClocksUnderCap(t *testing.T) {
	rdb := testenv.ClusterClient(t)
	emailMinute := []capping.Cap{{Name: "email-minute", Limit: 1, Window: time.Minute, Scope: capping.NewScope([]string{"email"}, nil)}}
	t0 := time.Now().Truncate(time.Millisecond)
	var trueNow time.Time
	replica := func(prefix string, offset, margin time.Duration) *capping.Limiter {
		l, err := capping.New(context.Background(), rdb, capping.Config{KeyPrefix: prefix, ClockMargin: margin,
			Clock: func() time.Time { return trueNow.Add(offset) }})
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	decide := func(l *capping.Limiter, at time.Duration, job, channel string, caps []capping.Cap) bool {
		t.Helper()
		trueNow = t0.Add(at)
		r := capping.Request{UserID: 42, JobID: job, Channel: channel, Caps: caps}
		if caps == nil {
			r.Retention = time.Minute // a count-only send: recorded, no check
		}
		ds, err := l.Decide(context.Background(), []capping.Request{r})
		if err != nil {
			t.Fatal(err)
		}
		return ds[0].Allowed
	}
	const d = 10 * time.Second

	t.Run("a replica ahead counts less", func(t *testing.T) {
		p := testenv.Unique("skew")
		correct, ahead := replica(p, 0, 0), replica(p, d, 0)
		if !decide(correct, 0, "e1", "email", emailMinute) {
			t.Fatal("the first email was capped")
		}
		// 55 s later the replica ahead sees the window (t0+5s, t0+65s]: e1 is not in it.
		if !decide(ahead, 55*time.Second, "e2", "email", emailMinute) {
			t.Fatal("the replica 10 s ahead capped the second email: the skew did not show")
		}
		if decide(correct, 56*time.Second, "e3", "email", emailMinute) {
			t.Error("the correct replica allowed a third email within the minute")
		}
	})
	t.Run("a replica behind records sends that stop counting early", func(t *testing.T) {
		p := testenv.Unique("skew")
		correct, behind := replica(p, 0, 0), replica(p, -d, 0)
		if !decide(behind, 0, "e1", "email", emailMinute) { // recorded at t0-10s
			t.Fatal("the first email was capped")
		}
		if !decide(correct, 55*time.Second, "e2", "email", emailMinute) {
			t.Fatal("the correct replica capped the second email: the skew did not show")
		}
	})
	for _, tc := range []struct {
		name    string
		margin  time.Duration
		evicted bool
	}{
		{"a replica ahead evicts what others count", 0, true},
		{"the clock margin keeps it", d, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := testenv.Unique("skew")
			correct, ahead := replica(p, 0, tc.margin), replica(p, d, tc.margin)
			if !decide(correct, 0, "e1", "email", emailMinute) {
				t.Fatal("the first email was capped")
			}
			// The replica ahead records a push (not counted by the email cap) 55 s later:
			// without a margin its eviction horizon, t0+65s-60s, passes e1.
			decide(ahead, 55*time.Second, "p1", "push", nil)
			log, err := capping.ReadLog(context.Background(), rdb, correct.Key(0, 42))
			if err != nil {
				t.Fatal(err)
			}
			kept := slices.ContainsFunc(log, func(e capping.LogEntry) bool { return e.Member == capping.Member("e1", "email", "", nil) })
			if kept == tc.evicted {
				t.Errorf("margin %v: e1 still in the log %v, want %v", tc.margin, kept, !tc.evicted)
			}
			secondAllowed := decide(correct, 56*time.Second, "e2", "email", emailMinute)
			if secondAllowed != tc.evicted {
				t.Errorf("margin %v: a second email within the minute on the correct replica allowed %v, want %v", tc.margin, secondAllowed, tc.evicted)
			}
		})
	}
}
