package main_test

import (
	"bufio"
	"bytes"
	"context"
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

	"github.com/RoaringBitmap/roaring/v2"
	"github.com/redis/go-redis/v9"
	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/testenv"
	"github.com/capper-dev/capper/segments"
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

// stack is one test's slice of the local stack: its own topics, group, key
// prefix and segment prefix.
type stack struct {
	t       *testing.T
	brokers []string
	redis   []string
	topics  [4]string // input, allowed, capped, dlq
	prefix  string
	config  string
}

const testRules = `
rules:
  segments:
    - name: new
      caps: [{name: daily, window: 24h, limit: 2}]
    - name: active
      caps:
        - {name: daily, window: 24h, limit: 3}
        - {name: push-daily, window: 24h, limit: 1, channel: push}
    - name: dormant
      caps: [{name: daily, window: 24h, limit: 1}]
  default_caps: [{name: daily, window: 24h, limit: 2}]
  exempt_categories: [transactional]
`

// newStack uploads segments new={1,2}, active={3,4}, dormant={5} plus the
// extra ids given, creates topics and writes a config file.
func newStack(t *testing.T, partitions int, extra map[string][]uint32) *stack {
	t.Helper()
	s := &stack{t: t, brokers: testenv.KafkaBrokers(t), redis: testenv.RedisAddrs(t)}
	endpoint, bucket := testenv.S3(t)
	name := testenv.Unique("e2e")
	for i, suffix := range []string{"", ".allowed", ".capped", ".dlq"} {
		s.topics[i] = name + suffix
	}
	testenv.CreateTopics(t, s.brokers, partitions, s.topics[:]...)
	s.prefix = name
	up := &segments.S3Source{Client: testenv.S3Client(endpoint), Bucket: bucket, Prefix: name}
	segs := map[string][]uint32{"new": {1, 2}, "active": {3, 4}, "dormant": {5}}
	for k, v := range extra {
		segs[k] = append(segs[k], v...)
	}
	for seg, ids := range segs {
		data, err := segments.Encode(roaring.BitmapOf(ids...))
		if err != nil {
			t.Fatal(err)
		}
		if err := up.Put(context.Background(), seg, data); err != nil {
			t.Fatal(err)
		}
	}
	cfg := fmt.Sprintf(`
kafka:
  brokers: [%s]
  group_id: %s
  topics: {input: %s, allowed: %s, capped: %s, dlq: %s}
  session_timeout: 6s
redis:
  addrs: [%s]
  key_prefix: %s
  read_timeout: 500ms
  write_timeout: 500ms
  decide_timeout: 1s
segments:
  source: s3://%s/%s
  s3_endpoint: %s
  s3_path_style: true
batch: {size: 200, max_wait: 50ms}
metrics_addr: "off"
shutdown_timeout: 10s
log_level: warn
%s`, strings.Join(s.brokers, ", "), name, s.topics[0], s.topics[1], s.topics[2], s.topics[3],
		strings.Join(s.redis, ", "), name, bucket, name, endpoint, testRules)
	s.config = filepath.Join(t.TempDir(), "capper.yaml")
	if err := os.WriteFile(s.config, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return s
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

func (s *stack) start(withMetrics bool) *worker {
	s.t.Helper()
	w := &worker{log: &bytes.Buffer{}, mu: &sync.Mutex{}, done: make(chan error, 1)}
	w.cmd = exec.Command(capperBin, "run", "--config", s.config)
	// The SASL password is loaded (no mechanism uses it here) so that the log
	// check below would catch it in any line.
	w.cmd.Env = append(os.Environ(), "AWS_ACCESS_KEY_ID=test", "AWS_SECRET_ACCESS_KEY=test", "AWS_REGION=us-east-1",
		"CAPPER_KAFKA_SASL_PASSWORD="+secretSentinel)
	if withMetrics {
		w.metrics = freeAddr(s.t)
		w.cmd.Env = append(w.cmd.Env, "CAPPER_METRICS_ADDR="+w.metrics)
	}
	w.cmd.Stderr = lockedWriter{w.mu, w.log}
	if err := w.cmd.Start(); err != nil {
		s.t.Fatal(err)
	}
	go func() { w.done <- w.cmd.Wait() }()
	s.t.Cleanup(func() {
		_ = w.cmd.Process.Kill()
		<-w.done
		checkLog(s.t, w.logText())
		if s.t.Failed() {
			s.t.Logf("worker log:\n%s", w.logText())
		}
	})
	return w
}

const secretSentinel = "s3cr3t-sentinel-do-not-log"

// checkLog fails the test on a worker log line that is not a JSON object
// (every library's lines go through the worker's slog logger) or that
// contains a secret.
func checkLog(t *testing.T, log string) {
	t.Helper()
	for i, line := range strings.Split(strings.TrimRight(log, "\n"), "\n") {
		if line == "" {
			continue
		}
		var v map[string]any
		if err := json.Unmarshal([]byte(line), &v); err != nil {
			t.Errorf("worker log line %d is not JSON: %q", i+1, line)
		}
		if strings.Contains(line, secretSentinel) {
			t.Errorf("worker log line %d contains the SASL password: %q", i+1, line)
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

type jobSpec struct {
	id, channel, category string
	user                  uint32
}

func (s *stack) produce(jobs []jobSpec, raw ...kafka.Message) {
	s.t.Helper()
	msgs := make([]kafka.Message, 0, len(jobs)+len(raw))
	for _, j := range jobs {
		v := map[string]any{"job_id": j.id, "user_id": j.user, "campaign_id": "c1", "channel": j.channel, "payload": map[string]any{"subject": "hi"}}
		if j.category != "" {
			v["category"] = j.category
		}
		b, _ := json.Marshal(v)
		msgs = append(msgs, kafka.Message{Key: []byte(strconv.Itoa(int(j.user))), Value: b})
	}
	msgs = append(msgs, raw...)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var err error
	// kafka-go caches topic metadata in the writer's transport, so a retry after
	// "Unknown Topic Or Partition" (a topic just created) needs a new writer.
	for attempt := 0; attempt < 20; attempt++ {
		w := &kafka.Writer{Addr: kafka.TCP(s.brokers...), Topic: s.topics[0], Balancer: &kafka.Murmur2Balancer{}, RequiredAcks: kafka.RequireAll, BatchTimeout: 2 * time.Millisecond, BatchSize: 1000}
		err = w.WriteMessages(ctx, msgs...)
		w.Close()
		if err == nil {
			return
		}
		time.Sleep(300 * time.Millisecond)
	}
	s.t.Errorf("produce: %v", err)
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

// output is one message on an output topic.
type output struct {
	topic, jobID, decision, segment, cap, retryAt, reason string
	user                                                  uint32
}

// collect reads the three output topics until want messages arrived or the
// timeout passes.
func (s *stack) collect(want int, timeout time.Duration) []output {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var mu sync.Mutex
	var outs []output
	var wg sync.WaitGroup
	for _, topic := range s.topics[1:] {
		wg.Add(1)
		go func(topic string) {
			defer wg.Done()
			r := kafka.NewReader(kafka.ReaderConfig{Brokers: s.brokers, GroupTopics: []string{topic}, GroupID: testenv.Unique("reader"), MaxWait: 200 * time.Millisecond, StartOffset: kafka.FirstOffset})
			defer r.Close()
			for {
				m, err := r.FetchMessage(ctx)
				if err != nil {
					return
				}
				o := output{topic: topic}
				for _, h := range m.Headers {
					switch h.Key {
					case "capper-decision":
						o.decision = string(h.Value)
					case "capper-segment":
						o.segment = string(h.Value)
					case "capper-cap":
						o.cap = string(h.Value)
					case "capper-retry-at":
						o.retryAt = string(h.Value)
					case "capper-error":
						o.reason = string(h.Value)
					}
				}
				var j struct {
					JobID  string `json:"job_id"`
					UserID uint32 `json:"user_id"`
				}
				_ = json.Unmarshal(m.Value, &j)
				o.jobID, o.user = j.JobID, j.UserID
				mu.Lock()
				outs = append(outs, o)
				n := len(outs)
				mu.Unlock()
				if n >= want {
					cancel()
				}
			}
		}(topic)
	}
	wg.Wait()
	return outs
}

func TestEndToEndDecisions(t *testing.T) {
	s := newStack(t, 3, nil)
	var jobs []jobSpec
	add := func(id string, user uint32, channel, category string) {
		jobs = append(jobs, jobSpec{id: id, user: user, channel: channel, category: category})
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
	bad := []kafka.Message{
		{Key: []byte("bad1"), Value: []byte("not json")},
		{Key: []byte("bad2"), Value: []byte(`{"job_id":"b2","user_id":-1,"campaign_id":"c","channel":"email"}`)},
		{Key: []byte("bad3"), Value: []byte(`{"job_id":"b3","user_id":7,"channel":"email"}`)},
		{Key: []byte("bad4"), Value: []byte(`{"job_id":"` + strings.Repeat("x", 200) + `","user_id":7,"campaign_id":"c","channel":"email"}`)},
	}
	s.produce(jobs, bad...)
	w := s.start(false)
	outs := s.collect(len(jobs)+len(bad), 60*time.Second)

	type key struct{ job, decision string }
	got := map[key]output{}
	for _, o := range outs {
		got[key{o.jobID, o.decision}] = o
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
		if !strings.HasSuffix(o.topic, "."+wt.topic) || o.segment != wt.segment || o.cap != wt.cap {
			t.Errorf("job %s: topic %s segment %q cap %q; want %s, %q, %q", wt.job, o.topic, o.segment, o.cap, wt.topic, wt.segment, wt.cap)
		}
		if wt.decision == "capped" {
			if ra, err := time.Parse(time.RFC3339Nano, o.retryAt); err != nil || time.Until(ra) < 23*time.Hour {
				t.Errorf("job %s: retry-at %q, want about 24h from now", wt.job, o.retryAt)
			}
		}
	}
	dlq := 0
	for _, o := range outs {
		if strings.HasSuffix(o.topic, ".dlq") {
			dlq++
			if o.decision != "dlq" || !strings.Contains(o.reason, "malformed job") {
				t.Errorf("dead-letter message %+v has no reason", o)
			}
		}
	}
	if dlq != len(bad) || len(outs) != len(jobs)+len(bad) {
		t.Errorf("%d outputs (%d dead-lettered), want %d (%d)", len(outs), dlq, len(jobs)+len(bad), len(bad))
	}
	// Exempt jobs are not counted: user 5's log holds d1 only; user 1's n1 and n2.
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: s.redis})
	defer rdb.Close()
	for user, n := range map[int]int64{1: 2, 3: 3, 5: 1, 99: 2} {
		if got := rdb.ZCard(context.Background(), fmt.Sprintf("%s:{%d}", s.prefix, user)).Val(); got != n {
			t.Errorf("user %d: %d sends logged, want %d", user, got, n)
		}
	}
	// SIGTERM: the worker drains, leaves the group and exits 0.
	_ = w.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-w.done:
		if err != nil {
			t.Errorf("worker exited with %v after SIGTERM, want 0", err)
		}
		w.done <- err
	case <-time.After(20 * time.Second):
		t.Error("worker did not stop within 20s of SIGTERM")
	}
}

// blast makes n jobs for users 1..users (ids 1-5 are in segments, the rest
// default), channels mixed.
func blast(prefix string, n, users int) []jobSpec {
	jobs := make([]jobSpec, n)
	chans := []string{"email", "push", "sms"}
	for i := range jobs {
		jobs[i] = jobSpec{id: fmt.Sprintf("%s-%d", prefix, i), user: uint32(1 + i%users), channel: chans[i%3]}
	}
	return jobs
}

// checkAccounting asserts that every job reached an output topic, that no
// user's allowed sends (unique job ids) exceed its daily cap, and that Redis
// logged each allowed job exactly once. With exactLog false (a master crashed
// without min_replicas_acked, so recorded sends may be lost with it) Redis
// must log no more than the allowed jobs: none counted twice.
func (s *stack) checkAccounting(jobs []jobSpec, outs []output, exactLog bool) {
	s.t.Helper()
	seen := map[string]bool{}
	allowed := map[uint32]map[string]bool{}
	for _, o := range outs {
		seen[o.jobID] = true
		if o.decision == "allowed" || o.decision == "duplicate" {
			if allowed[o.user] == nil {
				allowed[o.user] = map[string]bool{}
			}
			allowed[o.user][o.jobID] = true
		}
	}
	missing := 0
	for _, j := range jobs {
		if !seen[j.id] {
			missing++
		}
	}
	if missing > 0 {
		s.t.Errorf("%d of %d jobs reached no output topic", missing, len(jobs))
	}
	limit := map[uint32]int{1: 2, 2: 2, 3: 3, 4: 3, 5: 1}
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: s.redis})
	defer rdb.Close()
	users := map[uint32]bool{}
	for _, j := range jobs {
		users[j.user] = true
	}
	for u := range users {
		l, ok := limit[u]
		if !ok {
			l = 2
		}
		if n := len(allowed[u]); n > l {
			s.t.Errorf("user %d: %d unique jobs allowed, cap %d", u, n, l)
		}
		logged := rdb.ZCard(context.Background(), fmt.Sprintf("%s:{%d}", s.prefix, u)).Val()
		if int(logged) > len(allowed[u]) || exactLog && int(logged) != len(allowed[u]) {
			s.t.Errorf("user %d: %d sends logged in Redis, %d unique jobs allowed (a job counted twice or lost)", u, logged, len(allowed[u]))
		}
	}
}

// TestCrashMidStreamLosesNothing SIGKILLs the worker mid-stream while a Redis
// master is frozen, so a batch is caught half-decided and uncommitted; after a
// restart every job must be accounted for, no cap exceeded, and the jobs whose
// decisions were recorded before the crash must come back as duplicates
// without being counted twice.
func TestCrashMidStreamLosesNothing(t *testing.T) {
	s := newStack(t, 6, nil)
	jobs := blast("crash", 6000, 3000) // two jobs per user: the jobs in flight at the crash are allowed, so recorded
	w := s.start(false)
	const chunks = 30
	per := len(jobs) / chunks
	produced := make(chan int, chunks)
	go func() {
		for c := 0; c < chunks; c++ {
			s.produce(jobs[c*per : (c+1)*per])
			produced <- c + 1
			time.Sleep(100 * time.Millisecond)
		}
		close(produced)
	}()
	for c := range produced {
		if c == chunks/3 {
			resume := s.freezeMaster(t, 1)
			time.Sleep(700 * time.Millisecond) // the worker is now retrying a half-decided batch
			if err := w.cmd.Process.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			<-w.done
			w.done <- nil
			resume()
			s.start(false)
		}
	}
	outs := s.collect(len(jobs), 90*time.Second)
	s.checkAccounting(jobs, outs, true)
	if n := countDecision(outs, "duplicate"); n == 0 {
		t.Errorf("no job came back as a duplicate: the crash did not catch a batch with recorded decisions")
	} else {
		t.Logf("%d outputs for %d jobs; %d redelivered jobs recognised as duplicates", len(outs), len(jobs), n)
	}
}

// freezeMaster stops (SIGSTOP) the Redis master that owns user's key and
// returns the function that resumes it and waits for the cluster to be ok.
func (s *stack) freezeMaster(t *testing.T, user uint32) (resume func()) {
	t.Helper()
	stateDir := testenv.StackDir(t)
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: s.redis})
	master, err := rdb.MasterForKey(context.Background(), fmt.Sprintf("%s:{%d}", s.prefix, user))
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(master.Options().Addr)
	pidb, err := os.ReadFile(filepath.Join(stateDir, "redis", port+".pid"))
	if err != nil {
		t.Fatal(err)
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(pidb)))
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	done := false
	resume = func() {
		if done {
			return
		}
		done = true
		_ = syscall.Kill(pid, syscall.SIGCONT)
		testenv.WaitClusterOK(t, rdb)
		rdb.Close()
	}
	t.Cleanup(resume)
	return resume
}

