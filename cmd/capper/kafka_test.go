package main_test

// Consumer-group and broker behaviour on Apache Kafka: members that die or
// freeze, commits from a generation that has ended, a broker that crashes or
// stops mid-stream. Each must lose nothing and count nothing twice.

import (
	"encoding/json"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/capper-dev/capper/internal/testenv"
)

// TestWorkerKilledWhileJoining: a worker is SIGKILLed, a new one starts and
// is SIGKILLed while its JoinGroup is pending, and a third starts. Kafka
// expires the dead members after their session timeout (6 s here), so the
// third worker must get every partition and decide every job. (The fake
// broker the project ran on before kept such a member forever.)
func TestWorkerKilledWhileJoining(t *testing.T) {
	s := testenv.NewStack(t, 3, nil)
	w1 := start(s, false)
	s.Produce([]testenv.JobSpec{{ID: "k0", User: 50, Channel: "email"}})
	if outs := s.Collect(1, 60*time.Second); len(outs) != 1 {
		t.Fatalf("the first worker decided %d of 1 job", len(outs))
	}
	w1.kill(t)
	w2 := start(s, false)
	time.Sleep(1500 * time.Millisecond) // w2 is joining: the group waits for w1 to rejoin
	w2.kill(t)
	start(s, false)
	jobs := testenv.Blast("kj", 300, 100)
	s.Produce(jobs)
	outs := s.Collect(len(jobs)+1, 90*time.Second)
	if len(outs) < len(jobs)+1 {
		t.Fatalf("%d of %d jobs decided after the worker killed while joining was replaced", len(outs)-1, len(jobs))
	}
}

// TestStaleMemberCommitsAfterRebalance: a worker is frozen (SIGSTOP) with a
// decided batch in flight, longer than its session timeout. Kafka expires
// it; a second worker gets its partitions and decides the batch again. When
// the first one thaws it writes the outputs of its old batch and commits
// them: Kafka refuses a commit of the ended generation (UNKNOWN_MEMBER_ID,
// ILLEGAL_GENERATION or REBALANCE_IN_PROGRESS), and kafka-go, which rejoins in
// the background, may instead send it in the new one. Nothing may be lost, and
// the jobs decided twice must come back as duplicates, so that no user is
// counted twice.
func TestStaleMemberCommitsAfterRebalance(t *testing.T) {
	s := testenv.NewStack(t, 3, nil)
	w1 := start(s, true)
	warm := testenv.Blast("warm", 30, 30)
	s.Produce(warm)
	s.CollectJobs(warm, 60*time.Second)

	// A batch that w1 fetches and cannot decide yet: its users' Redis master is frozen.
	master := s.MasterOf(1)
	var stuck []testenv.JobSpec
	for u := uint32(1); len(stuck) < 20; u++ {
		if s.MasterOf(u) == master {
			stuck = append(stuck, testenv.JobSpec{ID: fmt.Sprintf("stuck-%d", len(stuck)), User: u, Channel: "email"})
		}
	}
	resume := s.FreezeMaster(t, 1)
	since := time.Now()
	s.Produce(stuck)
	w1.waitLog(t, "redis decisions failing", since)
	if err := w1.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	resume()
	w2 := start(s, true)
	outs := s.CollectJobs(stuck, 90*time.Second) // w2, once Kafka expired w1 (session timeout 6 s)
	if err := w1.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	// w1 thaws and finishes its old batch: every job of it is now a duplicate of w2's decision.
	thawed := time.Now()
	if got := len(s.Collect(len(warm)+2*len(stuck), 60*time.Second)); got < len(warm)+2*len(stuck) {
		t.Fatalf("%d outputs after the thaw, want %d: w1 did not finish its old batch", got, len(warm)+2*len(stuck))
	}
	written := time.Since(thawed)
	// Its commit is either refused (Kafka's answer to an ended generation) or, when kafka-go has rejoined
	// first, made in the new generation; either way only offsets whose outputs were written.
	commit := "made in the new generation"
	if _, line, ok := w1.logTime("commit failed; retried with the next batch", since); ok {
		commit = fmt.Sprint("refused: ", line["err"])
	}
	more := testenv.Blast("after", 600, 200)
	s.Produce(more)
	all := append(append(append([]testenv.JobSpec{}, warm...), stuck...), more...)
	outs = s.CollectJobs(all, 90*time.Second)
	s.CheckAccounting(all, outs, true)
	dups := 0
	for _, o := range outs {
		if strings.HasPrefix(o.JobID, "stuck-") && o.Decision == "duplicate" {
			dups++
		}
	}
	if dups < len(stuck) { // w1's old batch, at least (w1's first attempt may also be recorded once Redis thaws)
		t.Errorf("%d duplicates among the %d jobs decided by both workers, want at least one each", dups, len(stuck))
	}
	for end := time.Now().Add(30 * time.Second); s.Committed(t) != int64(len(all)); time.Sleep(100 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("%d of %d offsets committed", s.Committed(t), len(all))
		}
	}
	t.Logf("w1's stale commit %s; its batch written %.1f s after the thaw; %d duplicate outputs of the %d stuck jobs; w2 ready: %v",
		commit, written.Seconds(), dups, len(stuck), readyz(t, w2.metrics) == 200)
}

