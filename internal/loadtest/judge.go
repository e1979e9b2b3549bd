package loadtest

// The report's own reading of the rules. capper report must be able to catch
// a bug in the worker's rules (a scope that matches too little, a calendar
// period bounded in the wrong zone), so it does not use the worker's compiled
// rules, log members or scope digests: it reads the configuration as written
// and evaluates scopes on the raw strings and windows and local calendar
// periods directly. It only knows what the configuration reference says.

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/capper-dev/capper/rules"
)

// judge is the rules as the report reads them.
type judge struct {
	segments  map[string][]jcap // by segment name
	def       []jcap            // users in no segment, or in one without caps of its own
	exempt    map[string]bool
	countOnly map[string]bool
	zone      *time.Location
	weekStart time.Weekday
	budgets   []jbudget
	ruleCaps  map[string]bool // every cap's name, of every segment and the default
	// priorities by campaign, tag and category (rules.priorities)
	prioCampaign, prioTag, prioCategory map[string]int
}

// jscope is a cap's or a budget's scope as written.
type jscope struct {
	channels    []string // empty: every channel
	tags        []string // empty: every send; else a send with one of them (its category is one of its tags)
	perCampaign bool
}

type jcap struct {
	name  string
	limit int
	// reserve slots are for sends of minPriority and above
	reserve, minPriority int
	window               time.Duration // rolling; zero for a calendar cap
	calendar             string        // day, week, month
	shadow               bool
	scope                jscope
}

type jbudget struct {
	name   string
	held   string // what its holds name it (capper-cap): a workspace's own budget is "NAME/BUDGET"
	limit  int
	window time.Duration
	scope  jscope
}

func newJudge(c rules.Config) (*judge, error) {
	j := &judge{segments: map[string][]jcap{}, exempt: map[string]bool{}, countOnly: map[string]bool{}, zone: time.UTC, weekStart: time.Monday,
		prioCampaign: map[string]int{}, prioTag: map[string]int{}, prioCategory: map[string]int{}}
	for _, p := range c.Priorities {
		switch {
		case p.Campaign != "":
			j.prioCampaign[p.Campaign] = p.Priority
		case p.Tag != "":
			j.prioTag[p.Tag] = p.Priority
		default:
			j.prioCategory[p.Category] = p.Priority
		}
	}
	var err error
	if j.def, err = jcaps(c.DefaultCaps); err != nil {
		return nil, err
	}
	for _, s := range c.Segments {
		if j.segments[s.Name], err = jcaps(s.Caps); err != nil {
			return nil, err
		}
	}
	j.ruleCaps = map[string]bool{}
	for _, cs := range append(slices.Collect(maps.Values(j.segments)), j.def) {
		for _, cp := range cs {
			j.ruleCaps[cp.name] = true
		}
	}
	exempt := c.ExemptCategories
	if exempt == nil { // absent: the documented default
		exempt = []string{"transactional"}
	}
	for _, e := range exempt {
		j.exempt[e] = true
	}
	for _, e := range c.CountOnlyCategories {
		j.countOnly[e] = true
	}
	if c.DefaultTimezone != "" {
		if j.zone, err = time.LoadLocation(c.DefaultTimezone); err != nil {
			return nil, err
		}
	}
	if c.WeekStart != "" {
		days := []string{"sunday", "monday", "tuesday", "wednesday", "thursday", "friday", "saturday"}
		i := slices.Index(days, strings.ToLower(c.WeekStart))
		if i < 0 {
			return nil, fmt.Errorf("report: week_start %q", c.WeekStart)
		}
		j.weekStart = time.Weekday(i)
	}
	for _, b := range c.Budgets {
		if b.Limit == nil {
			return nil, fmt.Errorf("report: budget %s has no limit", b.Name)
		}
		j.budgets = append(j.budgets, jbudget{name: b.Name, held: c.BudgetName(b), limit: *b.Limit, window: time.Duration(b.Window), scope: jscopeOf(b.Scope)})
	}
	return j, nil
}

