package main_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
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
	worst := mostInAnyWindow(hot, time.Second)
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

// TestStalledReplicaKeepsTheBudget: two replicas share an SMS budget of 20
// per second. One (whichever) takes tokens for a batch whose users' Redis
// master is frozen, and is then itself stopped (SIGSTOP) for two windows
// while the other spends the budget on its own jobs; later it is stopped three more
// times for two windows each, wherever it is, while a burst flows. A
// stalled replica's sends are decided within their tokens' buckets (the
// frozen master decides them when it thaws, at the time the replica asked)
// or its tokens lapse and they wait for new ones: no second gets more than
// 20 forwarded sends by decision time, and every job is forwarded once.
func TestStalledReplicaKeepsTheBudget(t *testing.T) {
	s := testenv.NewStack(t, 3, nil)
	s.EnableHold(3, "100ms", "1s", "5s")
	s.EditConfig(testenv.TestRules, `
rules:
  segments:
    - name: new
      caps: [{name: daily, window: 24h, limit: 100}]
  default_caps: [{name: daily, window: 24h, limit: 100}]
  budgets:
    - {name: sms, channel: sms, limit: 20, window: 1s, max_hold: 1h}
`)
	ws := []*worker{start(s, true), start(s, true)}
	s.WaitGroupMembers(t, 2, 60*time.Second)
	budgetKey, err := s.RedisClient().MasterForKey(context.Background(), s.Prefix+":b:{sms}")
	if err != nil {
		t.Fatal(err)
	}
	// Users whose log is on a master other than the budget's: their
	// decisions stall while the budget stays reachable.
	var frozen, others []uint32
	for u := uint32(1000); len(frozen) < 60 || len(others) < 260; u++ {
		switch m := s.MasterOf(u); {
		case m == budgetKey.Options().Addr:
		case len(frozen) == 0 || m == s.MasterOf(frozen[0]):
			frozen = append(frozen, u)
		default:
			others = append(others, u)
		}
	}
	frozen, others = frozen[:60], others[:260]
	sms := func(prefix string, users []uint32) []testenv.JobSpec {
		var jobs []testenv.JobSpec
		for i, u := range users {
			jobs = append(jobs, testenv.JobSpec{ID: fmt.Sprintf("%s-%d", prefix, i), User: u, Channel: "sms"})
		}
		return jobs
	}
	resume := s.FreezeMaster(t, frozen[0])
	stuck := sms("stuck", frozen)
	s.Produce(stuck)
	// A replica takes tokens for some of them and cannot decide them: the one
	// stalled below. (Whichever decides them: the group may rebalance as they
	// come, and one replica then take every partition.)
	var w1 *worker
	which := 0
	for end := time.Now().Add(30 * time.Second); w1 == nil; time.Sleep(20 * time.Millisecond) {
		for i, w := range ws {
			if w1 == nil && scrapeMetric(t, w.metrics, `capper_budget_tokens_total{budget="sms",kind="used"}`) > 0 {
				w1, which = w, i+1
			}
		}
		if w1 == nil && time.Now().After(end) {
			t.Fatal("no replica took a budget token for the jobs of the frozen master")
		}
	}
	stall := func(d time.Duration) { // the stall itself is the fault: SIGSTOP for d
		if err := w1.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		time.Sleep(d)
		if err := w1.cmd.Process.Signal(syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
	}
	if err := w1.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	resume()
	more := sms("more", others[:60])
	s.Produce(more)
	time.Sleep(2 * time.Second)
	if err := w1.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	burst := sms("burst", others[60:])
	s.Produce(burst)
	for range 3 {
		s.CollectJobs(burst[:10], 30*time.Second) // the burst flows
		stall(2 * time.Second)
		time.Sleep(time.Second) // between stalls: a window's work
	}
	all := slices.Concat(stuck, more, burst)
	outs := s.CollectJobs(all, 90*time.Second)
	final := finals(t, outs)
	var at []time.Time
	dups := 0
	for _, j := range all {
		switch o, ok := final[j.ID]; {
		case !ok:
			t.Errorf("job %s reached no final topic", j.ID)
		case o.Decision == "duplicate": // its first decision was recorded, its answer lost in the freeze
			dups++
			at = append(at, o.DecidedAt)
		case o.Decision != "allowed":
			t.Errorf("job %s: %s by %q (%s), want forwarded (held until a token)", j.ID, o.Decision, o.Cap, o.Reason)
		default:
			at = append(at, o.DecidedAt)
		}
	}
	slices.SortFunc(at, func(a, b time.Time) int { return a.Compare(b) })
	worst := mostInAnyWindow(at, time.Second)
	if worst > 20 {
		t.Errorf("%d sends forwarded in one second by decision time, budget 20", worst)
	}
	t.Logf("%d sends (%d duplicates of a decision recorded in the freeze) over %v, at most %d in any second; the stalled replica (the %d. started) lapsed %v tokens",
		len(at), dups, at[len(at)-1].Sub(at[0]).Round(time.Millisecond), worst, which,
		scrapeMetric(t, w1.metrics, `capper_budget_tokens_total{budget="sms",kind="lapsed"}`))
}

// mostInAnyWindow returns the most of the sorted times in any window of the
// given length (a sliding window starting at one of them).
func mostInAnyWindow(sorted []time.Time, window time.Duration) int {
	worst := 0
	for i, j := 0, 0; i < len(sorted); i++ {
		for j < len(sorted) && sorted[j].Sub(sorted[i]) < window {
			j++
		}
		worst = max(worst, j-i)
	}
	return worst
}

// TestHeldSendsTakeAPutBackTokenEarly: 40 users with two SMS each, all at
// once, under a budget of 10 per second and a daily cap of 1: most are held,
// and the second of each user's sends comes back for its token only to be
// capped by the daily cap. Its token is put back and, with every send left
// held, no new send is there to take it: the held send promised soonest is
// released early for it (and at the promise it gave up, the next one). Every
// job reaches one final topic, one send per user is allowed, a released-early
// send was held by the budget and decided before the due time of its held
// record (its output's due time is its release), and no second gets more
// than 10 by decision time.
func TestHeldSendsTakeAPutBackTokenEarly(t *testing.T) {
	s := testenv.NewStack(t, 3, nil)
	s.EnableHold(3, "100ms", "1s", "5s")
	s.EditConfig(testenv.TestRules, `
rules:
  segments:
    - name: new
      caps: [{name: daily, window: 24h, limit: 1}]
  default_caps: [{name: daily, window: 24h, limit: 1}]
  budgets:
    - {name: sms, channel: sms, limit: 10, window: 1s, max_hold: 1h}
`)
	w := start(s, true)
	w.waitReady(t)
	const users = 40
	var jobs []testenv.JobSpec
	for round := range 2 { // each user's first send, then each user's second
		for u := range users {
			jobs = append(jobs, testenv.JobSpec{ID: fmt.Sprintf("sms-%d-%d", u, round), User: uint32(5000 + u), Channel: "sms"})
		}
	}
	s.Produce(jobs)
	final := finals(t, s.CollectJobs(jobs, 120*time.Second))
	heldDue := map[string]time.Time{} // the latest held record of each job
	heldBy := map[string]string{}
	for _, o := range s.CollectAll(s.Held, 60*time.Second) {
		if o.DueAt.After(heldDue[o.JobID]) {
			heldDue[o.JobID], heldBy[o.JobID] = o.DueAt, o.Cap
		}
	}
	allowed := map[uint32]int{}
	var at []time.Time
	early := 0
	for _, j := range jobs {
		o, ok := final[j.ID]
		if !ok {
			t.Errorf("job %s reached no final topic", j.ID)
			continue
		}
		if o.Decision == "allowed" {
			allowed[j.User]++
			at = append(at, o.DecidedAt)
		} else if o.Decision != "capped" || o.Cap != "daily" {
			t.Errorf("job %s: %s by %q (%s), want allowed or capped by daily", j.ID, o.Decision, o.Cap, o.Reason)
		}
		if due, held := heldDue[j.ID]; held && o.DueAt.Before(due) {
			early++
			if heldBy[j.ID] != "sms" || o.DecidedAt.Before(o.DueAt) {
				t.Errorf("job %s released early (due %v, its hold by %q due %v), decided %v: only a budget's hold ends early, and its output's due time is its release",
					j.ID, o.DueAt, heldBy[j.ID], due, o.DecidedAt)
			}
		}
	}
	for u := range users {
		if n := allowed[uint32(5000+u)]; n != 1 {
			t.Errorf("user %d: %d sends allowed, want 1 (daily cap of 1)", 5000+u, n)
		}
	}
	slices.SortFunc(at, func(a, b time.Time) int { return a.Compare(b) })
	if worst := mostInAnyWindow(at, time.Second); worst > 10 {
		t.Errorf("%d sends in one second, budget 10", worst)
	}
	if early == 0 {
		t.Errorf("no held send was released early: the %d tokens put back by the capped second sends went to no one", users)
	}
	// Each early claim granted is a send released early; a send may also go back to its tier for a token
	// sooner than its promise (its early claim refused) and so be released before its held record's due time.
	if v := scrapeMetric(t, w.metrics, `capper_budget_claims_total{budget="sms",result="early"}`); v < 1 || v > float64(early) {
		t.Errorf(`capper_budget_claims_total{result="early"} = %v, want 1 to %d (the sends released early)`, v, early)
	}
	t.Logf("%d sends released early of %d held; allowed over %v", early, len(heldDue), at[len(at)-1].Sub(at[0]))
}