func TestTwoWorkersShareTheGroup(t *testing.T) {
	s := newStack(t, 6, nil)
	w1 := s.start(true)
	w2 := s.start(true)
	time.Sleep(2 * time.Second)
	jobs := blast("pair", 4000, 400)
	s.produce(jobs)
	outs := s.collect(len(jobs), 90*time.Second)
	s.checkAccounting(jobs, outs, true)
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
	s := newStack(t, 6, nil)
	w := s.start(true)
	w.waitReady(t)
	jobs := blast("freeze", 3000, 300)
	s.produce(jobs[:1000])
	resume := s.freezeMaster(t, 1)
	s.produce(jobs[1000:])
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
	outs := s.collect(len(jobs), 120*time.Second)
	s.checkAccounting(jobs, outs, true)
	if !notReady {
		t.Error("/readyz never reported not-ready while a Redis master was stopped")
	}
}

// TestRulesReloadOnSIGHUP raises the default cap from 2 to 3 by rewriting the config file
// and sending SIGHUP; a broken file sent afterwards is rejected and the
// reloaded rules stay in force.
func TestRulesReloadOnSIGHUP(t *testing.T) {
	s := newStack(t, 1, nil)
	w := s.start(false)
	s.produce([]jobSpec{{id: "r1", user: 77, channel: "email"}, {id: "r2", user: 77, channel: "email"}, {id: "r3", user: 77, channel: "email"}})
	outs := s.collect(3, 60*time.Second)
	if capped := countDecision(outs, "capped"); capped != 1 {
		t.Fatalf("before the reload: %d capped of 3 (default cap 2), want 1", capped)
	}
	orig, err := os.ReadFile(s.config)
	if err != nil {
		t.Fatal(err)
	}
	raised := strings.Replace(string(orig), "default_caps: [{name: daily, window: 24h, limit: 2}]", "default_caps: [{name: daily, window: 24h, limit: 3}]", 1)
	if raised == string(orig) {
		t.Fatal("test config has no default cap to raise")
	}
	if err := os.WriteFile(s.config, []byte(raised), 0o644); err != nil {
		t.Fatal(err)
	}
	_ = w.cmd.Process.Signal(syscall.SIGHUP)
	time.Sleep(time.Second)
	if err := os.WriteFile(s.config, []byte(raised+"\nrules: [broken\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	_ = w.cmd.Process.Signal(syscall.SIGHUP)
	time.Sleep(time.Second)
	s.produce([]jobSpec{{id: "r4", user: 77, channel: "email"}, {id: "r5", user: 77, channel: "email"}})
	outs = s.collect(5, 60*time.Second)
	got := map[string]string{}
	for _, o := range outs {
		got[o.jobID] = o.decision
	}
	if got["r4"] != "allowed" || got["r5"] != "capped" {
		t.Fatalf("after raising the cap to 3: r4 %q, r5 %q; want allowed, capped (decisions %v)", got["r4"], got["r5"], got)
	}
	if !strings.Contains(w.logText(), "rules reload rejected") {
		t.Error("the broken config file was not reported as rejected")
	}
	if w.cmd.ProcessState != nil {
		t.Fatal("the worker exited")
	}
}

func countDecision(outs []output, decision string) int {
	n := 0
	for _, o := range outs {
		if o.decision == decision {
			n++
		}
	}
	return n
}

// TestLargeBatchesStayUnderTheBrokerLimit sends batches whose outputs for one
// partition add up to several MB: the worker must split them below the
// broker's message size limit (1 MB by default) instead of retrying a
// rejected batch forever.
func TestLargeBatchesStayUnderTheBrokerLimit(t *testing.T) {
	s := newStack(t, 1, nil)
	cfg, err := os.ReadFile(s.config)
	if err != nil {
		t.Fatal(err)
	}
	big := strings.Replace(string(cfg), "batch: {size: 200, max_wait: 50ms}", "batch: {size: 5000, max_wait: 500ms}", 1)
	if big == string(cfg) {
		t.Fatal("test config has no batch line to change")
	}
	if err := os.WriteFile(s.config, []byte(big), 0o644); err != nil {
		t.Fatal(err)
	}
	pad := strings.Repeat("x", 700)
	var msgs []kafka.Message
	for i := 0; i < 6000; i++ {
		v := fmt.Sprintf(`{"job_id":"big-%d","user_id":%d,"campaign_id":"c","channel":"email","payload":{"body":"%s"}}`, i, 1000+i, pad)
		msgs = append(msgs, kafka.Message{Key: []byte(strconv.Itoa(1000 + i)), Value: []byte(v)})
	}
	s.produce(nil, msgs...)
	s.start(false)
	outs := s.collect(len(msgs), 60*time.Second)
	if len(outs) < len(msgs) {
		t.Fatalf("%d of %d jobs reached an output topic", len(outs), len(msgs))
	}
}
