package main_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/capper-dev/capper/internal/testenv"
)

// TestWorkspacesAreIsolated runs one worker with two workspaces on the real
// stack: the same user id in each is capped by its own rules and segments;
// a job without a workspace is the default's, one naming another is
// dead-lettered; a broken rules file keeps only its workspace on its rules
// while the other's change applies; a workspace added to the file decides
// without a restart; and one workspace's keys deleted while the worker runs
// give its users a fresh start and leave the other's history.
func TestWorkspacesAreIsolated(t *testing.T) {
	s := testenv.NewStack(t, 2, nil)
	s.EditConfig("log_level: warn", "log_level: info") // the reload lines are at info
	acme := testenv.Workspace{Name: "acme", Segments: map[string][]uint32{"vip": {7}},
		Rules: "segments: [{name: vip, caps: [{name: daily, window: 24h, limit: 5}]}]\ndefault_caps: [{name: daily, window: 24h, limit: 2}]\n"}
	globex := testenv.Workspace{Name: "globex", Rules: "default_caps: [{name: daily, window: 24h, limit: 1}]\n"}
	s.EnableWorkspaces("acme", "", acme, globex)
	w := start(s, true)
	w.waitReady(t)

	decisions := func(want int) map[string]string {
		t.Helper()
		got := map[string]string{}
		for _, o := range s.Collect(want, 60*time.Second) {
			got[o.JobID] = o.Decision
			if o.Decision == "dlq" {
				got[o.JobID] += ": " + o.Error
			}
		}
		if len(got) != want {
			t.Fatalf("%d outputs, want %d: %v", len(got), want, got)
		}
		return got
	}
	expect := func(got map[string]string, want map[string]string) {
		t.Helper()
		for id, d := range want {
			if !strings.HasPrefix(got[id], d) {
				t.Errorf("job %s: %q, want %q", id, got[id], d)
			}
		}
	}
	var jobs []testenv.JobSpec
	for _, id := range []string{"a1", "a2", "a3"} {
		jobs = append(jobs, testenv.JobSpec{ID: id, User: 7, Channel: "email", Workspace: "acme"}) // acme's vip: 5 a day
	}
	for _, id := range []string{"g1", "g2", "g3"} {
		jobs = append(jobs, testenv.JobSpec{ID: id, User: 7, Channel: "email", Workspace: "globex"}) // globex: 1 a day
	}
	for _, id := range []string{"d1", "d2", "d3"} {
		jobs = append(jobs, testenv.JobSpec{ID: id, User: 8, Channel: "email"}) // no workspace: acme's default caps, 2 a day
	}
	jobs = append(jobs, testenv.JobSpec{ID: "x1", User: 9, Channel: "email", Workspace: "nobody"})
	s.Produce(jobs)
	got := decisions(len(jobs))
	expect(got, map[string]string{"a1": "allowed", "a2": "allowed", "a3": "allowed", "g1": "allowed", "g2": "capped", "g3": "capped",
		"d1": "allowed", "d2": "allowed", "d3": "capped", "x1": `dlq: malformed job: workspace "nobody" is not configured`})
	rdb := s.RedisClient()
	for key, want := range map[string]int{s.Prefix + ":w:acme:{7}": 3, s.Prefix + ":w:globex:{7}": 1, s.Prefix + ":w:acme:{8}": 2} {
		if n := testenv.LogLen(t, rdb, key); n != want {
			t.Errorf("%s holds %d sends, want %d", key, n, want)
		}
	}

	// globex's file broken, acme's default cap raised to 3: acme's applies,
	// globex keeps its rules in force.
	dir := filepath.Dir(s.Config)
	sent := time.Now()
	if err := os.WriteFile(filepath.Join(dir, "globex.yaml"), []byte("default_caps: [broken\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	acme.Rules = strings.Replace(acme.Rules, "limit: 2", "limit: 3", 1)
	s.WriteWorkspace(acme)
	_ = w.cmd.Process.Signal(syscall.SIGHUP)
	w.waitLog(t, "rules reload rejected for one workspace; keeping its rules in force", sent)
	w.waitLog(t, "workspace rules reloaded", sent)
	s.Produce([]testenv.JobSpec{{ID: "d4", User: 8, Channel: "email"}, {ID: "g4", User: 10, Channel: "email", Workspace: "globex"},
		{ID: "g5", User: 10, Channel: "email", Workspace: "globex"}})
	expect(decisions(len(jobs)+3), map[string]string{"d4": "allowed", "g4": "allowed", "g5": "capped"})

	// A workspace added to the file decides without a restart (and globex's
	// file is mended).
	initech := testenv.Workspace{Name: "initech", Rules: "default_caps: [{name: daily, window: 24h, limit: 1}]\n"}
	s.WriteWorkspace(initech)
	s.WriteWorkspace(globex)
	sent = time.Now()
	s.EditConfig("  - {name: globex, rules_file: globex.yaml}\n", "  - {name: globex, rules_file: globex.yaml}\n  - {name: initech, rules_file: initech.yaml}\n")
	_ = w.cmd.Process.Signal(syscall.SIGHUP)
	w.waitLog(t, "workspace added", sent)
	s.Produce([]testenv.JobSpec{{ID: "i1", User: 7, Channel: "email", Workspace: "initech"}, {ID: "i2", User: 7, Channel: "email", Workspace: "initech"}})
	expect(decisions(len(jobs)+5), map[string]string{"i1": "allowed", "i2": "capped"})

	// globex's keys deleted while the worker runs: its user 7 starts afresh,
	// acme's user 7 keeps its history.
	out, err := exec.Command(capperBin, "keys", "--config", s.Config, "--workspace", "globex", "--delete").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "workspace globex: 2 keys deleted matching "+s.Prefix+":w:globex:{*") {
		t.Fatalf("capper keys --delete: %v\n%s", err, out)
	}
	s.Produce([]testenv.JobSpec{{ID: "g6", User: 7, Channel: "email", Workspace: "globex"}, {ID: "a4", User: 7, Channel: "email", Workspace: "acme"}})
	expect(decisions(len(jobs)+7), map[string]string{"g6": "allowed", "a4": "allowed"})
	if n := testenv.LogLen(t, rdb, s.Prefix+":w:acme:{7}"); n != 4 {
		t.Errorf("acme's user 7 holds %d sends after globex's keys were deleted, want 4", n)
	}

	// Each workspace's decisions are counted under its name.
	for series, want := range map[string]float64{`capper_workspace_jobs_total{decision="capped",workspace="globex"}`: 3,
		`capper_workspace_jobs_total{decision="allowed",workspace="initech"}`: 1} {
		if v := scrapeMetric(t, w.metrics, series); v != want {
			t.Errorf("metrics: %s = %v, want %v", series, v, want)
		}
	}
}

// TestReportJudgesEachWorkspace: two blasts to the same user ids, one per
// workspace, each judged by capper report with its own workspace's rules and
// segments, pass; acme's judged by globex's stricter rules does not.
func TestReportJudgesEachWorkspace(t *testing.T) {
	s := testenv.NewStack(t, 2, nil)
	vip := make([]uint32, 20)
	for i := range vip {
		vip[i] = uint32(i + 1)
	}
	acme := testenv.Workspace{Name: "acme", Segments: map[string][]uint32{"vip": vip},
		Rules: "segments: [{name: vip, caps: [{name: daily, window: 24h, limit: 5}]}]\ndefault_caps: [{name: daily, window: 24h, limit: 3}]\ncount_only_categories: [receipt]\n"}
	globex := testenv.Workspace{Name: "globex", Rules: "default_caps: [{name: daily, window: 24h, limit: 1}]\ncount_only_categories: [receipt]\n"}
	s.EnableWorkspaces("", "", acme, globex)
	w := start(s, true)
	w.waitReady(t)
	env := []string{"AWS_ACCESS_KEY_ID=test", "AWS_SECRET_ACCESS_KEY=test", "AWS_REGION=us-east-1"}
	dir := t.TempDir()
	manifest := map[string]string{}
	for i, ws := range []string{"acme", "globex"} {
		manifest[ws] = filepath.Join(dir, ws+".csv")
		if out, err := capper(t, "", env, "loadgen", "--config", s.Config, "--manifest", manifest[ws], "--workspace", ws,
			"--jobs", "1500", "--users", "200", "--seed", fmt.Sprint(7+i)); err != nil { // seeds apart: job ids apart
			t.Fatalf("loadgen --workspace %s: %v\n%s", ws, err, out)
		}
	}
	report := func(ws, m string) (string, error) {
		return capper(t, "", env, "report", "--config", s.Config, "--manifest", m, "--workspace", ws, "--idle", "3s", "--wait", "2m")
	}
	for _, ws := range []string{"acme", "globex"} {
		out, err := report(ws, manifest[ws])
		if err != nil || !strings.Contains(out, `"violations":0`) || !strings.Contains(out, "1500 jobs sent, 1500 outputs read") {
			t.Fatalf("report --workspace %s on its own blast: %v\n%s", ws, err, out)
		}
		t.Logf("report --workspace %s:\n%s", ws, out)
	}
	out, err := report("globex", manifest["acme"])
	if err == nil || !strings.Contains(out, "caps exceeded") {
		t.Fatalf("acme's blast judged by globex's rules (1 a day, no vip segment): %v, want a failed report\n%s", err, out)
	}
	t.Logf("acme's blast judged by globex's rules:\n%s", out)
}

// TestWorkspaceBudgets: two workspaces' own budgets of one name are two
// budgets (one exhausted leaves the other's tokens), and a budget they share
// counts both workspaces' sends.
func TestWorkspaceBudgets(t *testing.T) {
	s := testenv.NewStack(t, 2, nil)
	s.EnableHold(2, "1s")
	own := "default_caps: [{name: daily, window: 24h, limit: 100}]\nbudgets: [{name: sms, channel: sms, limit: 2, window: 1m, max_hold: 1s}]\n"
	s.EnableWorkspaces("", "  budgets: [{name: provider, channel: push, limit: 3, window: 1m, max_hold: 1s, workspaces: [acme, globex]}]",
		testenv.Workspace{Name: "acme", Rules: own}, testenv.Workspace{Name: "globex", Rules: own})
	w := start(s, false)
	var jobs []testenv.JobSpec
	for _, ws := range []string{"acme", "globex"} {
		for u := uint32(1); u <= 3; u++ {
			jobs = append(jobs, testenv.JobSpec{ID: fmt.Sprintf("%s-sms-%d", ws, u), User: u, Channel: "sms", Workspace: ws})
		}
		for u := uint32(1); u <= 2; u++ {
			jobs = append(jobs, testenv.JobSpec{ID: fmt.Sprintf("%s-push-%d", ws, u), User: u, Channel: "push", Workspace: ws})
		}
	}
	s.Produce(jobs)
	outs := s.Collect(len(jobs), 60*time.Second)
	got := map[string]int{} // decision and cap -> jobs
	for _, o := range outs {
		got[o.Decision+" "+o.Cap]++
	}
	want := map[string]int{"allowed ": 7, "capped acme/sms": 1, "capped globex/sms": 1, "capped provider": 1}
	if len(outs) != len(jobs) || fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("outputs by decision and cap: %v, want %v\n%s", got, want, w.logText())
	}
}

