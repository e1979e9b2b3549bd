package consumer

// route: a job's outcome from its plan and what the budgets and Redis
// answered, as a pure function of its inputs and the clock reading it is given.

import (
	"cmp"
	"time"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/rules"
)

// Why a capped job was not held (HeaderReason), and the cap names of
// refusals that are not a cap's (HeaderCap).
const (
	ReasonNever      = "never"           // a limit of 0: no slot will come
	ReasonExpired    = "expired"         // its expires_at passed, or comes before its slot
	ReasonMaxHold    = "beyond max_hold" // its slot comes after submission + max_hold
	ReasonQuietHours = "quiet_hours"     // in quiet hours under the drop policy
	// ReasonRefusedBefore: another copy of the job (a redelivery, a resend)
	// was refused for good before; this one follows it (capping.Decision.RefusedBefore).
	ReasonRefusedBefore = "refused before"
	// ReasonArbitration is the hold reason of a candidate for a cap's last
	// slot, waiting for the end of its arbitration window.
	ReasonArbitration = "arbitration"
)

// What became of a send in an arbitration (HeaderArbitration).
const (
	ArbitrationCandidate = "candidate" // held until its window ends
	ArbitrationWon       = "won"       // allowed at the end of its window
	ArbitrationLost      = "lost"      // not allowed at the end of its window
)

// facts are what route looks at in a job besides its plan: its times, the
// hold state it arrived with, and what the budgets and Redis answered.
type facts struct {
	// malformed says why the job can never be decided (decode's finding);
	// truncate: its output keeps only the start of its value.
	malformed string
	truncate  bool
	expiresAt time.Time  // zero: never expires
	since     time.Time  // when it was submitted: max_hold counts from here
	arrived   hold.State // from a delay tier (Count 0: never held)
	// early: released before its wake time (hold.Early), to claim its
	// budget's token before its promise (arrived.Due) if claimsEarly
	early    bool
	collapse collapsed
	tokens   grant
	redis    answer
	mark     answer // to the look that marks it refused after the caps refused it for good (markRefusal)
}

// grant is what the budgets answered.
type grant struct {
	taken   bool      // the plan's tokens were asked for (or budgets are not enforced)
	short   string    // the budget that had no token for it; "": all granted
	retryAt time.Time // when a token of short is expected back
	until   time.Time // when the first of the tokens' buckets ends (budget.Grant.Until); zero: none held
	claimed bool      // a token is the one promised to the job when it was held (budget.Grant.Claimed)
	promise time.Time // the promise it claimed: its hold's due time
	copy    bool      // another copy of the job claimed its token (budget.Grant.Copy): short names the budget
	follow  bool      // its promised token was missing, the next is promised to it shortly: it moves on to it (followClaims)
	unkept  bool      // a token it was refused is not kept for it (budget.Grant.Promised): it cannot wait for it
}

// answer is what Redis answered to the job's request.
type answer struct {
	asked     bool
	dec       capping.Decision
	unchecked bool   // not asked in time: Redis has been failing beyond the plan's fail-open limit
	invalid   string // the request can never be decided (dead-letter), and why
}

// route is the outcome of a job at now, from its plan and what is known of
// it, and its next step while that is not enough (a Pending outcome's Ask).
// It is pure: the worker calls it after each step (plan, budget tokens,
// Redis) and acts on the answer. In order:
//   - malformed (decode's finding): dead-lettered;
//   - from a delay tier before its due time: moved to the tier that fits
//     what is left of its wait (no plan needed);
//   - exempt: forwarded (or capped, expired, when its expires_at has passed);
//   - expired, in quiet hours, short of a budget token: held until then if
//     its policy holds and the wait fits (never, expired, beyond max_hold
//     otherwise); else capped, after Redis said whether it is a redelivery
//     of a job that went (then a duplicate: one final topic per job);
//   - the budget tokens of its plan, then Redis: allowed, duplicate,
//     unchecked (fail-open), dead-letter (invalid), or capped and then held
//     or not by the strictest policy of the caps that refused it.
//
// A job that must not go is never forwarded unchecked: when Redis cannot say
// whether it is a redelivery, it is capped.
func route(p *rules.Plan, f *facts, wheel *hold.Wheel, now time.Time) Outcome {
	switch {
	case f.malformed != "":
		return Outcome{Kind: DeadLetter, Error: f.malformed, Truncate: f.truncate}
	case f.arrived.Due.After(now) && !claimsEarly(p, f): // from a delay tier, not due: on to the tier that fits what is left of its wait
		o := Outcome{Kind: Moved, Hold: f.arrived, DecidedAt: now}
		o.Tier, o.Hold.Wake = wheel.Route(now, f.arrived.Due)
		return o
	}
	o := routeOf(p, f, wheel, now)
	o.Priority, o.CollapseKey = p.Priority, p.Collapse.Key
	if f.arrived.Reason == ReasonArbitration && o.Kind != Pending && o.Arbitration == "" { // back from its window
		o.Arbitration = ArbitrationLost
		if o.Kind == Allowed || o.Kind == Duplicate {
			o.Arbitration = ArbitrationWon
		}
	}
	return o
}

