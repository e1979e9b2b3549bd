package loadtest

import (
	"cmp"
	"math"
	"slices"
	"sort"
	"time"

	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/output"
)

// Check compares the outputs with what was sent and with the caps: a Checker
// given every output of outs.
func Check(sent []Sent, outs []Output, p Policy, now time.Time) Result {
	c := NewChecker(NewManifest(sent), p)
	for i := range outs {
		c.Add(&outs[i])
	}
	return c.Result(now)
}

// Checker judges a blast's outputs one at a time (Add), then gives its
// verdict (Result). It keeps a few bytes per produced message, never the
// outputs: ten million jobs are judged in a few hundred megabytes.
//
//   - Every produced message (by HeaderID) must reach an output topic, and every
//     job id must reach exactly one of allowed, capped and dead-letter;
//     otherwise it is unaccounted. A job that was held (a record on the held
//     topic) and has no final output yet is pending while its due time is
//     later than now minus ReleaseGrace, else unaccounted (its release was lost).
//   - A released job must not be decided before its due time; an allowed job
//     not at or after its expires_at. Release lag is decided-at minus due.
//     Only a budget's hold may end before the due time its held record gave
//     (a token came free early: the final output's due time is its release).
//   - No budget gets more allowed sends of its scope in any window than its
//     limit plus a fortieth, rounded down, by decision time (a send recorded
//     after another replica's later entry in its user's log takes that
//     entry's time, which can fall after its token's bucket).
//   - Malformed messages must be dead-lettered; anything else there is a violation.
//   - A manifest without jobs is a violation: a verifier never passes on nothing.
//   - Every allowed send of a user (by unique job id; not exempt, not count-only,
//     not unchecked) must have been within every cap of the user's rules that
//     applies to it: fewer sends of the cap's scope than its limit before it in
//     its window (rolling, the calendar period in the job's time zone, or for a
//     lifetime cap the whole run).
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
//   - Of a user's sends with one collapse key, none goes after a newer one
//     was decided (a second's slack); a collapsed send names a newer send of
//     its key, or one sent within the collapse window before it; with a
//     window, no send goes within it after another of its key went, unless
//     the two were decided at once (collapse.go).
type Checker struct {
	r    Result
	p    Policy
	j    *judge
	err  error // the rules cannot be read
	m    *Manifest
	outs int
	// By line of the manifest:
	seen []bool // the message reached a topic
	// By job (its first line):
	roles      []roleSet // the final topics it reached
	allowedAt  []int64   // decision time (ns since the epoch) of its first allowed output; 0: none
	allowedBy  []uint32  // the line of that output's message
	heldDue    map[uint32]time.Time
	holds      map[holdKey]heldRec // by job and hold count: the earliest due time of those held records
	releasedAt map[uint32]released // of the jobs held: the due time and hold count their final output gives
	heldCapped []heldCap           // capped outputs of held jobs, with budgets (BudgetDelivery.HeldCapped)
	arbitrated map[uint32]string   // won or lost, from its final output
	// Arbitration candidates: user -> arbitration window's end -> their lines.
	windows     map[uint32]map[time.Time][]uint32
	lat         []int32 // µs from produce to output, of the jobs not held
	releaseLag  []float64
	first, last time.Time
	produced    time.Time // the newest produce stamp: when the demand ended
	// Sends with a collapse key, by job (collapse.go).
	keyed map[uint32]*keyedJob
	in    interner
}

// NewChecker starts judging the blast of m by the policy p.
func NewChecker(m *Manifest, p Policy) *Checker {
	n := m.Len()
	c := &Checker{
		r: Result{Jobs: n, ByCap: map[string]int{}, BySegment: map[string]map[string]int{}},
		p: p, m: m, seen: make([]bool, n), roles: make([]roleSet, n), allowedAt: make([]int64, n), allowedBy: make([]uint32, n),
		lat: make([]int32, 0, n), heldDue: map[uint32]time.Time{}, holds: map[holdKey]heldRec{}, releasedAt: map[uint32]released{}, windows: map[uint32]map[time.Time][]uint32{}, arbitrated: map[uint32]string{},
		in: interner{},
	}
	c.j, c.err = newJudge(p.Rules)
	return c
}

