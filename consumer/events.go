package consumer

// The event workers: external sends, recorded in the users' logs at their
// sent_at; delivery feedback, which removes the sends that failed or
// bounced; and the users' preferences, set in their slots. Each reads its topic in its own consumer group, writes malformed
// events to the dead-letter topic and commits a batch once Redis has
// answered for every event of it.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/events"
	"github.com/capper-dev/capper/output"
)

// EventKind is what an event worker reads.
type EventKind int

const (
	ExternalSends EventKind = iota + 1 // events.Send, recorded
	Feedback                           // events.Feedback, failed and bounced sends forgotten
	Preferences                        // events.Preference, set or cleared in the user's slot
)

func (k EventKind) String() string {
	switch k {
	case ExternalSends:
		return "external sends"
	case Feedback:
		return "feedback"
	}
	return "preferences"
}

// Recorder is what an event worker needs of Redis (*capping.Limiter).
type Recorder interface {
	Decide(ctx context.Context, reqs []capping.Request) ([]capping.Decision, error)
	Forget(ctx context.Context, s capping.Space, userID uint32, jobID string) (bool, error)
	SetPreference(ctx context.Context, s capping.Space, userID uint32, p capping.Preference, clear bool) error
}

// EventConfig configures an EventWorker.
type EventConfig struct {
	Kind     EventKind
	Reader   Reader   // (Required)
	Writer   Writer   // (Required) for dead letters
	DLQ      string   // (Required) the dead-letter topic
	Recorder Recorder // (Required)
	// Workspaces returns the workspaces in force: an event's user's key
	// space, and its rules (how long a log keeps a send). (Required)
	Workspaces func() *Workspaces
	// MaxFuture is how far after the clock an external send's sent_at may be
	// (the clocks' bound, max_clock_skew); later ones are dead-lettered.
	MaxFuture time.Duration
	// BatchSize, BatchWait, CommitTimeout, RetryMin, RetryMax, RedisRetryMin,
	// RedisRetryMax, Clock, Logger and Faults are as in Config.
	BatchSize                                                                  int
	BatchWait, CommitTimeout, RetryMin, RetryMax, RedisRetryMin, RedisRetryMax time.Duration
	Clock                                                                      func() time.Time
	Logger                                                                     *slog.Logger
	Faults                                                                     *ReaderFaults
	// Metrics are the workers' (for capper_errors_total); EventMetrics this
	// worker's own. Both required.
	Metrics      *Metrics
	EventMetrics *EventMetrics
}

// EventMetrics are the event workers' counters, shared by one process's.
type EventMetrics struct {
	external *prometheus.CounterVec
	feedback *prometheus.CounterVec
	prefs    *prometheus.CounterVec
}

// NewEventMetrics makes the event workers' metrics and registers them with reg (nil: unregistered).
func NewEventMetrics(reg prometheus.Registerer) (*EventMetrics, error) {
	m := &EventMetrics{
		external: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "capper_external_sends_total", Help: "External sends, by result: recorded, duplicate (recorded before: a redelivery), dropped_old (older than the longest window: no cap counts it), dlq (malformed, or sent_at beyond the clock bound).",
		}, []string{"result"}),
		feedback: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "capper_feedback_total", Help: "Delivery feedback events, by status (delivered, failed, bounced, opened, clicked, other, dlq) and result: given_back (a failed or bounced send removed from the log), unknown (failed or bounced, but not in the log: never recorded, or aged out), kept.",
		}, []string{"status", "result"}),
		prefs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "capper_preferences_total", Help: "Preference events, by result: set, cleared, dlq (malformed, or a window longer than the rules keep a send).",
		}, []string{"result"}),
	}
	for _, r := range []string{"set", "cleared", "dlq"} {
		m.prefs.WithLabelValues(r)
	}
	for _, r := range []string{"recorded", "duplicate", "dropped_old", "dlq"} {
		m.external.WithLabelValues(r)
	}
	for _, s := range []string{"failed", "bounced"} {
		for _, r := range []string{"given_back", "unknown"} {
			m.feedback.WithLabelValues(s, r)
		}
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.external, m.feedback, m.prefs} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("consumer: register metrics: %w", err)
			}
		}
	}
	return m, nil
}

// EventWorker consumes one event topic. Run it once.
type EventWorker struct {
	stream
	cfg EventConfig
}

