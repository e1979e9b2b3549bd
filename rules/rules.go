// Package rules is capper's rule language: the `rules` section of the
// configuration (Config, parsed from YAML) and its compiled form (Rules),
// built once per rules version, from which the hot path takes, per job, the
// caps that apply with their windows as absolute bounds.
//
// A cap counts the sends of its scope (channels, tags, per campaign; any
// combination) in a window: rolling (any window of the given length) or
// calendar (the current local day, week or month in the user's time zone).
// Shadow caps are counted and reported but never block. Exempt categories
// are neither counted nor capped; count-only categories are counted but never
// capped. Users in a segment get its caps (segments in priority order), the
// others the default caps.
package rules

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	_ "time/tzdata" // IANA zones in the binary: images without /usr/share/zoneinfo still resolve them

	"gopkg.in/yaml.v3"

	"github.com/capper-dev/capper/capping"
)

// Config is the rules section of the configuration file, reloadable without a restart.
type Config struct {
	// Segments in priority order: a user in several gets the first one's caps.
	Segments []Segment `yaml:"segments"`
	// DefaultCaps are the caps of users in no segment. (At least one)
	DefaultCaps []Cap `yaml:"default_caps"`
	// ExemptCategories bypass the caps and are not counted. Defaults to
	// [transactional] when the field is absent; [] exempts none.
	ExemptCategories []string `yaml:"exempt_categories"`
	// CountOnlyCategories are counted toward every cap whose scope they match,
	// but never capped themselves (e.g. receipts that use up the daily budget).
	CountOnlyCategories []string `yaml:"count_only_categories"`
	// DefaultTimezone is the IANA zone of calendar windows for jobs without a
	// timezone. Defaults to UTC.
	DefaultTimezone string `yaml:"default_timezone"`
	// WeekStart is the first day of a calendar week: monday ... sunday. Defaults to monday.
	WeekStart string `yaml:"week_start"`
	// FailOpen lists the categories and segments whose jobs may be forwarded
	// unchecked once Redis has been unavailable for longer than After.
	FailOpen []FailOpen `yaml:"fail_open"`
	// OnCapped is what happens to a capped send unless its cap, category or
	// segment says otherwise: drop (the default) or hold.
	OnCapped *OnCapped `yaml:"on_capped"`
	// DefaultQuietHours are the quiet hours of users in no segment.
	DefaultQuietHours *QuietHours `yaml:"default_quiet_hours"`
	// Categories configure the policy and quiet hours of a category's sends.
	Categories []Category `yaml:"categories"`
	// Budgets are global send-rate budgets shared by every replica.
	Budgets []Budget `yaml:"budgets"`
	// Priorities give jobs without a priority of their own a default, by
	// campaign, tag or category (see Priority).
	Priorities []Priority `yaml:"priorities"`
	// Arbitration is the arbitration window of every cap without its own
	// (Cap.Arbitration); 0: none.
	Arbitration Duration `yaml:"arbitration"`
	// Collapse derives collapse keys and sets their window (see Collapse).
	Collapse *Collapse `yaml:"collapse"`
	// ReloadInterval is how often the file is checked for changes. Defaults to 10s.
	ReloadInterval Duration `yaml:"reload_interval"`

	// workspace names the workspace these are the rules of (see InWorkspace);
	// "": its own budgets keep their names.
	workspace string
}

// InWorkspace returns c as the rules of workspace name, with the
// deployment's budgets shared by several workspaces added. Its own budgets
// are named "NAME/BUDGET" (in metrics, holds and their Redis keys), so that
// two workspaces' budgets of one name are two budgets; unless qualify is
// false: the workspace that keeps a deployment's keys from before it had
// workspaces keeps its budgets' names, and their state in Redis.
func (c Config) InWorkspace(name string, qualify bool, shared []Budget) Config {
	if qualify {
		c.workspace = name
	}
	c.Budgets = slices.Clip(c.Budgets)
	for _, b := range shared {
		b.shared = true
		c.Budgets = append(c.Budgets, b)
	}
	return c
}

// Segment is one segment's caps.
type Segment struct {
	Name string `yaml:"name"`
	Caps []Cap  `yaml:"caps"`
	// OnCapped overrides the rules' policy for this segment's capped sends.
	OnCapped *OnCapped `yaml:"on_capped"`
	// QuietHours: the segment's sends wait while they hold.
	QuietHours *QuietHours `yaml:"quiet_hours"`
}