// claimsEarly reports whether a job released early (facts.early) claims its
// budget's token now (budget.Want.Early): it was held by the one budget of
// its plan, outside quiet hours. Otherwise it goes on to its due time.
func claimsEarly(p *rules.Plan, f *facts) bool {
	return f.early && len(p.Wants) == 1 && p.Wants[0].Spec.Name == f.arrived.Reason && p.QuietUntil.IsZero()
}

// arbitrates reports whether a job asks Redis for an arbitration of the last
// slot (Request.Arbitration): its caps have a window, and it can wait for it
// on the delay tiers before it expires; or it comes back from its window.
func arbitrates(p *rules.Plan, f *facts, wheel *hold.Wheel, now time.Time) bool {
	if f.arrived.Reason == ReasonArbitration {
		return true
	}
	return p.Arbitration > 0 && wheel != nil && (f.expiresAt.IsZero() || now.Add(p.Arbitration).Before(f.expiresAt))
}

func routeOf(p *rules.Plan, f *facts, wheel *hold.Wheel, now time.Time) Outcome {
	expired := !f.expiresAt.IsZero() && !now.Before(f.expiresAt)
	if p.Exempt {
		if expired { // never logged, so there is no earlier send to recognise
			return Outcome{Kind: Capped, Cap: ReasonExpired, Reason: ReasonExpired, DecidedAt: now, Hold: f.arrived}
		}
		return Outcome{Kind: Exempt, DecidedAt: now, Hold: f.arrived}
	}
	var refusal Outcome // capped before Redis, unless it is a redelivery
	switch {
	case expired:
		refusal = Outcome{Kind: Capped, Cap: ReasonExpired, Reason: ReasonExpired}
	case p.Collapse.Key != "" && !f.collapse.asked:
		return Outcome{Ask: AskCollapse}
	case f.collapse.by != "":
		refusal = Outcome{Kind: Capped, Cap: ReasonCollapsed, Reason: ReasonCollapsed, CollapsedBy: f.collapse.by}
	case !p.QuietUntil.IsZero():
		o := holdOrRefuse(f, p.OnCapped(""), p.QuietUntil, ReasonQuietHours, "quiet_hours", wheel, now)
		if o.Kind == Held {
			return o
		}
		refusal = Outcome{Kind: Capped, Cap: ReasonQuietHours, Reason: cmp.Or(o.Reason, ReasonQuietHours), RetryAt: p.QuietUntil}
	case len(p.Wants) > 0 && !f.tokens.taken:
		return Outcome{Ask: AskTokens}
	case f.tokens.copy:
		return routeCopy(p, f, wheel, now)
	case f.tokens.short != "":
		b := f.tokens.short
		policy := p.OnShort(b)
		o := holdOrRefuse(f, policy, f.tokens.retryAt, b, "budget", wheel, now)
		if o.Kind == Held && f.tokens.unkept { // its token comes back too close to its until (budget.Grant.Promised):
			// refused as a wait until that bound would be (expired, beyond max_hold)
			o = holdOrRefuse(f, policy, holdUntil(f, policy, wheel, now), b, "budget", wheel, now)
		}
		if o.Kind == Held && (f.tokens.follow || f.early) { // on to its (new) promise, as a job not due yet: no new hold
			o.Kind, o.Cap, o.HeldBy, o.Hold.Count = Moved, "", "", f.arrived.Count
		}
		if o.Kind == Held || o.Kind == Moved {
			return o
		}
		refusal = Outcome{Kind: Capped, Cap: b, Reason: o.Reason, RetryAt: f.tokens.retryAt}
	}
	r := &f.redis
	switch {
	case !r.asked && refusal.Kind == Capped: // the look marks it refused as refusal.Cap
		return Outcome{Ask: AskDuplicate, Cap: refusal.Cap}
	case !r.asked:
		return Outcome{Ask: AskDecision}
	case r.invalid != "":
		return Outcome{Kind: DeadLetter, Error: r.invalid}
	case r.unchecked && refusal.Kind == Capped:
		refusal.DecidedAt, refusal.Hold = now, f.arrived
		return refusal
	case r.unchecked:
		return Outcome{Kind: Unchecked, DecidedAt: now, Hold: f.arrived}
	}
	d := &r.dec
	at := cmp.Or(d.At, now)
	switch {
	case d.Duplicate: // decided when it was first allowed
		return Outcome{Kind: Duplicate, DecidedAt: cmp.Or(d.Recorded, at), Hold: f.arrived}
	case d.RefusedBefore && refusal.Kind != Capped: // another copy was refused for good: so is this one
		return Outcome{Kind: Capped, Cap: d.Cap, Reason: ReasonRefusedBefore, DecidedAt: at, Hold: f.arrived}
	case refusal.Kind == Capped:
		refusal.DecidedAt, refusal.Hold = at, f.arrived
		return refusal
	case d.Allowed:
		return Outcome{Kind: Allowed, DecidedAt: cmp.Or(d.Recorded, at), Hold: f.arrived, Shadow: d.Shadow}
	case d.Candidate && wheel != nil: // waits for the end of its window, whatever its policy
		o := Outcome{Kind: Held, Cap: d.Cap, HeldBy: ReasonArbitration, DecidedAt: at, Arbitration: ArbitrationCandidate,
			Hold: hold.State{Since: f.since, Due: d.RetryAt, Count: f.arrived.Count + 1, Reason: ReasonArbitration}}
		o.Tier, o.Hold.Wake = wheel.Route(at, d.RetryAt)
		return o
	case d.Candidate: // no delay tiers (arbitrates says no): capped until the window ends
		return Outcome{Kind: Capped, Cap: d.Cap, RetryAt: d.RetryAt, DecidedAt: at, Hold: f.arrived}
	}
	pol := strictest(p, d)
	o := holdOrRefuse(f, pol, d.RetryAt, d.Cap, "cap", wheel, at)
	if o.Kind != Held {
		o = Outcome{Kind: Capped, Cap: d.Cap, Reason: o.Reason, RetryAt: d.RetryAt, DecidedAt: at, Hold: f.arrived}
		if marked, ok := markRefusal(f, pol, d, wheel, at); ok {
			return marked
		}
	}
	if d.Reserved {
		_, o.ReservedFor = p.Reservation(d.Cap)
	}
	return o
}

