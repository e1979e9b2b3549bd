package rules_test

import (
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/rules"
)

func limit(n int) *int { return &n }

func compile(t *testing.T, c rules.Config) *rules.Rules {
	t.Helper()
	if c.DefaultCaps == nil {
		c.DefaultCaps = []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(3)}}
	}
	r, err := rules.Compile(c, 1)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func zone(t *testing.T, name string) *time.Location {
	t.Helper()
	l, err := rules.Location(name)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestCalendarPeriods: a calendar cap's window is the local day, week or
// month that holds now, in the job's zone, from local midnight to the next
// period's: across DST changes (23 h and 25 h days) and at non-hour offsets.
func TestCalendarPeriods(t *testing.T) {
	type tc struct {
		name, zone, calendar, weekStart string
		now                             string // local time in zone
		since, until                    string // local times in zone
		hours                           float64
	}
	tests := []tc{
		{"New York, an ordinary day", "America/New_York", "day", "", "2026-11-22 12:00", "2026-11-22 00:00", "2026-11-23 00:00", 24},
		{"New York, DST starts: 23 h", "America/New_York", "day", "", "2026-03-08 12:00", "2026-03-08 00:00", "2026-03-09 00:00", 23},
		{"New York, DST ends: 25 h", "America/New_York", "day", "", "2026-11-01 01:30", "2026-11-01 00:00", "2026-11-02 00:00", 25},
		{"Kolkata, exactly at midnight", "Asia/Kolkata", "day", "", "2026-11-22 00:00", "2026-11-22 00:00", "2026-11-23 00:00", 24},
		{"Kolkata, the last millisecond", "Asia/Kolkata", "day", "", "2026-11-22 23:59:59.999", "2026-11-22 00:00", "2026-11-23 00:00", 24},
		{"Adelaide, DST starts: 23 h", "Australia/Adelaide", "day", "", "2026-10-04 12:00", "2026-10-04 00:00", "2026-10-05 00:00", 23},
		{"Adelaide, DST ends: 25 h", "Australia/Adelaide", "day", "", "2026-04-05 12:00", "2026-04-05 00:00", "2026-04-06 00:00", 25},
		{"week from Monday, on a Sunday", "Asia/Kolkata", "week", "", "2026-11-22 10:00", "2026-11-16 00:00", "2026-11-23 00:00", 168},
		{"week from Sunday, on a Sunday", "Asia/Kolkata", "week", "sunday", "2026-11-22 10:00", "2026-11-22 00:00", "2026-11-29 00:00", 168},
		{"week from Monday, on a Monday midnight", "America/New_York", "week", "monday", "2026-11-23 00:00", "2026-11-23 00:00", "2026-11-30 00:00", 168},
		{"week across the end of DST", "America/New_York", "week", "", "2026-11-01 12:00", "2026-10-26 00:00", "2026-11-02 00:00", 169},
		{"month across the end of DST", "Australia/Adelaide", "month", "", "2026-04-15 09:00", "2026-04-01 00:00", "2026-05-01 00:00", 30*24 + 1},
		{"February", "Asia/Kolkata", "month", "", "2028-02-29 23:00", "2028-02-01 00:00", "2028-03-01 00:00", 29 * 24},
		{"December into January", "America/New_York", "month", "", "2026-12-31 23:59", "2026-12-01 00:00", "2027-01-01 00:00", 31 * 24},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			loc := zone(t, tt.zone)
			parse := func(s string) time.Time {
				for _, layout := range []string{"2006-01-02 15:04:05.000", "2006-01-02 15:04"} {
					if v, err := time.ParseInLocation(layout, s, loc); err == nil {
						return v
					}
				}
				t.Fatalf("bad time %q", s)
				return time.Time{}
			}
			r := compile(t, rules.Config{WeekStart: tt.weekStart, DefaultCaps: []rules.Cap{{Name: "c", Calendar: tt.calendar, Limit: limit(1)}}})
			caps := r.Caps(nil, "", false, rules.Send{Zone: loc}, parse(tt.now))
			if len(caps) != 1 {
				t.Fatalf("%d caps", len(caps))
			}
			c := caps[0]
			if !c.Since.Equal(parse(tt.since)) || !c.Until.Equal(parse(tt.until)) || c.Window != 0 {
				t.Fatalf("period %v to %v, want %s to %s", c.Since.In(loc), c.Until.In(loc), tt.since, tt.until)
			}
			if h := c.Until.Sub(c.Since).Hours(); h != tt.hours {
				t.Fatalf("period of %v hours, want %v", h, tt.hours)
			}
		})
	}
}

