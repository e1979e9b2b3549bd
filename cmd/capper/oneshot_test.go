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

// TestValidate: capper validate checks a configuration offline (backends
// pointed at ports where nothing listens change nothing): the example is
// valid (exit 0); a bad one lists every error with its field and variable,
// and a value's line (exit 1).
func TestValidate(t *testing.T) {
	closed := []string{"CAPPER_KAFKA_BROKERS=" + freeAddr(t), "CAPPER_REDIS_ADDRS=" + freeAddr(t)}
	out, err := capper(t, "", closed, "validate", "--config", "../../config.example.yaml")
	if err != nil || !strings.Contains(out, "config.example.yaml: valid") {
		t.Fatalf("the example config: %v\n%s", err, out)
	}
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	if err := os.WriteFile(bad, []byte("kafka:\n  brokers: [localhost]\n  session_timeout: 30\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err = capper(t, "", nil, "validate", "--config", bad)
	if err == nil || !strings.Contains(out, "kafka.session_timeout (CAPPER_KAFKA_SESSION_TIMEOUT), line 3: invalid duration \"30\"") {
		t.Fatalf("a duration without a unit: %v\n%s", err, out)
	}
	if err := os.WriteFile(bad, []byte("kafka:\n  brokers: [localhost]\nshutdown_timeout: -5s\nmetrics_addr: localhost\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err = capper(t, "", nil, "validate", "--config", bad)
	for _, want := range []string{"invalid", `kafka.brokers (CAPPER_KAFKA_BROKERS): "localhost" is not host:port`, "shutdown_timeout (CAPPER_SHUTDOWN_TIMEOUT): -5s is negative",
		`metrics_addr (CAPPER_METRICS_ADDR): "localhost" is not host:port`, "redis.addrs (CAPPER_REDIS_ADDRS): at least one address is required", "segments.source", "default_caps"} {
		if err == nil || !strings.Contains(out, want) {
			t.Errorf("want %q in the errors (exit %v):\n%s", want, err, out)
		}
	}
}

// TestCheckGivesUpWithinItsTimeout: capper check against Redis where
// nothing listens gives up after its --timeout (2s here, not the worker's
// 30 s of patience), naming --timeout.
func TestCheckGivesUpWithinItsTimeout(t *testing.T) {
	start := time.Now()
	out, err := capper(t, "", []string{"CAPPER_REDIS_ADDRS=" + freeAddr(t)}, "check", "--config", "../../config.example.yaml", "--user", "42", "--timeout", "2s")
	if err == nil || !strings.Contains(out, "gave up after 2s (--timeout D waits longer)") {
		t.Fatalf("check against a closed Redis port: %v\n%s", err, out)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("check took %v to give up with --timeout 2s", d)
	}
}
