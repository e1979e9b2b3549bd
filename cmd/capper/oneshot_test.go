package main_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/capper-dev/capper/internal/loadtest"
	"github.com/capper-dev/capper/internal/testenv"
	"github.com/segmentio/kafka-go"
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

// TestLoadgenManifestListsOnlyAcknowledged: a broker SIGKILLed in the middle
// of a paced blast fails loadgen, whose manifest lists only the jobs the
// broker acknowledged before: each of them is on the input topic once the
// broker is back.
func TestLoadgenManifestListsOnlyAcknowledged(t *testing.T) {
	s := testenv.NewStack(t, 1, nil)
	manifest := filepath.Join(t.TempDir(), "m.csv")
	cmd := exec.Command(capperBin, "loadgen", "--config", s.Config, "--manifest", manifest, "--jobs", "4000", "--users", "100",
		"--rate", "400", "--malformed", "0")
	var out bytes.Buffer
	var mu sync.Mutex
	cmd.Stdout, cmd.Stderr = lockedWriter{&mu, &out}, lockedWriter{&mu, &out}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	text := func() string { mu.Lock(); defer mu.Unlock(); return out.String() }
	for end := time.Now().Add(60 * time.Second); !regexp.MustCompile(`loadgen: [1-9][0-9]{2,}/4000 messages`).MatchString(text()); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("no progress of loadgen within 60 s:\n%s", text())
		}
	}
	restart := testenv.StopKafka(t, syscall.SIGKILL)
	select {
	case err := <-done:
		if err == nil || !strings.Contains(text(), "the manifest "+manifest+" lists those") {
			t.Errorf("loadgen with its broker SIGKILLed mid-blast: %v\n%s", err, text())
		}
	case <-time.After(120 * time.Second):
		_ = cmd.Process.Kill()
		t.Fatalf("loadgen did not give up within 120 s of its broker's SIGKILL:\n%s", text())
	}
	restart()
	f, err := os.Open(manifest)
	if err != nil {
		t.Fatalf("no manifest of the acknowledged part: %v", err)
	}
	sent, err := loadtest.ReadManifest(f)
	f.Close()
	if err != nil || sent.Len() == 0 || sent.Len() >= 4000 {
		t.Fatalf("the manifest lists %d jobs (%v); want those acknowledged before the kill, some and not all", sent.Len(), err)
	}
	want := map[string]bool{}
	for i := range sent.Len() {
		want[sent.ID(i)] = true
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	r := kafka.NewReader(kafka.ReaderConfig{Brokers: s.Brokers, Topic: s.Topics[0], GroupID: testenv.Unique("acked"), StartOffset: kafka.FirstOffset, MaxWait: 200 * time.Millisecond})
	defer r.Close()
	for len(want) > 0 {
		m, err := r.FetchMessage(ctx)
		if err != nil {
			t.Fatalf("%d jobs of the manifest are not on the input topic: %v", len(want), err)
		}
		for _, h := range m.Headers {
			if h.Key == loadtest.HeaderID {
				delete(want, string(h.Value))
			}
		}
	}
	t.Logf("the manifest lists %d jobs, each on the input topic", sent.Len())
}