// TestDefaultZone: a job without a zone gets the rules' default_timezone.
func TestDefaultZone(t *testing.T) {
	r := compile(t, rules.Config{DefaultTimezone: "Asia/Kolkata", DefaultCaps: []rules.Cap{{Calendar: "day", Limit: limit(1)}}})
	now := time.Date(2026, 11, 22, 20, 0, 0, 0, time.UTC) // 01:30 on the 23rd in Kolkata
	c := r.Caps(nil, "", false, rules.Send{}, now)[0]
	if want := time.Date(2026, 11, 22, 18, 30, 0, 0, time.UTC); !c.Since.Equal(want) {
		t.Fatalf("since %v, want %v (local midnight in Kolkata)", c.Since.UTC(), want)
	}
}

// TestScopes: a cap's scope selects sends by channels, tags and campaign,
// alone and combined; segments get their caps, others the default ones.
func TestScopes(t *testing.T) {
	r := compile(t, rules.Config{
		Segments: []rules.Segment{{Name: "vip", Caps: []rules.Cap{
			{Name: "all", Window: rules.Duration(time.Hour), Limit: limit(9)},
			{Name: "push-or-sms", Window: rules.Duration(time.Hour), Limit: limit(9), Scope: rules.Scope{Channels: []string{"push", "sms"}}},
			{Name: "promo", Window: rules.Duration(time.Hour), Limit: limit(9), Scope: rules.Scope{Tags: []string{"promotional", "sale"}}},
			{Name: "promo-push", Window: rules.Duration(time.Hour), Limit: limit(9), Scope: rules.Scope{Channel: "push", Tags: []string{"promotional"}}},
			{Name: "campaign", Window: rules.Duration(time.Hour), Limit: limit(9), Scope: rules.Scope{PerCampaign: true}},
			{Name: "campaign-sms", Window: rules.Duration(time.Hour), Limit: limit(9), Scope: rules.Scope{PerCampaign: true, Channel: "sms"}},
		}}},
	})
	caps := r.Caps(nil, "vip", true, rules.Send{Campaign: "c1"}, time.Now())
	send := func(channel, campaign string, tags ...string) string {
		return capping.Member("j", channel, campaign, tags)
	}
	for _, tt := range []struct {
		member string
		want   string // names of the caps that count it
	}{
		{send("email", "c1", "marketing"), "all campaign"},
		{send("push", "c1", "marketing", "promotional"), "all push-or-sms promo promo-push campaign"},
		{send("sms", "c2", "marketing", "sale"), "all push-or-sms promo"},
		{send("sms", "c1", "newsletter"), "all push-or-sms campaign campaign-sms"},
		{send("email", "c2", "promotional"), "all promo"},
	} {
		var got []string
		for _, c := range caps {
			if c.Scope.Matches(tt.member) {
				got = append(got, c.Name)
			}
		}
		if strings.Join(got, " ") != tt.want {
			t.Errorf("member %x counted by %v, want %s", tt.member, got, tt.want)
		}
	}
	if d := r.Caps(nil, "vip", false, rules.Send{}, time.Now()); len(d) != 1 || d[0].Name != "daily" {
		t.Errorf("a user in no segment: caps %+v, want the default daily", d)
	}
	if d := r.Caps(nil, "unlisted", true, rules.Send{}, time.Now()); len(d) != 1 || d[0].Name != "daily" {
		t.Errorf("a segment without rules: caps %+v, want the default daily", d)
	}
}

func TestCategories(t *testing.T) {
	r := compile(t, rules.Config{CountOnlyCategories: []string{"receipt"}})
	if !r.IsExempt("transactional") || r.IsExempt("receipt") || !r.IsCountOnly("receipt") || r.IsCountOnly("marketing") {
		t.Error("default exempt [transactional] and count-only [receipt] not as configured")
	}
	if r := compile(t, rules.Config{ExemptCategories: []string{}}); r.IsExempt("transactional") {
		t.Error("exempt_categories: [] still exempts transactional")
	}
}

