package main_test

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"

	"github.com/capper-dev/capper/internal/loadtest"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestDemoScript runs the README's demo command on a small blast against the
// running stack and checks its report.
func TestDemoScript(t *testing.T) {
	testenv.KafkaBrokers(t)
	testenv.RedisAddrs(t)
	testenv.S3(t)
	testenv.StackDir(t)
	cmd := exec.Command("../../scripts/demo.sh")
	cmd.Env = append(cmd.Environ(), "DEMO_JOBS=4000", "DEMO_USERS=1000", "DEMO_METRICS_ADDR=127.0.0.1:9465")
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
