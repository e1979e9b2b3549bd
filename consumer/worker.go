package consumer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/budget"
	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/internal/backoff"
	"github.com/capper-dev/capper/internal/fault"
	"github.com/capper-dev/capper/rules"
)

// Defaults of Config fields that the process wiring also needs (the reader's
// queue and the writer's batch limit follow them).
const (
	DefaultBatchSize      = 2000
	DefaultMaxOutputBytes = 1_000_000 // below Kafka's default message.max.bytes, 1048588
)

// reservedHeaderBytes bounds what capper adds to a message (its headers and
// their framing), for the check that an output fits MaxOutputBytes before
// the job is decided.
const reservedHeaderBytes = 1024

// Reader is what the Worker needs of a consumer-group reader (*kafka.Reader).
type Reader interface {
	FetchMessage(ctx context.Context) (kafka.Message, error)
	CommitMessages(ctx context.Context, msgs ...kafka.Message) error
}

// Writer is what the Worker needs of a producer (*kafka.Writer with no Topic
// set, RequiredAcks = RequireAll, synchronous).
type Writer interface {
	WriteMessages(ctx context.Context, msgs ...kafka.Message) error
}

// Decider decides batches of sends (*capping.Limiter). It must not keep reqs
// (or their Caps) after Decide returns: the worker reuses their arrays.
type Decider interface {
	Decide(ctx context.Context, reqs []capping.Request) ([]capping.Decision, error)
}

// Budgeter hands out tokens of global send-rate budgets (*budget.Budgets).
type Budgeter interface {
	Take(ctx context.Context, wants []budget.Want) ([]budget.Grant, error)
	Return(w budget.Want, n int)
}

// Segmenter resolves a user's segment (*segments.Snapshot).
type Segmenter interface {
	Lookup(user uint32) (segment string, ok bool)
}

// Topics names the output topics.
type Topics struct {
	Allowed string
	Capped  string
	DLQ     string
	// Held receives an audit record of each hold. (Required with a Wheel)
	Held string
}

// Config configures a Worker.
type Config struct {
	Reader  Reader  // (Required)
	Writer  Writer  // (Required)
	Decider Decider // (Required)
	// Budgets hands out the tokens of the rules' budgets; nil: budgets are not
	// enforced (the daemon always sets it).
	Budgets Budgeter
	// Segments returns the current segment snapshot. (Required)
	Segments func() Segmenter
	// Rules are the initial rules. (Required)
	Rules *rules.Rules
	// Topics are the output topics. (Required)
	Topics Topics
	// BatchSize is the most jobs in one batch. Defaults to DefaultBatchSize.
	BatchSize int
	// BatchWait is how long a batch waits for more jobs after its first. Defaults to 100ms.
	BatchWait time.Duration
	// MaxMessageBytes: larger input messages go to the dead-letter topic. Defaults to 1 MiB.
	MaxMessageBytes int
	// MaxOutputBytes is the largest message the worker may produce (the writer's
	// batch limit, below the broker's message.max.bytes). A job whose output
	// would be larger goes to the dead-letter topic, with its value truncated,
	// before it is decided. Defaults to DefaultMaxOutputBytes.
	MaxOutputBytes int
	// CommitTimeout bounds an offset commit. Defaults to 10s.
	CommitTimeout time.Duration
	// RetryMin and RetryMax bound the exponential backoff of retries after a
	// Kafka failure. Default to 100ms and 5s.
	RetryMin, RetryMax time.Duration
	// RedisRetryMin and RedisRetryMax bound the backoff of retried decisions.
	// A Redis failover takes seconds, not minutes, and each retry also makes
	// the Redis client reload the cluster topology, so the ceiling is short:
	// decisions resume within about RedisRetryMax of a promotion. Default to
	// 50ms and 500ms.
	RedisRetryMin, RedisRetryMax time.Duration
	// RoundTrips, when set, returns a running count of Redis round trips; the
	// worker reports the count per batch.
	RoundTrips func() uint64
	// Wheel holds jobs on its delay topics; nil: nothing is held (a hold
	// policy then acts as drop).
	Wheel *hold.Wheel
	// Tier, when set, is the delay tier this worker reads: its Reader (a
	// hold.Reader) returns held jobs at their wake time, and the worker moves
	// each to a shorter tier or, once it is due, decides it again.
	Tier string
	// Now is the clock of hold decisions (due, expiry, quiet hours). Defaults to time.Now.
	Now func() time.Time
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// Faults collects the Reader's failures that no retry fixes (also those
	// kafka-go only logs: give its ErrorLogger to the reader); while it is
	// failing the worker is not ready. Nil: fetch and commit failures alone.
	Faults *ReaderFaults
	// Metrics, shared by the workers of one process; nil: New makes them
	// and registers them with Registerer.
	Metrics *Metrics
	// Registerer receives the worker's metrics. Optional.
	Registerer prometheus.Registerer
}

