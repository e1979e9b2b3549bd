package consumer

import (
	"cmp"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/fault"
)

// ReaderFaults keeps what one Kafka reader reports of failures that no retry
// fixes: a grant taken away (Read on its topic or group), a password or a
// certificate that changed. kafka-go's reader retries them inside, returning
// some from FetchMessage (a refused fetch) and only logging others (a refused
// JoinGroup, SyncGroup or Heartbeat); commits return theirs. Every such
// failure goes through Report, so a refused reader makes its worker not
// ready and says why at error level, whichever path it came by.
//
// A reader counts as failing for FaultHold after its last permanent failure
// (kafka-go retries a join every 5 s and a fetch within 1 s, so a failure
// that persists is reported again well within it), or until it fetches a
// message again. Each cause is logged at error once per FaultLogEvery.
//
// A reader can also stall without a refusal: kafka-go retries every other
// failure inside, and a reader that cannot fetch looks exactly like one with
// nothing to fetch. CheckStall, called every few seconds, tells them apart: a
// reader that has partitions assigned (the group's own answer says which) and
// has not fetched for a bound while those partitions hold messages not yet
// committed is stalled, and not ready, until it fetches again.
type ReaderFaults struct {
	// What names the reader in log lines, e.g. "topic sends, group capper".
	What   string
	Logger *slog.Logger
	// Clock defaults to time.Now.
	Clock func() time.Time

	last atomic.Int64 // unix nanoseconds of the newest permanent failure; 0: none since the last fetch
	// The stall watch: the newest fetch (or new assignment, or the first
	// look), the partitions of the assignment last read, whether it is stalled.
	fetched atomic.Int64
	parts   []int // nil: not read yet (CheckStall's goroutine alone uses it)
	stalled atomic.Bool
	// waiting is when a check first saw messages waiting on the reader's
	// partitions since its last fetch (unix ns; 0: none seen).
	waiting atomic.Int64
	mu      sync.Mutex
	logged  map[string]time.Time // cause -> when it was last logged
}

const (
	// FaultHold is how long a permanent failure keeps a reader not ready.
	FaultHold = 15 * time.Second
	// FaultLogEvery limits the error lines of one cause.
	FaultLogEvery = 30 * time.Second
)

func (f *ReaderFaults) now() time.Time {
	if f.Clock != nil {
		return f.Clock()
	}
	return time.Now()
}

// Report records err, which happened while msg ("fetch failed", ...). It
// returns true when err has a permanent cause (fault.Cause): the reader is
// then failing, and the cause is logged at error unless it was logged within
// FaultLogEvery. A nil f reports nothing.
func (f *ReaderFaults) Report(msg string, err error) bool {
	if f == nil {
		return false
	}
	cause := fault.Cause(err)
	if cause == "" {
		return false
	}
	now := f.now()
	f.last.Store(now.UnixNano())
	f.mu.Lock()
	if f.logged == nil {
		f.logged = map[string]time.Time{}
	}
	at, seen := f.logged[cause]
	quiet := seen && now.Sub(at) < FaultLogEvery
	if !quiet {
		f.logged[cause] = now
	}
	f.mu.Unlock()
	if !quiet && f.Logger != nil {
		f.Logger.Error("the Kafka reader is refused; not ready until it reads again", "reader", f.What, "during", msg,
			"cause", cause, "fix", fault.Hint("kafka", cause), "err", err)
	}
	return true
}

// Failing reports whether a permanent failure was reported within FaultHold
// and no message was fetched since, or the reader is stalled (CheckStall).
func (f *ReaderFaults) Failing() bool {
	if f == nil {
		return false
	}
	if f.stalled.Load() {
		return true
	}
	last := f.last.Load()
	return last != 0 && f.now().Sub(time.Unix(0, last)) < FaultHold
}

// Fetched records that the reader fetched a message: whatever failed before
// works again. Called once per batch.
func (f *ReaderFaults) Fetched() {
	if f == nil {
		return
	}
	f.fetched.Store(f.now().UnixNano())
	if f.waiting.Load() != 0 {
		f.waiting.Store(0)
	}
	if f.last.Load() != 0 {
		f.last.Store(0)
	}
	if f.stalled.Load() {
		f.stalled.Store(false)
	}
}

