package main_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/testenv"
)

var capperBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "capper-e2e-")
	if err != nil {
		panic(err)
	}
	capperBin = filepath.Join(dir, "capper")
	if out, err := exec.Command("go", "build", "-race", "-o", capperBin, ".").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build capper: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// worker is a running capper process.
type worker struct {
	cmd     *exec.Cmd
	log     *bytes.Buffer
	mu      *sync.Mutex
	metrics string
	done    chan error
}

type lockedWriter struct {
	mu *sync.Mutex
	b  *bytes.Buffer
}

func (w lockedWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func start(s *testenv.Stack, withMetrics bool) *worker {
	// The SASL password is loaded (no mechanism uses it here) so that the log
	// check would catch it in any line.
	return startWith(s, withMetrics, []string{secretSentinel}, "CAPPER_KAFKA_SASL_PASSWORD="+secretSentinel)
}

// startWith starts a worker with env added to the test's; its log may not
// contain any of secrets.
func startWith(s *testenv.Stack, withMetrics bool, secrets []string, env ...string) *worker {
	s.T.Helper()
	w := &worker{log: &bytes.Buffer{}, mu: &sync.Mutex{}, done: make(chan error, 1)}
	w.cmd = exec.Command(capperBin, "run", "--config", s.Config)
	w.cmd.Env = append(os.Environ(), "AWS_ACCESS_KEY_ID=test", "AWS_SECRET_ACCESS_KEY=test", "AWS_REGION=us-east-1")
	w.cmd.Env = append(w.cmd.Env, env...)
	if withMetrics {
		w.metrics = freeAddr(s.T)
		w.cmd.Env = append(w.cmd.Env, "CAPPER_METRICS_ADDR="+w.metrics)
	}
	w.cmd.Stderr = lockedWriter{w.mu, w.log}
	w.cmd.Stdout = w.cmd.Stderr
	if err := w.cmd.Start(); err != nil {
		s.T.Fatal(err)
	}
	go func() { w.done <- w.cmd.Wait() }()
	s.T.Cleanup(func() {
		_ = w.cmd.Process.Kill()
		<-w.done
		checkLog(s.T, w.logText(), secrets)
		if s.T.Failed() {
			s.T.Logf("worker log:\n%s", w.logText())
		}
	})
	return w
}

const secretSentinel = "s3cr3t-sentinel-do-not-log"

// checkLog fails the test on a worker log line that is not a JSON object
// (every library's lines go through the worker's slog logger) or that
// contains one of secrets.
func checkLog(t *testing.T, log string, secrets []string) {
	t.Helper()
	for i, line := range strings.Split(strings.TrimRight(log, "\n"), "\n") {
		if line == "" {
			continue
		}
		var v map[string]any
		if err := json.Unmarshal([]byte(line), &v); err != nil {
			t.Errorf("worker log line %d is not JSON: %q", i+1, line)
		}
		for _, secret := range secrets {
			if strings.Contains(line, secret) {
				t.Errorf("worker log line %d contains a secret: %q", i+1, line)
			}
		}
	}
}

func (w *worker) logText() string { w.mu.Lock(); defer w.mu.Unlock(); return w.log.String() }

func freeAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// waitReady polls /readyz until the worker is consuming.
func (w *worker) waitReady(t *testing.T) {
	t.Helper()
	for i := 0; i < 300; i++ {
		resp, err := http.Get("http://" + w.metrics + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("worker not ready after 30s:\n%s", w.logText())
}

func TestEndToEndDecisions(t *testing.T) {
	s := testenv.NewStack(t, 3, nil)
	jobs, bad := decisionJobs()
	s.Produce(jobs, bad...)
	w := start(s, false)
	checkDecisions(t, s, s.Collect(len(jobs)+len(bad), 60*time.Second), len(jobs), len(bad))
	// SIGTERM: the worker drains, leaves the group and exits 0.
	if ok, err := w.signalAndWait(syscall.SIGTERM); !ok || err != nil {
		t.Errorf("after SIGTERM: exited %v (within 20 s: %v), want 0", err, ok)
	}
}

// kill crashes the worker (SIGKILL, as a machine or the OOM killer would)
// and waits until it has exited.
func (w *worker) kill(t *testing.T) {
	t.Helper()
	if err := w.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err := <-w.done
	w.done <- err // for the cleanup
}

// signalAndWait sends sig and waits up to 20 s for the worker to exit:
// whether it exited, and its exit error.
func (w *worker) signalAndWait(sig os.Signal) (bool, error) {
	_ = w.cmd.Process.Signal(sig)
	select {
	case err := <-w.done:
		w.done <- err // for the cleanup
		return true, err
	case <-time.After(20 * time.Second):
		return false, nil
	}
}

// decisionJobs returns jobs whose decisions checkDecisions knows (under
// testenv.TestRules), and malformed messages.
func decisionJobs() (jobs []testenv.JobSpec, bad []kafka.Message) {
	add := func(id string, user uint32, channel, category string) {
		jobs = append(jobs, testenv.JobSpec{ID: id, User: user, Channel: channel, Category: category})
	}
	add("n1", 1, "email", "")
	add("n2", 1, "email", "")
	add("n3", 1, "email", "") // new: daily 2
	add("a1", 3, "push", "")
	add("a2", 3, "push", "") // active: push-daily 1
	add("a3", 3, "email", "")
	add("a4", 3, "email", "")
	add("a5", 3, "email", "")              // active: daily 3 (a1, a3, a4)
	add("t1", 5, "email", "transactional") // exempt, not counted
	add("d1", 5, "email", "")
	add("d2", 5, "sms", "") // dormant: daily 1
	add("x1", 99, "email", "")
	add("x2", 99, "email", "")
	add("x3", 99, "email", "") // default: daily 2
	add("n1", 1, "email", "")  // redelivered job: duplicate
	add("t2", 1, "email", "transactional")
	bad = []kafka.Message{
		{Key: []byte("bad1"), Value: []byte("not json")},
		{Key: []byte("bad2"), Value: []byte(`{"job_id":"b2","user_id":-1,"campaign_id":"c","channel":"email"}`)},
		{Key: []byte("bad3"), Value: []byte(`{"job_id":"b3","user_id":7,"channel":"email"}`)},
		{Key: []byte("bad4"), Value: []byte(`{"job_id":"` + strings.Repeat("x", 200) + `","user_id":7,"campaign_id":"c","channel":"email"}`)},
	}
	return jobs, bad
}

// checkDecisions checks the outputs of decisionJobs: each job's decision,
// topic, segment, cap and retry-at, the dead letters, and what Redis logged.
func checkDecisions(t *testing.T, s *testenv.Stack, outs []testenv.Output, jobs, bad int) {
	t.Helper()
	type key struct{ job, decision string }
	got := map[key]testenv.Output{}
	for _, o := range outs {
		got[key{o.JobID, o.Decision}] = o
	}
	want := []struct {
		job, decision, topic, segment, cap string
	}{
		{"n1", "allowed", "allowed", "new", ""}, {"n2", "allowed", "allowed", "new", ""}, {"n3", "capped", "capped", "new", "daily"},
		{"a1", "allowed", "allowed", "active", ""}, {"a2", "capped", "capped", "active", "push-daily"},
		{"a3", "allowed", "allowed", "active", ""}, {"a4", "allowed", "allowed", "active", ""}, {"a5", "capped", "capped", "active", "daily"},
		{"t1", "exempt", "allowed", "dormant", ""}, {"d1", "allowed", "allowed", "dormant", ""}, {"d2", "capped", "capped", "dormant", "daily"},
		{"x1", "allowed", "allowed", "default", ""}, {"x2", "allowed", "allowed", "default", ""}, {"x3", "capped", "capped", "default", "daily"},
		{"n1", "duplicate", "allowed", "new", ""}, {"t2", "exempt", "allowed", "new", ""},
	}
	for _, wt := range want {
		o, ok := got[key{wt.job, wt.decision}]
		if !ok {
			t.Errorf("job %s: no %q output", wt.job, wt.decision)
			continue
		}
		if !strings.HasSuffix(o.Topic, "."+wt.topic) || o.Segment != wt.segment || o.Cap != wt.cap {
			t.Errorf("job %s: topic %s segment %q cap %q; want %s, %q, %q", wt.job, o.Topic, o.Segment, o.Cap, wt.topic, wt.segment, wt.cap)
		}
		if wt.decision == "capped" {
			if ra := o.RetryAt; time.Until(ra) < 23*time.Hour {
				t.Errorf("job %s: retry-at %v, want about 24h from now", wt.job, ra)
			}
		}
	}
	dlq := 0
	for _, o := range outs {
		if strings.HasSuffix(o.Topic, ".dlq") {
			dlq++
			if o.Decision != "dlq" || !strings.Contains(o.Error, "malformed job") {
				t.Errorf("dead-letter message %+v has no reason", o)
			}
		}
	}
	if dlq != bad || len(outs) != jobs+bad {
		t.Errorf("%d outputs (%d dead-lettered), want %d (%d)", len(outs), dlq, jobs+bad, bad)
	}
	// Exempt jobs are not counted: user 5's log holds d1 only; user 1's n1 and n2.
	rdb := s.RedisClient()
	for user, n := range map[int]int{1: 2, 3: 3, 5: 1, 99: 2} {
		if got := testenv.LogLen(t, rdb, fmt.Sprintf("%s:{%d}", s.Prefix, user)); got != n {
			t.Errorf("user %d: %d sends logged, want %d", user, got, n)
		}
	}
}

// TestCrashMidStreamLosesNothing SIGKILLs the worker mid-stream while a Redis
// master is frozen, so a batch is caught half-decided and uncommitted; after a
// restart every job must be accounted for, no cap exceeded, and the jobs whose
// decisions were recorded before the crash must come back as duplicates
// without being counted twice.
func TestCrashMidStreamLosesNothing(t *testing.T) {
	s := testenv.NewStack(t, 6, nil)
	jobs := testenv.Blast("crash", 6000, 3000) // two jobs per user: the jobs in flight at the crash are allowed, so recorded
	w := start(s, false)
	const chunks = 30
	per := len(jobs) / chunks
	produced := make(chan int, chunks)
	go func() {
		for c := 0; c < chunks; c++ {
			s.Produce(jobs[c*per : (c+1)*per])
			produced <- c + 1
			time.Sleep(100 * time.Millisecond)
		}
		close(produced)
	}()
	for c := range produced {
		if c == chunks/3 {
			resume := s.FreezeMaster(t, 1)
			time.Sleep(700 * time.Millisecond) // the worker is now retrying a half-decided batch
			w.kill(t)
			resume()
			start(s, false)
		}
	}
	outs := s.Collect(len(jobs), 90*time.Second)
	s.CheckAccounting(jobs, outs, true)
	if n := testenv.CountDecision(outs, "duplicate"); n == 0 {
		t.Errorf("no job came back as a duplicate: the crash did not catch a batch with recorded decisions")
	} else {
		t.Logf("%d outputs for %d jobs; %d redelivered jobs recognised as duplicates", len(outs), len(jobs), n)
	}
}

func TestTwoWorkersShareTheGroup(t *testing.T) {
	s := testenv.NewStack(t, 6, nil)
	w1 := start(s, true)
	w2 := start(s, true)
	s.WaitGroupMembers(t, 2, 60*time.Second) // both joined, each with partitions
	jobs := testenv.Blast("pair", 4000, 400)
	s.Produce(jobs)
	outs := s.Collect(len(jobs), 90*time.Second)
	s.CheckAccounting(jobs, outs, true)
	for i, w := range []*worker{w1, w2} {
		if n := scrapeJobs(t, w.metrics); n == 0 {
			t.Errorf("worker %d handled no job: the partitions were not split", i+1)
		} else {
			t.Logf("worker %d handled %v jobs", i+1, n)
		}
	}
}

func scrapeJobs(t *testing.T, addr string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("scrape %s: %v", addr, err)
	}
	defer resp.Body.Close()
	total := 0.0
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "capper_jobs_total{") {
			f := strings.Fields(line)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			total += v
		}
	}
	return total
}

