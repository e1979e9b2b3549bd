package loadtest

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/output"
	"github.com/capper-dev/capper/rules"
)

// Output roles: which output topic a message was read from.
const (
	RoleAllowed = "allowed"
	RoleCapped  = "capped"
	RoleDLQ     = "dlq"
	RoleHeld    = "held" // audit records of holds: not a final topic
)

// ReleaseGrace is how late after its due time a held job may be released
// before the report counts it as lost; a job due later than the report's
// end plus this is pending, not lost.
const ReleaseGrace = 30 * time.Second

// Output is one message read from an output topic: what capper says of it
// (output.Parse), its topic's role, loadgen's id and when it was
// produced and written.
type Output struct {
	output.Output
	Role       string // RoleAllowed, RoleCapped, RoleDLQ or RoleHeld
	ID         string // HeaderID
	Time       time.Time
	ProducedAt time.Time
}

// at is when o was decided: capper-decided-at, else its write time.
func (o *Output) at() time.Time {
	if !o.DecidedAt.IsZero() {
		return o.DecidedAt
	}
	return o.Time
}

// Result is the report's verdict. The JSON field names are the report's last line.
type Result struct {
	Jobs       int `json:"jobs"`
	Allowed    int `json:"allowed"`
	Capped     int `json:"capped"`
	DLQ        int `json:"dlq"`
	Duplicates int `json:"duplicates"`
	Exempt     int `json:"exempt"`
	Unchecked  int `json:"unchecked"` // forwarded without a check under a fail-open rule
	Held       int `json:"held"`      // hold records (a job held twice counts twice)
	Released   int `json:"released"`  // final outputs of jobs that were held
	Pending    int `json:"pending"`   // jobs still held, due after the report
	// Arbitrations of a cap's last slot: final outputs of candidates that won and lost it.
	ArbitrationsWon  int `json:"arbitrations_won"`
	ArbitrationsLost int `json:"arbitrations_lost"`
	// VIPJudged counts the final outputs (allowed or capped) of jobs decided
	// while their user was VIP: each is a violation if the rules' caps capped it.
	VIPJudged   int     `json:"vip_judged"`
	Unaccounted int     `json:"unaccounted"`
	Violations  int     `json:"violations"`
	JobsPerSec  float64 `json:"jobs_per_sec"`
	P50ms       float64 `json:"p50_ms"`
	P99ms       float64 `json:"p99_ms"`
	// Release lag: from a held job's due time to its release decision.
	ReleaseP50ms float64 `json:"release_p50_ms"`
	ReleaseP99ms float64 `json:"release_p99_ms"`

	// Budgets: what each budget (per campaign: each key) forwarded per window.
	Budgets []BudgetDelivery `json:"budgets,omitempty"`

	ByCap     map[string]int            `json:"-"`
	BySegment map[string]map[string]int `json:"-"` // segment -> decision -> outputs
	Problems  []string                  `json:"-"` // the first few, for people
}

// BudgetDelivery is what a budget forwarded: its allowed sends (by decision
// time) per window of its length, from its first allowed send. Whole counts
// the windows after the first (partial: the demand begins) that end by the
// last produce stamp (the demand has ended after it; without stamps, all but
// the last, partial one): under demand above the limit, each of those is the
// share of the limit the budget delivers.
type BudgetDelivery struct {
	Budget string        `json:"budget"`
	Limit  int           `json:"limit"`
	Window time.Duration `json:"window_ns"`
	Whole  []int         `json:"whole_windows"`
	// MaxAny is the most allowed sends in any window of its length (sliding).
	MaxAny int `json:"max_any"`
}

// OK reports whether nothing was lost or over-sent.
func (r *Result) OK() bool { return r.Unaccounted == 0 && r.Violations == 0 }

const maxProblems = 20

func (r *Result) problem(format string, args ...any) {
	if len(r.Problems) < maxProblems {
		r.Problems = append(r.Problems, fmt.Sprintf(format, args...))
	}
}