// markRefusal marks refused a held job that its caps refuse for good back
// from the delay tiers (its next slot after its max_hold or its expiry),
// under a policy that holds, so that its other copies end alike: a resend,
// submitted later and so with a later max_hold, may be waiting on the tiers
// for that slot and would find it free. It asks Redis first (AskDuplicate:
// the look that marks), which then says whether another copy went meanwhile
// (a duplicate). ok is false when the caps' refusal stands: marked (or marked
// before, by another copy), or not to be: the drop policy, no slot ever,
// Redis failing, or a first decision (each such mark would cost the batch a
// second round trip to Redis, most of them for refusals the near cache
// decides without one: docs/contract.md).
func markRefusal(f *facts, pol rules.Policy, d *capping.Decision, wheel *hold.Wheel, at time.Time) (o Outcome, ok bool) {
	m := &f.mark
	switch {
	case !pol.Hold || wheel == nil || d.RetryAt.IsZero() || f.arrived.Count == 0:
		return o, false
	case !m.asked:
		return Outcome{Ask: AskDuplicate, Cap: d.Cap}, true
	case m.unchecked || m.invalid != "":
		return o, false
	case m.dec.Duplicate:
		return Outcome{Kind: Duplicate, DecidedAt: cmp.Or(m.dec.Recorded, m.dec.At, at), Hold: f.arrived}, true
	}
	return o, false
}

