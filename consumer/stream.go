package consumer

// The Kafka side of a worker, shared with the event workers: fetching a
// batch, writing its outputs until the broker acknowledges them, committing
// its offsets in order (a failed commit goes with the next one), and the
// accounting of each retry.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/backoff"
	"github.com/capper-dev/capper/internal/fault"
)

// stream is one reader's batches on their way to the broker.
type stream struct {
	reader                                       Reader
	writer                                       Writer
	faults                                       *ReaderFaults // nil: fetch and commit failures alone
	log                                          *slog.Logger
	errors                                       *prometheus.CounterVec // capper_errors_total
	batchSize                                    int
	batchWait, commitTimeout, retryMin, retryMax time.Duration
	// ready is false from a failed step until a batch goes through.
	ready atomic.Bool
	// uncommitted is, per topic and partition, the newest message whose
	// outputs are written but whose commit failed: it goes with the next
	// commit, or is retried when no batch comes (delivery stage only).
	uncommitted map[topicPartition]kafka.Message
}

// fetchFailed accounts for a failed fetch and waits before the next; false
// when ctx ended first.
func (s *stream) fetchFailed(ctx context.Context, err error) bool {
	s.errors.WithLabelValues("kafka_fetch").Inc()
	if !s.faults.Report("fetch failed", err) {
		s.log.Warn("fetch failed", "err", err)
	}
	return backoff.Sleep(ctx, s.retryMin)
}

// fetch blocks for the first message, then collects more for up to BatchWait.
func (s *stream) fetch(ctx context.Context) ([]kafka.Message, error) {
	first, err := s.reader.FetchMessage(ctx)
	if err != nil {
		return nil, err
	}
	s.faults.Fetched()
	batch := make([]kafka.Message, 1, s.batchSize)
	batch[0] = first
	fctx, cancel := context.WithTimeout(ctx, s.batchWait)
	defer cancel()
	for len(batch) < s.batchSize {
		m, err := s.reader.FetchMessage(fctx)
		if err != nil {
			break // the wait is over (or ctx ended): process what we have
		}
		batch = append(batch, m)
	}
	return batch, nil
}

// write writes outs, retrying the failed messages until all are acknowledged
// or ctx ends.
func (s *stream) write(ctx context.Context, outs []kafka.Message) error {
	retry := s.newRetry("kafka_write", s.retryMin, s.retryMax)
	for {
		err := s.writer.WriteMessages(ctx, outs...)
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
				s.log.Error("the broker rejects output batches as too large: set kafka.max_batch_bytes below the broker's message.max.bytes; retrying, nothing is committed")
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
func (s *stream) commit(ctx context.Context, batch []kafka.Message) {
	msgs := batch
	if len(s.uncommitted) > 0 {
		msgs = make([]kafka.Message, 0, len(s.uncommitted)+len(batch))
		for _, m := range s.uncommitted {
			msgs = append(msgs, m)
		}
		msgs = append(msgs, batch...) // the reader commits the newest offset of each partition
	}
	cctx, cancel := context.WithTimeout(ctx, s.commitTimeout)
	defer cancel()
	if err := s.reader.CommitMessages(cctx, msgs...); err != nil {
		s.errors.WithLabelValues("kafka_commit").Inc()
		if !s.faults.Report("commit failed", err) {
			s.log.Warn("commit failed; retried with the next batch", "messages", len(msgs), "err", err)
		}
		if s.uncommitted == nil {
			s.uncommitted = map[topicPartition]kafka.Message{}
		}
		for _, m := range batch {
			k := topicPartition{m.Topic, m.Partition}
			if old, ok := s.uncommitted[k]; !ok || m.Offset > old.Offset {
				s.uncommitted[k] = m
			}
		}
		return
	}
	clear(s.uncommitted)
}

// retry is the backoff of one failing step of a batch, with the worker's
// accounting of a failure: not ready, a metric, a log line.
type retry struct {
	s    *stream
	kind string // the errors_total label
	b    *backoff.Backoff
}

func (s *stream) newRetry(kind string, first, ceiling time.Duration) *retry {
	return &retry{s: s, kind: kind, b: backoff.New(first, ceiling)}
}

// wait records a failure of n jobs and sleeps the next backoff; false when
// ctx ended first.
func (r *retry) wait(ctx context.Context, msg string, n int, err error) bool {
	d := r.b.Next()
	r.s.ready.Store(false)
	r.s.errors.WithLabelValues(r.kind).Inc()
	if cause := fault.Cause(err); cause != "" {
		// a password, certificate or grant changed under a running worker
		r.s.log.Error(msg, "cause", cause, "jobs", n, "attempt", r.b.Attempt(), "in", d, "err", err)
	} else {
		r.s.log.Warn(msg, "jobs", n, "attempt", r.b.Attempt(), "in", d, "err", err)
	}
	return backoff.Sleep(ctx, d)
}
