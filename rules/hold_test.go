package rules_test

import (
	"strings"
	"testing"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/capper-dev/capper/rules"
)

func parse(t *testing.T, src string) rules.Config {
	t.Helper()
	var c rules.Config
	if err := yaml.Unmarshal([]byte(src), &c); err != nil {
		t.Fatal(err)
	}
	return c
}

// TestOnCappedPrecedence: the cap's policy, else the category's, else the
// segment's, else the rules', else drop.
func TestOnCappedPrecedence(t *testing.T) {
	r := compile(t, parse(t, `
on_capped: {policy: hold, max_hold: 24h}
segments:
  - name: vip
    on_capped: {policy: hold, max_hold: 2h}
    caps:
      - {name: daily, window: 24h, limit: 3}
      - {name: push, window: 24h, limit: 1, channel: push, on_capped: {policy: drop}}
  - name: plain
    caps: [{name: daily, window: 24h, limit: 3}]
default_caps: [{name: daily, window: 24h, limit: 2, on_capped: {policy: hold, max_hold: 1h}}, {name: weekly, window: 7d, limit: 5}]
categories:
  - {name: alert, on_capped: {policy: drop}}
  - {name: promo, on_capped: {policy: hold, max_hold: 30m}}
`))
	hold := func(d time.Duration) rules.Policy { return rules.Policy{Hold: true, MaxHold: d} }
	for _, c := range []struct {
		name              string
		segment, cat, cap string
		inSegment         bool
		want              rules.Policy
	}{
		{"cap's own", "vip", "promo", "push", true, rules.Policy{}},
		{"category over segment", "vip", "promo", "daily", true, hold(30 * time.Minute)},
		{"category drop over rules hold", "plain", "alert", "daily", true, rules.Policy{}},
		{"segment", "vip", "marketing", "daily", true, hold(2 * time.Hour)},
		{"rules", "plain", "marketing", "daily", true, hold(24 * time.Hour)},
		{"default caps' cap", "", "marketing", "daily", false, hold(time.Hour)},
		{"a segment without rules gets the default caps'", "nosuch", "marketing", "daily", true, hold(time.Hour)},
		{"default caps, no cap policy", "", "marketing", "weekly", false, hold(24 * time.Hour)},
		{"quiet hours skip the cap's", "", "marketing", "", false, hold(24 * time.Hour)},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := r.OnCapped(c.segment, c.inSegment, c.cat, c.cap); got != c.want {
				t.Errorf("OnCapped = %+v, want %+v", got, c.want)
			}
		})
	}
	if !r.Holds() {
		t.Error("Holds() is false with hold policies")
	}
	if compile(t, rules.Config{}).Holds() {
		t.Error("Holds() is true without any")
	}
}

// TestQuietHours: the end of the quiet range that holds now, in local
// wall-clock time: ranges across midnight, boundaries (from inclusive, to
// exclusive), DST nights, several zones, and the segment's and category's
// ranges chained.
func TestQuietHours(t *testing.T) {
	r := compile(t, parse(t, `
segments:
  - name: night
    quiet_hours: {from: "21:00", to: "08:00"}
    caps: [{name: daily, window: 24h, limit: 3}]
  - name: lunch
    quiet_hours: {from: "12:00", to: "13:30:30"}
    caps: [{name: daily, window: 24h, limit: 3}]
default_caps: [{name: daily, window: 24h, limit: 3}]
default_quiet_hours: {from: "23:00", to: "24:00"}
categories:
  - {name: promo, quiet_hours: {from: "07:30", to: "09:00"}}
count_only_categories: [receipt]
`))
	ny, berlin, kolkata := zone(t, "America/New_York"), zone(t, "Europe/Berlin"), zone(t, "Asia/Kolkata")
	at := func(z *time.Location, s string) time.Time {
		tm, err := time.ParseInLocation("2006-01-02 15:04:05", s, z)
		if err != nil {
			t.Fatal(err)
		}
		return tm
	}
	for _, c := range []struct {
		name, segment, cat string
		zone               *time.Location
		now                string
		want               string // "" = not quiet
	}{
		{"before midnight", "night", "marketing", ny, "2026-06-10 22:15:00", "2026-06-11 08:00:00"},
		{"after midnight", "night", "marketing", ny, "2026-06-11 03:00:00", "2026-06-11 08:00:00"},
		{"from is inclusive", "night", "marketing", ny, "2026-06-10 21:00:00", "2026-06-11 08:00:00"},
		{"to is exclusive", "night", "marketing", ny, "2026-06-11 08:00:00", ""},
		{"daytime", "night", "marketing", ny, "2026-06-11 14:00:00", ""},
		{"seconds", "lunch", "marketing", kolkata, "2026-06-11 13:30:29", "2026-06-11 13:30:30"},
		{"spring forward night (7 h)", "night", "marketing", ny, "2026-03-07 23:00:00", "2026-03-08 08:00:00"},
		{"fall back night (9 h)", "night", "marketing", berlin, "2026-10-24 22:00:00", "2026-10-25 08:00:00"},
		{"to 24:00 is the next midnight", "nosuch", "marketing", nil, "2026-06-11 23:10:00", "2026-06-12 00:00:00"},
		{"segment's night then the category's morning", "night", "promo", ny, "2026-06-11 02:00:00", "2026-06-11 09:00:00"},
		{"category alone", "lunch", "promo", ny, "2026-06-11 08:00:00", "2026-06-11 09:00:00"},
		{"count-only is never quiet", "night", "receipt", ny, "2026-06-11 02:00:00", ""},
		{"exempt is never quiet", "night", "transactional", ny, "2026-06-11 02:00:00", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			z := c.zone
			if z == nil {
				z = time.UTC
			}
			inSegment := c.segment != "nosuch"
			got := r.QuietUntil(c.segment, inSegment, c.cat, c.zone, at(z, c.now))
			var want time.Time
			if c.want != "" {
				want = at(z, c.want)
			}
			if !got.Equal(want) {
				t.Errorf("QuietUntil(%s %s) = %v, want %v", c.now, z, got.In(z), want)
			}
		})
	}
	// The spring-forward night is an hour shorter in elapsed time.
	start := at(ny, "2026-03-07 23:00:00")
	if d := r.QuietUntil("night", true, "marketing", ny, start).Sub(start); d != 8*time.Hour {
		t.Errorf("spring-forward: quiet for %v from 23:00, want 8h of elapsed time", d)
	}
}