// TestBrokerRestartMidStream stops the broker while a stream is being
// decided, by a crash (SIGKILL) and by a controlled shutdown (SIGTERM), and
// starts it again on its data directory. The worker retries what was in
// flight and goes on: every job once, nothing over a cap, every offset
// committed.
func TestBrokerRestartMidStream(t *testing.T) {
	for _, sig := range []syscall.Signal{syscall.SIGKILL, syscall.SIGTERM} {
		t.Run(sig.String(), func(t *testing.T) {
			s := testenv.NewStack(t, 3, nil)
			w := start(s, true)
			jobs := testenv.Blast("bk", 3000, 1000)
			s.Produce(jobs[:1500])
			s.CollectJobs(jobs[:300], 60*time.Second) // mid-stream
			stopped := time.Now()
			restart := testenv.StopKafka(t, sig)
			down := time.Since(stopped)
			restart()
			back := time.Now()
			s.Produce(jobs[1500:])
			s.CheckAccounting(jobs, s.CollectJobs(jobs, 120*time.Second), true)
			waitReadyz(t, w, 200)
			for end := time.Now().Add(30 * time.Second); s.Committed(t) != int64(len(jobs)); time.Sleep(100 * time.Millisecond) {
				if time.Now().After(end) {
					t.Fatalf("%d of %d offsets committed", s.Committed(t), len(jobs))
				}
			}
			t.Logf("the broker took %.1f s to stop and %.1f s to come back; every job decided %.1f s after that",
				down.Seconds(), back.Sub(stopped).Seconds()-down.Seconds(), time.Since(back).Seconds())
		})
	}
}

// TestStalledReaderIsNotReady: a reader that cannot fetch is not refused
// (nothing a grant fixes), it only stops; kafka-go retries inside and says
// nothing the worker could classify. An idle worker whose partitions hold
// nothing stays ready past the stall bound (3 fetch waits, a late reply's
// grace and the session timeout, 8.5 s here); with the broker gone (SIGKILL) the input reader has
// not fetched for the bound and its lag cannot be told: not ready, one error
// line naming the reader. With the broker back it reads again, decides what
// came meanwhile and is ready.
func TestStalledReaderIsNotReady(t *testing.T) {
	s := testenv.NewStack(t, 3, nil)
	w := start(s, true)
	first := testenv.Blast("sa", 200, 50)
	s.Produce(first)
	s.CollectJobs(first, 60*time.Second)
	waitReadyz(t, w, 200)
	// Idle with nothing waiting, beyond the bound and a check: still ready.
	const bound, check = 8500 * time.Millisecond, 2 * time.Second
	for idle := time.Now(); time.Since(idle) < bound+2*check; time.Sleep(200 * time.Millisecond) {
		if code := readyz(t, w.metrics); code != 200 {
			t.Fatalf("/readyz answers %d while the worker is idle with nothing waiting:\n%s", code, w.logText())
		}
	}
	const msg = "the Kafka reader has not fetched while its partitions hold messages; not ready until it reads again"
	if _, line, ok := w.logTime(msg, time.Time{}); ok {
		t.Fatalf("a stall was logged while the worker was idle with nothing waiting: %v", line)
	}
	stopped := time.Now()
	restart := testenv.StopKafka(t, syscall.SIGKILL)
	waitReadyz(t, w, 503)
	var line map[string]any
	for end := time.Now().Add(30 * time.Second); line == nil; time.Sleep(50 * time.Millisecond) {
		for _, l := range strings.Split(w.logText(), "\n") {
			var v map[string]any
			if json.Unmarshal([]byte(l), &v) == nil && v["msg"] == msg && strings.Contains(fmt.Sprint(v["reader"]), "topic "+s.Topics[0]+",") {
				line = v
			}
		}
		if line == nil && time.Now().After(end) {
			t.Fatalf("no stall line for the input reader within 30 s of the broker's SIGKILL:\n%s", w.logText())
		}
	}
	if line["level"] != "ERROR" || !strings.HasPrefix(fmt.Sprint(line["waiting"]), "unknown: ") || line["bound"] != bound.String() {
		t.Errorf("the stall is logged as %v; want level ERROR, waiting unknown (the broker is gone), bound %v", line, bound)
	}
	if scrapeMetric(t, w.metrics, "capper_ready") != 0 {
		t.Error("capper_ready is 1 while the input reader is stalled")
	}
	notReady := time.Since(stopped)
	restart()
	second := testenv.Blast("sb", 200, 50)
	s.Produce(second)
	all := append(append([]testenv.JobSpec{}, first...), second...)
	s.CheckAccounting(all, s.CollectJobs(all, 120*time.Second), true)
	waitReadyz(t, w, 200)
	t.Logf("not ready %.1f s after the broker's SIGKILL; stall line: %v", notReady.Seconds(), line)
}

