package rules

// What happens to a send the caps refuse (drop it, or hold it until it may
// go), and quiet hours: local times of day when a segment's or a category's
// sends wait.

import (
	"fmt"
	"time"
)

// OnCapped is what happens to a capped send, as configured.
type OnCapped struct {
	// Policy is drop (the send goes to the capped topic) or hold (it waits on
	// the delay topics until it may go, then is decided again). (Required)
	Policy string `yaml:"policy"`
	// MaxHold bounds how long after it was submitted (its input message's
	// timestamp) a held send may go; a send whose slot comes later is capped
	// with reason "beyond max_hold". Required for hold, at most 30 days.
	MaxHold Duration `yaml:"max_hold"`
}

// QuietHours is a daily local time range, e.g. from 21:00 to 08:00 (across
// midnight), in the user's time zone (the job's, else default_timezone).
type QuietHours struct {
	From string `yaml:"from"` // HH:MM or HH:MM:SS, inclusive (Required)
	To   string `yaml:"to"`   // HH:MM or HH:MM:SS, exclusive (Required)
}

// Category configures one category's sends.
type Category struct {
	Name       string      `yaml:"name"`        // (Required)
	OnCapped   *OnCapped   `yaml:"on_capped"`   // overrides the segment's and the rules' policy
	QuietHours *QuietHours `yaml:"quiet_hours"` // adds to the segment's quiet hours
}

// Policy is a compiled OnCapped: hold with MaxHold, or drop (Hold false).
type Policy struct {
	Hold    bool
	MaxHold time.Duration
}

// maxHoldLimit bounds max_hold: the delay topics must retain a held job for
// as long as its longest tier, and no campaign message stays relevant longer.
const maxHoldLimit = 30 * 24 * time.Hour

func compilePolicy(field string, o *OnCapped) (*Policy, error) {
	if o == nil {
		return nil, nil
	}
	switch o.Policy {
	case "drop":
		if o.MaxHold != 0 {
			return nil, fmt.Errorf("%s: max_hold only applies to policy hold", field)
		}
		return &Policy{}, nil
	case "hold":
		if o.MaxHold <= 0 || time.Duration(o.MaxHold) > maxHoldLimit {
			return nil, fmt.Errorf("%s: policy hold needs max_hold between 1ms and 30d, not %v", field, time.Duration(o.MaxHold))
		}
		return &Policy{Hold: true, MaxHold: time.Duration(o.MaxHold)}, nil
	default:
		return nil, fmt.Errorf("%s: policy %q is not drop or hold", field, o.Policy)
	}
}

// quiet is compiled QuietHours: seconds after local midnight.
type quiet struct{ from, to int }

func compileQuiet(field string, q *QuietHours) (*quiet, error) {
	if q == nil {
		return nil, nil
	}
	from, err := clock(q.From)
	if err != nil {
		return nil, fmt.Errorf("%s.from: %w", field, err)
	}
	to, err := clock(q.To)
	if err != nil {
		return nil, fmt.Errorf("%s.to: %w", field, err)
	}
	if from == to {
		return nil, fmt.Errorf("%s: from and to are both %s: an empty range", field, q.From)
	}
	return &quiet{from, to}, nil
}

// clock parses HH:MM or HH:MM:SS (00:00..24:00) as seconds after midnight.
func clock(s string) (int, error) {
	var h, m, sec int
	bad := fmt.Errorf("%q is not a time of day HH:MM or HH:MM:SS", s)
	switch len(s) {
	case 5:
		if n, err := fmt.Sscanf(s, "%2d:%2d", &h, &m); err != nil || n != 2 {
			return 0, bad
		}
	case 8:
		if n, err := fmt.Sscanf(s, "%2d:%2d:%2d", &h, &m, &sec); err != nil || n != 3 {
			return 0, bad
		}
	default:
		return 0, bad
	}
	if h < 0 || m < 0 || sec < 0 || m > 59 || sec > 59 || h > 24 || (h == 24 && m+sec != 0) {
		return 0, bad
	}
	return h*3600 + m*60 + sec, nil
}

// until returns the end of the quiet range that holds now in zone, or the
// zero time when now is outside it. The range is in local wall-clock time:
// across a daylight-saving change it follows the clock, so the night it
// covers is an hour shorter or longer.
func (q *quiet) until(now time.Time, zone *time.Location) time.Time {
	t := now.In(zone)
	m := t.Hour()*3600 + t.Minute()*60 + t.Second()
	y, mo, d := t.Date()
	at := func(day int) time.Time { return time.Date(y, mo, day, 0, 0, q.to, 0, zone) }
	switch {
	case q.from < q.to && m >= q.from && m < q.to: // e.g. 13:00-14:00
		return at(d)
	case q.from > q.to && m >= q.from: // 21:00-08:00, before midnight
		return at(d + 1)
	case q.from > q.to && m < q.to: // 21:00-08:00, after midnight
		return at(d)
	}
	return time.Time{}
}

// holdRules are the compiled hold policies and quiet hours.
type holdRules struct {
	policy       *Policy                       // rules-wide on_capped; nil = drop
	segPolicy    map[string]*Policy            // segment (or "" for default caps) -> policy
	capPolicy    map[string]map[string]*Policy // segment -> cap name -> policy
	catPolicy    map[string]*Policy
	segQuiet     map[string]*quiet // segment ("" for users in no segment) -> quiet hours
	catQuiet     map[string]*quiet
	anyHold      bool
	longest      time.Duration // the longest a send may wait on the delay tiers (Plan.LongestHold)
	longestQuiet time.Duration
}

