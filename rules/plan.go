package rules

// A job's plan: everything the rules say about one send at one instant,
// computed in one place so that the worker, capper check and the policies of
// its outcome all read the same answer.

import (
	"math"
	"time"

	"github.com/capper-dev/capper/budget"
	"github.com/capper-dev/capper/capping"
)

// Job is what the rules look at in a send.
type Job struct {
	Channel  string
	Category string   // "" when the job has none
	Tags     []string // its tags, its category among them (budget and cap scopes)
	Campaign string
	// CampaignEnds is when the job says its campaign ends (zero: it does
	// not): how long a tally cap with retain_until: campaign_end keeps its count.
	CampaignEnds time.Time
	Zone         *time.Location // nil: the rules' default
	// Segment is the user's segment; InSegment false: the user is in none
	// (the default caps apply).
	Segment   string
	InSegment bool
	// Priority is the job's own (HasPriority), else the rules give one.
	Priority    int
	HasPriority bool
	// CollapseKey is the job's own collapse_key ("": the rules may derive one).
	CollapseKey string
}

// Plan is what the rules say about one send at one instant (Rules.Plan).
type Plan struct {
	// Exempt sends bypass the caps: not counted, not capped, no quiet hours.
	Exempt bool
	// CountOnly sends are recorded without a check: Caps holds only the
	// tally caps whose counts they add to, as shadow caps that never report.
	CountOnly bool
	// QuietUntil is when the quiet hours that hold the send end; zero when
	// none holds.
	QuietUntil time.Time
	// Caps are the caps that apply (calendar periods bounded at the plan's
	// instant, per-campaign scopes narrowed to its campaign); empty for an
	// exempt or count-only send.
	Caps []capping.Cap
	// Wants are the budget tokens the send needs; empty for an exempt send.
	Wants []budget.Want
	// Retention is how long its user's log must keep it.
	Retention time.Duration
	// LongestHold is the longest any send may wait on the delay tiers under
	// these rules (a hold policy's or a budget's max_hold, an arbitration
	// window): how long after a copy of a job is refused for good another
	// copy held before may still come back.
	LongestHold time.Duration
	// FailOpenAfter is how long Redis may be unavailable before the send
	// goes out unchecked; 0: never (fail-closed).
	FailOpenAfter time.Duration
	// Priority is the send's: its own, else the rules' default for it.
	Priority int
	// Arbitration is the arbitration window of its caps' last slots (the
	// longest of its Arbitrated caps'); 0: none.
	Arbitration time.Duration
	// Collapse is the send's collapse key (Key "": none; an exempt or
	// count-only send has none).
	Collapse CollapsePlan
	// Policies say what becomes of the send when it is refused: its
	// segment's and category's, resolved when the rules were compiled (nil:
	// drop, no reservations).
	*Policies
}

// Buffers lets the plans of a batch share backing arrays for their caps and
// wants. The zero value is ready; Reset before reusing it for another batch
// (the plans made with it must be done with).
type Buffers struct {
	caps  []capping.Cap
	wants []budget.Want
}

// Reset empties b, keeping its arrays.
func (b *Buffers) Reset() {
	clear(b.caps)
	clear(b.wants)
	b.caps, b.wants = b.caps[:0], b.wants[:0]
}

// countedOnly keeps of caps[from:] the tally caps, as shadow caps of a limit
// no count reaches: a count-only send adds to their counts (the log counts
// it for the others) and is neither capped nor reported by them.
func countedOnly(caps []capping.Cap, from int) []capping.Cap {
	out := caps[:from]
	for _, c := range caps[from:] {
		if c.Tally {
			c.Shadow, c.Limit, c.Reserved = true, math.MaxInt32, 0
			out = append(out, c)
		}
	}
	clear(caps[len(out):])
	return out
}

// Plan returns the plan of job at now. b (nil: none) provides the arrays of
// its caps and wants.
func (r *Rules) Plan(job Job, now time.Time, b *Buffers) Plan {
	if b == nil {
		b = &Buffers{}
	}
	segKey := r.segmentKey(job.Segment, job.InSegment)
	p := Plan{Policies: r.policiesOf(segKey, job.Category),
		Exempt: r.exempt[job.Category], CountOnly: r.countOnly[job.Category], Retention: r.retention, LongestHold: r.hold.longest,
		FailOpenAfter: r.FailOpenAfter(job.Category, job.Segment)}
	p.Priority = job.Priority
	if !job.HasPriority {
		p.Priority = r.DefaultPriority(job.Campaign, job.Category, job.Tags)
	}
	if p.Exempt {
		return p
	}
	p.QuietUntil = r.QuietUntil(job.Segment, job.InSegment, job.Category, job.Zone, now)
	n := len(b.caps)
	b.caps = r.Caps(b.caps, job.Segment, job.InSegment, Send{Campaign: job.Campaign, CampaignEnds: job.CampaignEnds, Zone: job.Zone, Priority: p.Priority}, now)
	if p.CountOnly { // counted in its tally caps, capped by none
		b.caps = countedOnly(b.caps, n)
	} else {
		p.Arbitration = r.arbitration[segKey]
		if job.CollapseKey != "" || len(r.collapse.keys) > 0 {
			p.Collapse = r.collapseOf(&job)
		}
	}
	p.Caps = b.caps[n:len(b.caps):len(b.caps)]
	n = len(b.wants)
	b.wants = r.Budgets(b.wants, job.Channel, job.Tags, job.Campaign)
	p.Wants = b.wants[n:len(b.wants):len(b.wants)]
	return p
}