// CheckStall decides whether the reader is stalled: it has not fetched for
// bound, is not waiting for a message's due time (a delay tier's head:
// waiting), has partitions assigned (assignment, the group's answer, read
// only then; when it cannot be read, the last one read counts), and messages
// of those partitions have waited for bound without being fetched: lag has
// reported messages not yet committed at every check for bound (a reader
// idle for long is not stalled the moment messages arrive: it fetches them
// within its wait), or lag cannot tell (the broker that does not serve the
// reader does not answer lag either: stalled at once, idle as it is). An
// assignment that differs from the last one read is new: the reader could not
// fetch its partitions before, so its idle time starts again. A stall is
// logged at error when it starts (how long the reader has been idle, the
// messages waiting or lag's error); it ends at the next fetch, or when lag
// finds nothing waiting. CheckStall is called from one goroutine; the error
// of assignment or lag is returned.
func (f *ReaderFaults) CheckStall(bound time.Duration, waiting bool, assignment func() ([]int, error), lag func(parts []int) (int64, error)) error {
	if f == nil {
		return nil
	}
	now := f.now()
	f.fetched.CompareAndSwap(0, now.UnixNano()) // the first look: idle from here
	idle := now.Sub(time.Unix(0, f.fetched.Load()))
	if idle < bound || waiting {
		f.stalled.Store(false)
		return nil
	}
	parts, err := assignment()
	switch {
	case err != nil && f.parts == nil:
		f.stall(nil, idle, bound, 0, fmt.Errorf("its assignment: %w", err))
		return err
	case err != nil:
		parts = f.parts
	case f.parts != nil && !slices.Equal(parts, f.parts):
		f.parts = parts // a new assignment: idle from now
		f.fetched.Store(now.UnixNano())
		f.waiting.Store(0)
		f.stalled.Store(false)
		return nil
	default:
		f.parts = parts
	}
	if len(parts) == 0 {
		f.stalled.Store(false)
		return err
	}
	n, lerr := lag(parts)
	if lerr == nil && n == 0 {
		f.waiting.Store(0)
		f.stalled.Store(false)
		return err
	}
	if lerr == nil { // messages wait: since the first check that saw them
		f.waiting.CompareAndSwap(0, now.UnixNano())
		if now.Sub(time.Unix(0, f.waiting.Load())) < bound {
			f.stalled.Store(false)
			return err
		}
	}
	f.stall(parts, idle, bound, n, lerr)
	return cmp.Or(lerr, err)
}

// stall marks the reader stalled and logs it when the stall starts; with
// unknown set, what waits could not be told.
func (f *ReaderFaults) stall(parts []int, idle, bound time.Duration, n int64, unknown error) {
	if f.stalled.Swap(true) || f.Logger == nil {
		return
	}
	waiting := any(n)
	if unknown != nil {
		waiting = "unknown: " + unknown.Error()
	}
	f.Logger.Error("the Kafka reader has not fetched while its partitions hold messages; not ready until it reads again",
		"reader", f.What, "partitions", parts, "idle", idle.Round(time.Millisecond).String(), "waiting", waiting,
		"bound", bound.String(), "fix", "see the reader's warnings (fetch, join, heartbeat) and the broker's state")
}

// ErrorLogger returns kafka-go's error logger for the reader: a line whose
// arguments hold an error with a permanent cause is reported (and logged
// once at error); every line also goes to next.
func (f *ReaderFaults) ErrorLogger(next kafka.Logger) kafka.LoggerFunc {
	return func(msg string, args ...any) {
		for _, a := range args {
			if err, ok := a.(error); ok && f.Report(msgName(msg), err) {
				break
			}
		}
		if next != nil {
			next.Printf(msg, args...)
		}
	}
}

// msgName is the start of a kafka-go log format, without its verbs: "Failed to join group".
func msgName(format string) string {
	for i, r := range format {
		if r == '%' || r == ':' {
			return format[:i]
		}
	}
	return format
}
