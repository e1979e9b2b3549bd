package output

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"
)

// Headers capper adds to the messages it writes.
const (
	HeaderDecision = "capper-decision" // every output: one of the Decision* values
	HeaderSegment  = "capper-segment"  // the user's segment, or "default"
	HeaderCap      = "capper-cap"      // capped, held: the cap or budget that was hit, or quiet_hours, or expired
	HeaderRetryAt  = "capper-retry-at" // capped: RFC 3339 time when a send would pass, empty when never
	HeaderError    = "capper-error"    // dead-letter: why the job is malformed
	// HeaderReason says why a capped job was not held: never, expired,
	// beyond max_hold, quiet_hours, refused before, collapsed (absent under
	// the drop policy of a cap).
	HeaderReason = "capper-reason"
	// HeaderDecidedAt is when the job was decided (RFC 3339, ms), on every
	// allowed, capped and held output; for a duplicate, when it was first
	// allowed.
	HeaderDecidedAt = "capper-decided-at"
	// HeaderHeldFor is, on the final output of a job that was held, the
	// seconds from HeaderHeldSince to this decision.
	HeaderHeldFor = "capper-held-for"
	// HeaderShadow names, comma-separated, the shadow caps that would have
	// capped a forwarded send (absent when none would have).
	HeaderShadow = "capper-shadow-capped"
	// HeaderPriority is the send's priority (its own, or the rules' default),
	// on every output of a decided job.
	HeaderPriority = "capper-priority"
	// HeaderReservedFor, on a capped or held send, is the min_priority of the
	// cap's reserved slots when only those were left for it.
	HeaderReservedFor = "capper-reserved-for"
	// HeaderCollapseKey is, on every output of a send with a collapse key
	// (its own or one the rules derive), that key.
	HeaderCollapseKey = "capper-collapse-key"
	// HeaderCollapsedBy, on a send capped as collapsed (reason collapsed),
	// is the job id of the send that replaced it: a newer one of its key, or
	// one of its key sent within the collapse window.
	HeaderCollapsedBy = "capper-collapsed-by"
	// HeaderArbitration says what became of a send in an arbitration of a
	// cap's last slot: candidate (on its held record), won, lost.
	HeaderArbitration = "capper-arbitration"

	// The hold headers: on a held record and on a delay tier's message, this
	// hold; on the final output of a job that was held, its last hold.
	HeaderHoldCount  = "capper-hold-count"  // how often the job was held
	HeaderHeldSince  = "capper-held-since"  // RFC 3339: its input message's timestamp
	HeaderDueAt      = "capper-due-at"      // RFC 3339: when it may be decided again
	HeaderWakeAt     = "capper-wake-at"     // delay tiers only, RFC 3339: when its tier's reader returns it
	HeaderHoldReason = "capper-hold-reason" // delay tiers only: the cap that refused it, or quiet_hours
)

// The values of HeaderDecision.
const (
	DecisionAllowed   = "allowed"   // checked against its caps and recorded
	DecisionDuplicate = "duplicate" // allowed before (a redelivery): forwarded, not counted again
	DecisionExempt    = "exempt"    // an exempt category: forwarded without a check
	// DecisionUnchecked: forwarded without a cap check because Redis was
	// unavailable for longer than the fail-open rule of its category or
	// segment allows; not counted.
	DecisionUnchecked = "unchecked"
	DecisionCapped    = "capped" // refused: for good, or until HeaderRetryAt
	DecisionDLQ       = "dlq"    // malformed: it can never be decided
	// DecisionHeld: an audit record on the held topic; the job waits on the
	// delay topics and is decided again at its due time. Not final.
	DecisionHeld = "held"
)

// IsHoldHeader reports whether key is one of the hold headers, which a delay
// tier's message carries and its job's outputs replace.
func IsHoldHeader(key string) bool {
	switch key {
	case HeaderHeldSince, HeaderDueAt, HeaderWakeAt, HeaderHoldCount, HeaderHoldReason:
		return true
	}
	return false
}

// FormatTime is how capper writes an instant in its headers (decided-at and
// the hold headers): RFC 3339 in UTC, to the millisecond. Retry-at keeps
// every digit of its instant (RFC 3339 with nanoseconds).
func FormatTime(t time.Time) string { return t.UTC().Format(timeLayout) }

const timeLayout = "2006-01-02T15:04:05.000Z07:00"

// Output is what capper says on one message of an output topic (allowed,
// capped, dead-letter, held), as Parse reads it.
type Output struct {
	// Decision is capper-decision: one of the Decision* values.
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
	// CollapseKey is capper-collapse-key; CollapsedBy is a collapsed send's
	// capper-collapsed-by ("" absent).
	CollapseKey, CollapsedBy string
}

// Parse reads capper's headers of an output message; other headers are
// ignored. It fails on a message without capper-decision (not an output of
// capper) and on a header capper wrote that does not parse.
func Parse(hs []kafka.Header) (Output, error) {
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
		case HeaderCollapseKey:
			o.CollapseKey = v
		case HeaderCollapsedBy:
			o.CollapsedBy = v
		case HeaderHoldCount:
			o.HoldCount, err = strconv.Atoi(v)
		case HeaderHeldSince:
			o.HeldSince, err = time.Parse(time.RFC3339Nano, v)
		case HeaderDueAt:
			o.DueAt, err = time.Parse(time.RFC3339Nano, v)
		}
		if err != nil {
			return o, fmt.Errorf("output: header %s: %w", h.Key, err)
		}
	}
	if o.Decision == "" {
		return o, fmt.Errorf("output: not an output of capper: no %s header", HeaderDecision)
	}
	return o, nil
}