// Add judges one output. It keeps nothing of o.
func (c *Checker) Add(o *Output) {
	c.outs++
	if c.j == nil {
		return
	}
	if _, ok := c.m.Index(o.ID); !ok { // another blast's (another workspace's, on the same topics)
		c.r.Foreign++
		return
	}
	c.r.tally(o)
	c.timing(o)
	c.account(o)
	c.collapse(o)
}

// Result is the verdict on the outputs added so far, now.
func (c *Checker) Result(now time.Time) Result {
	if c.m.Len() == 0 { // a verifier never passes on nothing
		c.r.Violations++
		c.r.problem("the manifest lists no jobs: nothing was judged (did capper loadgen send any, to this config's input topic?)")
		return c.r
	}
	if c.outs == 0 {
		c.r.problem("no message was read from the output topics: is a worker running with this config (its topics, its group)?")
	}
	if c.err != nil {
		c.r.Violations++
		c.r.problem("the rules cannot be read: %v", c.err)
		return c.r
	}
	c.unaccounted(now)
	c.earlyReleases()
	c.arbitrations()
	c.collapses()
	sends := c.allowedSends()
	c.caps(sends)
	c.budgets(sends)
	c.finish()
	return c.r
}

// roleSet is the set of final topics a job reached (a bit per role).
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
func (c *Checker) timing(o *Output) {
	if !o.ProducedAt.IsZero() && o.HoldCount == 0 {
		us := o.Time.Sub(o.ProducedAt).Microseconds()
		c.lat = append(c.lat, int32(max(math.MinInt32, min(math.MaxInt32, us))))
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
func (c *Checker) account(o *Output) {
	i, ok := c.m.Index(o.ID)
	if !ok {
		return // not part of this blast
	}
	s, user, job := c.m.attrsOf(i), c.m.user(i), c.m.job(i)
	c.seen[i] = true
	// While a user is VIP, the rules' caps do not apply: none may cap or hold a job of theirs (the user's
	// own preferences, budgets and quiet hours still may).
	vip := c.vipAt(user, o.at())
	if vip && (o.Role == RoleAllowed || o.Role == RoleCapped) {
		c.r.VIPJudged++
	}
	if (o.Role == RoleCapped || o.Role == RoleHeld) && c.j.ruleCaps[o.Cap] && vip {
		c.r.Violations++
		c.r.problem("user %d: job %s %s by the rules' cap %q at %s, while the user was VIP", user, c.m.JobID(i), o.Role, o.Cap, o.at().Format(time.RFC3339Nano))
	}
	if o.Role == RoleHeld {
		c.held(o, i)
		return
	}
	if o.Arbitration == consumer.ArbitrationWon || o.Arbitration == consumer.ArbitrationLost {
		if _, ok := c.arbitrated[uint32(job)]; !ok {
			c.arbitrated[uint32(job)] = o.Arbitration
		}
	}
	if o.HoldCount > 0 && o.Decision != output.DecisionDuplicate { // a duplicate's time is its first decision's
		if _, ok := c.releasedAt[uint32(job)]; !ok {
			c.releasedAt[uint32(job)] = released{o.DueAt, o.HoldCount}
		}
		lag := o.at().Sub(o.DueAt)
		c.releaseLag = append(c.releaseLag, float64(lag.Microseconds())/1000)
		if lag < 0 {
			c.r.Violations++
			c.r.problem("job %q released at %s, %v before its due time", c.m.JobID(i), o.at().Format(time.RFC3339Nano), -lag)
		}
	}
	if s.Kind == KindMalformed {
		if o.Role != RoleDLQ {
			c.r.Violations++
			c.r.problem("malformed message %s reached %s", o.ID, o.Role)
		}
		return
	}
	c.roles[job] = c.roles[job].with(o.Role)
	if o.Role == RoleCapped && o.HoldCount > 0 && len(c.j.budgets) > 0 {
		c.heldCapped = append(c.heldCapped, heldCap{uint32(i), o.at().UnixNano(), c.in.get(cmp.Or(o.Reason, o.Cap))})
	}
	if o.Role == RoleAllowed && o.Decision != output.DecisionDuplicate && !s.ExpiresAt.IsZero() && !o.at().Before(s.ExpiresAt) {
		c.r.Violations++
		c.r.problem("job %q allowed at %s, at or after its expires_at %s", c.m.JobID(i), o.at().Format(time.RFC3339Nano), s.ExpiresAt.Format(time.RFC3339Nano))
	}
	if o.Role != RoleAllowed || o.Decision == output.DecisionUnchecked || c.j.exempt[category(s)] {
		return
	}
	if t := o.at().UnixNano(); c.allowedAt[job] == 0 || t < c.allowedAt[job] {
		c.allowedAt[job], c.allowedBy[job] = t, uint32(i)
	}
}

// held records a hold of line i's job: its latest due time, and its
// arbitration window when it is a candidate for a cap's last slot.
func (c *Checker) held(o *Output, i int) {
	s, job := c.m.attrsOf(i), uint32(c.m.job(i))
	if s.Kind == KindMalformed {
		c.r.Violations++
		c.r.problem("malformed message %s was held", o.ID)
	}
	if o.DueAt.After(c.heldDue[job]) {
		c.heldDue[job] = o.DueAt
	}
	// A copy of the job (a redelivery decided again) may have been held again with the same count.
	if k := (holdKey{job, o.HoldCount}); c.holds[k].due.IsZero() || o.DueAt.Before(c.holds[k].due) {
		c.holds[k] = heldRec{o.DueAt, c.in.get(o.Cap)}
	}
	if o.Arbitration != consumer.ArbitrationCandidate {
		return
	}
	user := c.m.user(i)
	w := c.windows[user]
	if w == nil {
		w = map[time.Time][]uint32{}
		c.windows[user] = w
	}
	if !slices.ContainsFunc(w[o.DueAt], func(x uint32) bool { return c.m.job(int(x)) == int(job) }) {
		w[o.DueAt] = append(w[o.DueAt], uint32(i))
	}
}

type holdKey struct {
	job   uint32
	count int
}

type heldRec struct {
	due time.Time
	by  string // the cap, budget or quiet_hours that held it
}

type released struct {
	due   time.Time
	count int
}

// earlyReleases counts the held jobs released before the due time of their
// last hold's held record (the one of their final output's hold count): a
// budget's hold, released when a token came free; a violation for any other
// hold (quiet hours, a cap's retry time).
func (c *Checker) earlyReleases() {
	budgets := map[string]bool{}
	for _, b := range c.j.budgets {
		budgets[b.held] = true
	}
	for job, r := range c.releasedAt {
		h, held := c.holds[holdKey{job, r.count}]
		if !held || !r.due.Before(h.due) {
			continue
		}
		if !budgets[h.by] {
			c.r.Violations++
			c.r.problem("job %q released before the due time of its hold by %q (%s): only a budget's hold ends early", c.m.JobID(int(job)),
				h.by, h.due.Format(time.RFC3339Nano))
			continue
		}
		c.r.EarlyReleases++
	}
}

// unaccounted counts the messages that reached no topic, the jobs that
// reached several, and the held jobs never released though due; it counts
// the held jobs due later as pending.
func (c *Checker) unaccounted(now time.Time) {
	for job, due := range c.heldDue {
		if c.roles[job] != 0 {
			continue
		}
		if due.After(now.Add(-ReleaseGrace)) {
			c.r.Pending++
			continue
		}
		c.r.Unaccounted++
		c.r.problem("job %q was held until %s and never released", c.m.JobID(int(job)), due.Format(time.RFC3339Nano))
	}
	for i, seen := range c.seen {
		if !seen {
			s := c.m.Sent(i)
			c.r.Unaccounted++
			c.r.problem("message %s (job %q, user %d, %s) reached no output topic", s.ID, s.JobID, s.UserID, s.Kind)
		}
	}
	for job, set := range c.roles {
		if roles := set.roles(); len(roles) > 1 {
			c.r.Unaccounted++
			c.r.problem("job %q reached %d output topics: %v", c.m.JobID(job), len(roles), roles)
		}
	}
}

// sentSend is a counted send: a job's first allowed output.
type sentSend struct {
	t    time.Time
	line int   // the line of the output's message: a user's jobs share a partition, so the worker decides them in this order
	s    *Sent // its fields (attrsOf)
	// back is when its delivery failed (Policy.GivenBack): from then on it no longer counts.
	back    time.Time
	hasBack bool
}

// allowedSends lists the counted sends, by user, then by time, then by line
// (outputs of one batch share a millisecond).
func (c *Checker) allowedSends() []uint32 {
	var jobs []uint32
	for job, t := range c.allowedAt {
		if t != 0 {
			jobs = append(jobs, uint32(job))
		}
	}
	slices.SortFunc(jobs, func(a, b uint32) int {
		la, lb := c.allowedBy[a], c.allowedBy[b]
		if ua, ub := c.m.user(int(la)), c.m.user(int(lb)); ua != ub {
			return cmp.Compare(ua, ub)
		}
		if c.allowedAt[a] != c.allowedAt[b] {
			return cmp.Compare(c.allowedAt[a], c.allowedAt[b])
		}
		return cmp.Compare(la, lb)
	})
	return jobs
}

// send is job's counted send.
func (c *Checker) send(job uint32) sentSend {
	line := int(c.allowedBy[job])
	s := sentSend{t: time.Unix(0, c.allowedAt[job]), line: line, s: c.m.attrsOf(line)}
	if len(c.p.GivenBack) > 0 {
		s.back, s.hasBack = c.p.GivenBack[c.m.JobID(line)]
	}
	return s
}

// caps checks every allowed send against the caps that applied to it.
func (c *Checker) caps(jobs []uint32) {
	var sends []sentSend
	for start := 0; start < len(jobs); {
		u := c.m.user(int(c.allowedBy[jobs[start]]))
		sends = sends[:0]
		end := start
		for ; end < len(jobs) && c.m.user(int(c.allowedBy[jobs[end]])) == u; end++ {
			sends = append(sends, c.send(jobs[end]))
		}
		start = end
		c.preferences(u, sends)
		c.userCaps(u, sends)
	}
}

// userCaps checks user u's counted sends, in order, against the caps of its
// segment.
func (c *Checker) userCaps(u uint32, sends []sentSend) {
	segment, inSegment := c.p.Segment(u)
	caps := c.j.caps(segment, inSegment)
	violated := map[string]bool{}
	for i, s := range sends {
		if c.j.countOnly[category(s.s)] || c.mayBeVIPAt(u, s.t) {
			continue
		}
		zone := c.j.zoneOf(s.s)
		priority := c.j.priority(s.s)
		for k := range caps {
			cp := &caps[k]
			if cp.shadow || violated[cp.name] || !cp.scope.matches(s.s, s.s) {
				continue
			}
			since := c.j.since(cp, s.t, zone)
			before := 0
			for j := 0; j < i; j++ {
				if sends[j].hasBack && !s.t.Before(sends[j].back) {
					continue // its slot was given back by then
				}
				if !sends[j].t.Before(since) && cp.scope.matches(sends[j].s, s.s) {
					before++
				}
			}
			if limit := cp.limitFor(priority); before >= limit {
				violated[cp.name] = true
				c.r.Violations++
				if limit < cp.limit {
					c.r.problem("user %d: send %s of priority %d at %s used a slot of cap %q reserved for priority %d and above (%d earlier sends; %d of %d are for any send)",
						u, c.m.JobID(s.line), priority, s.t.Format(time.RFC3339Nano), cp.name, cp.minPriority, before, limit, cp.limit)
				} else {
					c.r.problem("user %d: send %s at %s had %d earlier sends in the window of cap %q, which allows %d",
						u, c.m.JobID(s.line), s.t.Format(time.RFC3339Nano), before, cp.name, cp.limit)
				}
			}
		}
	}
}

// preferences checks a user's allowed sends against its own preferences:
// after a preference was applied, no send of its channel or tag beyond its
// limit in its window (none when opted out). Preferences do not bind a
// count-only send (recorded without a check), nor an exempt one.
func (c *Checker) preferences(u uint32, sends []sentSend) {
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
			if s.t.Before(p.From) || !match(s.s) || c.j.countOnly[category(s.s)] {
				continue
			}
			before := 0
			for j := 0; j < i; j++ {
				if sends[j].hasBack && !s.t.Before(sends[j].back) {
					continue
				}
				if sends[j].t.After(s.t.Add(-p.Window)) && match(sends[j].s) {
					before++
				}
			}
			if before >= p.Limit {
				c.r.Violations++
				c.r.problem("user %d: send %s at %s went beyond the user's own preference %+v (%d earlier sends of it in its window)",
					u, c.m.JobID(s.line), s.t.Format(time.RFC3339Nano), p, before)
				break
			}
		}
	}
}