// Cap is one cap as written in the configuration.
type Cap struct {
	// Name identifies the cap in decisions, headers and metrics. Defaults to a
	// name built from its window and scope.
	Name string `yaml:"name"`
	// Limit is the most sends of the scope in the window; 0 blocks them all. (Required)
	Limit *int `yaml:"limit"`
	// Window makes a rolling cap: any window of this length ("24h", "7d"), or
	// "lifetime": every send of the scope ever (for as long as Retain keeps
	// them).
	Window Duration `yaml:"window"`
	// Retain makes a rolling cap a tally cap (a lifetime cap is one): counted
	// in the user's tally, an item of a few bytes per scope in the log,
	// instead of from its sends, which the log then need not keep. The tally keeps
	// the cap's count this long after the user's last send of its scope: at
	// least the window. A lifetime cap's defaults to 400d.
	Retain Duration `yaml:"retain"`
	// RetainUntil: campaign_end keeps a tally cap's count until the job's
	// campaign_ends_at instead (at least a window from the send); a job
	// without one keeps it for Retain.
	RetainUntil string `yaml:"retain_until"`
	// Calendar makes a calendar cap: day, week or month, in the user's time zone.
	// (Exactly one of Window and Calendar.)
	Calendar string `yaml:"calendar"`
	// Scope: the sends it applies to and counts.
	Scope `yaml:",inline"`
	// Shadow caps are evaluated and reported but never block.
	Shadow bool `yaml:"shadow"`
	// OnCapped overrides every other policy for the sends this cap refuses.
	OnCapped *OnCapped `yaml:"on_capped"`
	// Reserve keeps the cap's last slots for sends of a minimum priority.
	Reserve *Reserve `yaml:"reserve"`
	// Arbitration makes a send that would take the cap's last slot wait this
	// long (an arbitration window) for more important sends to the same user:
	// at its end, the highest priority among them takes the slot. Overrides
	// rules.arbitration; 0s turns it off for this cap.
	Arbitration *Duration `yaml:"arbitration"`
}

// Scope selects sends, for a cap or a budget.
type Scope struct {
	// Channel and Channels restrict the scope to these channels; empty: every channel.
	Channel  string   `yaml:"channel"`
	Channels []string `yaml:"channels"`
	// Tags restrict the scope to sends with one of these tags (a job's category
	// is one of its tags); empty: any.
	Tags []string `yaml:"tags"`
	// PerCampaign: only the sends of the job's own campaign (a budget: one per campaign).
	PerCampaign bool `yaml:"per_campaign"`
}

// compile validates the scope and returns its channels.
func (s Scope) compile(field string) ([]string, error) {
	switch {
	case s.Channel != "" && len(s.Channels) > 0:
		return nil, fmt.Errorf("%s: set channel or channels, not both", field)
	case len(s.Channels) > 100 || len(s.Tags) > 100:
		return nil, fmt.Errorf("%s: at most 100 channels and 100 tags", field)
	}
	channels := slices.Clone(s.Channels)
	if s.Channel != "" {
		channels = []string{s.Channel}
	}
	for _, v := range append(slices.Clone(channels), s.Tags...) {
		if v == "" {
			return nil, fmt.Errorf("%s: an empty channel or tag", field)
		}
	}
	return channels, nil
}

// FailOpen chooses availability over caps for one category or one segment
// ("default" for users in no segment): exactly one of the two is set.
type FailOpen struct {
	Category string   `yaml:"category"`
	Segment  string   `yaml:"segment"`
	After    Duration `yaml:"after"` // how long Redis may be unavailable first (> 0)
}

// Duration reads "24h", "7d", "500ms".
type Duration time.Duration

func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	if n.Value == "lifetime" {
		*d = Lifetime
		return nil
	}
	v, err := ParseDuration(n.Value)
	if err != nil {
		return fmt.Errorf("line %d, column %d: %w", n.Line, n.Column, err)
	}
	*d = Duration(v)
	return nil
}

func (d Duration) String() string {
	if d == Lifetime {
		return "lifetime"
	}
	return time.Duration(d).String()
}

// Lifetime is a cap's window of "lifetime": every send of its scope counts,
// for as long as its tally keeps them (Cap.Retain). Only a cap's window may
// be one; anywhere else it is a negative duration, refused as such.
const Lifetime Duration = -1