// Policy is what Check needs of the worker: its rules as configured (Check
// reads them itself: see judge.go) and each user's segment.
type Policy struct {
	Rules rules.Config
	// Segment returns a user's segment (ok false: in none, the default caps).
	Segment func(user uint32) (segment string, ok bool)
	// GivenBack maps the job id of a send whose delivery failed (feedback
	// failed or bounced) to when that feedback was produced: from then on the
	// send may no longer count (a worker can only apply it later, so it is
	// treated as counted before). Optional.
	GivenBack map[string]time.Time
	// Preferences are users' own limits and opt-outs, each held from its
	// From on (Prefs). Optional.
	Preferences map[uint32][]Pref
}

// Check compares the outputs with what was sent and with the caps.
//
//   - Every produced message (by HeaderID) must reach an output topic, and every
//     job id must reach exactly one of allowed, capped and dead-letter;
//     otherwise it is unaccounted. A job that was held (a record on the held
//     topic) and has no final output yet is pending while its due time is
//     later than now minus ReleaseGrace, else unaccounted (its release was lost).
//   - A released job must not be decided before its due time; an allowed job
//     not at or after its expires_at. Release lag is decided-at minus due.
//   - No budget gets more allowed sends of its scope in any window than its
//     limit plus a fortieth, rounded down, by decision time (a send recorded
//     after another replica's later entry in its user's log takes that
//     entry's time, which can fall after its token's bucket).
//   - Malformed messages must be dead-lettered; anything else there is a violation.
//   - A manifest without jobs is a violation: a verifier never passes on nothing.
//   - Every allowed send of a user (by unique job id; not exempt, not count-only,
//     not unchecked) must have been within every cap of the user's rules that
//     applies to it: fewer sends of the cap's scope than its limit before it in
//     its window (rolling, or the calendar period in the job's time zone).
//     Counted sends are the allowed, count-only sends (exempt and unchecked ones
//     are not counted). A send's time is its decision time (capper-decided-at)
//     of its first allowed output; a violation is counted once per user and
//     cap. Shadow caps never block. A send whose delivery failed stops counting
//     when its feedback was produced (Policy.GivenBack); external sends are
//     not counted (when a worker recorded one cannot be known from outside).
//   - A user's own preferences (Policy.Preferences) bind from when they were
//     applied: no allowed send beyond a limit or of an opted-out channel or
//     tag; and while a VIP exemption holds, the rules' caps neither bind the
//     user's sends nor cap or hold any of them (a capped output or a hold
//     naming a rules cap is a violation).
func Check(sent []Sent, outs []Output, p Policy, now time.Time) Result {
	c := newChecker(sent, p)
	if len(sent) == 0 { // a verifier never passes on nothing
		c.r.Violations++
		c.r.problem("the manifest lists no jobs: nothing was judged (did capper loadgen send any, to this config's input topic?)")
		return c.r
	}
	if len(outs) == 0 {
		c.r.problem("no message was read from the output topics: is a worker running with this config (its topics, its group)?")
	}
	j, err := newJudge(p.Rules)
	if err != nil {
		c.r.Violations++
		c.r.problem("the rules cannot be read: %v", err)
		return c.r
	}
	c.j = j
	for i := range outs {
		c.r.tally(&outs[i])
		c.timing(&outs[i])
		c.account(&outs[i])
	}
	c.unaccounted(now)
	c.arbitrations()
	c.caps()
	c.budgets()
	c.finish()
	return c.r
}

// checker is one Check in progress.
type checker struct {
	r           Result
	p           Policy
	j           *judge
	sent        []Sent
	seq         map[string]int32                 // message id -> index in sent
	seen        []bool                           // by index in sent: the message reached a topic
	jobRoles    map[string]roleSet               // job id -> the final topics it reached
	allowed     map[uint32]map[string]sentSend   // user -> job id -> its first allowed output
	heldDue     map[string]time.Time             // job id -> the latest due time of its holds
	windows     map[uint32]map[time.Time][]*Sent // user -> arbitration window's end -> its candidates
	arbitrated  map[string]string                // job id -> won or lost, from its final output
	lat         []float64
	releaseLag  []float64
	first, last time.Time
	produced    time.Time // the newest produce stamp: when the demand ended
}

type sentSend struct {
	t    time.Time
	sent *Sent
	seq  int // its place in the manifest: a user's jobs share a partition, so the worker decides them in this order
}

