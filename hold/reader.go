package hold

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/segmentio/kafka-go"
)

// Source is what a Reader reads: a consumer-group reader of one tier (*kafka.Reader).
type Source interface {
	FetchMessage(ctx context.Context) (kafka.Message, error)
	CommitMessages(ctx context.Context, msgs ...kafka.Message) error
}

// Reader reads one tier and returns each message no earlier than its wake
// time, in order: the worker reads it like the input topic. A message whose
// wait is cut short by the end of ctx is kept and returned by the next call.
// Not safe for concurrent use.
type Reader struct {
	src     Source
	now     func() time.Time
	pending *kafka.Message
	wake    atomic.Int64 // unix nanoseconds the pending message is due at; 0: none pending
}

// NewReader returns a Reader of src; now defaults to time.Now.
func NewReader(src Source, now func() time.Time) *Reader {
	if now == nil {
		now = time.Now
	}
	return &Reader{src: src, now: now}
}

// FetchMessage returns the next message once its wake time has come (at once
// for a message without hold headers, which the worker dead-letters).
func (r *Reader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	if r.pending == nil {
		m, err := r.src.FetchMessage(ctx)
		if err != nil {
			return kafka.Message{}, err
		}
		r.pending = &m
	}
	if s, ok, err := ParseState(r.pending.Headers); err == nil && ok {
		if wait := s.Wake.Sub(r.now()); wait > 0 {
			r.wake.Store(s.Wake.UnixNano())
			t := time.NewTimer(wait)
			defer t.Stop()
			select {
			case <-ctx.Done():
				return kafka.Message{}, ctx.Err()
			case <-t.C:
			}
		}
	}
	m := *r.pending
	r.pending = nil
	r.wake.Store(0)
	return m, nil
}

// Waiting reports whether the reader holds a message that is not due yet:
// its tier has messages but none to return. Safe for concurrent use.
func (r *Reader) Waiting() bool {
	w := r.wake.Load()
	return w != 0 && r.now().UnixNano() < w
}

// CommitMessages commits through the source.
func (r *Reader) CommitMessages(ctx context.Context, msgs ...kafka.Message) error {
	return r.src.CommitMessages(ctx, msgs...)
}
