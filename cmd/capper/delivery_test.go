package main_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/capper-dev/capper/internal/testenv"
)

// TestBudgetDeliversItsLimit: an SMS budget of 600 per 30 s under three
// times the demand, sustained for 120 s: every whole window after the first
// forwards at least 95% of the limit, and no 30 s more than the limit by
// decision time (which follows the token: the limit holds by token time; a
// fortieth, 15, more allow for decisions a bucket or two after their tokens
// on a busy machine). Counted, not timed: at the limit's pace a token comes
// back a window and a bucket (300 ms) after its bucket started, so a window
// gets about 99% of the limit, less what the worker's stalls beyond a bucket
// delay: a stall shifts the flow of tokens later, and its window loses what
// the stall would have sent. A fresh-clone CI run, its test packages in
// parallel on 2 cores, had a 10 s window lose 15 tokens of 200 (92.5%) to
// such stalls; the same at 30 s is 2.5%. With one replica and with three,
// the budget spread over its window (the default): three replicas with the
// whole limit free to go at once once forwarded all of it in one window and
// none in the next (tokens freed together are taken together again a window
// and a bucket later, and the lump drifts across a window's edge; issue 30).
func TestBudgetDeliversItsLimit(t *testing.T) {
	for _, replicas := range []int{1, 3} {
		t.Run(fmt.Sprintf("replicas=%d", replicas), func(t *testing.T) {
			s := testenv.NewStack(t, 3, nil)
			s.EnableHold(3, "100ms", "1s", "5s")
			s.EditConfig(testenv.TestRules, `
rules:
  segments:
    - name: new
      caps: [{name: daily, window: 24h, limit: 100}]
  default_caps: [{name: daily, window: 24h, limit: 100}]
  budgets:
    - {name: sms, channel: sms, limit: 600, window: 30s, max_hold: 1h}
`)
			var ws []*worker
			for range replicas {
				ws = append(ws, start(s, true))
			}
			s.WaitGroupMembers(t, replicas, 60*time.Second)
			const rate, secs, limit, window = 60, 120, 600, 30 * time.Second // three times the budget's 20 per second
			var jobs []testenv.JobSpec
			begin := time.Now()
			for sec := range secs {
				var batch []testenv.JobSpec
				for i := range rate {
					batch = append(batch, testenv.JobSpec{ID: fmt.Sprintf("sms-%d-%d", sec, i), User: uint32(10000 + sec*rate + i), Channel: "sms"})
				}
				s.Produce(batch)
				jobs = append(jobs, batch...)
				if wait := time.Until(begin.Add(time.Duration(sec+1) * time.Second)); wait > 0 {
					time.Sleep(wait) // the demand's pace (a job per user), not a wait for an event
				}
			}
			outs := s.Collect(int(secs*time.Second/window)*limit, 120*time.Second) // what the budget forwards by the end of the demand
			var at []time.Time
			for _, o := range outs {
				if o.Decision == "allowed" {
					at = append(at, o.DecidedAt)
				} else {
					t.Errorf("job %s: %s by %q (%s), want allowed (held until a token)", o.JobID, o.Decision, o.Cap, o.Reason)
				}
			}
			slices.SortFunc(at, func(a, b time.Time) int { return a.Compare(b) })
			per := make([]int, secs*time.Second/window)
			for _, a := range at {
				if k := int(a.Sub(at[0]) / window); k < len(per) {
					per[k]++
				}
			}
			worst := 0
			for i, j := 0, 0; i < len(at); i++ {
				for j < len(at) && at[j].Sub(at[i]) < window {
					j++
				}
				worst = max(worst, j-i)
			}
			t.Logf("allowed per %v window from the first: %v; at most %d in any %v", window, per, worst, window)
			for k, n := range per[1 : len(per)-1] { // whole windows after the first, while the demand lasts
				if n < limit*95/100 {
					t.Errorf("window %d forwarded %d, below 95%% of the limit of %d (windows %v)", k+1, n, limit, per)
				}
			}
			if worst > limit+limit/40 {
				t.Errorf("%d sends in %v, over the limit of %d and a bucket's share", worst, window, limit)
			}
			var lapsed []string
			for _, w := range ws {
				for _, l := range strings.Split(scrape(t, w.metrics), "\n") {
					if strings.HasPrefix(l, `capper_budget_tokens_total{budget="sms",kind="lapsed"}`) {
						lapsed = append(lapsed, l)
					}
				}
			}
			t.Logf("%s", strings.Join(lapsed, "; "))
		})
	}
}
