package hold

import (
	"container/heap"
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/segmentio/kafka-go"
)

// Source is what a Reader reads: a consumer-group reader of one tier (*kafka.Reader).
type Source interface {
	FetchMessage(ctx context.Context) (kafka.Message, error)
	CommitMessages(ctx context.Context, msgs ...kafka.Message) error
}

// Ahead is how many messages the shortest tier's Reader reads ahead of the
// ones it returned.
const Ahead = 1024

// Reader reads one tier and returns each message no earlier than its wake
// time, the earliest wake first: while it waits for one, it may read on, up
// to ahead messages, so that a message due sooner is not kept behind it (in
// the shortest tier a job with a few milliseconds left is queued behind jobs
// with the whole delay left; read in order, it was released up to that delay
// late). In the other tiers wake times grow with the queueing time: reading
// ahead gains nothing there, and a rebalance would hand what a reader holds
// to another replica too (a job decided or moved on twice). The worker reads
// it like the input topic. Messages it holds are not committed: a commit
// covers, per partition, only offsets before the first message fetched and
// not yet committed, so a crash or a rebalance redelivers everything it had
// not passed on; a message it fetches again while it still holds it (the
// group's offset reset by a rebalance) is dropped.
//
// FetchMessage is not safe for concurrent use; CommitMessages and Waiting
// may be called while it runs.
type Reader struct {
	src   Source
	now   func() time.Time
	ahead int
	held  wakeHeap     // fetched, not returned yet
	seq   uint64       // fetch order, for ties
	wake  atomic.Int64 // unix nanoseconds the earliest held message wakes at; 0: none held
	// release: the batch being collected holds a job due to be decided
	release bool

	mu   sync.Mutex
	open map[partition]*offsets // per partition: fetched, not committed
}

type partition struct {
	topic string
	id    int
}

// offsets are one partition's: those fetched and not yet committed by the
// worker (ascending), the newest the worker committed, and the newest the
// source committed.
type offsets struct {
	open      []int64
	done      int64
	committed int64
}

// NewReader returns a Reader of src that holds up to ahead messages (at
// least one: Ahead for the shortest tier, 1 for the others); now defaults to
// time.Now.
func NewReader(src Source, now func() time.Time, ahead int) *Reader {
	if now == nil {
		now = time.Now
	}
	return &Reader{src: src, now: now, ahead: max(1, ahead), open: map[partition]*offsets{}}
}

// FetchMessage returns the held message with the earliest wake time once
// that time has come (at once for a message without hold headers, which the
// worker dead-letters); while it waits, it fetches on. A wait cut short by
// the end of ctx keeps every message for the next call.
//
// A call with a deadline is a batch collecting more after its first
// (hold.max_wait): it returns context.DeadlineExceeded at once, without
// waiting, when the earliest held message wakes after the deadline or when
// the batch holds a job due to be decided (a release waits for no hop: with
// jobs hopping through the shortest tier every few milliseconds, releases
// were decided the whole wait late).
func (r *Reader) FetchMessage(ctx context.Context) (kafka.Message, error) {
	dl, collecting := ctx.Deadline()
	if !collecting {
		r.release = false // a new batch
	}
	for {
		if len(r.held) == 0 {
			fctx, cancel := ctx, context.CancelFunc(func() {})
			if collecting {
				// a batch collecting more after its first: take what the
				// source has fetched already, but do not wait for a message
				// to be produced (one queued now wakes later)
				fctx, cancel = context.WithTimeout(ctx, time.Millisecond)
			}
			m, err := r.src.FetchMessage(fctx)
			cancel()
			if err != nil {
				if ctx.Err() == nil && fctx.Err() != nil {
					return kafka.Message{}, context.DeadlineExceeded
				}
				return kafka.Message{}, err
			}
			r.hold(m)
			continue
		}
		first := r.held[0]
		if !first.wake.After(r.now()) {
			heap.Pop(&r.held)
			r.setWake()
			r.release = r.release || first.release
			return first.m, nil
		}
		if collecting && (r.release || first.wake.After(dl)) {
			return kafka.Message{}, context.DeadlineExceeded
		}
		wait := first.wake.Sub(r.now())
		if len(r.held) >= r.ahead {
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return kafka.Message{}, ctx.Err()
			case <-t.C:
			}
			continue
		}
		fctx, cancel := context.WithTimeout(ctx, wait)
		m, err := r.src.FetchMessage(fctx)
		cancel()
		switch {
		case err == nil:
			r.hold(m)
		case ctx.Err() != nil:
			return kafka.Message{}, ctx.Err()
		case fctx.Err() == nil: // the source failed, not the wait
			return kafka.Message{}, err
		}
	}
}