// TestMoveToWorkspacesKeepsHistory moves a running deployment to workspaces
// as README says: its rules become the first workspace's file, which keeps
// the deployment's key prefix and bitmaps and is the default. After the
// restart its users' sends from before still count, its segments still
// apply, jobs without a workspace field are its jobs, and a new workspace's
// user of the same id starts afresh.
func TestMoveToWorkspacesKeepsHistory(t *testing.T) {
	s := testenv.NewStack(t, 1, nil)
	w := start(s, false)
	// User 3 is in the segment active (3 a day), user 77 in none (2 a day).
	before := []testenv.JobSpec{{ID: "b1", User: 3, Channel: "email"}, {ID: "b2", User: 3, Channel: "email"},
		{ID: "b3", User: 77, Channel: "email"}, {ID: "b4", User: 77, Channel: "email"}}
	s.Produce(before)
	if n := testenv.CountDecision(s.Collect(len(before), 60*time.Second), "allowed"); n != 4 {
		t.Fatalf("before the move: %d of 4 allowed", n)
	}
	if ok, err := w.signalAndWait(syscall.SIGTERM); !ok || err != nil {
		t.Fatalf("SIGTERM: exited %v (in time: %v)", err, ok)
	}
	var legacy strings.Builder
	for _, line := range strings.Split(strings.TrimPrefix(strings.TrimSpace(testenv.TestRules), "rules:\n"), "\n") {
		legacy.WriteString(strings.TrimPrefix(line, "  ") + "\n")
	}
	if err := os.WriteFile(filepath.Join(filepath.Dir(s.Config), "legacy.yaml"), []byte(legacy.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	s.WriteWorkspace(testenv.Workspace{Name: "globex", Rules: "default_caps: [{name: daily, window: 24h, limit: 1}]\n"})
	s.EditConfig(testenv.TestRules, fmt.Sprintf("\nworkspaces:\n  - {name: legacy, rules_file: legacy.yaml, key_prefix: %s, segments: .}\n"+
		"  - {name: globex, rules_file: globex.yaml}\ndefault_workspace: legacy\n", s.Prefix))
	start(s, false)
	after := []testenv.JobSpec{{ID: "a1", User: 3, Channel: "email"}, {ID: "a2", User: 3, Channel: "email"},
		{ID: "a3", User: 77, Channel: "email", Workspace: "legacy"}, {ID: "a4", User: 77, Channel: "email", Workspace: "globex"}}
	s.Produce(after)
	got := map[string]string{}
	for _, o := range s.Collect(len(before)+len(after), 60*time.Second) {
		got[o.JobID] = o.Decision
	}
	want := map[string]string{"a1": "allowed", "a2": "capped", "a3": "capped", "a4": "allowed"}
	for id, d := range want {
		if got[id] != d {
			t.Errorf("job %s: %q, want %q (the active segment's 3rd send allowed and 4th capped, user 77's history kept, globex's user 77 another user)", id, got[id], d)
		}
	}
}

// TestWorkspaceEvents: external sends, feedback and preferences apply to
// their own workspace's user; an event naming an unknown workspace is
// dead-lettered.
func TestWorkspaceEvents(t *testing.T) {
	s := testenv.NewStack(t, 1, nil)
	s.EnableEvents(1)
	one := "default_caps: [{name: daily, window: 24h, limit: 1}]\n"
	s.EnableWorkspaces("acme", "", testenv.Workspace{Name: "acme", Rules: one}, testenv.Workspace{Name: "globex", Rules: one})
	start(s, false)
	rdb := s.RedisClient()
	key := func(ws string, u uint32) string { return fmt.Sprintf("%s:w:%s:{%d}", s.Prefix, ws, u) }
	waitFor := func(what string, done func() bool) {
		t.Helper()
		for end := time.Now().Add(60 * time.Second); !done(); time.Sleep(20 * time.Millisecond) {
			if time.Now().After(end) {
				t.Fatalf("%s: not within 60 s", what)
			}
		}
	}
	// globex's user 5 is VIP until tomorrow; acme's user 5 is not.
	s.ProduceEvents(s.Preferences, map[string]any{"user_id": 5, "workspace": "globex", "vip_until": time.Now().Add(24 * time.Hour).UTC().Format(time.RFC3339)},
		map[string]any{"user_id": 9, "workspace": "nobody", "channel": "email", "opt_out": true})
	waitFor("globex's user 5's preference applied", func() bool { return rdb.Exists(context.Background(), key("globex", 5)+":prefs").Val() == 1 })
	// An external send fills globex's user 6's cap.
	s.ProduceEvents(s.External, map[string]any{"event_id": "e1", "user_id": 6, "workspace": "globex", "channel": "email", "sent_at": time.Now().UTC().Format(time.RFC3339Nano)})
	waitFor("globex's user 6's external send recorded", func() bool { return testenv.LogLen(t, rdb, key("globex", 6)) == 1 })
	jobs := []testenv.JobSpec{{ID: "a5-1", User: 5, Channel: "email"}, {ID: "a5-2", User: 5, Channel: "email"},
		{ID: "g5-1", User: 5, Channel: "email", Workspace: "globex"}, {ID: "g5-2", User: 5, Channel: "email", Workspace: "globex"},
		{ID: "a6-1", User: 6, Channel: "email"}, {ID: "g6-1", User: 6, Channel: "email", Workspace: "globex"}}
	s.Produce(jobs)
	got := map[string]string{}
	for _, o := range s.CollectJobs(jobs, 60*time.Second) {
		got[o.JobID] = o.Decision
	}
	want := map[string]string{"a5-1": "allowed", "a5-2": "capped", "g5-1": "allowed", "g5-2": "allowed", "a6-1": "allowed", "g6-1": "capped"}
	for id, d := range want {
		if got[id] != d {
			t.Errorf("job %s: %q, want %q", id, got[id], d)
		}
	}
	// acme's user 5's send bounced: its slot comes back in acme alone.
	s.ProduceEvents(s.Feedback, map[string]any{"job_id": "a5-1", "user_id": 5, "workspace": "acme", "status": "bounced"})
	waitFor("acme's user 5's bounced send given back", func() bool { return testenv.LogLen(t, rdb, key("acme", 5)) == 0 })
	if n := testenv.LogLen(t, rdb, key("globex", 5)); n != 2 {
		t.Errorf("globex's user 5 holds %d sends after acme's feedback, want 2", n)
	}
	dlq := s.CollectFrom([]string{s.Topics[3]}, 1, 30*time.Second)
	if len(dlq) != 1 || !strings.Contains(dlq[0].Error, `malformed event: workspace "nobody" is not configured`) {
		t.Errorf("dead letters %+v, want the preference naming workspace nobody", dlq)
	}
}