// DefaultLifetimeRetain is a lifetime cap's Retain unless it says.
const DefaultLifetimeRetain = 400 * 24 * time.Hour

// ParseDuration is time.ParseDuration plus a "d" (24h) suffix for whole
// days: the one duration syntax of the configuration, the rules, the events
// and every command's flags.
func ParseDuration(s string) (time.Duration, error) {
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		if err != nil {
			return 0, durationError(s)
		}
		return time.Duration(n) * 24 * time.Hour, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, durationError(s)
	}
	return d, nil
}

func durationError(s string) error {
	return fmt.Errorf("invalid duration %q: a number and a unit, without spaces: 500ms, 30s, 5m, 24h, 7d", s)
}

// Calendar periods.
type period int

const (
	rolling period = iota
	day
	week
	month
)

// maxPeriod bounds a calendar period (a 31-day month with a DST hour) for
// how long the log keeps sends.
const maxPeriod = 31*24*time.Hour + time.Hour

// Rules is a compiled rules version: immutable, safe for concurrent use.
type Rules struct {
	// Version identifies the rules in logs and metrics.
	Version int64

	segments           []string
	bySegment          map[string][]compiled
	def                []compiled
	exempt             map[string]bool
	countOnly          map[string]bool
	failCat            map[string]time.Duration
	failSeg            map[string]time.Duration
	zone               *time.Location
	weekStart          time.Weekday
	retention          time.Duration
	hold               holdRules
	budgets            []compiledBudget
	budgetHold         map[string]time.Duration
	prio               priorities
	arbitration        map[string]time.Duration    // segment key -> the longest arbitration window of its caps
	policies           map[string]*segmentPolicies // segment key -> the Policies of its sends (see Plan)
	defaultArbitration time.Duration
	collapse           compiledCollapse
}

// periods caches the current calendar period of each zone, kind and week
// start for every rule set of the process (workspaces share their entries):
// periodKey -> *[2]time.Time, reused until it ends.
var periods sync.Map

type periodKey struct {
	zone      *time.Location
	p         period
	weekStart time.Weekday
}

// compiled is one cap ready for the hot path.
type compiled struct {
	name        string
	limit       int
	window      time.Duration
	period      period
	scope       capping.Scope // without the campaign
	perCampaign bool
	shadow      bool
	reserve     int // slots kept for sends of minPriority and above
	minPriority int
	arbitration time.Duration // the arbitration window of its last slot; 0: none
	tally       bool          // counted in the user's tally: a lifetime (window 0) or a long window
	retain      time.Duration // a tally cap's: how long its count is kept after a send
	campaignEnd bool          // retain_until: campaign_end: its count is kept until the job's campaign ends
}

