package consumer

// A job's outcome as one value: what became of it, and everything its output
// messages say. route (route.go) computes it; wire.go writes it to Kafka and
// reads it back.

import (
	"time"

	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/output"
)

// Kind is what became of a job.
type Kind uint8

// The kinds of outcome. Allowed, Duplicate, Exempt and Unchecked go to the
// allowed topic, Capped to the capped topic, DeadLetter to the dead-letter
// topic: those are final. Held writes an audit record to the held topic and
// the job to a delay tier; Moved only the latter.
const (
	Pending    Kind = iota // not routed yet: Outcome.Ask says what it waits for
	Allowed                // checked against its caps and recorded
	Duplicate              // allowed before (a redelivery): forwarded, not counted again
	Exempt                 // an exempt category: forwarded without a check
	Unchecked              // forwarded without a check: Redis unavailable beyond the fail-open limit
	Capped                 // refused for good, or until Outcome.RetryAt
	Held                   // waits on a delay tier until its due time, then is decided again
	Moved                  // a held job not due yet: on to the tier that fits its wait
	DeadLetter             // malformed: it can never be decided
)

var kindNames = [...]string{Pending: "pending", Allowed: output.DecisionAllowed, Duplicate: output.DecisionDuplicate,
	Exempt: output.DecisionExempt, Unchecked: output.DecisionUnchecked, Capped: output.DecisionCapped, Held: output.DecisionHeld,
	Moved: "moved", DeadLetter: output.DecisionDLQ}

// String is the kind's capper-decision header value and metric label.
func (k Kind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return "unknown"
}

// Ask is what a pending outcome waits for.
type Ask uint8

const (
	AskNothing   Ask = iota
	AskCollapse      // its collapse key: may it go? (it is then its key's newest)
	AskTokens        // the budget tokens of its plan
	AskDecision      // Redis: check the caps and record the send
	AskDuplicate     // Redis: was it sent before? (it must not go now)
)

// Outcome is what became of one job.
type Outcome struct {
	Kind Kind
	// Ask: a Pending outcome's next step.
	Ask Ask
	// Cap names what refused or held the job: a cap, a budget, quiet_hours
	// or expired.
	Cap string
	// Reason says why a capped job was not held: never, expired, beyond
	// max_hold, quiet_hours; empty under a cap's drop policy.
	Reason string
	// CollapseKey is the send's collapse key ("": none); CollapsedBy names
	// the job that replaced a collapsed one (Reason collapsed).
	CollapseKey, CollapsedBy string
	// Error says why a dead-lettered job is malformed; Truncate: its output
	// keeps only the start of its value.
	Error    string
	Truncate bool
	// RetryAt is when a capped send would pass (the end of the quiet hours,
	// a budget's next token); zero when never or unknown.
	RetryAt time.Time
	// DecidedAt is when it was decided: for an allowed or duplicate send,
	// when it is in the user's log.
	DecidedAt time.Time
	// Hold is, for a held or moved job, the state it leaves with; for a final
	// outcome, the state it arrived with from a delay tier (Count 0: never held).
	Hold hold.State
	// Tier is the delay tier a held or moved job goes to.
	Tier hold.Tier
	// HeldBy is what a held job waits for: "cap", "budget" or "quiet_hours"
	// (the label of capper_held_total).
	HeldBy string
	// Shadow names the shadow caps that would have capped a forwarded send.
	Shadow []string
	// Priority is the send's (its own, or the rules' default for it).
	Priority int
	// Arbitration says what became of a send in an arbitration of a cap's
	// last slot: candidate (held until its window ends), won or lost.
	Arbitration string
	// ReservedFor, on a capped or held send, is the min_priority of Cap's
	// reserved slots when only those were left (the send's priority is
	// below it); 0 otherwise.
	ReservedFor int
}