// hold keeps m until its wake time and opens its offset, unless it holds
// that offset already (held, or passed on and not committed).
func (r *Reader) hold(m kafka.Message) {
	r.mu.Lock()
	o := r.partition(m)
	i, found := slices.BinarySearch(o.open, m.Offset)
	if !found {
		o.open = slices.Insert(o.open, i, m.Offset)
	}
	r.mu.Unlock()
	if found {
		return
	}
	h := heldMessage{m: m} // no hold headers: at once
	if s, ok, err := ParseState(m.Headers); err == nil && ok {
		h.wake, h.release = s.Wake, !s.Due.After(s.Wake)
	}
	r.seq++
	h.seq = r.seq
	heap.Push(&r.held, h)
	r.setWake()
}

func (r *Reader) partition(m kafka.Message) *offsets {
	k := partition{m.Topic, m.Partition}
	o := r.open[k]
	if o == nil {
		// first seen at the group's offset: nothing before it to commit
		o = &offsets{done: m.Offset - 1, committed: m.Offset - 1}
		r.open[k] = o
	}
	return o
}

func (r *Reader) setWake() {
	if len(r.held) == 0 {
		r.wake.Store(0)
		return
	}
	r.wake.Store(max(1, r.held[0].wake.UnixNano()))
}

// Waiting reports whether the reader holds messages none of which is due
// yet: its tier has messages but none to return. Safe for concurrent use.
func (r *Reader) Waiting() bool {
	w := r.wake.Load()
	return w != 0 && r.now().UnixNano() < w
}

// CommitMessages marks msgs done and commits, per partition, the newest
// offset before the first message fetched and not yet done.
func (r *Reader) CommitMessages(ctx context.Context, msgs ...kafka.Message) error {
	r.mu.Lock()
	var commits []kafka.Message
	touched := map[partition]bool{}
	for _, m := range msgs {
		o := r.partition(m)
		if i, found := slices.BinarySearch(o.open, m.Offset); found {
			o.open = slices.Delete(o.open, i, i+1)
		}
		o.done = max(o.done, m.Offset)
		touched[partition{m.Topic, m.Partition}] = true
	}
	for k := range touched {
		o := r.open[k]
		upto := o.done
		if len(o.open) > 0 {
			upto = min(upto, o.open[0]-1)
		}
		if upto > o.committed {
			commits = append(commits, kafka.Message{Topic: k.topic, Partition: k.id, Offset: upto})
		}
	}
	r.mu.Unlock()
	if len(commits) == 0 {
		return nil
	}
	if err := r.src.CommitMessages(ctx, commits...); err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range commits {
		o := r.partition(c)
		o.committed = max(o.committed, c.Offset)
	}
	return nil
}

// heldMessage is a fetched message waiting for its wake time.
type heldMessage struct {
	m       kafka.Message
	wake    time.Time
	release bool // due at its wake: decided when returned, not moved to another tier
	seq     uint64
}

// wakeHeap orders held messages by wake time, then by fetch order.
type wakeHeap []heldMessage

func (h wakeHeap) Len() int { return len(h) }
func (h wakeHeap) Less(i, j int) bool {
	if !h[i].wake.Equal(h[j].wake) {
		return h[i].wake.Before(h[j].wake)
	}
	return h[i].seq < h[j].seq
}
func (h wakeHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *wakeHeap) Push(x any)   { *h = append(*h, x.(heldMessage)) }
func (h *wakeHeap) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}
