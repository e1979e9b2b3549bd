package rules

// Priority: which send gets a user's last slot. A job's priority (its own
// field, else the rules' default for its campaign, tags or category) decides
// whether it may use the slots a cap reserves for important sends.

import (
	"fmt"
	"time"
)

// Priorities are 0..MaxPriority; higher is more important. A job without
// one, and that no rule gives one, has priority 0.
const MaxPriority = 100

// Priority gives the jobs of a campaign, a tag or a category a default
// priority. Exactly one of Campaign, Tag and Category is set.
type Priority struct {
	Campaign string `yaml:"campaign"`
	Tag      string `yaml:"tag"`
	Category string `yaml:"category"`
	Priority int    `yaml:"priority"` // 0..MaxPriority (Required)
}

// Reserve keeps a cap's last Slots for sends of priority MinPriority or
// above: a send below it sees a limit of limit - slots.
type Reserve struct {
	Slots       int `yaml:"slots"`        // (Required) 1..limit
	MinPriority int `yaml:"min_priority"` // (Required) 1..MaxPriority
}

// priorities are the compiled rules.priorities.
type priorities struct {
	campaign, tag, category map[string]int
}

func (r *Rules) compilePriorities(ps []Priority) error {
	r.prio = priorities{campaign: map[string]int{}, tag: map[string]int{}, category: map[string]int{}}
	for i, p := range ps {
		f := fmt.Sprintf("rules.priorities[%d]", i)
		var m map[string]int
		var key string
		n := 0
		for _, c := range []struct {
			v string
			m map[string]int
		}{{p.Campaign, r.prio.campaign}, {p.Tag, r.prio.tag}, {p.Category, r.prio.category}} {
			if c.v != "" {
				n++
				m, key = c.m, c.v
			}
		}
		switch {
		case n != 1:
			return fmt.Errorf("%s: set exactly one of campaign, tag and category", f)
		case p.Priority < 0 || p.Priority > MaxPriority:
			return fmt.Errorf("%s: priority %d is not in 0..%d", f, p.Priority, MaxPriority)
		}
		if _, dup := m[key]; dup {
			return fmt.Errorf("%s: %q is listed twice", f, key)
		}
		m[key] = p.Priority
	}
	return nil
}

// DefaultPriority is the priority of a job that names none: its campaign's,
// else the highest of its tags' (its category is one of them), else its
// category's, else 0.
func (r *Rules) DefaultPriority(campaign, category string, tags []string) int {
	if p, ok := r.prio.campaign[campaign]; ok {
		return p
	}
	best, found := 0, false
	for _, t := range tags {
		if p, ok := r.prio.tag[t]; ok && (!found || p > best) {
			best, found = p, true
		}
	}
	if found {
		return best
	}
	return r.prio.category[category]
}

func compileReserve(f string, res *Reserve, limit int) (slots, minPriority int, err error) {
	if res == nil {
		return 0, 0, nil
	}
	switch {
	case res.Slots < 1 || res.Slots > limit:
		return 0, 0, fmt.Errorf("%s: reserve.slots %d is not in 1..%d (the cap's limit)", f, res.Slots, limit)
	case res.MinPriority < 1 || res.MinPriority > MaxPriority:
		return 0, 0, fmt.Errorf("%s: reserve.min_priority %d is not in 1..%d", f, res.MinPriority, MaxPriority)
	}
	return res.Slots, res.MinPriority, nil
}

// reservedFor returns the slots of cap c a send of priority p may not use.
func (c *compiled) reservedFor(p int) int {
	if c.reserve > 0 && p < c.minPriority {
		return c.reserve
	}
	return 0
}

// maxArbitration bounds an arbitration window: a candidate waits this long
// on the delay tiers, and a slot stays open while it does.
const maxArbitration = time.Hour

func checkArbitration(f string, d Duration) error {
	w := time.Duration(d)
	if w != 0 && (w < 100*time.Millisecond || w > maxArbitration || w%time.Millisecond != 0) {
		return fmt.Errorf("%s: %v is not between 100ms and 1h (whole milliseconds)", f, w)
	}
	return nil
}

func longestArbitration(caps []compiled) time.Duration {
	var w time.Duration
	for i := range caps {
		w = max(w, caps[i].arbitration)
	}
	return w
}