func newChecker(sent []Sent, p Policy) *checker {
	c := &checker{
		r: Result{Jobs: len(sent), ByCap: map[string]int{}, BySegment: map[string]map[string]int{}},
		p: p, sent: sent, seq: make(map[string]int32, len(sent)), seen: make([]bool, len(sent)),
		jobRoles: make(map[string]roleSet, len(sent)), allowed: map[uint32]map[string]sentSend{}, heldDue: map[string]time.Time{},
		windows: map[uint32]map[time.Time][]*Sent{}, arbitrated: map[string]string{},
	}
	for i := range sent {
		c.seq[sent[i].ID] = int32(i)
	}
	return c
}

// roleSet is the set of final topics a job reached (a bit per role): ten
// million jobs fit in a map of bytes, where a map of roles per job took
// gigabytes.
type roleSet uint8

var finalRoles = [...]string{RoleAllowed, RoleCapped, RoleDLQ}

func (s roleSet) with(role string) roleSet {
	for i, r := range finalRoles {
		if r == role {
			return s | 1<<i
		}
	}
	return s
}

// roles lists the set's roles.
func (s roleSet) roles() []string {
	var out []string
	for i, r := range finalRoles {
		if s&(1<<i) != 0 {
			out = append(out, r)
		}
	}
	return out
}

// tally counts o by decision, cap and segment.
func (r *Result) tally(o *Output) {
	switch o.Decision {
	case output.DecisionAllowed:
		r.Allowed++
	case output.DecisionDuplicate:
		r.Duplicates++
	case output.DecisionExempt:
		r.Exempt++
	case output.DecisionUnchecked:
		r.Unchecked++
	case output.DecisionCapped:
		r.Capped++
		r.ByCap[o.Cap]++
	case output.DecisionDLQ:
		r.DLQ++
	case output.DecisionHeld:
		r.Held++
	}
	switch o.Arbitration {
	case consumer.ArbitrationWon:
		r.ArbitrationsWon++
	case consumer.ArbitrationLost:
		r.ArbitrationsLost++
	}
	if o.HoldCount > 0 && o.Role != RoleHeld {
		r.Released++
	}
	if o.Segment != "" {
		if r.BySegment[o.Segment] == nil {
			r.BySegment[o.Segment] = map[string]int{}
		}
		r.BySegment[o.Segment][o.Decision]++
	}
}

// timing records o's latency and the span of the run: a held record and a
// released job's output are not latency, they measure the hold.
func (c *checker) timing(o *Output) {
	if !o.ProducedAt.IsZero() && o.HoldCount == 0 {
		c.lat = append(c.lat, float64(o.Time.Sub(o.ProducedAt).Microseconds())/1000)
		if c.first.IsZero() || o.ProducedAt.Before(c.first) {
			c.first = o.ProducedAt
		}
	}
	if o.Time.After(c.last) {
		c.last = o.Time
	}
	if o.ProducedAt.After(c.produced) {
		c.produced = o.ProducedAt
	}
}

