package consumer

import (
	"fmt"
	"log/slog"
	"regexp"
	"strconv"
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
// reader that has partitions assigned and has not fetched for a bound while
// those partitions hold messages not yet committed is stalled, and not ready,
// until it fetches again.
type ReaderFaults struct {
	// What names the reader in log lines, e.g. "topic sends, group capper".
	What   string
	Logger *slog.Logger
	// Now defaults to time.Now.
	Now func() time.Time

	last atomic.Int64 // unix nanoseconds of the newest permanent failure; 0: none since the last fetch
	// The stall watch: the newest fetch (or assignment, or the first look),
	// the partitions of the current assignment, whether it is stalled.
	fetched atomic.Int64
	parts   atomic.Pointer[[]int]
	stalled atomic.Bool
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
	if f.Now != nil {
		return f.Now()
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
	if f.last.Load() != 0 {
		f.last.Store(0)
	}
	if f.stalled.Load() {
		f.stalled.Store(false)
	}
}

// assigned records the partitions of a new assignment: the reader could not
// fetch them before, so its idle time starts now.
func (f *ReaderFaults) assigned(parts []int) {
	f.parts.Store(&parts)
	f.fetched.Store(f.now().UnixNano())
}

// CheckStall decides whether the reader is stalled: it has partitions
// assigned, has not fetched for bound, is not waiting for a message's due
// time (a delay tier's head: waiting), and lag reports messages of those
// partitions not yet committed, or cannot tell (the broker that does not
// serve the reader does not answer lag either). lag is only asked when the
// rest holds. A stall is logged at error when it starts (how long the reader
// has been idle, the messages waiting or lag's error); it ends at the next
// fetch, or when lag finds nothing waiting. lag's error is returned.
func (f *ReaderFaults) CheckStall(bound time.Duration, waiting bool, lag func(parts []int) (int64, error)) error {
	if f == nil {
		return nil
	}
	now := f.now()
	f.fetched.CompareAndSwap(0, now.UnixNano()) // the first look: idle from here
	idle := now.Sub(time.Unix(0, f.fetched.Load()))
	var parts []int
	if p := f.parts.Load(); p != nil {
		parts = *p
	}
	if len(parts) == 0 || idle < bound || waiting {
		f.stalled.Store(false)
		return nil
	}
	n, err := lag(parts)
	if err == nil && n == 0 {
		f.stalled.Store(false)
		return nil
	}
	if !f.stalled.Swap(true) && f.Logger != nil {
		waiting := any(n)
		if err != nil {
			waiting = "unknown: " + err.Error()
		}
		f.Logger.Error("the Kafka reader has not fetched while its partitions hold messages; not ready until it reads again",
			"reader", f.What, "partitions", parts, "idle", idle.Round(time.Millisecond).String(), "waiting", waiting,
			"bound", bound.String(), "fix", "see the reader's warnings (fetch, join, heartbeat) and the broker's state")
	}
	return err
}

// subscribed is the line kafka-go 0.4.51's group reader logs when it is
// assigned partitions; its argument prints as map[{topic:T partition:N}:OFFSET ...].
const subscribed = "subscribed to topics and partitions: %+v"

var partitionOf = regexp.MustCompile(`partition:(\d+)\}`)

// InfoLogger returns kafka-go's logger for the reader: it learns each
// assignment from the line kafka-go logs when it subscribes (kafka-go tells
// it no other way), and passes every line to next.
func (f *ReaderFaults) InfoLogger(next kafka.Logger) kafka.LoggerFunc {
	return func(msg string, args ...any) {
		if f != nil && msg == subscribed && len(args) == 1 {
			parts := []int{}
			for _, m := range partitionOf.FindAllStringSubmatch(fmt.Sprintf("%+v", args[0]), -1) {
				if p, err := strconv.Atoi(m[1]); err == nil {
					parts = append(parts, p)
				}
			}
			f.assigned(parts)
		}
		if next != nil {
			next.Printf(msg, args...)
		}
	}
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
