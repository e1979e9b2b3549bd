package consumer

import (
	"fmt"
	"testing"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/rules"
)

// routeRules hold capped sends for up to two days, except promotions
// (dropped); night and quiet-held sends have quiet hours (dropped, held); SMS
// have a budget that holds for up to an hour.
const routeRules = `
default_caps:
  - {name: daily, window: 24h, limit: 2, reserve: {slots: 1, min_priority: 7}}
  - {name: promo-day, window: 24h, limit: 1, tags: [promotional], on_capped: {policy: drop}}
  - {name: weekly, window: 168h, limit: 5, on_capped: {policy: hold, max_hold: 2h}}
on_capped: {policy: hold, max_hold: 48h}
exempt_categories: [transactional]
fail_open: [{category: marketing, after: 10s}]
categories:
  - {name: promo, on_capped: {policy: drop}}
  - {name: night, quiet_hours: {from: "22:00", to: "08:00"}, on_capped: {policy: drop}}
  - {name: quiet-held, quiet_hours: {from: "22:00", to: "08:00"}}
budgets:
  - {name: sms, channel: sms, limit: 10, window: 1s, max_hold: 1h}
collapse:
  keys: [{name: price, tags: [price_drop], per_campaign: true, tag_prefix: "product:"}]
`

// TestRoute is route's table, on a fixed clock: each case gives what is
// known of a job and the outcome (or next step) it must get.
func TestRoute(t *testing.T) {
	var cfg rules.Config
	if err := yaml.Unmarshal([]byte(routeRules), &cfg); err != nil {
		t.Fatal(err)
	}
	rs, err := rules.Compile(cfg, 1)
	if err != nil {
		t.Fatal(err)
	}
	wheel, err := hold.NewWheel("sends.delay.", []time.Duration{time.Second, time.Minute, time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	noon := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	night := time.Date(2026, 11, 23, 23, 0, 0, 0, time.UTC)
	morning := time.Date(2026, 11, 24, 8, 0, 0, 0, time.UTC)
	h := time.Hour
	allowed := answer{asked: true, dec: capping.Decision{Allowed: true, At: noon, Recorded: noon.Add(time.Millisecond)}}
	dup := answer{asked: true, dec: capping.Decision{Allowed: true, Duplicate: true, At: noon, Recorded: noon.Add(-h)}}
	notFound := answer{asked: true, dec: capping.Decision{At: noon}}
	capped := func(retry time.Duration) answer {
		d := capping.Decision{Cap: "daily", At: noon}
		if retry > 0 {
			d.RetryAt = noon.Add(retry)
		}
		return answer{asked: true, dec: d}
	}
	tokens := grant{taken: true}
	short := func(in time.Duration) grant { return grant{taken: true, short: "sms", retryAt: noon.Add(in)} }
	copyOf := func(in time.Duration) grant { g := short(in); g.copy = true; return g }
	email := rules.Job{Channel: "email", Category: "marketing", Tags: []string{"marketing"}}
	sms := rules.Job{Channel: "sms", Category: "marketing", Tags: []string{"marketing"}}
	cat := func(c string) rules.Job { return rules.Job{Channel: "email", Category: c, Tags: []string{c}} }
	keyed := func(j rules.Job) rules.Job { j.CollapseKey = "k1"; return j }
	priceDrop := rules.Job{Channel: "push", Category: "marketing", Campaign: "c9", Tags: []string{"marketing", "price_drop", "product:42"}}
	mayGo := collapsed{asked: true}
	back := hold.State{Count: 1, Since: noon.Add(-46 * h), Reason: "daily"} // from a delay tier
	replaced := collapsed{asked: true, by: "job-9", why: "newer"}
	smsHeld := hold.State{Count: 1, Since: noon, Due: noon.Add(2 * time.Second), Wake: noon.Add(2 * time.Second), Reason: "sms"}
	dailyHeld := smsHeld
	dailyHeld.Reason = "daily"
	ended := func(s hold.State) hold.State { s.Due = noon; return s }
	for _, c := range []struct {
		name    string
		job     rules.Job
		f       facts
		now     time.Time // zero: noon
		noWheel bool
		want    string
	}{
		{name: "new job: Redis decides", job: email, want: "pending ask=decision"},
		{name: "allowed", job: email, f: facts{redis: allowed}, want: "allowed at=12:00:00.001"},
		{name: "duplicate", job: email, f: facts{redis: dup}, want: "duplicate at=11:00:00"},
		{name: "capped, held by the rules' policy", job: email, f: facts{since: noon, redis: capped(3 * h)},
			want: "held cap=daily due=15:00:00 by=cap count=1 tier=1h"},
		{name: "capped again after a hold: counted", job: email, f: facts{since: noon.Add(-h), arrived: hold.State{Count: 2, Since: noon.Add(-h)}, redis: capped(3 * h)},
			want: "held cap=daily due=15:00:00 by=cap count=3 tier=1h"},
		{name: "beyond max_hold", job: email, f: facts{since: noon.Add(-46 * h), redis: capped(3 * h)},
			want: "capped cap=daily reason=beyond max_hold retry=15:00:00 at=12:00:00"},
		{name: "beyond max_hold after a hold: a duplicate check, which marks it refused", job: email, f: facts{since: noon.Add(-46 * h), arrived: back, redis: capped(3 * h)},
			want: "pending ask=duplicate refused-as=daily"},
		{name: "beyond max_hold after a hold", job: email, f: facts{since: noon.Add(-46 * h), arrived: back, redis: capped(3 * h), mark: notFound},
			want: "capped cap=daily reason=beyond max_hold retry=15:00:00 at=12:00:00"},
		{name: "beyond max_hold after a hold, another copy allowed meanwhile: a duplicate", job: email, f: facts{since: noon.Add(-46 * h), arrived: back, redis: capped(3 * h), mark: dup},
			want: "duplicate at=11:00:00"},
		{name: "beyond max_hold after a hold, Redis down beyond fail-open for the mark: capped", job: email, f: facts{since: noon.Add(-46 * h), arrived: back, redis: capped(3 * h), mark: answer{asked: true, unchecked: true}},
			want: "capped cap=daily reason=beyond max_hold retry=15:00:00 at=12:00:00"},
		{name: "never after a hold: no mark (every copy is refused alike)", job: email, f: facts{since: noon, arrived: back, redis: capped(0)},
			want: "capped cap=daily reason=never at=12:00:00"},
		{name: "its slot comes after it expires", job: email, f: facts{since: noon, expiresAt: noon.Add(2 * h), redis: capped(3 * h), mark: notFound},
			want: "capped cap=daily reason=expired retry=15:00:00 at=12:00:00"},
		{name: "never: a limit of 0 under hold", job: email, f: facts{since: noon, redis: capped(0)},
			want: "capped cap=daily reason=never at=12:00:00"},
		{name: "drop policy of its category", job: cat("promo"), f: facts{since: noon, redis: capped(3 * h)},
			want: "capped cap=daily retry=15:00:00 at=12:00:00"},
		{name: "two caps refuse it, one drops: dropped", job: email, f: facts{since: noon, redis: answer{asked: true, dec: capping.Decision{Cap: "daily", RetryAt: noon.Add(3 * h), At: noon, Exceeded: []string{"daily", "promo-day"}}}},
			want: "capped cap=daily retry=15:00:00 at=12:00:00"},
		{name: "two caps refuse it, both hold: the shorter max_hold", job: email, f: facts{since: noon, redis: answer{asked: true, dec: capping.Decision{Cap: "daily", RetryAt: noon.Add(3 * h), At: noon, Exceeded: []string{"daily", "weekly"}}}, mark: notFound},
			want: "capped cap=daily reason=beyond max_hold retry=15:00:00 at=12:00:00"},
		{name: "capped by a reservation: says for which priority", job: email, noWheel: true, f: facts{since: noon, redis: answer{asked: true, dec: capping.Decision{Cap: "daily", RetryAt: noon.Add(3 * h), At: noon, Reserved: true}}},
			want: "capped cap=daily reserved-for=7 retry=15:00:00 at=12:00:00"},
		{name: "a candidate for the last slot: held until its window ends", job: email, f: facts{since: noon, redis: answer{asked: true, dec: capping.Decision{Cap: "daily", RetryAt: noon.Add(2 * time.Minute), At: noon, Candidate: true}}},
			want: "held cap=daily due=12:02:00 by=arbitration count=1 tier=1m arbitration=candidate"},
		{name: "back from its window: won", job: email, f: facts{since: noon, arrived: hold.State{Count: 1, Since: noon, Reason: ReasonArbitration}, redis: allowed},
			want: "allowed arbitration=won at=12:00:00.001"},
		{name: "back from its window: lost, dropped by its category", job: cat("promo"), f: facts{since: noon, arrived: hold.State{Count: 1, Since: noon, Reason: ReasonArbitration}, redis: capped(24 * h)},
			want: "capped cap=daily retry=12:00:00 arbitration=lost at=12:00:00"},
		{name: "back from its window: lost, held by the rules", job: email, f: facts{since: noon, arrived: hold.State{Count: 1, Since: noon, Reason: ReasonArbitration}, redis: capped(3 * h)},
			want: "held cap=daily due=15:00:00 by=cap count=2 tier=1h arbitration=lost"},
		{name: "no delay tiers: a hold policy drops", job: email, noWheel: true, f: facts{since: noon, redis: capped(3 * h)},
			want: "capped cap=daily retry=15:00:00 at=12:00:00"},
		{name: "expired on arrival: only a duplicate check, which marks it refused", job: email, f: facts{expiresAt: noon}, want: "pending ask=duplicate refused-as=expired"},
		{name: "expired, not sent before", job: email, f: facts{expiresAt: noon, redis: notFound},
			want: "capped cap=expired reason=expired at=12:00:00"},
		{name: "expired, a redelivery of a job that went", job: email, f: facts{expiresAt: noon, redis: dup}, want: "duplicate at=11:00:00"},
		{name: "expired, Redis down beyond fail-open: capped, not forwarded", job: email, f: facts{expiresAt: noon, redis: answer{asked: true, unchecked: true}},
			want: "capped cap=expired reason=expired at=12:00:00"},
		{name: "Redis down beyond fail-open", job: email, f: facts{redis: answer{asked: true, unchecked: true}}, want: "unchecked at=12:00:00"},
		{name: "invalid request", job: email, f: facts{redis: answer{asked: true, invalid: "empty channel"}}, want: "dlq error=empty channel"},
		{name: "exempt", job: cat("transactional"), want: "exempt at=12:00:00"},
		{name: "exempt and expired", job: cat("transactional"), f: facts{expiresAt: noon}, want: "capped cap=expired reason=expired at=12:00:00"},
		{name: "quiet hours, drop: a duplicate check first", job: cat("night"), now: night, want: "pending ask=duplicate refused-as=quiet_hours"},
		{name: "quiet hours, drop: capped until they end", job: cat("night"), now: night, f: facts{redis: notFound},
			want: "capped cap=quiet_hours reason=quiet_hours retry=08:00:00 at=12:00:00"},
		{name: "quiet hours, hold", job: cat("quiet-held"), now: night, f: facts{since: night},
			want: "held cap=quiet_hours due=08:00:00 by=quiet_hours count=1 tier=1h"},
		{name: "quiet hours, hold, expires first", job: cat("quiet-held"), now: night, f: facts{since: night, expiresAt: morning.Add(-h)}, want: "pending ask=duplicate refused-as=quiet_hours"},
		{name: "budget: tokens first", job: sms, want: "pending ask=tokens"},
		{name: "budget: granted, Redis decides", job: sms, f: facts{tokens: tokens}, want: "pending ask=decision"},
		{name: "budget exhausted: held until a token", job: sms, f: facts{since: noon, tokens: short(2 * time.Second)},
			want: "held cap=sms due=12:00:02 by=budget count=1 tier=1s"},
		{name: "budget exhausted beyond its max_hold: a duplicate check, which marks it refused", job: sms, f: facts{since: noon.Add(-h), tokens: short(2 * time.Second)},
			want: "pending ask=duplicate refused-as=sms"},
		{name: "a copy of a job refused for good before: refused too", job: email, f: facts{since: noon, redis: answer{asked: true, dec: capping.Decision{RefusedBefore: true, Cap: "sms", At: noon}}},
			want: "capped cap=sms reason=refused before at=12:00:00"},
		{name: "budget exhausted beyond its max_hold", job: sms, f: facts{since: noon.Add(-h), tokens: short(2 * time.Second), redis: notFound},
			want: "capped cap=sms reason=beyond max_hold retry=12:00:02 at=12:00:00"},
		{name: "budget exhausted, no delay tiers: capped naming the budget", job: sms, noWheel: true, f: facts{since: noon, tokens: short(2 * time.Second), redis: notFound},
			want: "capped cap=sms retry=12:00:02 at=12:00:00"},
		{name: "budget exhausted, a redelivery", job: sms, noWheel: true, f: facts{since: noon, tokens: short(time.Second), redis: dup}, want: "duplicate at=11:00:00"},
		{name: "another copy took its job's token: a duplicate check, unmarked", job: sms, f: facts{since: noon, tokens: copyOf(250 * time.Millisecond)},
			want: "pending ask=duplicate"},
		{name: "another copy took its job's token and was allowed: a duplicate", job: sms, f: facts{since: noon, tokens: copyOf(250 * time.Millisecond), redis: dup},
			want: "duplicate at=11:00:00"},
		{name: "another copy took its job's token, not decided yet: back shortly", job: sms, f: facts{since: noon, tokens: copyOf(250 * time.Millisecond), redis: notFound},
			want: "held cap=sms due=12:00:00.25 by=budget count=1 tier=1s"},
		{name: "another copy took its job's token and was refused for good: refused too", job: sms, f: facts{since: noon, tokens: copyOf(250 * time.Millisecond), redis: answer{asked: true, dec: capping.Decision{RefusedBefore: true, Cap: "daily", At: noon}}},
			want: "capped cap=daily reason=refused before at=12:00:00"},
		{name: "another copy took its job's token, beyond its max_hold: a duplicate check, which marks it refused", job: sms, f: facts{since: noon.Add(-h), tokens: copyOf(250 * time.Millisecond)},
			want: "pending ask=duplicate refused-as=sms"},
		{name: "another copy took its job's token, beyond its max_hold, not a duplicate: capped", job: sms, f: facts{since: noon.Add(-h), tokens: copyOf(250 * time.Millisecond), redis: notFound},
			want: "capped cap=sms reason=beyond max_hold retry=12:00:00.25 at=12:00:00"},
		{name: "released early for its budget: claims its token", job: sms, f: facts{since: noon, early: true, arrived: smsHeld},
			want: "pending ask=tokens"},
		{name: "released early, its claim granted: its hold ended, Redis decides", job: sms, f: facts{since: noon, early: true, arrived: ended(smsHeld), tokens: tokens},
			want: "pending ask=decision"},
		{name: "released early, its claim refused: back to its promise, no new hold", job: sms, f: facts{since: noon, early: true, arrived: smsHeld, tokens: short(2 * time.Second)},
			want: "moved due=12:00:02 count=1 tier=1s"},
		{name: "released early, held by another cap: on to its due time", job: sms, f: facts{since: noon, early: true, arrived: dailyHeld},
			want: "moved due=12:00:02 count=1 tier=1s"},
		{name: "released early, no budget of its own: on to its due time", job: email, f: facts{since: noon, early: true, arrived: smsHeld},
			want: "moved due=12:00:02 count=1 tier=1s"},
		{name: "a collapse key: checked first", job: keyed(email), want: "pending ask=collapse"},
		{name: "a collapse key the rules derive: checked first", job: priceDrop, want: "pending ask=collapse"},
		{name: "the tag the key needs missing: no key", job: rules.Job{Channel: "push", Category: "marketing", Tags: []string{"marketing", "price_drop"}}, want: "pending ask=decision"},
		{name: "a collapse key, the newest: Redis decides", job: keyed(email), f: facts{collapse: mayGo}, want: "pending ask=decision"},
		{name: "a collapse key, the newest, in quiet hours: held", job: keyed(cat("quiet-held")), now: night, f: facts{since: night, collapse: mayGo},
			want: "held cap=quiet_hours due=08:00:00 by=quiet_hours count=1 tier=1h"},
		{name: "a newer send of its key: a duplicate check, which marks it refused", job: keyed(email), f: facts{collapse: replaced}, want: "pending ask=duplicate refused-as=collapsed"},
		{name: "a newer send of its key, not sent before: collapsed", job: keyed(email), f: facts{collapse: replaced, redis: notFound},
			want: "capped cap=collapsed reason=collapsed by=job-9 at=12:00:00"},
		{name: "a newer send of its key, a redelivery of a job that went", job: keyed(email), f: facts{collapse: replaced, redis: dup}, want: "duplicate at=11:00:00"},
		{name: "a newer send of its key, back from a hold: collapsed, not held again", job: keyed(cat("quiet-held")), now: night, f: facts{since: night.Add(-h), arrived: hold.State{Count: 1, Since: night.Add(-h)}, collapse: replaced, redis: notFound},
			want: "capped cap=collapsed reason=collapsed by=job-9 at=12:00:00"},
		{name: "a collapse key, expired: no check of its key", job: keyed(email), f: facts{expiresAt: noon}, want: "pending ask=duplicate refused-as=expired"},
		{name: "a collapse key, exempt: no check of its key", job: keyed(cat("transactional")), want: "exempt at=12:00:00"},
	} {
		t.Run(c.name, func(t *testing.T) {
			now := c.now
			if now.IsZero() {
				now = noon
			}
			p := rs.Plan(c.job, now, nil)
			w := wheel
			if c.noWheel {
				w = nil
			}
			if got := describe(route(&p, &c.f, w, now)); got != c.want {
				t.Errorf("route:\n got %s\nwant %s", got, c.want)
			}
		})
	}
}

// TestRelease: a job from a delay tier before its due time moves to the
// tier that fits what is left of its wait; at its due time it is decided;
// a malformed one is dead-lettered, whatever else is known of it.
func TestRelease(t *testing.T) {
	wheel, err := hold.NewWheel("sends.delay.", []time.Duration{time.Second, time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	s := hold.State{Since: now.Add(-time.Hour), Due: now.Add(90 * time.Second), Count: 1, Reason: "daily"}
	var p rules.Plan
	o := route(&p, &facts{arrived: s}, wheel, now)
	if o.Kind != Moved || o.Tier.Name != "1m" || !o.Hold.Wake.Equal(now.Add(time.Minute)) || !o.Hold.Due.Equal(s.Due) || o.Hold.Count != 1 {
		t.Errorf("90 s before due: %+v; want moved to 1m, waking in 1m", o)
	}
	if o := route(&p, &facts{arrived: s}, wheel, s.Due); o.Kind == Moved {
		t.Error("at its due time: moved, want decided")
	}
	if o := route(&p, &facts{malformed: "bad", truncate: true, arrived: s}, wheel, now); o.Kind != DeadLetter || o.Error != "bad" || !o.Truncate {
		t.Errorf("malformed: %+v, want dead-lettered with its reason, truncated", o)
	}
}

// describe prints the parts of an outcome that its kind uses, times as
// UTC clock readings.
func describe(o Outcome) string {
	clock := func(t time.Time) string { return t.UTC().Format("15:04:05.999") }
	s := o.Kind.String()
	if o.Kind == Pending {
		s += " ask=" + [...]string{"nothing", "collapse", "tokens", "decision", "duplicate"}[o.Ask]
		if o.Cap != "" {
			s += " refused-as=" + o.Cap // the look marks the job refused
		}
		return s
	}
	add := func(k, v string) {
		if v != "" {
			s += " " + k + "=" + v
		}
	}
	add("cap", o.Cap)
	add("reason", o.Reason)
	add("by", o.CollapsedBy)
	add("error", o.Error)
	if o.ReservedFor > 0 {
		add("reserved-for", fmt.Sprint(o.ReservedFor))
	}
	if !o.RetryAt.IsZero() {
		add("retry", clock(o.RetryAt))
	}
	if o.Kind == Moved {
		add("due", clock(o.Hold.Due))
		add("count", fmt.Sprint(o.Hold.Count))
		add("tier", o.Tier.Name)
		return s
	}
	if o.Kind == Held {
		add("due", clock(o.Hold.Due))
		add("by", o.HeldBy)
		add("count", fmt.Sprint(o.Hold.Count))
		add("tier", o.Tier.Name)
		add("arbitration", o.Arbitration)
		return s
	}
	add("arbitration", o.Arbitration)
	if !o.DecidedAt.IsZero() {
		add("at", clock(o.DecidedAt))
	}
	return s
}

// TestArbitrates: a send asks for an arbitration when its caps have a window
// and it can wait for it before it expires, on delay tiers; one back from
// its window always does (to be resolved).
func TestArbitrates(t *testing.T) {
	var cfg rules.Config
	if err := yaml.Unmarshal([]byte("default_caps: [{name: daily, window: 24h, limit: 2, arbitration: 2m}]"), &cfg); err != nil {
		t.Fatal(err)
	}
	rs, err := rules.Compile(cfg, 1)
	if err != nil {
		t.Fatal(err)
	}
	wheel, _ := hold.NewWheel("d.", []time.Duration{time.Second})
	now := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	p := rs.Plan(rules.Job{Channel: "email", Category: "marketing", Tags: []string{"marketing"}}, now, nil)
	back := hold.State{Count: 1, Reason: ReasonArbitration}
	for _, c := range []struct {
		name  string
		f     facts
		wheel *hold.Wheel
		want  bool
	}{
		{"a new send", facts{}, wheel, true},
		{"expires after the window", facts{expiresAt: now.Add(3 * time.Minute)}, wheel, true},
		{"expires before the window ends", facts{expiresAt: now.Add(time.Minute)}, wheel, false},
		{"no delay tiers", facts{}, nil, false},
		{"back from its window", facts{arrived: back, expiresAt: now.Add(time.Second)}, wheel, true},
	} {
		if got := arbitrates(&p, &c.f, c.wheel, now); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}

// TestHoldUntilIsWhereHoldingEnds: a job due a millisecond before holdUntil
// is held, one due at it is refused (beyond max_hold, expired), and one that
// cannot be held at all gets now: a budget promises tokens only before it.
func TestHoldUntilIsWhereHoldingEnds(t *testing.T) {
	wheel, err := hold.NewWheel("d.", []time.Duration{time.Second, time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC)
	pol := rules.Policy{Hold: true, MaxHold: 2 * time.Hour}
	for _, c := range []struct {
		name   string
		f      facts
		until  time.Time
		reason string
	}{
		{"max_hold from submission", facts{since: now.Add(-time.Hour)}, now.Add(time.Hour), ReasonMaxHold},
		{"expiry first", facts{since: now, expiresAt: now.Add(30 * time.Minute)}, now.Add(30 * time.Minute), ReasonExpired},
	} {
		if got := holdUntil(&c.f, pol, wheel, now); !got.Equal(c.until) {
			t.Errorf("%s: holdUntil %v, want %v", c.name, got, c.until)
		}
		if o := holdOrRefuse(&c.f, pol, c.until.Add(-time.Millisecond), "sms", "budget", wheel, now); o.Kind != Held {
			t.Errorf("%s: due a millisecond before: %+v, want held", c.name, o)
		}
		if o := holdOrRefuse(&c.f, pol, c.until, "sms", "budget", wheel, now); o.Kind == Held || o.Reason != c.reason {
			t.Errorf("%s: due at holdUntil: %+v, want refused (%s)", c.name, o, c.reason)
		}
	}
	f := facts{since: now}
	if got := holdUntil(&f, rules.Policy{}, wheel, now); !got.Equal(now) {
		t.Errorf("drop policy: holdUntil %v, want now", got)
	}
	if got := holdUntil(&f, pol, nil, now); !got.Equal(now) {
		t.Errorf("no delay tiers: holdUntil %v, want now", got)
	}
}