func TestRetentionCoversEveryWindow(t *testing.T) {
	r := compile(t, rules.Config{Segments: []rules.Segment{{Name: "s", Caps: []rules.Cap{{Window: rules.Duration(40 * 24 * time.Hour), Limit: limit(1)}}}}})
	if r.Retention() != 40*24*time.Hour {
		t.Errorf("retention %v, want the 40d window", r.Retention())
	}
	r = compile(t, rules.Config{DefaultCaps: []rules.Cap{{Calendar: "month", Limit: limit(1)}}})
	if r.Retention() < 31*24*time.Hour {
		t.Errorf("retention %v, shorter than a month", r.Retention())
	}
}

// TestTallyCaps: "window: lifetime" and a rolling window with retain are
// tally caps: handed to the hot path with their keep, outside the log's
// retention; a long window without retain stays in the log.
func TestTallyCaps(t *testing.T) {
	var c rules.Config
	src := `
default_caps:
  - {name: daily, window: 24h, limit: 3}
  - {name: welcome-once, window: lifetime, limit: 1, tags: [welcome], per_campaign: true}
  - {name: survey, window: 90d, retain: 120d, limit: 1, tags: [survey]}
  - {name: winback, window: lifetime, retain: 2y, limit: 3}
`
	if err := yaml.Unmarshal([]byte(src), &c); err == nil || !strings.Contains(err.Error(), `invalid duration "2y"`) {
		t.Fatalf("retain 2y: %v, want an invalid duration", err)
	}
	if err := yaml.Unmarshal([]byte(strings.Replace(src, "2y", "730d", 1)), &c); err != nil {
		t.Fatal(err)
	}
	r := compile(t, c)
	if r.Retention() != 24*time.Hour {
		t.Errorf("retention %v, want the daily window alone", r.Retention())
	}
	now := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	caps := r.Caps(nil, "", false, rules.Send{Campaign: "w1"}, now)
	day := 24 * time.Hour
	for i, want := range []struct {
		tally  bool
		window time.Duration
		keep   time.Duration
	}{{false, day, 0}, {true, 0, 400 * day}, {true, 90 * day, 120 * day}, {true, 0, 730 * day}} {
		c := caps[i]
		var keep time.Duration
		if !c.Keep.IsZero() {
			keep = c.Keep.Sub(now)
		}
		if c.Tally != want.tally || c.Window != want.window || keep != want.keep {
			t.Errorf("cap %s: tally %v window %v keep +%v, want %v %v +%v", c.Name, c.Tally, c.Window, keep, want.tally, want.window, want.keep)
		}
	}
	if caps[1].TallyField() == r.Caps(nil, "", false, rules.Send{Campaign: "w2"}, now)[1].TallyField() {
		t.Error("a per-campaign lifetime cap has one tally field for two campaigns")
	}
	// retain_until: campaign_end keeps a count until the job's campaign ends, at least a window from now.
	ends := compile(t, rules.Config{DefaultCaps: []rules.Cap{
		{Name: "once", Window: rules.Lifetime, Limit: limit(1), Scope: rules.Scope{PerCampaign: true}, RetainUntil: "campaign_end"},
		{Name: "week", Window: rules.Duration(7 * day), Limit: limit(1), RetainUntil: "campaign_end"}}})
	for _, tt := range []struct {
		ends       time.Time
		once, week time.Duration
	}{{time.Time{}, 400 * day, 7 * day}, {now.Add(30 * day), 30 * day, 30 * day}, {now.Add(day), day, 7 * day}} {
		cs := ends.Caps(nil, "", false, rules.Send{Campaign: "w1", CampaignEnds: tt.ends}, now)
		if got := [2]time.Duration{cs[0].Keep.Sub(now), cs[1].Keep.Sub(now)}; !cs[0].Tally || !cs[1].Tally || got != [2]time.Duration{tt.once, tt.week} {
			t.Errorf("campaign ends %v: keeps +%v, tally %v %v; want +%v +%v", tt.ends, got, cs[0].Tally, cs[1].Tally, tt.once, tt.week)
		}
	}
	long := compile(t, rules.Config{DefaultCaps: []rules.Cap{{Window: rules.Duration(90 * day), Limit: limit(20)}}})
	if c := long.Caps(nil, "", false, rules.Send{}, now)[0]; c.Tally || long.Retention() != 90*day {
		t.Errorf("a 90d cap without retain: tally %v, retention %v; want it in the log", c.Tally, long.Retention())
	}
}

