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

// TestArbitrationEndToEnd: the last slot of a daily cap of 2 is arbitrated
// in windows of 15 s. For 40 users, after a first send, a promotion
// (priority 0) and an abandoned-cart message (priority 9 by
// rules.priorities) ask for the last slot, in both orders, the second once
// the first is a candidate; two replicas, and one is SIGKILLed while the
// windows are open. Whenever both sends were candidates of one window,
// the abandoned cart wins and the promotion is capped (lost); every job
// reaches one final topic and no user gets more than 2.
func TestArbitrationEndToEnd(t *testing.T) {
	s := testenv.NewStack(t, 3, nil)
	s.EnableHold(3, "1s", "5s")
	s.EditConfig("default_caps: [{name: daily, window: 24h, limit: 2}]", `default_caps:
    - {name: daily, window: 24h, limit: 2, arbitration: 15s}
  priorities:
    - {campaign: cart, priority: 9}`)
	w1 := start(s, false)
	start(s, false)
	s.WaitGroupMembers(t, 2, 60*time.Second)
	const users = 40
	var firsts, seconds, all []testenv.JobSpec
	for i := range users {
		u := uint32(3000 + i)
		low := testenv.JobSpec{ID: fmt.Sprintf("%d-promo", u), User: u, Channel: "email", Campaign: "promo"}
		high := testenv.JobSpec{ID: fmt.Sprintf("%d-cart", u), User: u, Channel: "push", Campaign: "cart"}
		firsts = append(firsts, testenv.JobSpec{ID: fmt.Sprintf("%d-first", u), User: u, Channel: "email", Campaign: "news"})
		if i%2 == 0 {
			firsts, seconds = append(firsts, low), append(seconds, high)
		} else {
			firsts, seconds = append(firsts, high), append(seconds, low)
		}
	}
	all = append(append(all, firsts...), seconds...)
	s.Produce(firsts)
	// The first of each pair is a candidate once its held record is written.
	if held := s.CollectFrom([]string{s.Held}, users, 60*time.Second); len(held) < users {
		t.Fatalf("%d of %d first sends are candidates", len(held), users)
	}
	s.Produce(seconds)
	// Both sends of each user are candidates; the windows are open. A worker
	// dies now: the candidates are resolved by the others, across a
	// rebalance of the input and of the delay tiers.
	if held := s.CollectFrom([]string{s.Held}, 2*users, 60*time.Second); len(held) < 2*users {
		t.Fatalf("%d of %d sends are candidates", len(held), 2*users)
	}
	w1.kill(t)
	start(s, false)
	outs := s.CollectJobs(all, 120*time.Second)
	s.CheckAccounting(all, outs, true)
	final := finals(t, outs)
	due := map[string]time.Time{} // job -> the end of its arbitration window
	for _, o := range s.CollectFrom([]string{s.Held}, 2*users, 30*time.Second) {
		if o.Arbitration == "candidate" {
			due[o.JobID] = o.DueAt
		}
	}
	covered := 0
	for i := range users {
		u := 3000 + i
		promo, cart := fmt.Sprintf("%d-promo", u), fmt.Sprintf("%d-cart", u)
		if o := final[fmt.Sprintf("%d-first", u)]; o.Decision != "allowed" || o.HoldCount != 0 {
			t.Errorf("user %d: first send %s, held %d times; want allowed at once (not the last slot)", u, o.Decision, o.HoldCount)
		}
		if due[promo].IsZero() || !due[promo].Equal(due[cart]) {
			continue // not candidates of one window (the kill delayed the second past it): no contest
		}
		covered++
		if p, c := final[promo], final[cart]; c.Decision != "allowed" || c.Arbitration != "won" || p.Decision != "capped" || p.Arbitration != "lost" || p.Cap != "daily" {
			t.Errorf("user %d (%s first): cart %s/%s, promo %s/%s by %q; want cart allowed (won), promo capped by daily (lost)",
				u, map[bool]string{true: "promotion", false: "cart"}[i%2 == 0], c.Decision, c.Arbitration, p.Decision, p.Arbitration, p.Cap)
		}
	}
	t.Logf("%d of %d users had both sends in one arbitration window", covered, users)
	if covered < users/2 {
		t.Errorf("only %d of %d users had both sends in one window: the test did not exercise arbitration", covered, users)
	}
}