// account records where o's message and job went, and the counted sends.
func (c *checker) account(o *Output) {
	i, ok := c.seq[o.ID]
	if !ok {
		return // not part of this blast
	}
	s := &c.sent[i]
	c.seen[i] = true
	// While a user is VIP, the rules' caps do not apply: none may cap or hold a job of theirs (the user's
	// own preferences, budgets and quiet hours still may).
	vip := c.vipAt(s.UserID, o.at())
	if vip && (o.Role == RoleAllowed || o.Role == RoleCapped) {
		c.r.VIPJudged++
	}
	if (o.Role == RoleCapped || o.Role == RoleHeld) && c.j.ruleCaps[o.Cap] && vip {
		c.r.Violations++
		c.r.problem("user %d: job %s %s by the rules' cap %q at %s, while the user was VIP", s.UserID, s.JobID, o.Role, o.Cap, o.at().Format(time.RFC3339Nano))
	}
	if o.Role == RoleHeld {
		if s.Kind == KindMalformed {
			c.r.Violations++
			c.r.problem("malformed message %s was held", o.ID)
		}
		if o.DueAt.After(c.heldDue[s.JobID]) {
			c.heldDue[s.JobID] = o.DueAt
		}
		if o.Arbitration == consumer.ArbitrationCandidate {
			w := c.windows[s.UserID]
			if w == nil {
				w = map[time.Time][]*Sent{}
				c.windows[s.UserID] = w
			}
			if !slices.ContainsFunc(w[o.DueAt], func(x *Sent) bool { return x.JobID == s.JobID }) {
				w[o.DueAt] = append(w[o.DueAt], s)
			}
		}
		return
	}
	if o.Arbitration == consumer.ArbitrationWon || o.Arbitration == consumer.ArbitrationLost {
		if _, ok := c.arbitrated[s.JobID]; !ok {
			c.arbitrated[s.JobID] = o.Arbitration
		}
	}
	if o.HoldCount > 0 && o.Decision != output.DecisionDuplicate { // a duplicate's time is its first decision's
		lag := o.at().Sub(o.DueAt)
		c.releaseLag = append(c.releaseLag, float64(lag.Microseconds())/1000)
		if lag < 0 {
			c.r.Violations++
			c.r.problem("job %q released at %s, %v before its due time", s.JobID, o.at().Format(time.RFC3339Nano), -lag)
		}
	}
	if s.Kind == KindMalformed {
		if o.Role != RoleDLQ {
			c.r.Violations++
			c.r.problem("malformed message %s reached %s", o.ID, o.Role)
		}
		return
	}
	c.jobRoles[s.JobID] = c.jobRoles[s.JobID].with(o.Role)
	if o.Role == RoleAllowed && o.Decision != output.DecisionDuplicate && !s.ExpiresAt.IsZero() && !o.at().Before(s.ExpiresAt) {
		c.r.Violations++
		c.r.problem("job %q allowed at %s, at or after its expires_at %s", s.JobID, o.at().Format(time.RFC3339Nano), s.ExpiresAt.Format(time.RFC3339Nano))
	}
	if o.Role != RoleAllowed || o.Decision == output.DecisionUnchecked || c.j.exempt[category(s)] {
		return
	}
	if c.allowed[s.UserID] == nil {
		c.allowed[s.UserID] = map[string]sentSend{}
	}
	if prev, ok := c.allowed[s.UserID][s.JobID]; !ok || o.at().Before(prev.t) {
		c.allowed[s.UserID][s.JobID] = sentSend{t: o.at(), sent: s, seq: int(i)}
	}
}

// unaccounted counts the messages that reached no topic, the jobs that
// reached several, and the held jobs never released though due; it counts
// the held jobs due later as pending.
func (c *checker) unaccounted(now time.Time) {
	for job, due := range c.heldDue {
		if c.jobRoles[job] != 0 {
			continue
		}
		if due.After(now.Add(-ReleaseGrace)) {
			c.r.Pending++
			continue
		}
		c.r.Unaccounted++
		c.r.problem("job %q was held until %s and never released", job, due.Format(time.RFC3339Nano))
	}
	for i, s := range c.sent {
		if !c.seen[i] {
			c.r.Unaccounted++
			c.r.problem("message %s (job %q, user %d, %s) reached no output topic", s.ID, s.JobID, s.UserID, s.Kind)
		}
	}
	for job, set := range c.jobRoles {
		if roles := set.roles(); len(roles) > 1 {
			c.r.Unaccounted++
			c.r.problem("job %q reached %d output topics: %v", job, len(roles), roles)
		}
	}
}

