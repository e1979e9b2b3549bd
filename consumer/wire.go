package consumer

// The wire format of outcomes: the messages that carry a job to its topics,
// and ParseOutput, which reads them back (for capper report, the tests and
// any consumer of the output topics written in Go).

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/hold"
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
	// HeaderPriority is the send's priority (its own, or the rules' default),
	// on allowed, capped and held outputs.
	HeaderPriority = "capper-priority"
	// HeaderReservedFor, on a capped or held send, is the min_priority of the
	// cap's reserved slots when only those were left for it.
	HeaderReservedFor = "capper-reserved-for"
	// HeaderArbitration says what became of a send in an arbitration of a
	// cap's last slot: candidate (on its held record), won, lost.
	HeaderArbitration = "capper-arbitration"
)

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

// encoder turns the outcomes of a batch into messages.
type encoder struct {
	topics   Topics
	fromTier bool // the input is a delay tier: its hold headers are not passed on
	maxBytes int  // the largest message that may be written
	hv       headerValues
}

func newEncoder(topics Topics, fromTier bool, maxBytes int) *encoder {
	return &encoder{topics: topics, fromTier: fromTier, maxBytes: maxBytes, hv: headerValues{m: make(map[string][]byte, 16)}}
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
	return formatted(&h.decided, t, func(t time.Time) []byte { return []byte(hold.FormatTime(t)) })
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
			if !hold.IsHeader(h.Key) {
				orig = append(orig, h)
			}
		}
	}
	m := kafka.Message{Key: msg.Key, Value: msg.Value}
	m.Headers = append(make([]kafka.Header, 0, len(orig)+8), orig...)
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
		add(HeaderDecision, hv.get(DecisionHeld))
		add(HeaderCap, hv.get(o.Cap))
		add(hold.HeaderDue, []byte(hold.FormatTime(o.Hold.Due)))
		add(hold.HeaderCount, hv.get(strconv.Itoa(o.Hold.Count)))
		add(HeaderDecidedAt, hv.time(o.DecidedAt))
		add(HeaderSegment, hv.get(segment))
		e.priority(add, o)
		return append(outs, m)
	case DeadLetter:
		m.Topic = e.topics.DLQ
		add(HeaderDecision, hv.get(DecisionDLQ))
		add(HeaderError, []byte(o.Error))
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
		add(HeaderDecision, hv.get(DecisionCapped))
		add(HeaderCap, hv.get(o.Cap))
		retry := empty
		if !o.RetryAt.IsZero() {
			retry = hv.retryAt(o.RetryAt)
		}
		add(HeaderRetryAt, retry)
		if o.Reason != "" {
			add(HeaderReason, hv.get(o.Reason))
		}
	case Allowed, Duplicate, Exempt, Unchecked:
		m.Topic = e.topics.Allowed
		add(HeaderDecision, hv.get(o.Kind.String()))
		if len(o.Shadow) > 0 {
			add(HeaderShadow, hv.get(strings.Join(o.Shadow, ",")))
		}
	default:
		panic(fmt.Sprintf("consumer: a %v outcome has no output", o.Kind))
	}
	add(HeaderDecidedAt, hv.time(o.DecidedAt))
	if h := o.Hold; h.Count > 0 { // released: how often and how long it was held
		add(hold.HeaderCount, hv.get(strconv.Itoa(h.Count)))
		add(hold.HeaderSince, []byte(hold.FormatTime(h.Since)))
		add(hold.HeaderDue, []byte(hold.FormatTime(h.Due)))
		add(HeaderHeldFor, strconv.AppendFloat(nil, o.DecidedAt.Sub(h.Since).Seconds(), 'f', 3, 64))
	}
	add(HeaderSegment, hv.get(segment))
	e.priority(add, o)
	return append(outs, m)
}

// priority adds the send's priority and, when a reservation refused it, the
// priority the slots are kept for.
func (e *encoder) priority(add func(string, []byte), o *Outcome) {
	add(HeaderPriority, e.hv.get(strconv.Itoa(o.Priority)))
	if o.Arbitration != "" {
		add(HeaderArbitration, e.hv.get(o.Arbitration))
	}
	if o.ReservedFor > 0 {
		add(HeaderReservedFor, e.hv.get(strconv.Itoa(o.ReservedFor)))
	}
}

// Output is what capper says on one message of an output topic (allowed,
// capped, dead-letter, held), as ParseOutput reads it.
type Output struct {
	// Decision is capper-decision: allowed, duplicate, exempt, unchecked,
	// capped, dlq, or held (an audit record on the held topic).
	Decision string
	Segment  string // capper-segment
	Cap      string // capped, held: what refused or held it
	Reason   string // capped: why it was not held (capper-reason)
	Error    string // dead-letter: why it is malformed (capper-error)
	// RetryAt is a capped send's capper-retry-at; zero when it is empty
	// (never) or absent.
	RetryAt time.Time
	// Shadow names the shadow caps that would have capped an allowed send.
	Shadow []string
	// DecidedAt is capper-decided-at (zero on a dead letter).
	DecidedAt time.Time
	// HoldCount and DueAt: on a held record, this hold; on a final output,
	// how often the job was held and its last due time, with HeldSince and
	// HeldFor (seconds from its first hold to its decision).
	HoldCount        int
	HeldSince, DueAt time.Time
	HeldFor          float64
	// Priority is capper-priority; ReservedFor is capper-reserved-for (0: absent).
	Priority, ReservedFor int
	// Arbitration is capper-arbitration: candidate, won, lost; "" absent.
	Arbitration string
}

// ParseOutput reads capper's headers of an output message; other headers
// are ignored. It fails on a header capper wrote that does not parse.
func ParseOutput(hs []kafka.Header) (Output, error) {
	var o Output
	var err error
	for _, h := range hs {
		v := string(h.Value)
		switch h.Key {
		case HeaderDecision:
			o.Decision = v
		case HeaderSegment:
			o.Segment = v
		case HeaderCap:
			o.Cap = v
		case HeaderReason:
			o.Reason = v
		case HeaderError:
			o.Error = v
		case HeaderShadow:
			o.Shadow = strings.Split(v, ",")
		case HeaderRetryAt:
			if v != "" {
				o.RetryAt, err = time.Parse(time.RFC3339Nano, v)
			}
		case HeaderDecidedAt:
			o.DecidedAt, err = time.Parse(time.RFC3339Nano, v)
		case HeaderHeldFor:
			o.HeldFor, err = strconv.ParseFloat(v, 64)
		case HeaderPriority:
			o.Priority, err = strconv.Atoi(v)
		case HeaderReservedFor:
			o.ReservedFor, err = strconv.Atoi(v)
		case HeaderArbitration:
			o.Arbitration = v
		case hold.HeaderCount:
			o.HoldCount, err = strconv.Atoi(v)
		case hold.HeaderSince:
			o.HeldSince, err = time.Parse(time.RFC3339Nano, v)
		case hold.HeaderDue:
			o.DueAt, err = time.Parse(time.RFC3339Nano, v)
		}
		if err != nil {
			return o, fmt.Errorf("consumer: output header %s: %w", h.Key, err)
		}
	}
	if o.Decision == "" {
		return o, fmt.Errorf("consumer: not an output of capper: no %s header", HeaderDecision)
	}
	return o, nil
}
