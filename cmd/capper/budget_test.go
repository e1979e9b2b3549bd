package main_test

import (
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/capper-dev/capper/internal/testenv"
)

// TestCampaignSendSpeed: one campaign of a blast is over its per-campaign
// budget of 20 sends per second: its jobs are held and released at that
// rate, none lost, never more than the budget in any second; the other
// campaign's jobs are not held at all.
func TestCampaignSendSpeed(t *testing.T) {
	s := testenv.NewStack(t, 3, nil)
	s.EnableHold(3, "1s", "5s")
	s.EditConfig(testenv.TestRules, `
rules:
  segments:
    - name: new
      caps: [{name: daily, window: 24h, limit: 100}]
  default_caps: [{name: daily, window: 24h, limit: 100}]
  budgets:
    - {name: campaign-speed, per_campaign: true, limit: 20, window: 1s}
`)
	w := start(s, true)
	w.waitReady(t)
	var jobs []testenv.JobSpec
	for i := 0; i < 100; i++ {
		jobs = append(jobs, testenv.JobSpec{ID: fmt.Sprintf("hot-%d", i), User: uint32(100 + i), Channel: "push", Campaign: "hot"})
		if i < 15 {
			jobs = append(jobs, testenv.JobSpec{ID: fmt.Sprintf("cold-%d", i), User: uint32(300 + i), Channel: "push", Campaign: "cold"})
		}
	}
	s.Produce(jobs)
	outs := s.CollectJobs(jobs, 60*time.Second)
	final := finals(t, outs)
	var hot []time.Time
	held := 0
	for _, j := range jobs {
		o, ok := final[j.ID]
		switch {
		case !ok:
			t.Errorf("job %s reached no final topic", j.ID)
			continue
		case o.Decision != "allowed":
			t.Errorf("job %s: %s by %q (%s), want allowed", j.ID, o.Decision, o.Cap, o.Reason)
		case j.Campaign == "cold" && o.HoldCount > 0:
			t.Errorf("job %s of the campaign within its budget was held", j.ID)
		}
		if j.Campaign == "hot" {
			hot = append(hot, o.DecidedAt)
			if o.HoldCount > 0 {
				held++
			}
		}
	}
	slices.SortFunc(hot, func(a, b time.Time) int { return a.Compare(b) })
	worst := 0
	for i, j := 0, 0; i < len(hot); i++ {
		for j < len(hot) && hot[j].Sub(hot[i]) < time.Second {
			j++
		}
		worst = max(worst, j-i)
	}
	// By decision time: the limit (a fortieth of it is 0) and 2 for
	// decisions a bucket or two after their tokens.
	if worst > 22 {
		t.Errorf("%d sends of the hot campaign in one second, budget 20 (+2 by decision time)", worst)
	}
	if span := hot[len(hot)-1].Sub(hot[0]); span < 3500*time.Millisecond || held < 70 {
		t.Errorf("100 sends at 20/s spread over %v with %d held; want about 4 s or more and at least 70 held", span, held)
	}
	if v := scrapeMetric(t, w.metrics, `capper_held_total{reason="budget"}`); v < float64(held) {
		t.Errorf(`capper_held_total{reason="budget"} = %v, want at least %d`, v, held)
	}
	t.Logf("hot campaign: 100 sends over %v, %d held, at most %d in any second", hot[len(hot)-1].Sub(hot[0]), held, worst)
	cmd := exec.Command(capperBin, "check", "--config", s.Config, "--budget", "campaign-speed", "--campaign", "hot")
	cmd.Env = append(os.Environ(), "AWS_ACCESS_KEY_ID=test", "AWS_SECRET_ACCESS_KEY=test", "AWS_REGION=us-east-1")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("capper check --budget: %v\n%s", err, out)
	}
	for _, want := range []string{"budget campaign-speed:hot  key " + s.Prefix + ":b:{campaign-speed:hot}", "limit 20 per 1s", " of 20 in the window now"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("capper check --budget lacks %q:\n%s", want, out)
		}
	}
}
