package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/output"
	"github.com/capper-dev/capper/rules"
)

// These tests run the Worker against fakes of its four interfaces: no
// broker, no Redis. The end-to-end tests run it against the real stack.

// fakeReader hands out the messages sent on its channel and records commits.
type fakeReader struct {
	msgs    chan kafka.Message
	mu      sync.Mutex
	commits [][]int64 // offsets of each successful CommitMessages call
	// commitErr, when set, decides per call (from 1) whether a commit fails.
	commitErr func(call int) error
	calls     int
}

func newReader() *fakeReader { return &fakeReader{msgs: make(chan kafka.Message, 1000)} }

func (r *fakeReader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	select {
	case m := <-r.msgs:
		return m, nil
	case <-ctx.Done():
		return kafka.Message{}, ctx.Err()
	}
}

func (r *fakeReader) CommitMessages(_ context.Context, msgs ...kafka.Message) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls++
	if r.commitErr != nil {
		if err := r.commitErr(r.calls); err != nil {
			return err
		}
	}
	var offs []int64
	for _, m := range msgs {
		offs = append(offs, m.Offset)
	}
	r.commits = append(r.commits, offs)
	return nil
}

func (r *fakeReader) Stats() kafka.ReaderStats { return kafka.ReaderStats{} }

func (r *fakeReader) committed() [][]int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([][]int64(nil), r.commits...)
}

// fakeWriter records what was written; fail, when set, decides per call
// whether the write fails.
type fakeWriter struct {
	mu      sync.Mutex
	written []kafka.Message
	calls   int
	fail    func(call int, msgs []kafka.Message) error
}

func (w *fakeWriter) WriteMessages(_ context.Context, msgs ...kafka.Message) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.calls++
	if w.fail != nil {
		if err := w.fail(w.calls, msgs); err != nil {
			return err
		}
	}
	w.written = append(w.written, msgs...)
	return nil
}

func (w *fakeWriter) outputs() []kafka.Message {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]kafka.Message(nil), w.written...)
}

// fakeDecider allows every request unless decide says otherwise, and
// records each call's requests.
type fakeDecider struct {
	mu     sync.Mutex
	calls  [][]capping.Request
	decide func(call int, r capping.Request) (capping.Decision, error)
}

func (d *fakeDecider) Decide(_ context.Context, reqs []capping.Request) ([]capping.Decision, error) {
	d.mu.Lock()
	kept := append([]capping.Request(nil), reqs...)
	for i := range kept { // the worker reuses its arrays for the next batch (Decider's contract)
		kept[i].Caps = append([]capping.Cap(nil), kept[i].Caps...)
	}
	d.calls = append(d.calls, kept)
	call := len(d.calls)
	d.mu.Unlock()
	ds := make([]capping.Decision, len(reqs))
	errs := make(capping.RequestErrors, len(reqs))
	failed := false
	for i, r := range reqs {
		ds[i] = capping.Decision{Allowed: true}
		if d.decide != nil {
			ds[i], errs[i] = d.decide(call, r)
			failed = failed || errs[i] != nil
		}
	}
	if failed {
		return ds, errs
	}
	return ds, nil
}

func (d *fakeDecider) requests() [][]capping.Request {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([][]capping.Request(nil), d.calls...)
}

type noSegments struct{}

func (noSegments) Lookup(uint32) (string, bool) { return "", false }

func compile(t *testing.T, limit int, failOpen ...rules.FailOpen) *rules.Rules {
	t.Helper()
	r, err := rules.Compile(rules.Config{DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: &limit}}, FailOpen: failOpen}, int64(limit))
	if err != nil {
		t.Fatal(err)
	}
	return r
}

type harness struct {
	r   *fakeReader
	w   *fakeWriter
	d   *fakeDecider
	wk  *consumer.Worker
	run chan error
	end context.CancelFunc
}

