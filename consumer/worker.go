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
	// Return puts back n tokens of w that were not used (the job was not
	// forwarded); Lapse counts n tokens that went unused past their bucket.
	Return(w budget.Want, n int)
	Lapse(w budget.Want, n int)
	// PutBack gives back n tokens of w granted until until (budget.Grant.Until)
	// that were not used: to Redis while the budget refuses sends, where any
	// replica's next send may take them, else as Return.
	PutBack(ctx context.Context, w budget.Want, until time.Time, n int)
	// Unclaim gives back the token a claim took (budget.Grant.Claimed) for a
	// send that was a duplicate, and keeps the promise it took again.
	Unclaim(ctx context.Context, w budget.Want, until time.Time) error
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
	// TokenGrace is how far back a send that holds budget tokens may be
	// decided and recorded, so that its decision is dated within the bucket
	// its tokens are counted in (budget.Grant.Until) and the budget holds by
	// decision time; a job decided later than that (a stall, a Redis outage,
	// a starved CPU) lets its tokens lapse and waits for new ones. The daemon
	// sets max_clock_skew, the margin the logs keep for clocks that differ.
	// Defaults to 0: never dated back.
	TokenGrace time.Duration
	// Collapse keeps the users' collapse keys, under UserKey (the user's log
	// key, capping.Limiter.Key); nil: collapse keys are not checked (the
	// daemon always sets it).
	Collapse Collapser
	UserKey  func(capping.Space, uint32) string
	// Segments returns the current segment snapshot, and Rules are the
	// initial rules, of a deployment without workspaces. (Required without
	// Workspaces)
	Segments func() Segmenter
	Rules    *rules.Rules
	// Workspaces are the initial workspaces, each with its rules and
	// segments (Segments and Rules are then not used). Optional.
	Workspaces *Workspaces
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
	// Preferences: each decision reads the user's own preferences (the
	// preferences topic is configured).
	Preferences bool
	// Wheel holds jobs on its delay topics; nil: nothing is held (a hold
	// policy then acts as drop).
	Wheel *hold.Wheel
	// Tier, when set, is the delay tier this worker reads: its Reader (a
	// hold.Reader) returns held jobs at their wake time, and the worker moves
	// each to a shorter tier or, once it is due, decides it again.
	Tier string
	// Early, shared by a process's tier workers and their Readers
	// (hold.Reader.UseEarly), fills a budget's tokens that no send would
	// take: when a held send puts its token back (capped by its user's
	// caps), and when a held send released early gives its promise up, the
	// worker asks for the budget's next held send then; it comes before its
	// wake time and claims a token early (budget.Want.Early): granted, it is
	// decided now; refused, it goes back to its tier for its promise, as
	// held before (no new hold). nil: held sends come at their due times.
	Early *hold.Early
	// Clock is the clock of hold decisions (due, expiry, quiet hours). Defaults to time.Now.
	Clock func() time.Time
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
	case c.Workspaces == nil && c.Segments == nil:
		return errors.New("consumer: segments is required")
	case c.Workspaces == nil && c.Rules == nil:
		return errors.New("consumer: rules are required")
	case c.Topics.Allowed == "" || c.Topics.Capped == "" || c.Topics.DLQ == "":
		return errors.New("consumer: the allowed, capped and dead-letter topics are required")
	case c.Wheel != nil && c.Topics.Held == "":
		return errors.New("consumer: holding jobs needs the held topic")
	case c.Collapse != nil && c.UserKey == nil:
		return errors.New("consumer: collapse keys need the users' key names")
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
	stream
	cfg    Config
	spaces atomic.Pointer[Workspaces]
	m      *Metrics
	// redisDownSince is when decisions started failing, zero while they
	// succeed; only the consume stage touches it.
	redisDownSince time.Time
	redisAttempts  int
	// buf keeps a batch's working arrays for the next one (consume stage only).
	buf struct {
		entries []entry
		reqs    []capping.Request
		plans   rules.Buffers
		tags    []string // the batch's jobs' tags (entry.tags), one after the other
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
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	w := &Worker{cfg: cfg, m: cfg.Metrics}
	if cfg.Workspaces == nil {
		cfg.Workspaces = SingleWorkspace(cfg.Rules, cfg.Segments)
		w.cfg.Workspaces = cfg.Workspaces
	}
	w.spaces.Store(cfg.Workspaces)
	if w.m == nil {
		var err error
		if w.m, err = NewMetrics(cfg.Registerer); err != nil {
			return nil, err
		}
	}
	w.stream = stream{reader: cfg.Reader, writer: cfg.Writer, faults: cfg.Faults, log: cfg.Logger, errors: w.m.errors,
		batchSize: cfg.BatchSize, batchWait: cfg.BatchWait, commitTimeout: cfg.CommitTimeout, retryMin: cfg.RetryMin, retryMax: cfg.RetryMax}
	w.ready.Store(true)
	if def := cfg.Workspaces.Default(); def != nil {
		w.m.rulesVersion.Set(float64(def.Rules.Version))
	}
	return w, nil
}

// Workspaces returns the workspaces in force.
func (w *Worker) Workspaces() *Workspaces { return w.spaces.Load() }

// SetRules makes r the rules of a deployment without workspaces from the next batch on.
func (w *Worker) SetRules(r *rules.Rules) {
	w.spaces.Store(w.spaces.Load().WithRules("", r))
	w.m.rulesVersion.Set(float64(r.Version))
}

// SetWorkspaces makes ws apply from the next batch on; version counts the
// changes (capper_rules_version).
func (w *Worker) SetWorkspaces(ws *Workspaces, version int64) {
	w.spaces.Store(ws)
	w.m.rulesVersion.Set(float64(version))
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
		if err != nil && !w.fetchFailed(ctx, err) {
			return nil
		}
	}
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
	for i, kinds := range d.byWS {
		for k, n := range kinds {
			if n > 0 {
				w.m.wsJobs.WithLabelValues(d.spaces.names[i], Kind(k).String()).Add(float64(n))
			}
		}
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
	w.m.batchSeconds.Observe(w.cfg.Clock().Sub(d.start).Seconds())
	return nil
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