// caps checks every allowed send against the caps that applied to it.
func (c *checker) caps() {
	users := make([]uint32, 0, len(c.allowed))
	for u := range c.allowed {
		users = append(users, u)
	}
	sort.Slice(users, func(i, j int) bool { return users[i] < users[j] })
	for _, u := range users {
		sends := make([]sentSend, 0, len(c.allowed[u]))
		for _, s := range c.allowed[u] {
			sends = append(sends, s)
		}
		sort.Slice(sends, func(i, j int) bool { // outputs of one batch share a millisecond
			if !sends[i].t.Equal(sends[j].t) {
				return sends[i].t.Before(sends[j].t)
			}
			return sends[i].seq < sends[j].seq
		})
		c.preferences(u, sends)
		segment, inSegment := c.p.Segment(u)
		caps := c.j.caps(segment, inSegment)
		violated := map[string]bool{}
		for i, s := range sends {
			if c.j.countOnly[category(s.sent)] || c.mayBeVIPAt(u, s.t) {
				continue
			}
			zone := c.j.zoneOf(s.sent)
			priority := c.j.priority(s.sent)
			for k := range caps {
				cp := &caps[k]
				if cp.shadow || violated[cp.name] || !cp.scope.matches(s.sent, s.sent) {
					continue
				}
				since := c.j.since(cp, s.t, zone)
				before := 0
				for j := 0; j < i; j++ {
					if back, ok := c.p.GivenBack[sends[j].sent.JobID]; ok && !s.t.Before(back) {
						continue // its slot was given back by then
					}
					if !sends[j].t.Before(since) && cp.scope.matches(sends[j].sent, s.sent) {
						before++
					}
				}
				if limit := cp.limitFor(priority); before >= limit {
					violated[cp.name] = true
					c.r.Violations++
					if limit < cp.limit {
						c.r.problem("user %d: send %s of priority %d at %s used a slot of cap %q reserved for priority %d and above (%d earlier sends; %d of %d are for any send)",
							u, s.sent.JobID, priority, s.t.Format(time.RFC3339Nano), cp.name, cp.minPriority, before, limit, cp.limit)
					} else {
						c.r.problem("user %d: send %s at %s had %d earlier sends in the window of cap %q, which allows %d",
							u, s.sent.JobID, s.t.Format(time.RFC3339Nano), before, cp.name, cp.limit)
					}
				}
			}
		}
	}
}

// preferences checks a user's allowed sends against its own preferences:
// after a preference was applied, no send of its channel or tag beyond its
// limit in its window (none when opted out). Preferences do not bind a
// count-only send (recorded without a check), nor an exempt one.
func (c *checker) preferences(u uint32, sends []sentSend) {
	for _, p := range c.p.Preferences[u] {
		if !p.VIPUntil.IsZero() {
			continue // an exemption: see caps and account
		}
		match := func(s *Sent) bool {
			if p.Channel != "" {
				return s.Channel == p.Channel
			}
			return category(s) == p.Tag || slices.Contains(s.Tags, p.Tag)
		}
		for i, s := range sends {
			if s.t.Before(p.From) || !match(s.sent) || c.j.countOnly[category(s.sent)] {
				continue
			}
			before := 0
			for j := 0; j < i; j++ {
				if back, ok := c.p.GivenBack[sends[j].sent.JobID]; ok && !s.t.Before(back) {
					continue
				}
				if sends[j].t.After(s.t.Add(-p.Window)) && match(sends[j].sent) {
					before++
				}
			}
			if before >= p.Limit {
				c.r.Violations++
				c.r.problem("user %d: send %s at %s went beyond the user's own preference %+v (%d earlier sends of it in its window)",
					u, s.sent.JobID, s.t.Format(time.RFC3339Nano), p, before)
				break
			}
		}
	}
}

// vipAt reports whether a VIP exemption of user u holds at t.
func (c *checker) vipAt(u uint32, t time.Time) bool {
	for i := range c.p.Preferences[u] {
		if c.p.Preferences[u][i].vipAt(t) {
			return true
		}
	}
	return false
}

// mayBeVIPAt reports whether a VIP exemption of user u may have held at t
// (see Pref.mayBeVIPAt): such a send is not held to the rules' caps.
func (c *checker) mayBeVIPAt(u uint32, t time.Time) bool {
	for i := range c.p.Preferences[u] {
		if c.p.Preferences[u][i].mayBeVIPAt(t) {
			return true
		}
	}
	return false
}

// arbitrations checks every arbitration window of a cap's last slot: no
// candidate won while one of higher priority (by the report's own reading
// of the rules) of the same window lost.
func (c *checker) arbitrations() {
	for u, ws := range c.windows {
		for end, cands := range ws {
			for _, w := range cands {
				if c.arbitrated[w.JobID] != consumer.ArbitrationWon {
					continue
				}
				for _, l := range cands {
					if c.arbitrated[l.JobID] == consumer.ArbitrationLost && c.j.priority(l) > c.j.priority(w) {
						c.r.Violations++
						c.r.problem("user %d: in the arbitration window ending %s, job %q of priority %d won the last slot while job %q of priority %d lost",
							u, end.Format(time.RFC3339Nano), w.JobID, c.j.priority(w), l.JobID, c.j.priority(l))
					}
				}
			}
		}
	}
}

