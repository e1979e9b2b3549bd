package skew_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/capper-dev/capper/internal/testenv"
	"github.com/capper-dev/capper/skew"
)

// TestMeasuresTheOffset: a clock set 5 s ahead or behind is measured against
// every master of the real cluster, reported, and refused beyond MaxSkew;
// removing the offset makes the worker decide again.
func TestMeasuresTheOffset(t *testing.T) {
	rdb := testenv.ClusterClient(t)
	var offset time.Duration
	var log bytes.Buffer
	reg := prometheus.NewRegistry()
	m, err := skew.New(skew.Config{Client: rdb, Clock: func() time.Time { return time.Now().Add(offset) }, MaxSkew: time.Second,
		Logger: slog.New(slog.NewTextHandler(&log, nil)), Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		offset time.Duration
		within bool
		logged string
	}{
		{0, true, ""},
		{5 * time.Second, false, "clock skew beyond max_clock_skew"},
		{-5 * time.Second, false, ""}, // already refusing: no second error line
		{700 * time.Millisecond, true, "clock skew above half of max_clock_skew"},
		{0, true, "clock skew back within bounds"},
	} {
		offset = tc.offset
		log.Reset()
		if err := m.Check(context.Background()); err != nil {
			t.Fatal(err)
		}
		// Redis's TIME has microseconds; the loopback round trip is well under 100 ms.
		if got := m.Skew(); got < tc.offset-100*time.Millisecond || got > tc.offset+100*time.Millisecond {
			t.Errorf("offset %v: measured %v", tc.offset, got)
		}
		if m.Within() != tc.within || (m.Err() == nil) != tc.within {
			t.Errorf("offset %v: within %v (err %v), want %v", tc.offset, m.Within(), m.Err(), tc.within)
		}
		if g := gathered(t, reg); g < tc.offset.Abs().Seconds()-0.1 || g > tc.offset.Abs().Seconds()+0.1 {
			t.Errorf("offset %v: capper_clock_skew_seconds %v", tc.offset, g)
		}
		if tc.logged != "" && !strings.Contains(log.String(), tc.logged) || tc.logged == "" && log.Len() > 0 {
			t.Errorf("offset %v: logged %q, want %q", tc.offset, log.String(), tc.logged)
		}
	}
	offset = -5 * time.Second
	_ = m.Check(context.Background())
	if err := m.Err(); err == nil || !strings.Contains(err.Error(), "5.0s behind") {
		t.Errorf("error %v, want it to say the clock is 5s behind", err)
	}
}

func TestZeroDisablesTheBound(t *testing.T) {
	m, err := skew.New(skew.Config{Client: testenv.ClusterClient(t), Clock: func() time.Time { return time.Now().Add(time.Hour) }})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Check(context.Background()); err != nil {
		t.Fatal(err)
	}
	if !m.Within() || m.Skew() < 59*time.Minute {
		t.Errorf("max skew 0: within %v, skew %v; want within and about 1h measured", m.Within(), m.Skew())
	}
}

// gathered returns capper_clock_skew_seconds from reg.
func gathered(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() == "capper_clock_skew_seconds" {
			return f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("capper_clock_skew_seconds is not registered")
	return 0
}
