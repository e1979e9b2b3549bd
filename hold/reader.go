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

// Rebalancer is a Source that tells its group's generations: joined counts
// the times it joined its group (each after its last generation ended:
// what it fetched of that generation will be read again from the committed
// offsets, by it or by the partition's new owner), assigned the times a
// generation began (it may count more: the consumer then waits less for
// the generation it joined, and may keep a message of the last).
type Rebalancer interface {
	Generations() (joined, assigned int64)
}

// Ahead is how many messages a Reader reads ahead of the ones it returned.
const Ahead = 1024

// Reader reads one tier and returns each message no earlier than its wake
// time, the earliest wake first: while it waits for one, it reads on, up to
// ahead messages, so that a message due sooner is not kept behind it. In
// the shortest tier a job with a few milliseconds left is queued behind jobs
// with the whole delay left; in every tier the consumer-group reader
// interleaves the partitions as their fetches come, so a message can follow
// one of another partition queued seconds after it (read in order, held
// sends came back up to 3 s late, and a budget's tokens with them). The
// worker reads it like the input topic. Messages it holds are not
// committed: a commit covers, per partition, only offsets before the first
// message fetched and not yet committed, so a crash or a rebalance
// redelivers everything it had not passed on; a message it fetches again
// while it still holds it (the group's offset reset by a rebalance) is
// dropped. When its Source is a Rebalancer, a rebalance drops every message
// it held or fetched before the next generation began: its own partitions
// send them again, and those of partitions now another replica's are that
// replica's alone (kept, each would be moved on or decided twice).
//
// FetchMessage is not safe for concurrent use; CommitMessages and Waiting
// may be called while it runs.
type Reader struct {
	src        Source
	rebalancer Rebalancer // nil: the source does not tell
	joined     int64      // its counts when last looked at, after the last fetch
	assigned   int64
	rejoining  bool // joined since the last generation began: what is fetched is of the one before
	now        func() time.Time
	ahead      int
	held       wakeHeap     // fetched, not returned yet
	seq        uint64       // fetch order, for ties
	wake       atomic.Int64 // unix nanoseconds the earliest held message wakes at; 0: none held
	// release: the batch being collected holds a job due to be decided
	release bool
	early   *Early // nil: no message is returned before its wake time

	mu   sync.Mutex
	open map[partition]*offsets // per partition: fetched, not committed
}

type partition struct {
	topic string
	id    int
}

// offsets are one partition's: those fetched and not yet committed by the
// worker (ascending), those dropped by a rebalance and not fetched again
// (ascending: no commit passes them), the newest the worker committed, and
// the newest the source committed.
type offsets struct {
	open      []int64
	dropped   []int64
	done      int64
	committed int64
}

// NewReader returns a Reader of src that holds up to ahead messages (at
// least one; Ahead); now defaults to time.Now.
func NewReader(src Source, now func() time.Time, ahead int) *Reader {
	if now == nil {
		now = time.Now
	}
	r := &Reader{src: src, now: now, ahead: max(1, ahead), open: map[partition]*offsets{}}
	if rb, ok := src.(Rebalancer); ok {
		r.rebalancer = rb
		r.joined, r.assigned = rb.Generations()
	}
	return r
}

// fetch fetches one message from the source and holds it, unless it is of
// a generation that ended. When the group was joined since the last fetch,
// every message held was fetched before (the last look found no join): all
// are dropped. Until a generation begins, what is fetched is of the last
// one, and dropped too. The fetch that sees a generation begin may return a
// message of either: it is kept (at worst passed on twice).
func (r *Reader) fetch(ctx context.Context) error {
	m, err := r.src.FetchMessage(ctx)
	straddles := false
	if r.rebalancer != nil {
		joined, assigned := r.rebalancer.Generations()
		if joined != r.joined {
			r.joined, r.rejoining = joined, true
			r.drop(r.held...)
			r.held = r.held[:0]
			r.setWake()
		}
		if r.rejoining && assigned != r.assigned {
			r.rejoining, straddles = false, true
		}
		r.assigned = assigned
		if r.rejoining && err == nil {
			r.drop(heldMessage{m: m})
			return nil
		}
	}
	if err == nil {
		r.hold(m, straddles)
	}
	return err
}

// drop forgets messages fetched: their offsets stay uncommitted until they
// are fetched again.
func (r *Reader) drop(hs ...heldMessage) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, h := range hs {
		o := r.partition(h.m)
		if i, found := slices.BinarySearch(o.open, h.m.Offset); found {
			o.open = slices.Delete(o.open, i, i+1)
		}
		if i, found := slices.BinarySearch(o.dropped, h.m.Offset); !found {
			o.dropped = slices.Insert(o.dropped, i, h.m.Offset)
		}
	}
}