func TestCompileErrors(t *testing.T) {
	day := rules.Duration(24 * time.Hour)
	for _, tt := range []struct {
		name string
		c    rules.Config
		err  string
	}{
		{"no default caps", rules.Config{DefaultCaps: []rules.Cap{}}, "at least one cap"},
		{"window and calendar", rules.Config{DefaultCaps: []rules.Cap{{Window: day, Calendar: "day", Limit: limit(1)}}}, "exactly one of window"},
		{"neither window nor calendar", rules.Config{DefaultCaps: []rules.Cap{{Limit: limit(1)}}}, "exactly one of window"},
		{"unknown calendar", rules.Config{DefaultCaps: []rules.Cap{{Calendar: "fortnight", Limit: limit(1)}}}, `"fortnight" is not day, week or month`},
		{"no limit", rules.Config{DefaultCaps: []rules.Cap{{Window: day}}}, "limit is required"},
		{"negative limit", rules.Config{DefaultCaps: []rules.Cap{{Window: day, Limit: limit(-1)}}}, "must not be negative"},
		{"channel and channels", rules.Config{DefaultCaps: []rules.Cap{{Window: day, Limit: limit(1), Scope: rules.Scope{Channel: "a", Channels: []string{"b"}}}}}, "not both"},
		{"two caps of one name", rules.Config{DefaultCaps: []rules.Cap{{Name: "x", Window: day, Limit: limit(1)}, {Name: "x", Window: day, Limit: limit(2)}}}, `a second cap named "x"`},
		{"unknown zone", rules.Config{DefaultTimezone: "Mars/Olympus"}, `unknown time zone "Mars/Olympus"`},
		{"bad week start", rules.Config{WeekStart: "someday"}, "not a day of the week"},
		{"count-only and exempt", rules.Config{CountOnlyCategories: []string{"transactional"}}, "also exempt"},
		{"retain on a calendar cap", rules.Config{DefaultCaps: []rules.Cap{{Calendar: "day", Retain: day, Limit: limit(1)}}}, "not a calendar one"},
		{"a tally cap with a reserve", rules.Config{DefaultCaps: []rules.Cap{{Window: rules.Lifetime, Limit: limit(2), Reserve: &rules.Reserve{Slots: 1, MinPriority: 50}}}}, "no reserve and no arbitration"},
		{"a rolling tally cap over 16", rules.Config{DefaultCaps: []rules.Cap{{Window: 90 * day, Retain: 90 * day, Limit: limit(17)}}}, "at most 16"},
		{"retain until what", rules.Config{DefaultCaps: []rules.Cap{{Window: rules.Lifetime, RetainUntil: "forever", Limit: limit(1)}}}, `retain_until "forever" is not campaign_end`},
		{"retain below the window", rules.Config{DefaultCaps: []rules.Cap{{Window: 90 * day, Retain: 30 * day, Limit: limit(1)}}}, "must be at least the window"},
		{"a collapse key without a name", rules.Config{Collapse: &rules.Collapse{Keys: []rules.CollapseKey{{Scope: rules.Scope{Tags: []string{"a"}}}}}}, "name is required"},
		{"two collapse keys of one name", rules.Config{Collapse: &rules.Collapse{Keys: []rules.CollapseKey{{Name: "k"}, {Name: "k"}}}}, `a second key named "k"`},
		{"a collapse retain below its window", rules.Config{Collapse: &rules.Collapse{Window: day, Retain: rules.Duration(time.Hour)}}, "must be at least the window"},
		{"segment twice", rules.Config{Segments: []rules.Segment{{Name: "a", Caps: []rules.Cap{{Window: day, Limit: limit(1)}}}, {Name: "a", Caps: []rules.Cap{{Window: day, Limit: limit(1)}}}}}, "listed twice"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			if tt.c.DefaultCaps == nil {
				tt.c.DefaultCaps = []rules.Cap{{Window: day, Limit: limit(1)}}
			}
			if _, err := rules.Compile(tt.c, 1); err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Fatalf("err = %v, want one containing %q", err, tt.err)
			}
		})
	}
}