// start runs a Worker over the fakes until the test ends.
func start(t *testing.T, cfg consumer.Config) *harness {
	t.Helper()
	h := &harness{r: newReader(), w: &fakeWriter{}, d: &fakeDecider{}, run: make(chan error, 1)}
	if cfg.Writer != nil {
		h.w = cfg.Writer.(*fakeWriter)
	}
	if cfg.Decider != nil {
		h.d = cfg.Decider.(*fakeDecider)
	}
	cfg.Reader, cfg.Writer, cfg.Decider = h.r, h.w, h.d
	cfg.Segments = func() consumer.Segmenter { return noSegments{} }
	cfg.Topics = consumer.Topics{Allowed: "allowed", Capped: "capped", DLQ: "dlq", Held: "held"}
	if cfg.Rules == nil {
		cfg.Rules = compile(t, 10)
	}
	cfg.BatchWait = 20 * time.Millisecond
	cfg.RetryMin, cfg.RetryMax = time.Millisecond, 5*time.Millisecond
	cfg.RedisRetryMin, cfg.RedisRetryMax = time.Millisecond, 5*time.Millisecond
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	wk, err := consumer.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h.wk = wk
	ctx, cancel := context.WithCancel(context.Background())
	h.end = cancel
	go func() { h.run <- wk.Run(ctx, time.Second) }()
	t.Cleanup(func() { cancel(); <-h.run })
	return h
}

var (
	offset  int64
	offsets = map[string]int64{} // job id -> input offset
)

// job is one input message: a valid job unless raw is given.
func job(id string, user uint32, category string) kafka.Message {
	offset++
	offsets[id] = offset
	v, _ := json.Marshal(map[string]any{"job_id": id, "user_id": user, "campaign_id": "c", "channel": "email", "category": category})
	return kafka.Message{Topic: "sends", Partition: 0, Offset: offset, Key: []byte(fmt.Sprint(user)), Value: v}
}

func raw(value string) kafka.Message {
	offset++
	return kafka.Message{Topic: "sends", Offset: offset, Value: []byte(value)}
}

func (h *harness) send(msgs ...kafka.Message) {
	for _, m := range msgs {
		h.r.msgs <- m
	}
}

// waitOutputs waits until n outputs were written.
func (h *harness) waitOutputs(t *testing.T, n int) []kafka.Message {
	t.Helper()
	for end := time.Now().Add(5 * time.Second); time.Now().Before(end); time.Sleep(2 * time.Millisecond) {
		if outs := h.w.outputs(); len(outs) >= n {
			return outs
		}
	}
	t.Fatalf("%d outputs written, want %d", len(h.w.outputs()), n)
	return nil
}