// routeCopy routes a job whose budget token another copy of it claimed
// (budget.Grant.Copy): a duplicate of that copy once Redis knows it (or
// refused before with it), else back shortly (the copy is being decided, or
// was not forwarded: this one then takes its turn) if its policy holds, or
// capped; its refusal is marked, so that the two end alike.
func routeCopy(p *rules.Plan, f *facts, wheel *hold.Wheel, now time.Time) Outcome {
	b := f.tokens.short
	o := holdOrRefuse(f, p.OnShort(b), f.tokens.retryAt, b, "budget", wheel, now)
	refusal := Outcome{Kind: Capped, Cap: b, Reason: o.Reason, RetryAt: f.tokens.retryAt, DecidedAt: now, Hold: f.arrived}
	r := &f.redis
	switch {
	case !r.asked && o.Kind == Held:
		return Outcome{Ask: AskDuplicate}
	case !r.asked:
		return Outcome{Ask: AskDuplicate, Cap: b}
	case r.invalid != "":
		return Outcome{Kind: DeadLetter, Error: r.invalid}
	case r.unchecked && o.Kind == Held:
		return o
	case r.unchecked:
		return refusal
	case r.dec.Duplicate:
		return Outcome{Kind: Duplicate, DecidedAt: cmp.Or(r.dec.Recorded, r.dec.At, now), Hold: f.arrived}
	case r.dec.RefusedBefore: // another copy was refused for good: so is this one
		return Outcome{Kind: Capped, Cap: r.dec.Cap, Reason: ReasonRefusedBefore, DecidedAt: cmp.Or(r.dec.At, now), Hold: f.arrived}
	case o.Kind == Held:
		return o
	}
	refusal.DecidedAt = cmp.Or(r.dec.At, now)
	return refusal
}

// strictest is the policy of a send refused by several caps: held only if
// every one of them holds (a cap that drops does not want the send late), for
// the shortest of their max_holds.
func strictest(p *rules.Plan, d *capping.Decision) rules.Policy {
	pol := p.OnCapped(d.Cap)
	for _, c := range d.Exceeded {
		q := p.OnCapped(c)
		if !q.Hold {
			return q
		}
		pol.MaxHold = min(pol.MaxHold, q.MaxHold)
	}
	return pol
}

// holdUntil is the first due time holdOrRefuse refuses under policy pol:
// the job's max_hold from its submission, or its expiry if sooner; now when
// it cannot be held at all (the drop policy, no delay tiers). A budget
// promises its tokens only to jobs due before it (budget.Want.Until).
func holdUntil(f *facts, pol rules.Policy, wheel *hold.Wheel, now time.Time) time.Time {
	if !pol.Hold || wheel == nil {
		return now
	}
	until := f.since.Add(pol.MaxHold)
	if !f.expiresAt.IsZero() && f.expiresAt.Before(until) {
		until = f.expiresAt
	}
	return until
}

// holdOrRefuse holds the job until due under policy pol, for cause (a cap,
// a budget, quiet_hours), or says why it cannot be held (Reason: never, when
// due is zero; expired, when it expires first; beyond max_hold; empty under
// the drop policy or with no delay tiers).
func holdOrRefuse(f *facts, pol rules.Policy, due time.Time, cause, by string, wheel *hold.Wheel, now time.Time) Outcome {
	switch {
	case !pol.Hold || wheel == nil:
		return Outcome{}
	case due.IsZero():
		return Outcome{Reason: ReasonNever}
	case !f.expiresAt.IsZero() && !due.Before(f.expiresAt):
		return Outcome{Reason: ReasonExpired}
	case !due.Before(f.since.Add(pol.MaxHold)):
		return Outcome{Reason: ReasonMaxHold}
	}
	o := Outcome{Kind: Held, Cap: cause, HeldBy: by, DecidedAt: now,
		Hold: hold.State{Since: f.since, Due: due, Count: f.arrived.Count + 1, Reason: cause}}
	o.Tier, o.Hold.Wake = wheel.Route(now, due)
	return o
}