func jcaps(cs []rules.Cap) ([]jcap, error) {
	out := make([]jcap, 0, len(cs))
	for i, c := range cs {
		if c.Limit == nil {
			return nil, fmt.Errorf("report: cap %d has no limit", i)
		}
		name := c.Name
		if name == "" {
			name = fmt.Sprintf("cap%d", i)
		}
		jc := jcap{name: name, limit: *c.Limit, window: time.Duration(c.Window), calendar: c.Calendar, shadow: c.Shadow, scope: jscopeOf(c.Scope)}
		if c.Reserve != nil {
			jc.reserve, jc.minPriority = c.Reserve.Slots, c.Reserve.MinPriority
		}
		out = append(out, jc)
	}
	return out, nil
}

func jscopeOf(s rules.Scope) jscope {
	chs := slices.Clone(s.Channels)
	if s.Channel != "" {
		chs = append(chs, s.Channel)
	}
	return jscope{channels: chs, tags: slices.Clone(s.Tags), perCampaign: s.PerCampaign}
}

// category is a send's category: "marketing" when the job names none.
func category(s *Sent) string {
	if s.Category == "" {
		return "marketing"
	}
	return s.Category
}

// matches reports whether the scope selects s; of, when set, is the send whose
// per-campaign scope it is (its campaign's sends only).
func (sc *jscope) matches(s, of *Sent) bool {
	if len(sc.channels) > 0 && !slices.Contains(sc.channels, s.Channel) {
		return false
	}
	if sc.perCampaign && of != nil && s.Campaign != of.Campaign {
		return false
	}
	if len(sc.tags) > 0 && !slices.Contains(sc.tags, category(s)) && !slices.ContainsFunc(s.Tags, func(t string) bool { return slices.Contains(sc.tags, t) }) {
		return false
	}
	return true
}

// caps returns the caps of a user's segment.
func (j *judge) caps(segment string, inSegment bool) []jcap {
	if cs, ok := j.segments[segment]; inSegment && ok {
		return cs
	}
	return j.def
}

// zoneOf is the time zone of s's calendar periods.
func (j *judge) zoneOf(s *Sent) *time.Location {
	if s.Timezone != "" {
		if z, err := time.LoadLocation(s.Timezone); err == nil {
			return z
		}
	}
	return j.zone
}

// since is the start of the window of cap c that holds t, for a send in zone:
// the last millisecond a rolling window's sends still count from, or the
// first local midnight of the calendar day, week or month.
func (j *judge) since(c *jcap, t time.Time, zone *time.Location) time.Time {
	if c.window == time.Duration(rules.Lifetime) { // every earlier send of the run
		return time.Time{}
	}
	if c.calendar == "" {
		return t.Add(-c.window + time.Millisecond)
	}
	l := t.In(zone)
	y, m, d := l.Date()
	switch c.calendar {
	case "week":
		d -= (int(l.Weekday()) - int(j.weekStart) + 7) % 7
	case "month":
		d = 1
	}
	return time.Date(y, m, d, 0, 0, 0, 0, zone)
}

// priority is a send's priority: its own, else its campaign's, else the
// highest of its tags' (its category among them), else its category's, else 0.
func (j *judge) priority(s *Sent) int {
	if s.HasPriority {
		return s.Priority
	}
	if p, ok := j.prioCampaign[s.Campaign]; ok {
		return p
	}
	best, found := 0, false
	for _, t := range append([]string{category(s)}, s.Tags...) {
		if p, ok := j.prioTag[t]; ok && (!found || p > best) {
			best, found = p, true
		}
	}
	if found {
		return best
	}
	return j.prioCategory[category(s)]
}

// limitFor is the part of cap c's limit a send of priority p may use: all of
// it, or without the reserved slots when p is below their min_priority.
func (c *jcap) limitFor(p int) int {
	if c.reserve > 0 && p < c.minPriority {
		return c.limit - c.reserve
	}
	return c.limit
}