// TestCollapseKeys: a job's own collapse_key is its key; else the first
// key rule that selects it derives one (its name, its campaign with
// per_campaign, its first tag of tag_prefix, which it must have); an exempt
// or count-only send has none; the window and retain are the rules'.
func TestCollapseKeys(t *testing.T) {
	var c rules.Config
	if err := yaml.Unmarshal([]byte(`
default_caps: [{window: 24h, limit: 3}]
count_only_categories: [receipt]
collapse:
  window: 1h
  keys:
    - {name: price, channel: push, tags: [price_drop], per_campaign: true, tag_prefix: "product:"}
    - {name: news, tags: [news]}
`), &c); err != nil {
		t.Fatal(err)
	}
	r := compile(t, c)
	now := time.Date(2026, 11, 28, 9, 0, 0, 0, time.UTC)
	for _, tt := range []struct {
		name string
		job  rules.Job
		want string
	}{
		{"its own key", rules.Job{Channel: "push", Category: "marketing", Tags: []string{"marketing", "price_drop", "product:1"}, CollapseKey: "mine"}, "mine"},
		{"per campaign and product", rules.Job{Channel: "push", Category: "marketing", Campaign: "c7", Tags: []string{"marketing", "price_drop", "x", "product:1", "product:2"}}, "price/c7/product:1"},
		{"no product tag: the next rule", rules.Job{Channel: "push", Category: "marketing", Campaign: "c7", Tags: []string{"marketing", "price_drop", "news"}}, "news"},
		{"another channel", rules.Job{Channel: "email", Category: "marketing", Tags: []string{"marketing", "price_drop", "product:1"}}, ""},
		{"exempt", rules.Job{Channel: "push", Category: "transactional", Tags: []string{"transactional", "news"}, CollapseKey: "mine"}, ""},
		{"count-only", rules.Job{Channel: "push", Category: "receipt", Tags: []string{"receipt", "news"}, CollapseKey: "mine"}, ""},
	} {
		p := r.Plan(tt.job, now, nil)
		if p.Collapse.Key != tt.want {
			t.Errorf("%s: collapse key %q, want %q", tt.name, p.Collapse.Key, tt.want)
		}
		if tt.want != "" && (p.Collapse.Window != time.Hour || p.Collapse.Retain != rules.DefaultCollapseRetain) {
			t.Errorf("%s: window %v retain %v, want 1h and the default", tt.name, p.Collapse.Window, p.Collapse.Retain)
		}
	}
}

// TestPeriodCacheFollowsTheClock: the cached period is reused within it and
// replaced once now leaves it, forwards or backwards.
func TestPeriodCacheFollowsTheClock(t *testing.T) {
	ny := zone(t, "America/New_York")
	r := compile(t, rules.Config{DefaultCaps: []rules.Cap{{Calendar: "day", Limit: limit(1)}}})
	day := func(y int, m time.Month, d int) time.Time { return time.Date(y, m, d, 0, 0, 0, 0, ny) }
	for _, tt := range []struct {
		now   time.Time
		since time.Time
	}{
		{day(2026, 11, 22).Add(10 * time.Hour), day(2026, 11, 22)},
		{day(2026, 11, 22).Add(23*time.Hour + 59*time.Minute), day(2026, 11, 22)},
		{day(2026, 11, 23), day(2026, 11, 23)},
		{day(2026, 11, 21).Add(12 * time.Hour), day(2026, 11, 21)},
		{day(2026, 11, 22).Add(time.Hour), day(2026, 11, 22)},
	} {
		if c := r.Caps(nil, "", false, rules.Send{Zone: ny}, tt.now)[0]; !c.Since.Equal(tt.since) || !c.Until.Equal(tt.since.AddDate(0, 0, 1)) {
			t.Errorf("at %v: period %v to %v, want the day from %v", tt.now, c.Since, c.Until, tt.since)
		}
	}
}
