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

// logged waits until every user's log in Redis holds want sends (testenv.LogLen), or
// fails the test after timeout.
func logged(t *testing.T, s *testenv.Stack, users []uint32, want int, timeout time.Duration) {
	t.Helper()
	rdb := s.RedisClient()
	var last string
	for end := time.Now().Add(timeout); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		done := true
		for _, u := range users {
			if n := testenv.LogLen(t, rdb, fmt.Sprintf("%s:{%d}", s.Prefix, u)); n != want {
				done, last = false, fmt.Sprintf("user %d: %d logged", u, n)
				break
			}
		}
		if done {
			return
		}
	}
	t.Fatalf("not every user's log holds %d sends within %v (%s)", want, timeout, last)
}

func span(from, n uint32) []uint32 {
	us := make([]uint32, n)
	for i := range us {
		us[i] = from + uint32(i)
	}
	return us
}

// TestExternalSendsAndFeedback: on the real stack with the daily cap of 2,
//   - two external sends per user (one of them redelivered) fill the cap, so
//     capper's own send is capped;
//   - a failed send is given back (redelivered feedback too): the next job
//     is allowed; delivered and unknown-job feedback change nothing;
//   - malformed events and a sent_at beyond the clock bound are
//     dead-lettered with the reason;
//   - external sends keep being recorded exactly once through a SIGKILL of
//     the worker mid-stream.
func TestExternalSendsAndFeedback(t *testing.T) {
	s := testenv.NewStack(t, 3, nil)
	s.EnableEvents(3)
	w := start(s, true)
	now := time.Now().UTC()
	ext := func(id string, u uint32, ago time.Duration) map[string]any {
		return map[string]any{"event_id": id, "user_id": u, "channel": "email", "campaign_id": "esp", "sent_at": now.Add(-ago).Format(time.RFC3339Nano)}
	}

	// External sends fill the cap.
	filled := span(100, 20)
	var evs []map[string]any
	for _, u := range filled {
		evs = append(evs, ext(fmt.Sprint("x1-", u), u, time.Hour), ext(fmt.Sprint("x2-", u), u, time.Minute), ext(fmt.Sprint("x1-", u), u, time.Hour))
	}
	s.ProduceEvents(s.External, evs...)
	s.ProduceEvents(s.External, map[string]any{"event_id": "bad", "channel": "email", "sent_at": now.Format(time.RFC3339)},
		ext("future", 150, -time.Hour))
	logged(t, s, filled, 2, 60*time.Second)
	var jobs []testenv.JobSpec
	for _, u := range filled {
		jobs = append(jobs, testenv.JobSpec{ID: fmt.Sprint("after-", u), User: u, Channel: "email"})
	}

	// Failed sends give their slot back.
	given := span(200, 20)
	var first []testenv.JobSpec
	for _, u := range given {
		first = append(first, testenv.JobSpec{ID: fmt.Sprint("a-", u), User: u, Channel: "email"}, testenv.JobSpec{ID: fmt.Sprint("b-", u), User: u, Channel: "push"})
	}
	s.Produce(first)
	if outs := s.CollectJobs(first, 60*time.Second); testenv.CountDecision(outs, "allowed") != len(first) {
		t.Fatalf("the first two sends of each user: %d of %d allowed", testenv.CountDecision(outs, "allowed"), len(first))
	}
	var fb []map[string]any
	for _, u := range given {
		failed := map[string]any{"job_id": fmt.Sprint("a-", u), "user_id": u, "status": "failed"}
		fb = append(fb, failed, failed, map[string]any{"job_id": fmt.Sprint("b-", u), "user_id": u, "status": "delivered"},
			map[string]any{"job_id": fmt.Sprint("never-", u), "user_id": u, "status": "bounced"})
	}
	fb = append(fb, map[string]any{"job_id": "x", "status": "failed"})
	s.ProduceEvents(s.Feedback, fb...)
	logged(t, s, given, 1, 60*time.Second)
	for _, u := range given {
		jobs = append(jobs, testenv.JobSpec{ID: fmt.Sprint("c-", u), User: u, Channel: "email"})
	}
	s.Produce(jobs)
	outs := s.CollectJobs(append(first, jobs...), 60*time.Second)
	got := map[string]string{}
	for _, o := range outs {
		got[o.JobID] = o.Decision
	}
	for _, u := range filled {
		if d := got[fmt.Sprint("after-", u)]; d != "capped" {
			t.Errorf("user %d, after two external sends: %q, want capped", u, d)
		}
	}
	for _, u := range given {
		if d := got[fmt.Sprint("c-", u)]; d != "allowed" {
			t.Errorf("user %d, after a failed send was given back: %q, want allowed", u, d)
		}
	}
	dlq := s.CollectFrom([]string{s.Topics[3]}, 3, 30*time.Second)
	reasons := ""
	for _, o := range dlq {
		reasons += o.Error + "\n"
	}
	for _, want := range []string{"user_id is missing", "is after the worker's clock", `malformed event: user_id is missing`} {
		if !strings.Contains(reasons, want) {
			t.Errorf("dead letters lack %q:\n%s", want, reasons)
		}
	}
	metrics := scrape(t, w.metrics)
	for _, want := range []string{`capper_external_sends_total{result="recorded"} 40`, `capper_external_sends_total{result="duplicate"} 20`,
		`capper_external_sends_total{result="dlq"} 2`, `capper_feedback_total{result="given_back",status="failed"} 20`,
		`capper_feedback_total{result="unknown",status="failed"} 20`, `capper_feedback_total{result="kept",status="delivered"} 20`,
		`capper_feedback_total{result="unknown",status="bounced"} 20`, `capper_feedback_total{result="dlq",status="dlq"} 1`} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %s", want)
		}
	}

	// A SIGKILL while external sends stream in: each is recorded once.
	crashed := span(300, 100)
	evs = evs[:0]
	for _, u := range crashed {
		for k := range 3 {
			evs = append(evs, ext(fmt.Sprintf("k%d-%d", k, u), u, time.Duration(k+1)*time.Minute))
		}
	}
	go s.ProduceEvents(s.External, evs...)
	w.kill(t)
	start(s, false)
	logged(t, s, crashed, 3, 90*time.Second)
}