// TestEndpointsServedDuringStartup: while start-up waits for a broker that
// does not answer (retried for 30 s), /metrics and /readyz are served, and
// /readyz answers 503, from the first moment: an orchestrator sees a pod
// that is starting, not one that refuses connections; capper_ready is 0 and
// capper_build_info there from the first moment too.
func TestEndpointsServedDuringStartup(t *testing.T) {
	s := testenv.NewStack(t, 1, nil)
	w := startWith(s, true, nil, "CAPPER_KAFKA_BROKERS="+freeAddr(t)) // nothing listens there
	var code int
	for end := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if code = readyz(t, w.metrics); code != 0 {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("/readyz not served within 20 s of the start:\n%s", w.logText())
		}
	}
	if code != 503 {
		t.Fatalf("/readyz answers %d while the broker does not answer, want 503", code)
	}
	if m := scrape(t, w.metrics); !strings.Contains(m, "go_goroutines") || !strings.Contains(m, "capper_build_info{") {
		t.Error("/metrics does not serve the registry (capper_build_info) during start-up")
	}
	if v := scrapeMetric(t, w.metrics, "capper_ready"); v != 0 {
		t.Errorf("capper_ready = %v during start-up (-1: absent); want 0 from the first moment, so that sum(capper_ready) == 0 can fire", v)
	}
	if _, _, ok := w.logTime("kafka not ready; retrying", time.Time{}); !ok {
		w.waitLog(t, "kafka not ready; retrying", time.Time{})
	}
	if code := readyz(t, w.metrics); code != 503 {
		t.Errorf("/readyz answers %d while start-up retries the broker, want 503", code)
	}
	// SIGINT while starting: a clean stop, exit 0, no error line.
	if ok, err := w.signalAndWait(syscall.SIGINT); !ok || err != nil || strings.Contains(w.logText(), `"level":"ERROR"`) {
		t.Errorf("SIGINT during start-up: exit %v (within 20 s: %v), want 0 and no error line:\n%s", err, ok, w.logText())
	}
}

// TestBothBackendsNamedAtStartup: with neither backend answering, the
// worker says so for both at once, each in a line naming the setting to
// check, instead of a line per retry for Redis alone (go-redis's own
// repeated dial failures are said once in five attempts); then a SIGINT
// stops it cleanly.
func TestBothBackendsNamedAtStartup(t *testing.T) {
	s := testenv.NewStack(t, 1, nil)
	w := startWith(s, true, nil, "CAPPER_REDIS_ADDRS="+freeAddr(t), "CAPPER_KAFKA_BROKERS="+freeAddr(t))
	w.waitLog(t, "kafka not ready", time.Time{})
	w.waitLog(t, "redis not ready; retrying", time.Time{})
	for end := time.Now().Add(30 * time.Second); !strings.Contains(w.logText(), `"attempt":5,`); time.Sleep(50 * time.Millisecond) {
		if time.Now().After(end) { // five attempts, each a round of go-redis's dials
			t.Fatalf("no fifth attempt at Redis within 30 s:\n%s", w.logText())
		}
	}
	logs := w.logText()
	if !strings.Contains(logs, "kafka.brokers (CAPPER_KAFKA_BROKERS)") || !strings.Contains(logs, "redis.addrs (CAPPER_REDIS_ADDRS)") {
		t.Errorf("the start-up lines do not name both settings:\n%s", logs)
	}
	if ok, err := w.signalAndWait(syscall.SIGINT); !ok || err != nil {
		t.Errorf("SIGINT while waiting for the backends: exit %v (within 20 s: %v), want 0", err, ok)
	}
	warned := 0
	for _, l := range strings.Split(w.logText(), "\n") {
		if strings.Contains(l, "connection pool: failed to dial") && strings.Contains(l, `"level":"WARN"`) {
			warned++
		}
	}
	if warned != 1 {
		t.Errorf("go-redis's dial failure logged at warn %d times, want once (its repeats at debug):\n%s", warned, w.logText())
	}
}
