package main_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestLoadgenAndReportNameAnUnreachableBroker: with nothing listening at
// kafka.brokers, capper loadgen fails within seconds naming the setting and
// leaves no manifest (it would list jobs the broker never acknowledged), and
// capper report fails as fast naming the brokers, instead of blaming the
// worker for jobs that reached no topic, or passing on an empty manifest.
func TestLoadgenAndReportNameAnUnreachableBroker(t *testing.T) {
	dir := t.TempDir()
	manifest := filepath.Join(dir, "m.csv")
	env := []string{"CAPPER_KAFKA_BROKERS=" + freeAddr(t)}
	start := time.Now()
	out, err := capper(t, "", env, "loadgen", "--config", "../../config.example.yaml", "--manifest", manifest, "--jobs", "100", "--users", "10")
	if err == nil || !strings.Contains(out, "do not answer") || !strings.Contains(out, "kafka.brokers (CAPPER_KAFKA_BROKERS)") {
		t.Fatalf("loadgen against a closed port: %v\n%s", err, out)
	}
	if _, err := os.Stat(manifest); !os.IsNotExist(err) {
		t.Errorf("loadgen left a manifest of jobs it never sent (stat: %v)", err)
	}
	if err := os.WriteFile(manifest, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err = capper(t, "", env, "report", "--config", "../../config.example.yaml", "--manifest", manifest)
	if err == nil || !strings.Contains(out, "do not answer") || !strings.Contains(out, "kafka.brokers (CAPPER_KAFKA_BROKERS)") {
		t.Fatalf("report against a closed port: %v\n%s", err, out)
	}
	if d := time.Since(start); d > 40*time.Second {
		t.Errorf("both commands took %v to fail on a broker that is not there", d)
	}
}

// TestUnknownVariableIsWarned: a typo in a CAPPER_* variable is not ignored
// in silence: the command warns, naming the nearest setting's variable.
func TestUnknownVariableIsWarned(t *testing.T) {
	out, _ := capper(t, "", []string{"CAPPER_REDIS_ADDR=127.0.0.1:1", "CAPPER_KAFKA_BROKERS=" + freeAddr(t)},
		"report", "--config", "../../config.example.yaml", "--manifest", filepath.Join(t.TempDir(), "none.csv"))
	if !strings.Contains(out, `"level":"WARN"`) || !strings.Contains(out, "CAPPER_REDIS_ADDR is not a setting capper reads") || !strings.Contains(out, "did you mean CAPPER_REDIS_ADDRS?") {
		t.Fatalf("no warning for CAPPER_REDIS_ADDR:\n%s", out)
	}
}