func header(m kafka.Message, key string) string {
	for _, h := range m.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

func byJob(outs []kafka.Message) map[string]kafka.Message {
	m := map[string]kafka.Message{}
	for _, o := range outs {
		var j struct {
			JobID string `json:"job_id"`
		}
		_ = json.Unmarshal(o.Value, &j)
		m[j.JobID] = o
	}
	return m
}

func TestRoutesEveryJobToOneTopic(t *testing.T) {
	d := &fakeDecider{decide: func(_ int, r capping.Request) (capping.Decision, error) {
		switch r.JobID {
		case "capped":
			return capping.Decision{Cap: "daily", RetryAt: time.UnixMilli(1_800_000_000_000)}, nil
		case "dup":
			return capping.Decision{Allowed: true, Duplicate: true}, nil
		case "invalid":
			return capping.Decision{}, fmt.Errorf("job: %w: no caps", capping.ErrInvalidRequest)
		}
		return capping.Decision{Allowed: true}, nil
	}}
	h := start(t, consumer.Config{Decider: d})
	h.send(job("ok", 1, ""), job("capped", 2, ""), job("dup", 3, ""), job("receipt", 4, "transactional"), job("invalid", 5, ""), raw("not json"))
	outs := byJob(h.waitOutputs(t, 6))
	for id, want := range map[string][2]string{
		"ok": {"allowed", "allowed"}, "capped": {"capped", "capped"}, "dup": {"allowed", "duplicate"},
		"receipt": {"allowed", "exempt"}, "invalid": {"dlq", "dlq"}, "": {"dlq", "dlq"},
	} {
		o, ok := outs[id]
		if !ok || o.Topic != want[0] || header(o, output.HeaderDecision) != want[1] {
			t.Errorf("job %q: topic %q decision %q, want %q %q", id, o.Topic, header(o, output.HeaderDecision), want[0], want[1])
		}
	}
	if c := outs["capped"]; header(c, output.HeaderCap) != "daily" || !strings.HasPrefix(header(c, output.HeaderRetryAt), "2027-01-15T") {
		t.Errorf("capped output: cap %q retry-at %q", header(c, output.HeaderCap), header(c, output.HeaderRetryAt))
	}
	if e := header(outs[""], output.HeaderError); !strings.Contains(e, "not a JSON object") {
		t.Errorf("malformed message's reason %q", e)
	}
	if e := header(outs["invalid"], output.HeaderError); !strings.Contains(e, "invalid request") {
		t.Errorf("invalid request's reason %q", e)
	}
	for _, r := range d.requests()[0] {
		if r.JobID == "receipt" {
			t.Error("an exempt job was sent to the decider")
		}
	}
}

// TestRetriesOnlyTheFailedDecisions: the decisions that failed (one user's
// node down) are retried alone; the others are not asked again.
func TestRetriesOnlyTheFailedDecisions(t *testing.T) {
	d := &fakeDecider{decide: func(call int, r capping.Request) (capping.Decision, error) {
		if r.UserID == 2 && call < 3 {
			return capping.Decision{}, errors.New("dial tcp: connection refused")
		}
		return capping.Decision{Allowed: true}, nil
	}}
	h := start(t, consumer.Config{Decider: d})
	h.send(job("a", 1, ""), job("b", 2, ""), job("c", 3, ""))
	outs := h.waitOutputs(t, 3)
	calls := d.requests()
	if len(calls) != 3 || len(calls[0]) != 3 || len(calls[1]) != 1 || len(calls[2]) != 1 || calls[1][0].JobID != "b" || calls[2][0].JobID != "b" {
		t.Fatalf("decider calls %v, want [a b c], [b], [b]", jobIDs(calls))
	}
	if len(outs) != 3 || len(h.r.committed()) != 1 {
		t.Fatalf("%d outputs, %d commits; want 3 outputs and the batch committed once", len(outs), len(h.r.committed()))
	}
}

func jobIDs(calls [][]capping.Request) [][]string {
	var out [][]string
	for _, c := range calls {
		var ids []string
		for _, r := range c {
			ids = append(ids, r.JobID)
		}
		out = append(out, ids)
	}
	return out
}

// TestNothingCommittedAfterAFailedDelivery: while one batch cannot be
// written, neither it nor any later batch is committed; once the write goes
// through, the commits come in batch order.
func TestNothingCommittedAfterAFailedDelivery(t *testing.T) {
	var mu sync.Mutex
	broken, failures := true, 0
	w := &fakeWriter{fail: func(_ int, msgs []kafka.Message) error {
		mu.Lock()
		defer mu.Unlock()
		if broken && byJob(msgs)["b1"].Value != nil {
			failures++
			return errors.New("broker unavailable")
		}
		return nil
	}}
	h := start(t, consumer.Config{Writer: w, BatchSize: 1})
	h.send(job("a1", 1, ""))
	h.waitOutputs(t, 1)
	h.send(job("b1", 2, ""), job("c1", 3, ""))
	// The write of b1 fails again and again; c1 is decided meanwhile.
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		mu.Lock()
		n := failures
		mu.Unlock()
		if n >= 5 {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("b1's write failed %d times in 10 s, want 5", n)
		}
	}
	if got := h.r.committed(); len(got) != 1 || got[0][0] != offsets["a1"] {
		t.Fatalf("commits %v while b1 fails: want only a1's", got)
	}
	if outs := byJob(h.w.outputs()); outs["c1"].Value != nil {
		t.Fatal("c1 was written while b1, before it, was not")
	}
	mu.Lock()
	broken = false
	mu.Unlock()
	h.waitOutputs(t, 3)
	for end := time.Now().Add(5 * time.Second); len(h.r.committed()) < 3 && time.Now().Before(end); {
		time.Sleep(2 * time.Millisecond)
	}
	got := h.r.committed()
	if len(got) != 3 || !(got[0][0] < got[1][0] && got[1][0] < got[2][0]) {
		t.Fatalf("commits %v, want three in offset order", got)
	}
}