// Compile validates c and compiles it as rules version.
func Compile(c Config, version int64) (*Rules, error) {
	r := &Rules{
		Version: version, bySegment: map[string][]compiled{}, exempt: map[string]bool{}, countOnly: map[string]bool{},
		failCat: map[string]time.Duration{}, failSeg: map[string]time.Duration{},
	}
	var err error
	if r.zone, err = Location(c.DefaultTimezone); err != nil {
		return nil, fmt.Errorf("rules: default_timezone: %w", err)
	}
	if r.weekStart, err = weekday(c.WeekStart); err != nil {
		return nil, fmt.Errorf("rules: week_start: %w", err)
	}
	if len(c.DefaultCaps) == 0 {
		return nil, errors.New("rules: default_caps: at least one cap is required (the caps of users in no segment)")
	}
	if err := checkArbitration("rules.arbitration", c.Arbitration); err != nil {
		return nil, err
	}
	r.defaultArbitration = time.Duration(c.Arbitration)
	r.arbitration = map[string]time.Duration{}
	if r.def, err = r.compileCaps("rules.default_caps", c.DefaultCaps); err != nil {
		return nil, err
	}
	for i, s := range c.Segments {
		field := fmt.Sprintf("rules.segments[%d]", i)
		switch {
		case s.Name == "":
			return nil, fmt.Errorf("%s: name is required", field)
		case r.bySegment[s.Name] != nil:
			return nil, fmt.Errorf("%s: segment %q is listed twice", field, s.Name)
		case len(s.Caps) == 0:
			return nil, fmt.Errorf("%s (%s): at least one cap is required", field, s.Name)
		}
		caps, err := r.compileCaps(field+".caps", s.Caps)
		if err != nil {
			return nil, err
		}
		r.bySegment[s.Name] = caps
		r.arbitration[s.Name] = longestArbitration(caps)
		r.segments = append(r.segments, s.Name)
	}
	r.arbitration[""] = longestArbitration(r.def)
	for _, w := range r.arbitration {
		if w > 0 { // a candidate waits on the delay tiers
			r.hold.noteHold(w)
		}
	}
	exempt := c.ExemptCategories
	if exempt == nil {
		exempt = []string{"transactional"}
	}
	for _, cat := range exempt {
		r.exempt[cat] = true
	}
	for _, cat := range c.CountOnlyCategories {
		if r.exempt[cat] {
			return nil, fmt.Errorf("rules: count_only_categories: %q is also exempt", cat)
		}
		r.countOnly[cat] = true
	}
	for i, f := range c.FailOpen {
		var m map[string]time.Duration
		var name string
		switch {
		case (f.Category == "") == (f.Segment == ""):
			return nil, fmt.Errorf("rules: fail_open[%d]: set exactly one of category and segment", i)
		case f.After <= 0:
			return nil, fmt.Errorf("rules: fail_open[%d]: after must be a positive duration (how long Redis may be unavailable)", i)
		case f.Category != "":
			m, name = r.failCat, f.Category
		default:
			m, name = r.failSeg, f.Segment
		}
		if _, dup := m[name]; dup {
			return nil, fmt.Errorf("rules: fail_open[%d]: %q is listed twice", i, name)
		}
		m[name] = time.Duration(f.After)
	}
	if err := r.compileHold(c); err != nil {
		return nil, err
	}
	if err := r.compileBudgets(c.Budgets, c.workspace); err != nil {
		return nil, err
	}
	if err := r.compilePriorities(c.Priorities); err != nil {
		return nil, err
	}
	if err := r.compileCollapse(c.Collapse); err != nil {
		return nil, err
	}
	for _, d := range r.budgetHold { // a job short of a token waits for it
		r.hold.noteHold(d)
	}
	r.compilePolicies()
	return r, nil
}

// capName is the compiled name of the i-th cap of segment ("" for the default caps).
func (r *Rules) capName(segment string, i int) string {
	if segment == "" {
		return r.def[i].name
	}
	return r.bySegment[segment][i].name
}

func (r *Rules) compileCaps(field string, caps []Cap) ([]compiled, error) {
	out := make([]compiled, len(caps))
	names := map[string]bool{}
	for i, c := range caps {
		f := fmt.Sprintf("%s[%d]", field, i)
		cc := compiled{window: time.Duration(c.Window), perCampaign: c.PerCampaign, shadow: c.Shadow}
		switch {
		case c.Limit == nil:
			return nil, fmt.Errorf("%s: limit is required", f)
		case *c.Limit < 0:
			return nil, fmt.Errorf("%s: limit %d must not be negative", f, *c.Limit)
		case (c.Window != 0) == (c.Calendar != ""):
			return nil, fmt.Errorf("%s: set exactly one of window (rolling, or lifetime) and calendar (day, week or month)", f)
		case c.Window != 0 && c.Window != Lifetime && (cc.window < time.Millisecond || cc.window%time.Millisecond != 0):
			return nil, fmt.Errorf("%s: window %v must be whole milliseconds, at least 1ms, or lifetime", f, cc.window)
		}
		cc.limit = *c.Limit
		if err := cc.compileTally(f, c); err != nil {
			return nil, err
		}
		var err error
		if cc.reserve, cc.minPriority, err = compileReserve(f, c.Reserve, cc.limit); err != nil {
			return nil, err
		}
		cc.arbitration = r.defaultArbitration
		if c.Arbitration != nil {
			if err := checkArbitration(f+".arbitration", *c.Arbitration); err != nil {
				return nil, err
			}
			cc.arbitration = time.Duration(*c.Arbitration)
		}
		if cc.arbitration > 0 && (cc.shadow || cc.tally) {
			// a shadow cap never blocks, so it has no last slot to arbitrate; a
			// tally cap's last slot is not arbitrated (see compileTally)
			cc.arbitration = 0
		}
		switch c.Calendar {
		case "":
		case "day":
			cc.period = day
		case "week":
			cc.period = week
		case "month":
			cc.period = month
		default:
			return nil, fmt.Errorf("%s: calendar %q is not day, week or month", f, c.Calendar)
		}
		channels, err := c.Scope.compile(f)
		if err != nil {
			return nil, err
		}
		cc.scope = capping.NewScope(channels, c.Tags)
		cc.name = c.Name
		if cc.name == "" {
			cc.name = defaultName(c, channels)
		}
		if names[cc.name] {
			return nil, fmt.Errorf("%s: a second cap named %q", f, cc.name)
		}
		names[cc.name] = true
		switch {
		case cc.tally: // counted in the tally: the log keeps none of its window
		case cc.period != rolling:
			r.retention = max(r.retention, maxPeriod)
		default:
			r.retention = max(r.retention, cc.window)
		}
		out[i] = cc
	}
	return out, nil
}

