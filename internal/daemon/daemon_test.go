package daemon_test

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/daemon"
	"github.com/capper-dev/capper/internal/testenv"
)

// syncBuffer is a log sink safe for the daemon's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}
func (s *syncBuffer) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

// startDaemon runs a daemon in process on the test's slice of the stack and
// stops it (SIGTERM's path: the context ends, Run drains and returns nil)
// when the test ends.
func startDaemon(t *testing.T, s *testenv.Stack) (*daemon.Daemon, *syncBuffer) {
	t.Helper()
	t.Setenv("AWS_ACCESS_KEY_ID", "test")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "test")
	t.Setenv("AWS_REGION", "us-east-1")
	s.EditConfig(`metrics_addr: "off"`, `metrics_addr: "127.0.0.1:0"`)
	cfg, err := config.Load(s.Config)
	if err != nil {
		t.Fatal(err)
	}
	log := &syncBuffer{}
	ctx, cancel := context.WithCancel(context.Background())
	d, err := daemon.New(ctx, cfg, daemon.Options{ConfigPath: s.Config, Stderr: log})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run after the context ended: %v", err)
		}
		d.Close()
		if t.Failed() {
			t.Logf("daemon log:\n%s", log.String())
		}
	})
	return d, log
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestReloadRules raises the default cap from 2 to 3 with ReloadRules (what
// SIGHUP calls): it applies from the next batch, without a restart. A broken
// file and a changed segment list are rejected, and the rules in force stay.
func TestReloadRules(t *testing.T) {
	s := testenv.NewStack(t, 1, nil)
	d, _ := startDaemon(t, s)
	if !d.Ready() {
		t.Error("not ready after New: the segment snapshot is loaded by then")
	}
	if code, _ := get(t, "http://"+d.MetricsAddr()+"/readyz"); code != http.StatusOK {
		t.Errorf("/readyz answered %d, want 200", code)
	}
	jobs := func(ids ...string) []testenv.JobSpec {
		var js []testenv.JobSpec
		for _, id := range ids {
			js = append(js, testenv.JobSpec{ID: id, User: 77, Channel: "email"})
		}
		return js
	}
	s.Produce(jobs("r1", "r2", "r3"))
	if capped := testenv.CountDecision(s.Collect(3, 60*time.Second), "capped"); capped != 1 {
		t.Fatalf("before the reload: %d of 3 capped (default cap 2), want 1", capped)
	}

	s.EditConfig("default_caps: [{name: daily, window: 24h, limit: 2}]", "default_caps: [{name: daily, window: 24h, limit: 3}]")
	if err := d.ReloadRules(context.Background()); err != nil {
		t.Fatalf("reload of a valid file: %v", err)
	}
	valid, err := os.ReadFile(s.Config)
	if err != nil {
		t.Fatal(err)
	}
	for name, broken := range map[string]string{
		"a YAML error":           string(valid) + "\nrules: [broken\n",
		"a changed segment list": strings.Replace(string(valid), "- name: dormant", "- name: lapsed", 1),
	} {
		if err := os.WriteFile(s.Config, []byte(broken), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := d.ReloadRules(context.Background()); err == nil {
			t.Errorf("reload of a file with %s succeeded, want rejected", name)
		}
	}
	s.Produce(jobs("r4", "r5"))
	got := map[string]string{}
	for _, o := range s.Collect(5, 60*time.Second) {
		got[o.JobID] = o.Decision
	}
	if got["r4"] != "allowed" || got["r5"] != "capped" {
		t.Fatalf("after raising the cap to 3: r4 %q, r5 %q; want allowed, capped (decisions %v)", got["r4"], got["r5"], got)
	}
	if _, metrics := get(t, "http://"+d.MetricsAddr()+"/metrics"); !strings.Contains(metrics, "capper_rules_version 2") {
		t.Error("capper_rules_version is not 2 after one accepted reload")
	}
}