// TestRedisMasterStoppedMidRun freezes a Redis master (SIGSTOP) while jobs
// flow, then resumes it: the worker retries, reports not-ready, and recovers
// with no loss and no over-send.
func TestRedisMasterStoppedMidRun(t *testing.T) {
	s := testenv.NewStack(t, 6, nil)
	w := start(s, true)
	w.waitReady(t)
	jobs := testenv.Blast("freeze", 3000, 300)
	s.Produce(jobs[:1000])
	resume := s.FreezeMaster(t, 1)
	s.Produce(jobs[1000:])
	notReady := false
	for i := 0; i < 30 && !notReady; i++ {
		resp, err := http.Get("http://" + w.metrics + "/readyz")
		if err == nil {
			notReady = resp.StatusCode == http.StatusServiceUnavailable
			resp.Body.Close()
		}
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(1500 * time.Millisecond)
	resume()
	outs := s.Collect(len(jobs), 120*time.Second)
	s.CheckAccounting(jobs, outs, true)
	if !notReady {
		t.Error("/readyz never reported not-ready while a Redis master was stopped")
	}
}

// TestRulesReloadOnSIGHUP raises the default cap from 2 to 3 by rewriting the config file
// and sending SIGHUP to the binary; a broken file sent afterwards is rejected and the
// reloaded rules stay in force. (internal/daemon tests the reload itself in
// process; this one checks the signal's wiring.)
func TestRulesReloadOnSIGHUP(t *testing.T) {
	s := testenv.NewStack(t, 1, nil)
	s.EditConfig("log_level: warn", "log_level: info") // "rules reloaded" is at info
	w := start(s, false)
	s.Produce([]testenv.JobSpec{{ID: "r1", User: 77, Channel: "email"}, {ID: "r2", User: 77, Channel: "email"}, {ID: "r3", User: 77, Channel: "email"}})
	outs := s.Collect(3, 60*time.Second)
	if capped := testenv.CountDecision(outs, "capped"); capped != 1 {
		t.Fatalf("before the reload: %d capped of 3 (default cap 2), want 1", capped)
	}
	orig, err := os.ReadFile(s.Config)
	if err != nil {
		t.Fatal(err)
	}
	raised := strings.Replace(string(orig), "default_caps: [{name: daily, window: 24h, limit: 2}]", "default_caps: [{name: daily, window: 24h, limit: 3}]", 1)
	if raised == string(orig) {
		t.Fatal("test config has no default cap to raise")
	}
	if err := os.WriteFile(s.Config, []byte(raised), 0o644); err != nil {
		t.Fatal(err)
	}
	sent := time.Now()
	_ = w.cmd.Process.Signal(syscall.SIGHUP)
	w.waitLog(t, "rules reloaded", sent)
	if err := os.WriteFile(s.Config, []byte(raised+"\nrules: [broken\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	sent = time.Now()
	_ = w.cmd.Process.Signal(syscall.SIGHUP)
	w.waitLog(t, "rules reload rejected; keeping the rules in force", sent)
	s.Produce([]testenv.JobSpec{{ID: "r4", User: 77, Channel: "email"}, {ID: "r5", User: 77, Channel: "email"}})
	outs = s.Collect(5, 60*time.Second)
	got := map[string]string{}
	for _, o := range outs {
		got[o.JobID] = o.Decision
	}
	if got["r4"] != "allowed" || got["r5"] != "capped" {
		t.Fatalf("after raising the cap to 3: r4 %q, r5 %q; want allowed, capped (decisions %v)", got["r4"], got["r5"], got)
	}
	if w.cmd.ProcessState != nil {
		t.Fatal("the worker exited")
	}
}

// TestLargeBatchesStayUnderTheBrokerLimit sends batches whose outputs for one
// partition add up to several MB: the worker must split them below the
// broker's message size limit (1 MB by default) instead of retrying a
// rejected batch forever.
func TestLargeBatchesStayUnderTheBrokerLimit(t *testing.T) {
	s := testenv.NewStack(t, 1, nil)
	cfg, err := os.ReadFile(s.Config)
	if err != nil {
		t.Fatal(err)
	}
	big := strings.Replace(string(cfg), "batch: {size: 200, max_wait: 50ms}", "batch: {size: 5000, max_wait: 500ms}", 1)
	if big == string(cfg) {
		t.Fatal("test config has no batch line to change")
	}
	if err := os.WriteFile(s.Config, []byte(big), 0o644); err != nil {
		t.Fatal(err)
	}
	pad := strings.Repeat("x", 700)
	var msgs []kafka.Message
	for i := 0; i < 6000; i++ {
		v := fmt.Sprintf(`{"job_id":"big-%d","user_id":%d,"campaign_id":"c","channel":"email","payload":{"body":"%s"}}`, i, 1000+i, pad)
		msgs = append(msgs, kafka.Message{Key: []byte(strconv.Itoa(1000 + i)), Value: []byte(v)})
	}
	s.Produce(nil, msgs...)
	start(s, false)
	outs := s.Collect(len(msgs), 60*time.Second)
	if len(outs) < len(msgs) {
		t.Fatalf("%d of %d jobs reached an output topic", len(outs), len(msgs))
	}
}
