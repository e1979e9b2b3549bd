package daemon_test

import (
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/capper-dev/capper/internal/daemon"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestClockSkewStopsDecisions plays a worker whose clock jumps 5 s ahead, and
// then 5 s behind, of the real cluster's (max_clock_skew 1s): it reports the
// skew, goes not ready, decides and commits nothing, and once the offset is
// removed decides every job exactly, with nothing lost.
func TestClockSkewStopsDecisions(t *testing.T) {
	for _, offset := range []time.Duration{5 * time.Second, -5 * time.Second} {
		t.Run(offset.String(), func(t *testing.T) {
			s := testenv.NewStack(t, 1, nil)
			s.EditConfig("log_level: warn", "log_level: info\nclock_check_interval: 200ms\nmax_clock_skew: 1s")
			var skew atomic.Int64
			d, log := startDaemonWith(t, s, daemon.Options{Clock: func() time.Time { return time.Now().Add(time.Duration(skew.Load())) }})
			metrics := "http://" + d.MetricsAddr()
			waitFor(t, "ready", func() bool { code, _ := get(t, metrics+"/readyz"); return code == http.StatusOK })

			skew.Store(int64(offset))
			waitFor(t, "the skew reported and /readyz not ready", func() bool {
				code, body := get(t, metrics+"/metrics")
				ready, _ := get(t, metrics+"/readyz")
				return code == http.StatusOK && gauge(body, "capper_clock_skew_seconds") > 4.5 && gauge(body, "capper_ready") == 0 &&
					ready == http.StatusServiceUnavailable
			})
			jobs := []testenv.JobSpec{{ID: "s1", User: 99, Channel: "email"}, {ID: "s2", User: 99, Channel: "email"},
				{ID: "s3", User: 99, Channel: "email"}, {ID: "s4", User: 99, Channel: "email", Category: "transactional"}}
			s.Produce(jobs)
			if outs := s.Collect(1, 3*time.Second); len(outs) != 0 {
				t.Fatalf("%d outputs while the clock was %v off: %+v", len(outs), offset, outs)
			}
			if n := s.Committed(t); n != 0 {
				t.Errorf("%d offsets committed while the clock was off", n)
			}
			if !strings.Contains(log.String(), "clock skew beyond max_clock_skew") || !strings.Contains(log.String(), "not deciding until it is back within the bound") {
				t.Errorf("the log does not say why nothing is decided:\n%s", log.String())
			}

			skew.Store(0)
			got := map[string]string{}
			for _, o := range s.CollectJobs(jobs, 30*time.Second) {
				got[o.JobID] = o.Decision
			}
			want := map[string]string{"s1": "allowed", "s2": "allowed", "s3": "capped", "s4": "exempt"}
			for id, w := range want {
				if got[id] != w {
					t.Errorf("after the clock came back: %s %q, want %q (all: %v)", id, got[id], w, got)
				}
			}
			waitFor(t, "ready again", func() bool { code, _ := get(t, metrics+"/readyz"); return code == http.StatusOK })
			if n := s.Committed(t); n != int64(len(jobs)) {
				t.Errorf("%d offsets committed, want %d", n, len(jobs))
			}
		})
	}
}

func waitFor(t *testing.T, what string, ok func() bool) {
	t.Helper()
	for end := time.Now().Add(20 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if ok() {
			return
		}
	}
	t.Fatalf("not %s within 20 s", what)
}

// gauge returns the value of an unlabelled sample in a /metrics body, or -1.
func gauge(body, name string) float64 {
	for _, line := range strings.Split(body, "\n") {
		if v, ok := strings.CutPrefix(line, name+" "); ok {
			var f float64
			if _, err := fmt.Sscan(v, &f); err == nil {
				return f
			}
		}
	}
	return -1
}