// budgets checks every budget: in any window, at most its limit plus a
// fortieth of it (the documented bound by decision time) of the allowed
// sends in its scope.
func (c *checker) budgets() {
	byKey := map[string][]time.Time{}
	limits, spec := map[string]int{}, map[string]int{}
	windows := map[string]time.Duration{}
	for _, sends := range c.allowed {
		for _, s := range sends {
			for _, b := range c.j.budgets {
				if !b.scope.matches(s.sent, nil) {
					continue
				}
				key := b.name
				if b.scope.perCampaign {
					key += ":" + s.sent.Campaign
				}
				byKey[key] = append(byKey[key], s.t)
				limits[key] = b.limit + b.limit/40 // the documented bound by decision time (docs/design.md, Budgets)
				spec[key] = b.limit
				windows[key] = b.window
			}
		}
	}
	keys := make([]string, 0, len(byKey))
	for key := range byKey {
		keys = append(keys, key)
	}
	sort.Strings(keys)
	for _, key := range keys {
		ts := byKey[key]
		sort.Slice(ts, func(i, j int) bool { return ts[i].Before(ts[j]) })
		d := BudgetDelivery{Budget: key, Limit: spec[key], Window: windows[key]}
		reported := false
		for i, j := 0, 0; i < len(ts); i++ {
			for j < len(ts) && ts[j].Sub(ts[i]) < windows[key] {
				j++
			}
			d.MaxAny = max(d.MaxAny, j-i)
			if j-i > limits[key] && !reported {
				c.r.Violations++
				c.r.problem("budget %s: %d sends in the %v from %s, at most %d", key, j-i, windows[key], ts[i].Format(time.RFC3339Nano), limits[key])
				reported = true
			}
		}
		per := make([]int, int(ts[len(ts)-1].Sub(ts[0])/windows[key])+1)
		for _, t := range ts {
			per[int(t.Sub(ts[0])/windows[key])]++
		}
		// Whole windows while the demand lasts: after the first, ending by the
		// last produce (without produce stamps, before the last window).
		end := len(per) - 1
		if !c.produced.IsZero() {
			end = min(end, int(c.produced.Sub(ts[0])/windows[key]))
		}
		if end > 1 {
			d.Whole = per[1:end]
		}
		c.r.Budgets = append(c.r.Budgets, d)
	}
}

// finish computes throughput and latency percentiles.
func (c *checker) finish() {
	if d := c.last.Sub(c.first); d > 0 {
		c.r.JobsPerSec = float64(len(c.sent)) / d.Seconds()
	}
	sort.Float64s(c.lat)
	c.r.P50ms, c.r.P99ms = percentile(c.lat, 0.50), percentile(c.lat, 0.99)
	sort.Float64s(c.releaseLag)
	c.r.ReleaseP50ms, c.r.ReleaseP99ms = percentile(c.releaseLag, 0.50), percentile(c.releaseLag, 0.99)
}

// percentile is the nearest-rank percentile of sorted values.
func percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(math.Ceil(p * float64(len(sorted))))
	return sorted[min(len(sorted), max(rank, 1))-1]
}

// ReadConfig says what ReadOutputs reads and when it stops.
type ReadConfig struct {
	Dialer  *kafka.Dialer     // TLS and SASL; nil for plain connections
	Brokers []string          // (Required)
	Topics  map[string]string // role (RoleAllowed, RoleCapped, RoleDLQ, RoleHeld) -> topic (Required)
	Want    map[string]bool   // message ids to wait for
	Idle    time.Duration     // stop when nothing new arrived for this long
	// HoldWait: a held message due within this is waited for (until its due
	// time plus ReleaseGrace); one due later is not. Defaults to 1m.
	HoldWait time.Duration
	// Progress, when set, is called now and then with the count read so far.
	Progress func(read int)
}