// Validate reports whether the configuration is usable.
func (c *Config) Validate() error {
	switch {
	case c.Reader == nil:
		return errors.New("consumer: reader is required")
	case c.Writer == nil:
		return errors.New("consumer: writer is required")
	case c.Decider == nil:
		return errors.New("consumer: decider is required")
	case c.Segments == nil:
		return errors.New("consumer: segments is required")
	case c.Rules == nil:
		return errors.New("consumer: rules are required")
	case c.Topics.Allowed == "" || c.Topics.Capped == "" || c.Topics.DLQ == "":
		return errors.New("consumer: the allowed, capped and dead-letter topics are required")
	case c.Wheel != nil && c.Topics.Held == "":
		return errors.New("consumer: holding jobs needs the held topic")
	case c.Tier != "" && c.Wheel == nil:
		return errors.New("consumer: a delay tier's worker needs the wheel")
	case c.BatchSize < 0 || c.BatchWait < 0 || c.MaxMessageBytes < 0 || c.MaxOutputBytes < 0:
		return errors.New("consumer: batch size, batch wait and max message and output bytes must not be negative")
	case c.MaxOutputBytes > 0 && c.MaxOutputBytes < 2*reservedHeaderBytes:
		return fmt.Errorf("consumer: max output bytes %d is below %d", c.MaxOutputBytes, 2*reservedHeaderBytes)
	}
	return nil
}

// Worker runs the consume, decide, produce, commit loop. Run it once.
type Worker struct {
	cfg   Config
	rules atomic.Pointer[rules.Rules]
	ready atomic.Bool
	m     *Metrics
	// redisDownSince is when decisions started failing, zero while they
	// succeed; only the consume stage touches it.
	redisDownSince time.Time
	redisAttempts  int
	// uncommitted is, per topic and partition, the newest message whose
	// outputs are written but whose commit failed: it goes with the next
	// commit, or is retried when no batch comes (delivery stage only).
	uncommitted map[topicPartition]kafka.Message
	// buf keeps a batch's working arrays for the next one (consume stage only).
	buf struct {
		entries []entry
		reqs    []capping.Request
		plans   rules.Buffers
	}
}