// NewEventWorker returns an EventWorker.
func NewEventWorker(cfg EventConfig) (*EventWorker, error) {
	switch {
	case cfg.Kind != ExternalSends && cfg.Kind != Feedback && cfg.Kind != Preferences:
		return nil, errors.New("consumer: unknown event kind")
	case cfg.Reader == nil || cfg.Writer == nil || cfg.Recorder == nil || cfg.Workspaces == nil || cfg.Metrics == nil || cfg.EventMetrics == nil:
		return nil, errors.New("consumer: an event worker needs a reader, a writer, a recorder, the rules and metrics")
	case cfg.DLQ == "":
		return nil, errors.New("consumer: an event worker needs the dead-letter topic")
	}
	cfg.BatchSize = cmp.Or(cfg.BatchSize, 500)
	cfg.BatchWait = cmp.Or(cfg.BatchWait, 100*time.Millisecond)
	cfg.CommitTimeout = cmp.Or(cfg.CommitTimeout, 10*time.Second)
	cfg.RetryMin, cfg.RetryMax = cmp.Or(cfg.RetryMin, 100*time.Millisecond), cmp.Or(cfg.RetryMax, 5*time.Second)
	cfg.RedisRetryMin, cfg.RedisRetryMax = cmp.Or(cfg.RedisRetryMin, 50*time.Millisecond), cmp.Or(cfg.RedisRetryMax, 500*time.Millisecond)
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	w := &EventWorker{cfg: cfg}
	w.stream = stream{reader: cfg.Reader, writer: cfg.Writer, faults: cfg.Faults, log: cfg.Logger, errors: cfg.Metrics.errors,
		batchSize: cfg.BatchSize, batchWait: cfg.BatchWait, commitTimeout: cfg.CommitTimeout, retryMin: cfg.RetryMin, retryMax: cfg.RetryMax}
	w.ready.Store(true)
	return w, nil
}

// Ready reports whether the last batch went through and the reader is not refused.
func (w *EventWorker) Ready() bool { return w.ready.Load() && !w.cfg.Faults.Failing() }

// Run consumes until ctx ends; a batch in hand when it ends is finished
// within drain, or left uncommitted. It returns nil after a clean stop.
func (w *EventWorker) Run(ctx context.Context, drain time.Duration) error {
	dctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stop := context.AfterFunc(ctx, func() { time.AfterFunc(drain, cancel) })
	defer stop()
	for {
		batch, err := w.fetch(ctx)
		if len(batch) > 0 {
			dead, perr := w.handle(dctx, batch)
			if perr == nil {
				perr = w.write(dctx, dead)
			}
			if perr != nil {
				return perr
			}
			w.commit(dctx, batch)
			w.ready.Store(true)
		}
		if ctx.Err() != nil {
			if len(w.uncommitted) > 0 {
				w.commit(dctx, nil)
			}
			return nil
		}
		if err != nil && !w.fetchFailed(ctx, err) {
			return nil
		}
	}
}

// handle applies a batch of events to Redis, retrying what failed, and
// returns the dead letters of the malformed ones.
func (w *EventWorker) handle(ctx context.Context, batch []kafka.Message) ([]kafka.Message, error) {
	var dead []kafka.Message
	deadLetter := func(m *kafka.Message, reason string) {
		dead = append(dead, kafka.Message{Topic: w.cfg.DLQ, Key: m.Key, Value: m.Value, Headers: append(append([]kafka.Header(nil), m.Headers...),
			kafka.Header{Key: output.HeaderDecision, Value: []byte(output.DecisionDLQ)}, kafka.Header{Key: output.HeaderError, Value: []byte(reason)})})
	}
	switch w.cfg.Kind {
	case ExternalSends:
		return dead, w.record(ctx, batch, deadLetter)
	case Feedback:
		return dead, w.forget(ctx, batch, deadLetter)
	}
	return dead, w.prefer(ctx, batch, deadLetter)
}

