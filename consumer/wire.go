package consumer

// The wire format of outcomes: the messages that carry a job to its topics,
// with the headers of package output, which reads them back.

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/capper-dev/capper/output"
	"github.com/segmentio/kafka-go"
)

// truncatedValueBytes is how much of the value an oversize job keeps on the
// dead-letter topic: enough to identify it.
const truncatedValueBytes = 4096

// encoder turns the outcomes of a batch into messages.
type encoder struct {
	topics   Topics
	fromTier bool // the input is a delay tier: its hold headers are not passed on
	maxBytes int  // the largest message that may be written
	hv       headerValues
	headers  []kafka.Header // the batch's messages' headers, sliced off for each (see headersFor)
}

// headersPerJob is the room a message gets for capper's headers besides its
// job's own: an allowed or capped job's take 4 to 6 (a message that needs
// more grows its own slice).
const headersPerJob = 8

// newEncoder returns an encoder for a batch of jobs messages whose own
// headers number headers in all: it keeps room for those and capper's.
func newEncoder(topics Topics, fromTier bool, maxBytes, jobs, headers int) *encoder {
	return &encoder{topics: topics, fromTier: fromTier, maxBytes: maxBytes, hv: headerValues{m: make(map[string][]byte, 16)},
		headers: make([]kafka.Header, 0, headers+jobs*headersPerJob)}
}

// headersFor returns an empty slice with room for n headers, cut from the
// batch's (one allocation a batch, not one a message: they were a seventh
// of the bytes the worker allocated) while it lasts.
func (e *encoder) headersFor(n int) []kafka.Header {
	k := len(e.headers)
	if cap(e.headers)-k < n {
		return make([]kafka.Header, 0, n)
	}
	e.headers = e.headers[:k+n]
	return e.headers[k : k : k+n]
}

// headerValues hands out one []byte per distinct header value of a batch:
// decisions, caps, segments, decision times and retry-at times repeat across
// its jobs (the writer only reads them). A batch's jobs share a few clock
// readings (the worker's, the Limiter's) and the capped ones' retry-at is
// mostly a window's end after one of a few earlier batches' readings:
// formatting each was 2% of the worker's CPU.
type headerValues struct {
	m       map[string][]byte
	decided map[instant][]byte // hold.FormatTime's text
	retry   map[instant][]byte // RFC 3339 with nanoseconds
}

// instant is a time's key: its instant, whatever its location (both formats
// are of its UTC).
type instant struct {
	sec  int64
	nsec int
}

func (h *headerValues) get(s string) []byte {
	if b, ok := h.m[s]; ok {
		return b
	}
	b := []byte(s)
	h.m[s] = b
	return b
}

// time formats t (ms) as a decision time, once per instant of the batch.
func (h *headerValues) time(t time.Time) []byte {
	return formatted(&h.decided, t, func(t time.Time) []byte { return []byte(output.FormatTime(t)) })
}

// retryAt formats t as a capped send's retry-at, once per instant of the batch.
func (h *headerValues) retryAt(t time.Time) []byte {
	return formatted(&h.retry, t, func(t time.Time) []byte {
		return t.UTC().AppendFormat(make([]byte, 0, 24), time.RFC3339Nano)
	})
}

func formatted(m *map[instant][]byte, t time.Time, format func(time.Time) []byte) []byte {
	k := instant{t.Unix(), t.Nanosecond()}
	if b, ok := (*m)[k]; ok {
		return b
	}
	if *m == nil {
		*m = make(map[instant][]byte, 8)
	}
	b := format(t)
	(*m)[k] = b
	return b
}

// empty is the value of a header that is present and says nothing (a
// capped send's retry-at when it will never pass): zero bytes, never null,
// which clients in other languages read as a missing value.
var empty = []byte{}