// New returns a Worker.
func New(cfg Config) (*Worker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.BatchSize == 0 {
		cfg.BatchSize = DefaultBatchSize
	}
	if cfg.BatchWait == 0 {
		cfg.BatchWait = 100 * time.Millisecond
	}
	if cfg.MaxMessageBytes == 0 {
		cfg.MaxMessageBytes = 1 << 20
	}
	if cfg.MaxOutputBytes == 0 {
		cfg.MaxOutputBytes = DefaultMaxOutputBytes
	}
	if cfg.RedisRetryMin == 0 {
		cfg.RedisRetryMin = 50 * time.Millisecond
	}
	if cfg.RedisRetryMax == 0 {
		cfg.RedisRetryMax = 500 * time.Millisecond
	}
	if cfg.CommitTimeout == 0 {
		cfg.CommitTimeout = 10 * time.Second
	}
	if cfg.RetryMin == 0 {
		cfg.RetryMin = 100 * time.Millisecond
	}
	if cfg.RetryMax == 0 {
		cfg.RetryMax = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	w := &Worker{cfg: cfg, m: cfg.Metrics}
	w.rules.Store(cfg.Rules)
	w.ready.Store(true)
	if w.m == nil {
		var err error
		if w.m, err = NewMetrics(cfg.Registerer); err != nil {
			return nil, err
		}
	}
	w.m.rulesVersion.Set(float64(cfg.Rules.Version))
	return w, nil
}

// SetRules makes r apply from the next batch on.
func (w *Worker) SetRules(r *rules.Rules) {
	w.rules.Store(r)
	w.m.rulesVersion.Set(float64(r.Version))
}

// Ready reports whether the last batch went through without a backend
// failure and the reader is not refused by the broker.
func (w *Worker) Ready() bool { return w.ready.Load() && !w.cfg.Faults.Failing() }

// Run consumes until ctx ends. Two stages overlap: while one batch is
// written and committed, the next is fetched and decided; commits stay in
// batch order. The batches in flight when ctx ends are finished (decided,
// written, committed) within drain, a separate deadline; if they cannot be,
// their offsets stay uncommitted and they are redelivered. Run returns nil
// after a clean stop.
func (w *Worker) Run(ctx context.Context, drain time.Duration) error {
	dctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(drain, cancel) })
	defer stop()
	ready := make(chan *decided, 1)
	delivered := make(chan error, 1)
	go func() {
		var err error
		idle := time.NewTicker(w.cfg.RetryMax)
		defer idle.Stop()
		for {
			select {
			case d, ok := <-ready:
				if !ok {
					if err == nil && len(w.uncommitted) > 0 {
						w.commit(dctx, nil) // a last try before the group is left
					}
					delivered <- err
					return
				}
				if err == nil { // after a failure nothing later may be committed
					err = w.deliver(dctx, d)
				}
			case <-idle.C:
				if err == nil && len(w.uncommitted) > 0 {
					w.commit(dctx, nil) // no batch came to carry them
				}
			}
		}
	}()
	err := w.consume(ctx, dctx, ready)
	close(ready)
	if derr := <-delivered; err == nil {
		err = derr
	}
	return err
}