// TestFailedCommitIsRetried: a batch whose commit fails (the broker away, a
// rebalance, a Read grant taken away) is committed with the next batch, and,
// when no batch comes, by itself: the group's offsets catch up.
func TestFailedCommitIsRetried(t *testing.T) {
	h := start(t, consumer.Config{BatchSize: 1})
	h.r.mu.Lock()
	h.r.commitErr = func(call int) error {
		if call <= 2 {
			return kafka.RebalanceInProgress
		}
		return nil
	}
	h.r.mu.Unlock()
	h.send(job("f1", 1, ""))
	h.waitOutputs(t, 1)
	h.send(job("f2", 2, ""))
	h.waitOutputs(t, 2)
	// Both batches' commits may fail (calls 1 and 2, whichever carried them); a later commit, with the
	// next batch or alone, must bring the partition's offset to f2's. Without the retry nothing is committed.
	for end := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		got := h.r.committed()
		if len(got) > 0 && slices.Contains(got[len(got)-1], offsets["f2"]) {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("commits %v: f2's offset %d never committed after the failures", got, offsets["f2"])
		}
	}
	// Alone: a failed commit with no batch after it is retried by itself.
	h.r.mu.Lock()
	calls := h.r.calls
	h.r.commitErr = func(call int) error {
		if call == calls+1 {
			return kafka.RebalanceInProgress
		}
		return nil
	}
	h.r.mu.Unlock()
	h.send(job("f3", 3, ""))
	for end := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		got := h.r.committed()
		if last := got[len(got)-1]; last[len(last)-1] == offsets["f3"] {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("commits %v: f3's failed commit was never retried", got)
		}
	}
}

// TestDrainDeadline: when the context ends while a batch cannot be written,
// Run gives up after the drain deadline, returns an error and commits
// nothing of that batch (it is redelivered).
func TestDrainDeadline(t *testing.T) {
	w := &fakeWriter{fail: func(int, []kafka.Message) error { return errors.New("broker unavailable") }}
	h := start(t, consumer.Config{Writer: w})
	h.send(job("x", 1, ""))
	for end := time.Now().Add(5 * time.Second); w.callCount() < 2 && time.Now().Before(end); {
		time.Sleep(time.Millisecond)
	}
	began := time.Now()
	h.end()
	select {
	case err := <-h.run:
		if err == nil || !strings.Contains(err.Error(), "unwritten outputs") {
			t.Fatalf("Run = %v, want the unwritten outputs reported", err)
		}
		if waited := time.Since(began); waited < 900*time.Millisecond {
			t.Fatalf("Run gave up after %v, before the 1s drain deadline", waited)
		}
		h.run <- err
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after the drain deadline")
	}
	if got := h.r.committed(); len(got) != 0 {
		t.Fatalf("commits %v, want none", got)
	}
}

func (w *fakeWriter) callCount() int { w.mu.Lock(); defer w.mu.Unlock(); return w.calls }

// TestRulesSwapBetweenBatches: rules set with SetRules apply from the next batch on.
func TestRulesSwapBetweenBatches(t *testing.T) {
	h := start(t, consumer.Config{Rules: compile(t, 2)})
	h.send(job("a", 1, ""))
	h.waitOutputs(t, 1)
	h.wk.SetRules(compile(t, 5))
	h.send(job("b", 1, ""))
	h.waitOutputs(t, 2)
	calls := h.d.requests()
	if len(calls) != 2 || calls[0][0].Caps[0].Limit != 2 || calls[1][0].Caps[0].Limit != 5 {
		t.Fatalf("limits asked: %v, want 2 then 5", jobIDs(calls))
	}
}