// vipAt reports whether a VIP exemption of user u holds at t.
func (c *Checker) vipAt(u uint32, t time.Time) bool {
	for i := range c.p.Preferences[u] {
		if c.p.Preferences[u][i].vipAt(t) {
			return true
		}
	}
	return false
}

// mayBeVIPAt reports whether a VIP exemption of user u may have held at t
// (see Pref.mayBeVIPAt): such a send is not held to the rules' caps.
func (c *Checker) mayBeVIPAt(u uint32, t time.Time) bool {
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
func (c *Checker) arbitrations() {
	for u, ws := range c.windows {
		for end, cands := range ws {
			for _, w := range cands {
				if c.arbitrated[uint32(c.m.job(int(w)))] != consumer.ArbitrationWon {
					continue
				}
				pw := c.j.priority(c.m.attrsOf(int(w)))
				for _, l := range cands {
					if pl := c.j.priority(c.m.attrsOf(int(l))); c.arbitrated[uint32(c.m.job(int(l)))] == consumer.ArbitrationLost && pl > pw {
						c.r.Violations++
						c.r.problem("user %d: in the arbitration window ending %s, job %q of priority %d won the last slot while job %q of priority %d lost",
							u, end.Format(time.RFC3339Nano), c.m.JobID(int(w)), pw, c.m.JobID(int(l)), pl)
					}
				}
			}
		}
	}
}

// heldCap is a manifest line's capped output of a held job, decided at a
// time (ns since the epoch), and what capped it: its reason, else its cap.
type heldCap struct {
	line  uint32
	at    int64
	cause string
}

// budgetKeys calls f with the budget key of each budget whose scope s is in.
func (c *Checker) budgetKeys(s *Sent, f func(b *jbudget, key string)) {
	for k := range c.j.budgets {
		b := &c.j.budgets[k]
		if !b.scope.matches(s, nil) {
			continue
		}
		key := b.name
		if b.scope.perCampaign {
			key += ":" + s.Campaign
		}
		f(b, key)
	}
}

// budgets checks every budget: in any window, at most its limit plus a
// fortieth of it (the documented bound by decision time) of the allowed
// sends in its scope.
func (c *Checker) budgets(jobs []uint32) {
	if len(c.j.budgets) == 0 {
		return
	}
	heldCapped := map[string][]heldCap{}
	once := map[int]bool{} // a job's copies capped twice count once
	for _, h := range c.heldCapped {
		if job := c.m.job(int(h.line)); !once[job] {
			once[job] = true
			c.budgetKeys(c.m.attrsOf(int(h.line)), func(_ *jbudget, key string) { heldCapped[key] = append(heldCapped[key], h) })
		}
	}
	byKey := map[string][]int64{}
	lastHeld := map[string]int64{} // the last send of a job that was held: the demand waited until then
	limits, spec := map[string]int{}, map[string]int{}
	windows := map[string]time.Duration{}
	for _, job := range jobs {
		c.budgetKeys(c.m.attrsOf(int(c.allowedBy[job])), func(b *jbudget, key string) {
			byKey[key] = append(byKey[key], c.allowedAt[job])
			if _, held := c.heldDue[job]; held {
				lastHeld[key] = max(lastHeld[key], c.allowedAt[job])
			}
			limits[key] = b.limit + b.limit/40 // the documented bound by decision time (docs/design.md, Budgets)
			spec[key] = b.limit
			windows[key] = b.window
		})
	}
	keys := make([]string, 0, len(byKey))
	for key := range byKey {
		keys = append(keys, key)
	}
	sort.Strings(keys)
	for _, key := range keys {
		ts, window := byKey[key], int64(windows[key])
		slices.Sort(ts)
		d := BudgetDelivery{Budget: key, Limit: spec[key], Window: windows[key], First: ts[0]}
		reported := false
		for i, j := 0, 0; i < len(ts); i++ {
			for j < len(ts) && ts[j]-ts[i] < window {
				j++
			}
			d.MaxAny = max(d.MaxAny, j-i)
			if j-i > limits[key] && !reported {
				c.r.Violations++
				c.r.problem("budget %s: %d sends in the %v from %s, at most %d", key, j-i, windows[key], time.Unix(0, ts[i]).UTC().Format(time.RFC3339Nano), limits[key])
				reported = true
			}
		}
		per := make([]int, int((ts[len(ts)-1]-ts[0])/window)+1)
		for _, t := range ts {
			per[int((t-ts[0])/window)]++
		}
		// Whole windows while the demand lasts: after the first, ending by the
		// last produce or, when held jobs were still waiting after it (a
		// burst), by the window of the last of them sent (without produce
		// stamps, before the last window).
		end := len(per) - 1
		if !c.produced.IsZero() {
			end = min(end, int((max(c.produced.UnixNano(), lastHeld[key])-ts[0])/window))
		}
		if end > 1 {
			d.Whole = per[1:end]
			// What each could get: the limit, or the sends still to come at
			// its start when fewer (a burst's last windows).
			d.Demand = make([]int, end-1)
			rest := 0
			for i := len(per) - 1; i >= 1; i-- {
				rest += per[i]
				if i < end {
					d.Demand[i-1] = min(spec[key], rest)
				}
			}
			d.HeldCapped = make([]int, end-1)
			for _, h := range heldCapped[key] {
				if w := (h.at - ts[0]) / window; h.at >= ts[0] && w >= 1 && w < int64(end) {
					d.HeldCapped[w-1]++
					if d.HeldCappedBy == nil {
						d.HeldCappedBy = map[string]int{}
					}
					d.HeldCappedBy[h.cause]++
				}
			}
		}
		c.r.Budgets = append(c.r.Budgets, d)
	}
}

// finish computes throughput and latency percentiles.
func (c *Checker) finish() {
	if d := c.last.Sub(c.first); d > 0 {
		c.r.JobsPerSec = float64(c.m.Len()) / d.Seconds()
	}
	slices.Sort(c.lat) // µs
	c.r.P50ms, c.r.P99ms = float64(percentile(c.lat, 0.50))/1000, float64(percentile(c.lat, 0.99))/1000
	sort.Float64s(c.releaseLag)
	c.r.ReleaseP50ms, c.r.ReleaseP99ms = percentile(c.releaseLag, 0.50), percentile(c.releaseLag, 0.99)
}