// record records the batch's external sends at their sent_at.
func (w *EventWorker) record(ctx context.Context, batch []kafka.Message, deadLetter func(*kafka.Message, string)) error {
	m := w.cfg.EventMetrics.external
	now := w.cfg.Clock()
	spaces := w.cfg.Workspaces()
	var reqs []capping.Request
	for i := range batch {
		s, err := events.DecodeSend(batch[i].Value)
		var ws *Workspace
		if err == nil {
			ws, err = workspaceOf(spaces, s.Workspace)
		}
		switch {
		case err != nil:
			deadLetter(&batch[i], err.Error())
			m.WithLabelValues("dlq").Inc()
			continue
		case s.SentAt.After(now.Add(w.cfg.MaxFuture)):
			deadLetter(&batch[i], events.Malformed("sent_at %s is after the worker's clock (%s) by more than max_clock_skew (%v)",
				s.SentAt.UTC().Format(time.RFC3339Nano), now.UTC().Format(time.RFC3339Nano), w.cfg.MaxFuture).Error())
			m.WithLabelValues("dlq").Inc()
			continue
		case !s.SentAt.After(now.Add(-ws.Rules.Retention())):
			m.WithLabelValues("dropped_old").Inc() // outside every window
			continue
		}
		// The log's member of an external send is its event id's, in a
		// namespace of its own: it never collides with a job's.
		reqs = append(reqs, capping.Request{UserID: s.UserID, Space: ws.Space, JobID: "external:" + s.EventID, Channel: s.Channel, Campaign: s.Campaign,
			Tags: s.AllTags(), Retention: ws.Rules.Retention(), SentAt: s.SentAt})
	}
	retry := w.newRetry("redis", w.cfg.RedisRetryMin, w.cfg.RedisRetryMax)
	for len(reqs) > 0 {
		ds, err := w.cfg.Recorder.Decide(ctx, reqs)
		re := requestErrors(err, len(reqs))
		var again []capping.Request
		for i := range reqs {
			switch {
			case re != nil && re[i] != nil && errors.Is(re[i], capping.ErrInvalidRequest):
				m.WithLabelValues("dlq").Inc() // cannot happen after DecodeSend; never retried
				w.log.Error("external send refused by capping", "err", re[i])
			case re != nil && re[i] != nil:
				again = append(again, reqs[i])
			case ds[i].Duplicate:
				m.WithLabelValues("duplicate").Inc()
			default:
				m.WithLabelValues("recorded").Inc()
			}
		}
		if len(again) == 0 {
			return nil
		}
		if !retry.wait(ctx, "recording external sends failed; retrying", len(again), err) {
			return fmt.Errorf("consumer: stopped with %d external sends unrecorded (left uncommitted): %w", len(again), ctx.Err())
		}
		reqs = again
	}
	return nil
}

// forget removes the sends that failed or bounced from their users' logs.
func (w *EventWorker) forget(ctx context.Context, batch []kafka.Message, deadLetter func(*kafka.Message, string)) error {
	m := w.cfg.EventMetrics.feedback
	spaces := w.cfg.Workspaces()
	for i := range batch {
		f, err := events.DecodeFeedback(batch[i].Value)
		var ws *Workspace
		if err == nil {
			ws, err = workspaceOf(spaces, f.Workspace)
		}
		if err != nil {
			deadLetter(&batch[i], err.Error())
			m.WithLabelValues("dlq", "dlq").Inc()
			continue
		}
		status := "other"
		for _, s := range events.Statuses {
			if f.Status == s {
				status = s
			}
		}
		if !f.GivesBack() {
			m.WithLabelValues(status, "kept").Inc()
			continue
		}
		retry := w.newRetry("redis", w.cfg.RedisRetryMin, w.cfg.RedisRetryMax)
		for {
			found, err := w.cfg.Recorder.Forget(ctx, ws.Space, f.UserID, f.JobID)
			if err == nil {
				m.WithLabelValues(status, map[bool]string{true: "given_back", false: "unknown"}[found]).Inc()
				break
			}
			if !retry.wait(ctx, "giving back a failed send failed; retrying", 1, err) {
				return fmt.Errorf("consumer: stopped with feedback unapplied (left uncommitted): %w", ctx.Err())
			}
		}
	}
	return nil
}

// prefer sets or clears the users' preferences, in order.
func (w *EventWorker) prefer(ctx context.Context, batch []kafka.Message, deadLetter func(*kafka.Message, string)) error {
	m := w.cfg.EventMetrics.prefs
	spaces := w.cfg.Workspaces()
	for i := range batch {
		p, err := events.DecodePreference(batch[i].Value)
		var ws *Workspace
		if err == nil {
			ws, err = workspaceOf(spaces, p.Workspace)
		}
		if err == nil && p.Pref.Window > ws.Rules.Retention() {
			err = events.Malformed("window %v is longer than the rules keep a send (%v): no log could count it", p.Pref.Window, ws.Rules.Retention())
		}
		if err != nil {
			deadLetter(&batch[i], err.Error())
			m.WithLabelValues("dlq").Inc()
			continue
		}
		retry := w.newRetry("redis", w.cfg.RedisRetryMin, w.cfg.RedisRetryMax)
		for {
			err := w.cfg.Recorder.SetPreference(ctx, ws.Space, p.UserID, p.Pref, p.Clear)
			if err == nil {
				m.WithLabelValues(map[bool]string{false: "set", true: "cleared"}[p.Clear]).Inc()
				break
			}
			if !retry.wait(ctx, "setting a preference failed; retrying", 1, err) {
				return fmt.Errorf("consumer: stopped with a preference unapplied (left uncommitted): %w", ctx.Err())
			}
		}
	}
	return nil
}

// workspaceOf is the workspace of an event whose workspace field is name; the
// error is a malformed event's.
func workspaceOf(spaces *Workspaces, name string) (*Workspace, error) {
	ws, err := spaces.Lookup(name)
	if err != nil {
		return nil, events.Malformed("%v", err)
	}
	return ws, nil
}
