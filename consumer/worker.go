package consumer

import (
	"cmp"
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

// Headers capper adds to the messages it writes.
const (
	HeaderDecision = "capper-decision" // allowed, duplicate, exempt, unchecked, capped, held, dlq
	HeaderSegment  = "capper-segment"  // the user's segment, or "default"
	HeaderCap      = "capper-cap"      // capped, held: the cap that was hit, or quiet_hours, or expired
	HeaderRetryAt  = "capper-retry-at" // capped: RFC 3339 time when a send would pass, empty when never
	HeaderError    = "capper-error"    // dead-letter: why the job is malformed
	// HeaderReason says why a capped job was not held: never, expired,
	// beyond max_hold, quiet_hours (absent under the drop policy of a cap).
	HeaderReason = "capper-reason"
	// HeaderDecidedAt is when the job was decided (RFC 3339, ms), on every
	// allowed, capped and held output.
	HeaderDecidedAt = "capper-decided-at"
	// HeaderHeldFor is, on the final output of a job that was held, the
	// seconds from its first hold to this decision; the hold headers of
	// package hold (capper-hold-count, capper-held-since, capper-due-at) come with it.
	HeaderHeldFor = "capper-held-for"
	// HeaderShadow names, comma-separated, the shadow caps that would have
	// capped a forwarded send (absent when none would have).
	HeaderShadow = "capper-shadow-capped"
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

// truncatedValueBytes is how much of the value an oversize job keeps on the
// dead-letter topic: enough to identify it.
const truncatedValueBytes = 4096

// Decision header values.
const (
	DecisionAllowed   = "allowed"
	DecisionDuplicate = "duplicate"
	DecisionExempt    = "exempt"
	DecisionCapped    = "capped"
	DecisionDLQ       = "dlq"
	// DecisionUnchecked: forwarded without a cap check because Redis was
	// unavailable for longer than the fail-open rule of its category or segment allows.
	DecisionUnchecked = "unchecked"
	// DecisionHeld: an audit record on the held topic; the job waits on the
	// delay topics and is decided again at its due time. Not final.
	DecisionHeld = "held"
)

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
		items    []item
		reqs     []capping.Request
		reqItems []int
		caps     []capping.Cap
		wants    []budget.Want
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

// item is one job of a batch on its way to an output topic.
type item struct {
	msg       *kafka.Message
	job       Job
	segment   string
	inSegment bool
	decision  string
	cap       string
	retryAt   time.Time
	reason    string    // dead-letter: the error; capped: why it was not held
	truncate  bool      // dead-letter an oversize message with the start of its value only
	shadow    []string  // shadow caps that would have capped it
	at        time.Time // when it was decided
	// hold: the state it arrived with from a delay tier (Count 0: never held),
	// then, for a held or moved job, the state it leaves with.
	hold  hold.State
	since time.Time // when it was submitted: where max_hold counts from
	tier  hold.Tier // held, moved: the delay tier it goes to
	// refuse, when set, is decided by Redis only to recognise a duplicate,
	// and otherwise capped by refuseCap with this reason (expired, quiet hours).
	refuse, refuseCap string
	// req is its request to Redis when decide is set.
	req    capping.Request
	decide bool
	// wants are the budget tokens it needs, taken is how many of them it got
	// (given back if it is not allowed after all); byBudget: held for a token.
	wants    []budget.Want
	taken    bool
	byBudget bool
}

// decisionMove is a held job that is not due yet and moves to a shorter
// delay tier: internal, never an output decision.
const decisionMove = "move"

// decided is a batch whose outputs are ready to be written.
type decided struct {
	batch     []kafka.Message
	outs      []kafka.Message
	decisions map[string]int // jobs by decision, counted once the outputs are acknowledged
	shadow    map[string]int // allowed jobs that a shadow cap would have capped, by cap
	cappedBy  map[string]int // capped jobs, by the cap that refused them
	start     time.Time
}

// prepare decodes and decides one batch and builds its outputs. It returns an
// error only when ctx ends before the batch is decided. The path of a job:
// decode -> segment -> (a tier's job not due yet: move on) -> classify
// (expiry, exempt, quiet hours, the caps and budgets that apply) -> budget
// tokens (short of one: held) -> Redis -> allowed, or capped and then held or
// refused by its policy (tokens of jobs not forwarded go back) -> outputs.
func (w *Worker) prepare(ctx context.Context, batch []kafka.Message) (*decided, error) {
	start := w.cfg.Now()
	var trips0 uint64
	if w.cfg.RoundTrips != nil {
		trips0 = w.cfg.RoundTrips()
	}
	rs := w.rules.Load()
	seg := w.cfg.Segments()
	// The batch's working arrays are the last batch's, cleared: nothing
	// outlives prepare but the outputs, which do not point into them.
	items := w.buf.items[:0]
	if cap(items) < len(batch) {
		items = make([]item, len(batch))
	}
	items = items[:len(batch)]
	clear(items)
	reqs, reqItems := w.buf.reqs[:0], w.buf.reqItems[:0]
	caps := w.buf.caps[:0]   // one backing array for the batch's caps
	wants := w.buf.wants[:0] // and for its budget wants
	defer func() {
		clear(reqs)
		clear(caps)
		clear(wants)
		w.buf.items, w.buf.reqs, w.buf.reqItems, w.buf.caps, w.buf.wants = items, reqs, reqItems, caps, wants
	}()
	for i := range batch {
		it := &items[i]
		it.msg, it.at = &batch[i], start
		if n := messageBytes(&batch[i]) + reservedHeaderBytes; n > w.cfg.MaxOutputBytes {
			it.decision, it.truncate = DecisionDLQ, true
			it.reason = fmt.Sprintf("%v: message of %d bytes with capper's headers would exceed the output limit of %d bytes (kafka.max_batch_bytes); value truncated to its first %d bytes", ErrMalformed, n, w.cfg.MaxOutputBytes, truncatedValueBytes)
			continue
		}
		job, err := DecodeJob(batch[i].Value, w.cfg.MaxMessageBytes)
		if err == nil && w.cfg.Tier != "" {
			err = w.released(it, start)
		}
		if err != nil {
			it.decision, it.reason = DecisionDLQ, err.Error()
			continue
		}
		it.job = job
		if it.hold.Count == 0 { // submitted now, or when its producer stamped it
			it.since = cmp.Or(batch[i].Time, start)
		}
		it.segment, it.inSegment = seg.Lookup(job.UserID)
		if !it.inSegment {
			it.segment = "default"
		}
		if it.decision == decisionMove {
			continue
		}
		caps, wants = w.classify(rs, it, start, caps, wants)
	}
	if len(wants) > 0 {
		if err := w.takeBudgets(ctx, rs, items, start); err != nil {
			return nil, err
		}
	}
	for i := range items {
		if items[i].decide {
			reqs = append(reqs, items[i].req)
			reqItems = append(reqItems, i)
		}
	}
	if err := w.decide(ctx, reqs, reqItems, items); err != nil {
		return nil, err
	}
	w.returnBudgets(items)
	if w.cfg.RoundTrips != nil { // only this stage talks to Redis, so the delta is this batch's
		w.m.roundTrips.Observe(float64(w.cfg.RoundTrips() - trips0))
	}
	for _, i := range reqItems {
		if it := &items[i]; it.decision == DecisionCapped {
			w.capped(rs, it)
		}
	}
	outs := make([]kafka.Message, 0, len(items))
	decisions := make(map[string]int, 5)
	shadow, cappedBy := map[string]int{}, map[string]int{}
	hv := newHeaderValues()
	for i := range items {
		outs = w.outputs(outs, &items[i], hv)
		decisions[items[i].decision]++
		switch items[i].decision {
		case DecisionAllowed:
			for _, c := range items[i].shadow {
				shadow[c]++
			}
		case DecisionCapped:
			cappedBy[items[i].cap]++
		}
	}
	return &decided{batch: batch, outs: outs, decisions: decisions, shadow: shadow, cappedBy: cappedBy, start: start}, nil
}

// classify decides what a decoded job needs before Redis: expired, exempt,
// held for quiet hours, or to be decided (it.decide) with its caps and budget
// wants, appended to the batch's backing arrays caps and wants.
func (w *Worker) classify(rs *rules.Rules, it *item, now time.Time, caps []capping.Cap, wants []budget.Want) ([]capping.Cap, []budget.Want) {
	job := &it.job
	exempt := rs.IsExempt(job.Category)
	expired := !job.ExpiresAt.IsZero() && !now.Before(job.ExpiresAt)
	switch {
	case expired && exempt: // never logged, so there is no earlier send to recognise
		it.decision, it.cap, it.reason = DecisionCapped, ReasonExpired, ReasonExpired
		w.countNotHeld(it)
		return caps, wants
	case expired:
		it.refuse, it.refuseCap = ReasonExpired, ReasonExpired
	case exempt:
		it.decision = DecisionExempt
		return caps, wants
	default:
		if until := rs.QuietUntil(it.segment, it.inSegment, job.Category, job.Zone, now); !until.IsZero() {
			p := rs.OnCapped(it.segment, it.inSegment, job.Category, "")
			if w.holdOrRefuse(it, p, until, ReasonQuietHours, now) {
				return caps, wants
			}
			it.refuse, it.refuseCap = it.reason, ReasonQuietHours
		}
	}
	req := capping.Request{UserID: job.UserID, JobID: job.JobID, Channel: job.Channel, Campaign: job.CampaignID,
		Tags: job.AllTags(), Retention: rs.Retention()}
	switch {
	case it.refuse != "":
		req.Caps = refuseCaps
	case !rs.IsCountOnly(job.Category): // a count-only send is recorded without a check
		n := len(caps)
		caps = rs.Caps(caps, it.segment, it.inSegment, rules.Send{Campaign: job.CampaignID, Zone: job.Zone}, now)
		req.Caps = caps[n:len(caps):len(caps)]
	}
	if it.refuse == "" && w.cfg.Budgets != nil {
		n := len(wants)
		wants = rs.Budgets(wants, job.Channel, req.Tags, job.CampaignID)
		it.wants = wants[n:len(wants):len(wants)]
	}
	it.req, it.decide = req, true
	return caps, wants
}

// deliver writes a decided batch's outputs and then commits its offsets. It
// returns an error only when ctx ends before the outputs are acknowledged.
func (w *Worker) deliver(ctx context.Context, d *decided) error {
	if err := w.write(ctx, d.outs); err != nil {
		return err
	}
	for decision, n := range d.decisions {
		if decision != decisionMove { // a move is not a decision; its metric is counted with the output
			w.m.jobs.WithLabelValues(decision).Add(float64(n))
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
	w.m.batchSeconds.Observe(time.Since(d.start).Seconds())
	return nil
}

// decide decides reqs, retrying the failed ones with capped exponential
// backoff until all are decided or ctx ends. Invalid requests go to the
// dead-letter topic. A job whose fail-open rule allows it is forwarded
// unchecked once Redis has been failing for longer than the rule's limit.
func (w *Worker) decide(ctx context.Context, reqs []capping.Request, reqItems []int, items []item) error {
	retry := w.newRetry("redis", w.cfg.RedisRetryMin, w.cfg.RedisRetryMax)
	rs := w.rules.Load()
	for len(reqs) > 0 {
		w.expire(reqs, reqItems, items)
		ds, err := w.cfg.Decider.Decide(ctx, reqs)
		var re capping.RequestErrors
		if err != nil && !errors.As(err, &re) {
			re = make(capping.RequestErrors, len(reqs))
			for i := range re {
				re[i] = err
			}
		}
		var retryReqs []capping.Request
		var retryItems []int
		transient := false
		for j, i := range reqItems {
			it := &items[i]
			if re != nil && re[j] != nil {
				if errors.Is(re[j], capping.ErrInvalidRequest) {
					it.decision, it.reason = DecisionDLQ, re[j].Error()
					continue
				}
				transient = true
				if w.failOpen(rs, it) {
					it.decision = DecisionUnchecked
					continue
				}
				retryReqs = append(retryReqs, reqs[j])
				retryItems = append(retryItems, i)
				continue
			}
			d := ds[j]
			it.at = d.At
			switch {
			case d.Duplicate:
				it.decision = DecisionDuplicate
				if !d.Recorded.IsZero() { // decided when it was first allowed
					it.at = d.Recorded
				}
			case d.Allowed:
				it.decision = DecisionAllowed
				if !d.Recorded.IsZero() {
					it.at = d.Recorded
				}
			default:
				it.decision = DecisionCapped
				it.cap = d.Cap
				it.retryAt = d.RetryAt
			}
			it.shadow = d.Shadow
		}
		w.redisHealth(transient, err)
		if len(retryReqs) == 0 {
			return nil
		}
		if !retry.wait(ctx, "redis decisions failed; retrying", len(retryReqs), err) {
			return fmt.Errorf("consumer: stopped with %d undecided jobs (left uncommitted): %w", len(retryReqs), ctx.Err())
		}
		reqs, reqItems = retryReqs, retryItems
	}
	return nil
}

// redisHealth tracks how long decisions have been failing: it starts the
// clock at the first failure and, at the first attempt without one, logs and
// records how long Redis was unavailable.
func (w *Worker) redisHealth(failed bool, err error) {
	now := time.Now()
	switch {
	case failed && w.redisDownSince.IsZero():
		w.redisDownSince, w.redisAttempts = now, 1
		w.cfg.Logger.Warn("redis decisions failing", "err", err)
	case failed:
		w.redisAttempts++
	case !w.redisDownSince.IsZero():
		down := now.Sub(w.redisDownSince)
		w.m.redisOutage.Observe(down.Seconds())
		w.cfg.Logger.Info("redis decisions recovered", "unavailable_seconds", down.Seconds(), "failed_attempts", w.redisAttempts)
		w.redisDownSince, w.redisAttempts = time.Time{}, 0
	}
}

// failOpen reports whether the job of it may go out unchecked: Redis has been
// failing for longer than its category's or segment's fail-open limit.
func (w *Worker) failOpen(rs *rules.Rules, it *item) bool {
	after := rs.FailOpenAfter(it.job.Category, it.segment)
	return after > 0 && !w.redisDownSince.IsZero() && time.Since(w.redisDownSince) >= after
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