// OnCapped returns the policy for a send of category, capped by cap, for a
// user of segment (inSegment false: the default caps): the cap's own policy,
// else the category's, else the segment's, else the rules' on_capped, else drop.
// cap "" (quiet hours) skips the cap's.
func (r *Rules) OnCapped(segment string, inSegment bool, category, cap string) Policy {
	return r.onCapped(r.segmentKey(segment, inSegment), category, cap)
}

func (r *Rules) onCapped(seg, category, cap string) Policy {
	if p := r.hold.capPolicy[seg][cap]; p != nil && cap != "" {
		return *p
	}
	if p := r.hold.catPolicy[category]; p != nil {
		return *p
	}
	if p := r.hold.segPolicy[seg]; p != nil {
		return *p
	}
	if r.hold.policy != nil {
		return *r.hold.policy
	}
	return Policy{}
}

// QuietUntil returns when the quiet hours that hold now end for a send of
// category to a user of segment in zone (nil: the rules' default), or the
// zero time when none holds. The segment's and the category's quiet hours both
// apply; when they overlap, the send waits until neither holds. Exempt and
// count-only categories have no quiet hours.
func (r *Rules) QuietUntil(segment string, inSegment bool, category string, zone *time.Location, now time.Time) time.Time {
	if zone == nil {
		zone = r.zone
	}
	qs := [2]*quiet{r.hold.segQuiet[r.segmentKey(segment, inSegment)], r.hold.catQuiet[category]}
	if (qs[0] == nil && qs[1] == nil) || r.exempt[category] || r.countOnly[category] {
		return time.Time{}
	}
	var end time.Time
	t := now
	for range 4 { // each step moves to the end of a range; two ranges cannot chain more
		moved := false
		for _, q := range qs {
			if q == nil {
				continue
			}
			if u := q.until(t, zone); !u.IsZero() && u.After(t) {
				t, end, moved = u, u, true
			}
		}
		if !moved {
			break
		}
	}
	return end
}

// Holds reports whether any rule holds sends (a hold policy or quiet hours):
// the worker then needs its delay topics.
func (r *Rules) Holds() bool { return r.hold.anyHold }

func (r *Rules) segmentKey(segment string, inSegment bool) string {
	if inSegment {
		if _, ok := r.bySegment[segment]; ok {
			return segment
		}
	}
	return ""
}

func (h *holdRules) notePolicy(p *Policy) {
	if p != nil && p.Hold {
		h.noteHold(p.MaxHold)
	}
}

// noteHold notes that a send may wait on the delay tiers up to d.
func (h *holdRules) noteHold(d time.Duration) {
	h.anyHold, h.longest = true, max(h.longest, d)
}

// compileHold compiles the hold policies and quiet hours of c.
func (r *Rules) compileHold(c Config) error {
	h := &r.hold
	h.segPolicy, h.capPolicy, h.catPolicy = map[string]*Policy{}, map[string]map[string]*Policy{}, map[string]*Policy{}
	h.segQuiet, h.catQuiet = map[string]*quiet{}, map[string]*quiet{}
	var err error
	if h.policy, err = compilePolicy("rules.on_capped", c.OnCapped); err != nil {
		return err
	}
	h.notePolicy(h.policy)
	caps := func(seg, field string, cs []Cap) error {
		for i, cp := range cs {
			p, err := compilePolicy(fmt.Sprintf("%s[%d].on_capped", field, i), cp.OnCapped)
			if err != nil {
				return err
			}
			if p != nil {
				if h.capPolicy[seg] == nil {
					h.capPolicy[seg] = map[string]*Policy{}
				}
				h.capPolicy[seg][r.capName(seg, i)] = p
				h.notePolicy(p)
			}
		}
		return nil
	}
	if err := caps("", "rules.default_caps", c.DefaultCaps); err != nil {
		return err
	}
	if h.segQuiet[""], err = compileQuiet("rules.default_quiet_hours", c.DefaultQuietHours); err != nil {
		return err
	}
	for i, s := range c.Segments {
		field := fmt.Sprintf("rules.segments[%d]", i)
		if h.segPolicy[s.Name], err = compilePolicy(field+".on_capped", s.OnCapped); err != nil {
			return err
		}
		h.notePolicy(h.segPolicy[s.Name])
		if h.segQuiet[s.Name], err = compileQuiet(field+".quiet_hours", s.QuietHours); err != nil {
			return err
		}
		if err := caps(s.Name, field+".caps", s.Caps); err != nil {
			return err
		}
	}
	seen := map[string]bool{}
	for i, cat := range c.Categories {
		field := fmt.Sprintf("rules.categories[%d]", i)
		switch {
		case cat.Name == "":
			return fmt.Errorf("%s: name is required", field)
		case seen[cat.Name]:
			return fmt.Errorf("%s: category %q is listed twice", field, cat.Name)
		case r.exempt[cat.Name] && (cat.OnCapped != nil || cat.QuietHours != nil):
			return fmt.Errorf("%s: category %q is exempt: it is never capped nor held", field, cat.Name)
		}
		seen[cat.Name] = true
		if h.catPolicy[cat.Name], err = compilePolicy(field+".on_capped", cat.OnCapped); err != nil {
			return err
		}
		h.notePolicy(h.catPolicy[cat.Name])
		if h.catQuiet[cat.Name], err = compileQuiet(field+".quiet_hours", cat.QuietHours); err != nil {
			return err
		}
	}
	for _, m := range []map[string]*quiet{h.segQuiet, h.catQuiet} { // unset entries are nil: no quiet hours
		for _, q := range m {
			h.anyHold = h.anyHold || q != nil
		}
	}
	return nil
}