func TestHoldRulesRejected(t *testing.T) {
	for _, c := range []struct{ name, src, want string }{
		{"hold without max_hold", `on_capped: {policy: hold}`, "needs max_hold"},
		{"max_hold too long", `on_capped: {policy: hold, max_hold: 31d}`, "needs max_hold"},
		{"drop with max_hold", `on_capped: {policy: drop, max_hold: 1h}`, "only applies to policy hold"},
		{"unknown policy", `on_capped: {policy: queue}`, "not drop or hold"},
		{"bad time", `default_quiet_hours: {from: "9pm", to: "08:00"}`, "not a time of day"},
		{"25:00", `default_quiet_hours: {from: "25:00", to: "08:00"}`, "not a time of day"},
		{"empty range", `default_quiet_hours: {from: "08:00", to: "08:00"}`, "empty range"},
		{"category twice", "categories: [{name: a, on_capped: {policy: drop}}, {name: a, on_capped: {policy: drop}}]", "listed twice"},
		{"category twice, neither setting anything", "categories: [{name: a}, {name: a}]", "listed twice"},
		{"exempt category", "categories: [{name: transactional, quiet_hours: {from: '21:00', to: '08:00'}}]", "is exempt"},
		{"cap policy", "default_caps: [{name: d, window: 1h, limit: 1, on_capped: {policy: hold}}]", "default_caps[0].on_capped"},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := parse(t, c.src)
			if cfg.DefaultCaps == nil {
				cfg.DefaultCaps = []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(3)}}
			}
			_, err := rules.Compile(cfg, 1)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("Compile: %v, want an error with %q", err, c.want)
			}
		})
	}
}

// TestLongestHold: a plan carries the longest a send may wait on the delay
// tiers under the rules (how long a refusal's mark must outlive it): the
// longest max_hold of a hold policy or a budget, or arbitration window.
func TestLongestHold(t *testing.T) {
	hold := func(d time.Duration) *rules.OnCapped {
		return &rules.OnCapped{Policy: "hold", MaxHold: rules.Duration(d)}
	}
	day := rules.Cap{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(1)}
	ownHold := day
	ownHold.OnCapped = hold(72 * time.Hour)
	arbitrated := day
	window := rules.Duration(2 * time.Minute)
	arbitrated.Arbitration = &window
	for _, c := range []struct {
		name string
		cfg  rules.Config
		want time.Duration
	}{
		{"drop: none", rules.Config{DefaultCaps: []rules.Cap{day}}, 0},
		{"the rules' policy", rules.Config{OnCapped: hold(2 * time.Hour), DefaultCaps: []rules.Cap{day}}, 2 * time.Hour},
		{"a cap's own, longer", rules.Config{OnCapped: hold(2 * time.Hour), DefaultCaps: []rules.Cap{ownHold}}, 72 * time.Hour},
		{"a category's", rules.Config{DefaultCaps: []rules.Cap{day}, Categories: []rules.Category{{Name: "promo", OnCapped: hold(5 * time.Hour)}}}, 5 * time.Hour},
		{"a budget's default max_hold", rules.Config{OnCapped: hold(2 * time.Hour), DefaultCaps: []rules.Cap{day},
			Budgets: []rules.Budget{{Name: "sms", Limit: limit(10), Window: rules.Duration(time.Second)}}}, 24 * time.Hour},
		{"an arbitration window", rules.Config{DefaultCaps: []rules.Cap{arbitrated}}, 2 * time.Minute},
	} {
		r := compile(t, c.cfg)
		if got := r.Plan(rules.Job{Channel: "email", Category: "marketing"}, time.Now(), nil).LongestHold; got != c.want {
			t.Errorf("%s: LongestHold %v, want %v", c.name, got, c.want)
		}
	}
}