// compileTally makes cc, compiled from c at field f, a tally cap when its
// window is a lifetime or it says how long to retain its count.
func (cc *compiled) compileTally(f string, c Cap) error {
	cc.tally = c.Window == Lifetime || c.Retain != 0 || c.RetainUntil != ""
	switch {
	case !cc.tally:
		return nil
	case c.RetainUntil != "" && c.RetainUntil != "campaign_end":
		return fmt.Errorf("%s: retain_until %q is not campaign_end (the job's campaign_ends_at)", f, c.RetainUntil)
	case c.Calendar != "":
		return fmt.Errorf("%s: retain is for a rolling or lifetime cap (a tally cap), not a calendar one", f)
	case c.Reserve != nil || (c.Arbitration != nil && *c.Arbitration != 0):
		return fmt.Errorf("%s: a tally cap (lifetime, or with retain) keeps no reserve and no arbitration", f)
	case c.Window != Lifetime && cc.limit > capping.MaxTallyTimes:
		return fmt.Errorf("%s: a rolling tally cap has a limit of at most %d (its tally keeps the times of that many sends)", f, capping.MaxTallyTimes)
	case c.Retain < 0 || (c.Window != Lifetime && c.Retain != 0 && c.Retain < c.Window):
		return fmt.Errorf("%s: retain %v must be at least the window %v", f, c.Retain, c.Window)
	}
	cc.retain, cc.campaignEnd = time.Duration(c.Retain), c.RetainUntil != ""
	switch {
	case cc.retain > 0:
	case c.Window == Lifetime:
		cc.retain = DefaultLifetimeRetain
	default:
		cc.retain = cc.window
	}
	if c.Window == Lifetime {
		cc.window = 0
	}
	return nil
}

// defaultName names an unnamed cap after its window and scope: "24h", "day/push", "7d/promotional/campaign".
func defaultName(c Cap, channels []string) string {
	parts := []string{c.Calendar}
	if c.Calendar == "" {
		parts[0] = c.Window.String()
	}
	if len(channels) > 0 {
		parts = append(parts, strings.Join(channels, "+"))
	}
	if len(c.Tags) > 0 {
		parts = append(parts, strings.Join(c.Tags, "+"))
	}
	if c.PerCampaign {
		parts = append(parts, "campaign")
	}
	return strings.Join(parts, "/")
}

func weekday(s string) (time.Weekday, error) {
	if s == "" {
		return time.Monday, nil
	}
	for d := time.Sunday; d <= time.Saturday; d++ {
		if strings.EqualFold(s, d.String()) {
			return d, nil
		}
	}
	return 0, fmt.Errorf("%q is not a day of the week", s)
}

var zones sync.Map // name -> *time.Location

// Location resolves an IANA time zone name ("" is UTC), caching it.
func Location(name string) (*time.Location, error) {
	if name == "" {
		return time.UTC, nil
	}
	if l, ok := zones.Load(name); ok {
		return l.(*time.Location), nil
	}
	if len(name) > 64 || name == "Local" {
		return nil, fmt.Errorf("unknown time zone %q", name)
	}
	l, err := time.LoadLocation(name)
	if err != nil {
		return nil, fmt.Errorf("unknown time zone %q", name)
	}
	zones.Store(name, l)
	return l, nil
}

// SegmentNames returns the segments in priority order.
func (r *Rules) SegmentNames() []string { return slices.Clone(r.segments) }