// ReadOutputs reads the output topics from their beginning with a fresh
// consumer group, until every id in c.Want has a final output (or is held
// until after c.HoldWait), nothing new arrived for c.Idle while no held
// message is due soon, or ctx ends.
func ReadOutputs(ctx context.Context, c ReadConfig) ([]Output, error) {
	dialer, brokers, topics, want, idle, progress := c.Dialer, c.Brokers, c.Topics, c.Want, c.Idle, c.Progress
	holdWait := cmp.Or(c.HoldWait, time.Minute)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var mu sync.Mutex
	outs := make([]Output, 0, len(want)) // a final output per id at least: no regrowth of a 10M-output slice
	seen := map[string]bool{}            // ids with a final output
	held := map[string]time.Time{}       // ids of want held (latest due) without a final output yet
	found := 0                           // ids of want with a final output
	lastNew := time.Now()
	roles := map[string]string{} // topic -> role
	var names []string
	for role, topic := range topics {
		roles[topic] = role
		names = append(names, topic)
	}
	errs := make(chan error, 1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		in := map[string]interner{} // per topic: its reader's goroutine's own
		for _, t := range names {
			in[t] = interner{}
		}
		err := output.Read(ctx, output.ReadConfig{Brokers: brokers, Dialer: dialer, Topics: names,
			Group: fmt.Sprintf("capper-report-%d", time.Now().UnixNano())}, func(m *output.Message) error {
			role := roles[m.Topic]
			o, err := parseOutput(role, m, in[m.Topic])
			if err != nil {
				return err
			}
			mu.Lock()
			defer mu.Unlock()
			outs = append(outs, o)
			switch {
			case role == RoleHeld:
				lastNew = time.Now()
				if want[o.ID] && !seen[o.ID] && o.DueAt.After(held[o.ID]) {
					held[o.ID] = o.DueAt
				}
			case !seen[o.ID]:
				seen[o.ID] = true
				lastNew = time.Now()
				delete(held, o.ID)
				if want[o.ID] {
					found++
				}
			}
			return nil
		})
		if err != nil {
			errs <- err
		}
	}()
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	lastProgress := time.Now()
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case err := <-errs:
			cancel()
			wg.Wait()
			return nil, err
		case <-tick.C:
			mu.Lock()
			now := time.Now()
			done, n, quiet := found, len(outs), now.Sub(lastNew)
			soon := 0 // held messages due within holdWait, or due and not yet past the grace
			for _, due := range held {
				if due.After(now.Add(holdWait)) {
					done++
				} else if due.After(now.Add(-ReleaseGrace)) {
					soon++
				}
			}
			mu.Unlock()
			if progress != nil && time.Since(lastProgress) >= 2*time.Second {
				progress(n)
				lastProgress = time.Now()
			}
			if done == len(want) || (quiet > idle && soon == 0) {
				break loop
			}
		}
	}
	cancel()
	wg.Wait()
	return outs, nil
}

// interner keeps one copy of each of the few values a field takes across
// millions of outputs or manifest lines (a decision, segment, cap, reason,
// channel, campaign, time zone). What it returns never points into s's
// buffer (a manifest line).
type interner map[string]string

func (in interner) get(s string) string {
	if v, ok := in[s]; ok {
		return v
	}
	c := strings.Clone(s)
	if len(in) < 10000 { // the values are a handful; never let a surprise grow it without bound
		in[c] = c
	}
	return c
}

func parseOutput(role string, m *output.Message, in interner) (Output, error) {
	o := Output{Role: role, Time: m.Time, Output: m.Output}
	for _, h := range m.Headers {
		switch h.Key {
		case HeaderID:
			o.ID = string(h.Value)
		case HeaderProducedAt:
			if ms, err := strconv.ParseInt(string(h.Value), 10, 64); err == nil {
				o.ProducedAt = time.UnixMilli(ms)
			}
		}
	}
	if m.Err != nil {
		return o, fmt.Errorf("report: %s partition %d offset %d (loadgen id %q): %w", m.Topic, m.Partition, m.Offset, o.ID, m.Err)
	}
	o.Decision, o.Segment, o.Cap, o.Reason, o.Arbitration = in.get(o.Decision), in.get(o.Segment), in.get(o.Cap), in.get(o.Reason), in.get(o.Arbitration)
	return o, nil
}
