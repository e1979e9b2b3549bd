package main_test

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/capper-dev/capper/internal/testenv"
)

// TestReservedSlotsEndToEnd: a daily cap of 3 keeps its last slot for
// priority 7 and above. For each of 40 users, two promotions go out, a third
// is capped by the reservation (capper-reserved-for 7), the abandoned-cart
// message (priority 8 from rules.priorities, no field of its own) takes the
// reserved slot, and a fourth send of priority 9 finds the cap full.
// capper check says the same of a user with two sends.
func TestReservedSlotsEndToEnd(t *testing.T) {
	s := testenv.NewStack(t, 3, nil)
	s.EditConfig("default_caps: [{name: daily, window: 24h, limit: 2}]", `default_caps:
    - {name: daily, window: 24h, limit: 3, reserve: {slots: 1, min_priority: 7}}
  priorities:
    - {campaign: cart, priority: 8}`)
	s.DefaultCap = 3
	start(s, true)
	nine := 9
	var jobs []testenv.JobSpec
	for u := uint32(1000); u < 1040; u++ {
		id := func(n string) string { return fmt.Sprintf("%d-%s", u, n) }
		jobs = append(jobs,
			testenv.JobSpec{ID: id("promo1"), User: u, Channel: "email", Campaign: "promo"},
			testenv.JobSpec{ID: id("promo2"), User: u, Channel: "push", Campaign: "promo"},
			testenv.JobSpec{ID: id("promo3"), User: u, Channel: "email", Campaign: "promo"},
			testenv.JobSpec{ID: id("cart"), User: u, Channel: "push", Campaign: "cart"},
			testenv.JobSpec{ID: id("alert"), User: u, Channel: "sms", Campaign: "alert", Priority: &nine},
		)
	}
	jobs = append(jobs, testenv.JobSpec{ID: "two-1", User: 2000, Channel: "email"}, testenv.JobSpec{ID: "two-2", User: 2000, Channel: "email"})
	s.Produce(jobs)
	outs := s.CollectJobs(jobs, 90*time.Second)
	s.CheckAccounting(jobs, outs, true)
	got := map[string]testenv.Output{}
	for _, o := range outs {
		got[o.JobID] = o
	}
	for u := uint32(1000); u < 1040; u++ {
		for _, w := range []struct {
			job, decision    string
			priority, forPri int
		}{
			{"promo1", "allowed", 0, 0}, {"promo2", "allowed", 0, 0}, {"promo3", "capped", 0, 7},
			{"cart", "allowed", 8, 0}, {"alert", "capped", 9, 0},
		} {
			o := got[fmt.Sprintf("%d-%s", u, w.job)]
			if o.Decision != w.decision || o.Priority != w.priority || o.ReservedFor != w.forPri {
				t.Errorf("user %d %s: %s, priority %d, reserved for %d; want %s, %d, %d", u, w.job, o.Decision, o.Priority, o.ReservedFor, w.decision, w.priority, w.forPri)
			}
		}
	}
	check := func(priority string) string {
		cmd := exec.Command(capperBin, "check", "--config", s.Config, "--user", "2000", "--priority", priority)
		cmd.Env = append(os.Environ(), "AWS_ACCESS_KEY_ID=test", "AWS_SECRET_ACCESS_KEY=test", "AWS_REGION=us-east-1")
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("capper check --priority %s: %v\n%s", priority, err, out)
		}
		return string(out)
	}
	for p, wants := range map[string][]string{
		"3": {"priority 3", "cap daily                  2 of   2", "[1 more reserved for priority 7 and above]",
			"capped by daily (the slots left are reserved for priority 7 and above)"},
		"7": {"priority 7", "cap daily                  2 of   3", "a email send now: allowed"},
	} {
		if out := check(p); !containsAll(out, wants) {
			t.Errorf("capper check --priority %s lacks one of %q:\n%s", p, wants, out)
		}
	}
}

func containsAll(s string, subs []string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}