// consume fetches and decides batches until ctx ends, handing them to the
// delivery stage.
func (w *Worker) consume(ctx, dctx context.Context, ready chan<- *decided) error {
	for {
		batch, err := w.fetch(ctx)
		if len(batch) > 0 {
			d, perr := w.prepare(dctx, batch)
			if perr != nil {
				return perr
			}
			select {
			case ready <- d:
			case <-dctx.Done():
				return fmt.Errorf("consumer: stopped with a decided batch of %d jobs unwritten (left uncommitted): %w", len(batch), dctx.Err())
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			w.m.errors.WithLabelValues("kafka_fetch").Inc()
			if !w.cfg.Faults.Report("fetch failed", err) {
				w.cfg.Logger.Warn("fetch failed", "err", err)
			}
			if !backoff.Sleep(ctx, w.cfg.RetryMin) {
				return nil
			}
		}
	}
}

// fetch blocks for the first message, then collects more for up to BatchWait.
func (w *Worker) fetch(ctx context.Context) ([]kafka.Message, error) {
	first, err := w.cfg.Reader.FetchMessage(ctx)
	if err != nil {
		return nil, err
	}
	w.cfg.Faults.Fetched()
	batch := make([]kafka.Message, 1, w.cfg.BatchSize)
	batch[0] = first
	fctx, cancel := context.WithTimeout(ctx, w.cfg.BatchWait)
	defer cancel()
	for len(batch) < w.cfg.BatchSize {
		m, err := w.cfg.Reader.FetchMessage(fctx)
		if err != nil {
			break // the wait is over (or ctx ended): process what we have
		}
		batch = append(batch, m)
	}
	return batch, nil
}

// deliver writes a decided batch's outputs and then commits its offsets. It
// returns an error only when ctx ends before the outputs are acknowledged.
func (w *Worker) deliver(ctx context.Context, d *decided) error {
	if err := w.write(ctx, d.outs); err != nil {
		return err
	}
	for k, n := range d.decisions {
		w.m.jobs.WithLabelValues(k.String()).Add(float64(n))
	}
	for c, n := range d.shadow {
		w.m.shadowCapped.WithLabelValues(c).Add(float64(n))
	}
	for c, n := range d.cappedBy {
		w.m.cappedBy.WithLabelValues(c).Add(float64(n))
	}
	w.commit(ctx, d.batch)
	w.ready.Store(true)
	w.m.batchSize.Observe(float64(len(d.batch)))
	w.m.batchSeconds.Observe(w.cfg.Now().Sub(d.start).Seconds())
	return nil
}

// write writes outs, retrying the failed messages until all are acknowledged
// or ctx ends.
func (w *Worker) write(ctx context.Context, outs []kafka.Message) error {
	retry := w.newRetry("kafka_write", w.cfg.RetryMin, w.cfg.RetryMax)
	for {
		err := w.cfg.Writer.WriteMessages(ctx, outs...)
		if err == nil {
			return nil
		}
		var we kafka.WriteErrors
		if errors.As(err, &we) && len(we) == len(outs) {
			var failed []kafka.Message
			tooLarge := false
			for i, e := range we {
				if e != nil {
					failed = append(failed, outs[i])
					tooLarge = tooLarge || errors.Is(e, kafka.MessageSizeTooLarge)
				}
			}
			outs = failed
			if tooLarge { // retrying cannot help until the configuration changes
				w.cfg.Logger.Error("the broker rejects output batches as too large: set kafka.max_batch_bytes below the broker's message.max.bytes; retrying, nothing is committed")
			}
		}
		if !retry.wait(ctx, "writing outputs failed; retrying", len(outs), err) {
			return fmt.Errorf("consumer: stopped with %d unwritten outputs (batch left uncommitted): %w", len(outs), ctx.Err())
		}
	}
}

type topicPartition struct {
	topic     string
	partition int
}

// commit commits the batch's offsets, with those of earlier batches whose
// commit failed. A failed commit (a broker that is away, a rebalance, a Read
// grant taken away) is logged and kept: the reader has moved past those
// messages and will not hand them out again before a rebalance, so without a
// later commit the group's offset would stay behind (lag that never drains)
// and a restart would redeliver them, recognised as duplicates.
func (w *Worker) commit(ctx context.Context, batch []kafka.Message) {
	msgs := batch
	if len(w.uncommitted) > 0 {
		msgs = make([]kafka.Message, 0, len(w.uncommitted)+len(batch))
		for _, m := range w.uncommitted {
			msgs = append(msgs, m)
		}
		msgs = append(msgs, batch...) // the reader commits the newest offset of each partition
	}
	cctx, cancel := context.WithTimeout(ctx, w.cfg.CommitTimeout)
	defer cancel()
	if err := w.cfg.Reader.CommitMessages(cctx, msgs...); err != nil {
		w.m.errors.WithLabelValues("kafka_commit").Inc()
		if !w.cfg.Faults.Report("commit failed", err) {
			w.cfg.Logger.Warn("commit failed; retried with the next batch", "messages", len(msgs), "err", err)
		}
		if w.uncommitted == nil {
			w.uncommitted = map[topicPartition]kafka.Message{}
		}
		for _, m := range batch {
			k := topicPartition{m.Topic, m.Partition}
			if old, ok := w.uncommitted[k]; !ok || m.Offset > old.Offset {
				w.uncommitted[k] = m
			}
		}
		return
	}
	clear(w.uncommitted)
}

// retry is the backoff of one failing step of a batch, with the worker's
// accounting of a failure: not ready, a metric, a log line.
type retry struct {
	w    *Worker
	kind string // the errors_total label
	b    *backoff.Backoff
}

func (w *Worker) newRetry(kind string, first, ceiling time.Duration) *retry {
	return &retry{w: w, kind: kind, b: backoff.New(first, ceiling)}
}

// wait records a failure of n jobs and sleeps the next backoff; false when
// ctx ended first.
func (r *retry) wait(ctx context.Context, msg string, n int, err error) bool {
	d := r.b.Next()
	r.w.ready.Store(false)
	r.w.m.errors.WithLabelValues(r.kind).Inc()
	if cause := fault.Cause(err); cause != "" {
		// a password, certificate or grant changed under a running worker
		r.w.cfg.Logger.Error(msg, "cause", cause, "jobs", n, "attempt", r.b.Attempt(), "in", d, "err", err)
	} else {
		r.w.cfg.Logger.Warn(msg, "jobs", n, "attempt", r.b.Attempt(), "in", d, "err", err)
	}
	return backoff.Sleep(ctx, d)
}

// messageBytes is an upper bound of the size of m in a record batch (key,
// value, headers and their framing), the size the writer checks against its
// batch limit.
func messageBytes(m *kafka.Message) int {
	n := 64 + len(m.Key) + len(m.Value)
	for _, h := range m.Headers {
		n += 16 + len(h.Key) + len(h.Value)
	}
	return n
}
