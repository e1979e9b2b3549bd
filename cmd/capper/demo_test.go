package main_test

import (
	"encoding/json"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/capper-dev/capper/internal/loadtest"
	"github.com/capper-dev/capper/internal/testenv"
)

// demo runs scripts/demo.sh with env against the running stack and returns
// its report (the JSON last line) and output.
func demo(t *testing.T, env ...string) (loadtest.Result, string) {
	t.Helper()
	testenv.KafkaBrokers(t)
	testenv.RedisAddrs(t)
	testenv.S3(t)
	testenv.StackDir(t)
	cmd := exec.Command("../../scripts/demo.sh")
	cmd.Env = append(cmd.Environ(), env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("demo.sh: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	var last string
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.HasPrefix(lines[i], `{"jobs"`) { // worker log lines are JSON too
			last = lines[i]
			break
		}
	}
	var r loadtest.Result
	if err := json.Unmarshal([]byte(last), &r); err != nil {
		t.Fatalf("no JSON report line (%v) in:\n%s", err, out)
	}
	return r, string(out)
}

// TestDemoScript runs the README's demo command on a small blast against the
// running stack and checks its report.
func TestDemoScript(t *testing.T) {
	r, out := demo(t, "DEMO_JOBS=4000", "DEMO_USERS=1000", "DEMO_METRICS_ADDR=127.0.0.1:9465")
	if r.Jobs != 4000 || r.Unaccounted != 0 || r.Violations != 0 {
		t.Fatalf("report %+v, want 4000 jobs, none unaccounted, no violations\n%s", r, out)
	}
	if r.Capped == 0 || r.Duplicates == 0 || r.Exempt == 0 || r.DLQ == 0 || r.Held == 0 || r.Pending == 0 {
		t.Fatalf("report %+v: the blast should exercise every decision, holds of new users included", r)
	}
	// Held jobs wait for their slot (about a day): they have a held record, no final output yet.
	if total := r.Allowed + r.Duplicates + r.Exempt + r.Capped + r.DLQ + r.Held; total < r.Jobs {
		t.Fatalf("%d final outputs and held records for %d jobs", total, r.Jobs)
	}
}

// TestDemoWithPreferences: a blast where 30% of the users have a preference
// (at most one email a day, no promotions, or VIP for a day), applied before
// it, with the near cache on and the blast's redeliveries and count-only
// sends: the report holds every allowed send to the user's own preferences,
// and no VIP user's job is capped or held by the rules' caps.
func TestDemoWithPreferences(t *testing.T) {
	r, out := demo(t, "DEMO_JOBS=6000", "DEMO_USERS=600", "DEMO_PREFS_SHARE=0.3", "DEMO_METRICS_ADDR=127.0.0.1:9466")
	if r.Jobs != 6000 || r.Unaccounted != 0 || r.Violations != 0 {
		t.Fatalf("report %+v, want 6000 jobs, none unaccounted, no violations\n%s", r, out)
	}
	for _, want := range []string{"preference:tag:promotional", "preference:channel:email"} {
		if !strings.Contains(out, want) {
			t.Errorf("the report lacks sends capped by %q: preferences not exercised\n%s", want, out)
		}
	}
	if m := regexp.MustCompile(`([0-9.]+) near cache hits/job`).FindStringSubmatch(out); m == nil || m[1] == "0.000" {
		t.Errorf("near cache hits per job: %v, want some\n%s", m, out)
	}
}

// TestDemoWithVIPMidway: a paced blast (12,000 jobs at 3,000/s for 600
// users, the example's caps, the near cache on) during which, halfway, a
// third of the users get a VIP exemption while their sends go on. Copies of
// their logs made before the exemption landed (their caps full: "capped"
// without a call) must not answer after it: the report judges every send of
// theirs decided after the exemption was seen applied in Redis, and a rules'
// cap on any is a violation.
func TestDemoWithVIPMidway(t *testing.T) {
	r, out := demo(t, "DEMO_JOBS=12000", "DEMO_USERS=600", "DEMO_PREFS_SHARE=0", "DEMO_LOADGEN_ARGS=--rate 3000 --vip-midway-share 0.3",
		"DEMO_METRICS_ADDR=127.0.0.1:9467")
	if r.Jobs != 12000 || r.Unaccounted != 0 || r.Violations != 0 {
		t.Fatalf("report %+v, want 12000 jobs, none unaccounted, no violations\n%s", r, out)
	}
	if !strings.Contains(out, "VIP exemptions sent halfway through the blast") || r.VIPJudged < 50 {
		t.Fatalf("%d sends judged under the midway exemptions, want at least 50 (the wave applied before the blast ended)\n%s", r.VIPJudged, out)
	}
	if m := regexp.MustCompile(`([0-9.]+) near cache hits/job`).FindStringSubmatch(out); m == nil || m[1] == "0.000" {
		t.Errorf("near cache hits per job: %v, want some\n%s", m, out)
	}
}