// UseEarly has r serve e's requests: a message of a request's reason that
// r holds is returned at the request's time, before its wake time (the one
// of that reason that wakes first). The worker sees it by its wake time,
// still to come. Call it before the first FetchMessage.
func (r *Reader) UseEarly(e *Early) { r.early = e }

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
			err := r.fetch(fctx)
			cancel()
			if err != nil {
				if ctx.Err() == nil && fctx.Err() != nil {
					return kafka.Message{}, context.DeadlineExceeded
				}
				return kafka.Message{}, err
			}
			continue
		}
		if m, ok := r.popEarly(); ok {
			r.release = true
			return m, nil
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
		now := r.now()
		wait := first.wake.Sub(now)
		var poke context.Context // cancelled by a new early request
		if r.early != nil {
			var next time.Time
			poke, next = r.early.watch(now)
			if !next.IsZero() {
				wait = min(wait, next.Sub(now))
			}
		}
		if len(r.held) >= r.ahead {
			t := time.NewTimer(wait)
			var poked <-chan struct{}
			if poke != nil {
				poked = poke.Done()
			}
			select {
			case <-ctx.Done():
				t.Stop()
				return kafka.Message{}, ctx.Err()
			case <-t.C:
			case <-poked:
				t.Stop()
			}
			continue
		}
		fctx, cancel := context.WithTimeout(ctx, wait)
		stop := func() bool { return false }
		if poke != nil {
			stop = context.AfterFunc(poke, cancel)
		}
		err := r.fetch(fctx)
		stop()
		cancel()
		switch {
		case err == nil:
		case ctx.Err() != nil:
			return kafka.Message{}, ctx.Err()
		case fctx.Err() == nil: // the source failed, not the wait
			return kafka.Message{}, err
		}
	}
}

// hold keeps m until its wake time and opens its offset, unless it holds
// that offset already (held, or passed on and not committed) or is done
// with it (its commit held back by an offset dropped before it, and sent
// again by a rebalance). straddles: m may be of the generation before the
// last rebalance.
func (r *Reader) hold(m kafka.Message, straddles bool) {
	r.mu.Lock()
	o := r.partition(m)
	i, open := slices.BinarySearch(o.open, m.Offset)
	j, dropped := slices.BinarySearch(o.dropped, m.Offset)
	fresh := !open && (dropped || m.Offset > o.done)
	if fresh {
		o.open = slices.Insert(o.open, i, m.Offset)
		// A dropped offset fetched again is open again. A partition is read
		// in order, so those dropped before it were not sent again: the
		// group's offset had passed them (another replica's work), and they
		// must not hold back its commits. Unless m may have been read before
		// the dropped ones were sent again.
		switch {
		case dropped:
			o.dropped = slices.Delete(o.dropped, 0, j+1)
		case !straddles:
			o.dropped = slices.Delete(o.dropped, 0, j)
		}
	}
	r.mu.Unlock()
	if !fresh {
		return
	}
	h := heldMessage{m: m} // no hold headers: at once
	if s, ok, err := ParseState(m.Headers); err == nil && ok {
		h.wake, h.release, h.reason = s.Wake, !s.Due.After(s.Wake), s.Reason
	}
	r.seq++
	h.seq = r.seq
	heap.Push(&r.held, h)
	r.setWake()
}

// popEarly takes out the message an early request is for, if r holds one:
// of the request's reason, the one that wakes first, among those not awake
// yet (those are returned anyway).
func (r *Reader) popEarly() (kafka.Message, bool) {
	if r.early == nil || len(r.held) == 0 {
		return kafka.Message{}, false
	}
	now := r.now()
	find := func(reason string) int {
		k := -1
		for i, h := range r.held {
			if h.reason == reason && h.wake.After(now) && (k < 0 || r.held.Less(i, k)) {
				k = i
			}
		}
		return k
	}
	reason, ok := r.early.take(now, func(reason string) bool { return find(reason) >= 0 })
	if !ok {
		return kafka.Message{}, false
	}
	h := heap.Remove(&r.held, find(reason)).(heldMessage)
	r.setWake()
	return h.m, true
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
		if len(o.dropped) > 0 {
			upto = min(upto, o.dropped[0]-1)
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
	release bool   // due at its wake: decided when returned, not moved to another tier
	reason  string // the hold's (an early request's)
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