// append appends the messages that carry a job (msg, segment) with outcome o
// to its topics: its original key, value and headers (without the hold
// headers of a delay tier) and capper's. A held job has two: the audit
// record on the held topic and the job on its delay tier; a moved job only
// the latter.
func (e *encoder) append(outs []kafka.Message, msg *kafka.Message, segment string, o *Outcome) []kafka.Message {
	hv := &e.hv
	orig := msg.Headers
	if e.fromTier {
		orig = make([]kafka.Header, 0, len(msg.Headers))
		for _, h := range msg.Headers {
			if !output.IsHoldHeader(h.Key) {
				orig = append(orig, h)
			}
		}
	}
	m := kafka.Message{Key: msg.Key, Value: msg.Value}
	m.Headers = append(e.headersFor(len(orig)+headersPerJob), orig...)
	add := func(k string, v []byte) { m.Headers = append(m.Headers, kafka.Header{Key: k, Value: v}) }
	switch o.Kind {
	case Moved:
		m.Topic = o.Tier.Topic
		m.Headers = o.Hold.AppendHeaders(m.Headers)
		return append(outs, m)
	case Held:
		wait := kafka.Message{Key: m.Key, Value: m.Value, Topic: o.Tier.Topic, Headers: o.Hold.AppendHeaders(append([]kafka.Header(nil), orig...))}
		outs = append(outs, wait)
		m.Topic = e.topics.Held
		add(output.HeaderDecision, hv.get(output.DecisionHeld))
		add(output.HeaderCap, hv.get(o.Cap))
		add(output.HeaderDueAt, []byte(output.FormatTime(o.Hold.Due)))
		add(output.HeaderHoldCount, hv.get(strconv.Itoa(o.Hold.Count)))
		add(output.HeaderDecidedAt, hv.time(o.DecidedAt))
		add(output.HeaderSegment, hv.get(segment))
		e.priority(add, o)
		return append(outs, m)
	case DeadLetter:
		m.Topic = e.topics.DLQ
		add(output.HeaderDecision, hv.get(output.DecisionDLQ))
		add(output.HeaderError, []byte(o.Error))
		if o.Truncate && len(m.Value) > truncatedValueBytes {
			m.Value = m.Value[:truncatedValueBytes]
		}
		if over := messageBytes(&m) - e.maxBytes; over > 0 {
			// Keep as much of the value as fits and the headers; drop the
			// original headers too if they alone are too large.
			m.Value = m.Value[:max(0, len(m.Value)-over-64)]
			if messageBytes(&m) > e.maxBytes {
				m.Headers = m.Headers[len(orig):]
			}
		}
		return append(outs, m)
	case Capped:
		m.Topic = e.topics.Capped
		add(output.HeaderDecision, hv.get(output.DecisionCapped))
		add(output.HeaderCap, hv.get(o.Cap))
		retry := empty
		if !o.RetryAt.IsZero() {
			retry = hv.retryAt(o.RetryAt)
		}
		add(output.HeaderRetryAt, retry)
		if o.Reason != "" {
			add(output.HeaderReason, hv.get(o.Reason))
		}
		if o.CollapsedBy != "" {
			add(output.HeaderCollapsedBy, []byte(o.CollapsedBy))
		}
	case Allowed, Duplicate, Exempt, Unchecked:
		m.Topic = e.topics.Allowed
		add(output.HeaderDecision, hv.get(o.Kind.String()))
		if len(o.Shadow) > 0 {
			add(output.HeaderShadow, hv.get(strings.Join(o.Shadow, ",")))
		}
	default:
		panic(fmt.Sprintf("consumer: a %v outcome has no output", o.Kind))
	}
	add(output.HeaderDecidedAt, hv.time(o.DecidedAt))
	if h := o.Hold; h.Count > 0 { // released: how often and how long it was held
		add(output.HeaderHoldCount, hv.get(strconv.Itoa(h.Count)))
		add(output.HeaderHeldSince, []byte(output.FormatTime(h.Since)))
		add(output.HeaderDueAt, []byte(output.FormatTime(h.Due)))
		add(output.HeaderHeldFor, strconv.AppendFloat(nil, o.DecidedAt.Sub(h.Since).Seconds(), 'f', 3, 64))
	}
	add(output.HeaderSegment, hv.get(segment))
	e.priority(add, o)
	return append(outs, m)
}

// priority adds the send's priority, its collapse key and, when a
// reservation refused it, the priority the slots are kept for.
func (e *encoder) priority(add func(string, []byte), o *Outcome) {
	add(output.HeaderPriority, e.hv.get(strconv.Itoa(o.Priority)))
	if o.CollapseKey != "" {
		add(output.HeaderCollapseKey, e.hv.get(o.CollapseKey))
	}
	if o.Arbitration != "" {
		add(output.HeaderArbitration, e.hv.get(o.Arbitration))
	}
	if o.ReservedFor > 0 {
		add(output.HeaderReservedFor, e.hv.get(strconv.Itoa(o.ReservedFor)))
	}
}