// IsExempt reports whether category bypasses the caps (not counted, not capped).
func (r *Rules) IsExempt(category string) bool { return r.exempt[category] }

// IsCountOnly reports whether category is counted but never capped.
func (r *Rules) IsCountOnly(category string) bool { return r.countOnly[category] }

// Retention is how long a user's log must keep a send for every cap of these
// rules to see it: the longest rolling window, or a calendar month.
func (r *Rules) Retention() time.Duration { return r.retention }

// DefaultZone is the time zone of jobs without one.
func (r *Rules) DefaultZone() *time.Location { return r.zone }

// FailOpenAfter returns how long Redis may be unavailable before a job of
// category for a user of segment goes out unchecked: the shorter of the two
// rules that apply, or 0 when none does (fail-closed).
func (r *Rules) FailOpenAfter(category, segment string) time.Duration {
	c, s := r.failCat[category], r.failSeg[segment]
	if c == 0 || (s > 0 && s < c) {
		return s
	}
	return c
}

// Send is what the rules look at in a job.
type Send struct {
	Campaign     string
	CampaignEnds time.Time      // zero: the job does not say
	Zone         *time.Location // nil: the rules' default
	Priority     int            // below a cap's reserve.min_priority, its reserved slots are not the send's
}

// Caps appends to dst the caps of a user's segment (the default caps when
// inSegment is false or the segment has no rule), with calendar windows
// bounded at now in the send's time zone and per-campaign scopes narrowed to
// its campaign.
func (r *Rules) Caps(dst []capping.Cap, segment string, inSegment bool, s Send, now time.Time) []capping.Cap {
	caps := r.def
	if inSegment {
		if c, ok := r.bySegment[segment]; ok {
			caps = c
		}
	}
	zone := s.Zone
	if zone == nil {
		zone = r.zone
	}
	for i := range caps {
		c := &caps[i]
		out := capping.Cap{Name: c.name, Limit: c.limit, Scope: c.scope, Shadow: c.shadow, Arbitrated: c.arbitration > 0, Tally: c.tally}
		if c.tally {
			out.Keep = now.Add(c.retain)
			if c.campaignEnd && !s.CampaignEnds.IsZero() {
				out.Keep = maxTime(s.CampaignEnds, now.Add(c.window))
			}
		}
		if n := c.reservedFor(s.Priority); n > 0 {
			out.Limit, out.Reserved = c.limit-n, n
		}
		if c.perCampaign {
			out.Scope = c.scope.Campaign(s.Campaign)
		}
		if c.period == rolling { // a lifetime: 0
			out.Window = c.window
		} else {
			out.Since, out.Until = r.current(c.period, now, zone)
		}
		dst = append(dst, out)
	}
	return dst
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// current returns period(p, now, zone), from a per-zone cache while now is
// inside the cached period, so a job pays a map lookup, not a date computation.
func (r *Rules) current(p period, now time.Time, zone *time.Location) (since, until time.Time) {
	k := periodKey{zone, p, r.weekStart}
	if v, ok := periods.Load(k); ok {
		b := v.(*[2]time.Time)
		if !now.Before(b[0]) && now.Before(b[1]) {
			return b[0], b[1]
		}
	}
	since, until = r.period(p, now, zone)
	periods.Store(k, &[2]time.Time{since, until})
	return since, until
}

// period returns the local calendar period (day, week, month) that holds
// now in zone: from its first local midnight to the next period's. Days are
// 23 or 25 hours long across daylight-saving changes.
func (r *Rules) period(p period, now time.Time, zone *time.Location) (since, until time.Time) {
	t := now.In(zone)
	y, m, d := t.Date()
	switch p {
	case day:
		return midnight(y, m, d, zone), midnight(y, m, d+1, zone)
	case week:
		back := (int(t.Weekday()) - int(r.weekStart) + 7) % 7
		return midnight(y, m, d-back, zone), midnight(y, m, d-back+7, zone)
	default:
		return midnight(y, m, 1, zone), midnight(y, m+1, 1, zone)
	}
}

// midnight is the first instant of a local date. Where a zone skips
// midnight (a DST change at 00:00), time.Date moves it to the first instant
// that exists.
func midnight(y int, m time.Month, d int, zone *time.Location) time.Time {
	return time.Date(y, m, d, 0, 0, 0, 0, zone)
}