// TestPrefsCommand: capper prefs set sends a preference to the topic the
// workers apply, capper prefs get and capper check show it, and the next
// send of that channel is capped by it.
func TestPrefsCommand(t *testing.T) {
	s := testenv.NewStack(t, 1, nil)
	s.EnableEvents(1)
	start(s, false)
	capper := func(args ...string) string {
		t.Helper()
		n := 1 // the command's words, then --config
		if args[0] == "prefs" {
			n = 2
		}
		cmd := exec.Command(capperBin, append(append(append([]string{}, args[:n]...), "--config", s.Config), args[n:]...)...)
		cmd.Env = append(os.Environ(), "AWS_ACCESS_KEY_ID=test", "AWS_SECRET_ACCESS_KEY=test", "AWS_REGION=us-east-1")
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("capper %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	capper("prefs", "set", "--user", "42", "--channel", "sms", "--opt-out")
	cmd := exec.Command(capperBin, "prefs", "set", "--config", s.Config, "--user", "42", "--channel", "sms", "--limit", "1")
	if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "a limit of at least 1") {
		t.Errorf("a limit without a window: %v\n%s", err, out)
	}
	for end := time.Now().Add(60 * time.Second); !strings.Contains(capper("prefs", "get", "--user", "42"), "preference:channel:sms opted out"); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("the preference was not applied within 60 s")
		}
	}
	if out := capper("check", "--user", "42", "--channel", "sms"); !strings.Contains(out, "the user's preference:channel:sms opted out") ||
		!strings.Contains(out, "capped by preference:channel:sms; retry after never") {
		t.Errorf("capper check:\n%s", out)
	}
	jobs := []testenv.JobSpec{{ID: "sms", User: 42, Channel: "sms"}, {ID: "email", User: 42, Channel: "email"}}
	s.Produce(jobs)
	for _, o := range s.CollectJobs(jobs, 60*time.Second) {
		if want := map[string]string{"sms": "capped", "email": "allowed"}[o.JobID]; o.Decision != want {
			t.Errorf("%s: %s by %q, want %s", o.JobID, o.Decision, o.Cap, want)
		}
	}
}
