package main_test

import (
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
