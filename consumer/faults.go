package consumer

import (
	"log/slog"
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
type ReaderFaults struct {
	// What names the reader in log lines, e.g. "topic sends, group capper".
	What   string
	Logger *slog.Logger
	// Now defaults to time.Now.
	Now func() time.Time

	last   atomic.Int64 // unix nanoseconds of the newest permanent failure; 0: none since the last fetch
	mu     sync.Mutex
	logged map[string]time.Time // cause -> when it was last logged
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
// and no message was fetched since.
func (f *ReaderFaults) Failing() bool {
	if f == nil {
		return false
	}
	last := f.last.Load()
	return last != 0 && f.now().Sub(time.Unix(0, last)) < FaultHold
}

// Fetched records that the reader fetched a message: whatever failed before works again.
func (f *ReaderFaults) Fetched() {
	if f != nil && f.last.Load() != 0 {
		f.last.Store(0)
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
