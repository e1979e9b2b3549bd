package rules

import "time"

// Policies are what the rules do with a send's refusals: hold or drop when a
// cap or the quiet hours refuse it, how long it may wait for a budget's
// token, and each cap's reserved slots. They are resolved once per rules
// version for each segment and configured category; a Plan carries its own.
type Policies struct {
	// fallback is the policy of the quiet hours and of a cap without one of
	// its own: the category's, else the segment's, else the rules', else drop.
	fallback Policy
	caps     map[string]capPolicy     // the segment's caps by name
	budgets  map[string]time.Duration // budget name -> max_hold (shared by every Policies of a version)
}

// capPolicy is one cap's part of Policies.
type capPolicy struct {
	onCapped    Policy
	own         bool // the cap has an on_capped of its own
	reserve     int  // slots kept for sends of minPriority and above
	minPriority int
}

// segmentPolicies are the Policies of one segment key: by configured
// category, and for every other category.
type segmentPolicies struct {
	byCategory map[string]*Policies
	other      *Policies
}

// compilePolicies resolves the Policies of every segment and category (after
// compileHold and compileBudgets).
func (r *Rules) compilePolicies() {
	r.policies = map[string]*segmentPolicies{}
	resolve := func(seg, category string, caps []compiled) *Policies {
		p := &Policies{fallback: r.onCapped(seg, category, ""), caps: make(map[string]capPolicy, len(caps)), budgets: r.budgetHold}
		for _, c := range caps {
			own := r.hold.capPolicy[seg][c.name] != nil
			p.caps[c.name] = capPolicy{onCapped: r.onCapped(seg, category, c.name), own: own, reserve: c.reserve, minPriority: c.minPriority}
		}
		return p
	}
	for _, seg := range append([]string{""}, r.segments...) {
		caps := r.def
		if seg != "" {
			caps = r.bySegment[seg]
		}
		sp := &segmentPolicies{byCategory: map[string]*Policies{}, other: resolve(seg, "", caps)}
		for cat := range r.hold.catPolicy {
			sp.byCategory[cat] = resolve(seg, cat, caps)
		}
		r.policies[seg] = sp
	}
}

// policiesOf returns the Policies of a send of category to the segment key seg.
func (r *Rules) policiesOf(seg, category string) *Policies {
	sp := r.policies[seg]
	if sp == nil {
		return nil
	}
	if len(sp.byCategory) > 0 {
		if p, ok := sp.byCategory[category]; ok {
			return p
		}
	}
	return sp.other
}

// OnCapped returns the policy of the send when cap refuses it: the cap's own,
// else its category's, else its segment's, else the rules', else drop. cap
// "" (quiet hours) skips the cap's.
func (p *Policies) OnCapped(cap string) Policy {
	if p == nil {
		return Policy{}
	}
	if c, ok := p.caps[cap]; ok && cap != "" && c.own {
		return c.onCapped
	}
	return p.fallback
}

// OnShort returns the policy of the send when budget has no token for it:
// held, up to the budget's max_hold.
func (p *Policies) OnShort(budget string) Policy {
	if p == nil {
		return Policy{}
	}
	return Policy{Hold: true, MaxHold: p.budgets[budget]}
}

// Reservation returns the reserve of the cap named cap: the slots it keeps
// for sends of minPriority and above (0, 0: none).
func (p *Policies) Reservation(cap string) (slots, minPriority int) {
	if p == nil {
		return 0, 0
	}
	c := p.caps[cap]
	return c.reserve, c.minPriority
}