// TestFailOpenAfterItsLimit: while Redis fails, a job of a fail-open category
// goes out unchecked once the outage is longer than the rule's limit (on the
// worker's clock); other jobs wait for Redis however long it fails.
func TestFailOpenAfterItsLimit(t *testing.T) {
	var mu sync.Mutex
	now, down := t0, true
	attempts := map[string]int{} // failed attempts per job
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	d := &fakeDecider{decide: func(_ int, r capping.Request) (capping.Decision, error) {
		mu.Lock()
		defer mu.Unlock()
		if down {
			attempts[r.JobID]++
			now = now.Add(10 * time.Millisecond) // each attempt takes 10 ms of the worker's clock
			return capping.Decision{}, errors.New("i/o timeout")
		}
		return capping.Decision{Allowed: true, At: now}, nil
	}}
	limit := 50 * time.Millisecond
	h := start(t, consumer.Config{Decider: d, Rules: compile(t, 10, rules.FailOpen{Category: "alerts", After: rules.Duration(limit)}), BatchSize: 1, Clock: clock})
	h.send(job("alert", 1, "alerts"))
	outs := h.waitOutputs(t, 1)
	if header(outs[0], output.HeaderDecision) != output.DecisionUnchecked || outs[0].Topic != "allowed" {
		t.Fatalf("alert while Redis is down: %q on %q, want unchecked on allowed", header(outs[0], output.HeaderDecision), outs[0].Topic)
	}
	mu.Lock()
	failedFor := time.Duration(attempts["alert"]-1) * 10 * time.Millisecond // from the first failure to the last
	mu.Unlock()
	if failedFor < limit || failedFor > limit+20*time.Millisecond {
		t.Errorf("the alert went out unchecked after %v of failures, want just past its limit of %v", failedFor, limit)
	}
	h.send(job("promo", 1, "marketing"))
	// The marketing job has no fail-open rule: it is retried far beyond the
	// alert's limit and does not go out.
	for end := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		mu.Lock()
		n := attempts["promo"]
		mu.Unlock()
		if n >= 20 { // 200 ms of the worker's clock
			break
		}
		if time.Now().After(end) {
			t.Fatalf("the marketing job was tried %d times in 10 s", n)
		}
	}
	if n := len(h.w.outputs()); n != 1 {
		t.Fatalf("%d outputs: the marketing job went out while Redis was down", n)
	}
	mu.Lock()
	down = false
	mu.Unlock()
	outs = h.waitOutputs(t, 2)
	if header(outs[1], output.HeaderDecision) != output.DecisionAllowed {
		t.Fatalf("marketing job after Redis came back: %q, want allowed", header(outs[1], output.HeaderDecision))
	}
}

// TestOversizeOutputDeadLettered: a message too large to forward with
// capper's headers is dead-lettered, truncated, and never decided.
func TestOversizeOutputDeadLettered(t *testing.T) {
	h := start(t, consumer.Config{MaxOutputBytes: 20_000})
	big := job("big", 1, "")
	big.Value = []byte(strings.Replace(string(big.Value), `"job_id"`, `"pad":"`+strings.Repeat("x", 30_000)+`","job_id"`, 1))
	h.send(big, job("small", 2, ""))
	outs := h.waitOutputs(t, 2)
	var dlq kafka.Message
	for _, o := range outs {
		if o.Topic == "dlq" {
			dlq = o
		}
	}
	if dlq.Value == nil || len(dlq.Value) != 4096 || !strings.Contains(header(dlq, output.HeaderError), "output limit") {
		t.Fatalf("dead-letter output: %d value bytes, reason %q; want the first 4096 bytes and the reason", len(dlq.Value), header(dlq, output.HeaderError))
	}
	for _, c := range h.d.requests() {
		for _, r := range c {
			if r.JobID == "big" {
				t.Fatal("the oversize job was decided (recorded) although it cannot be forwarded")
			}
		}
	}
}
