package rules_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testenv"
	"github.com/capper-dev/capper/rules"
)

// decider decides sends for one user through compiled rules and a real
// Limiter, at a clock the test moves.
type decider struct {
	t     *testing.T
	lim   *capping.Limiter
	rules *rules.Rules
	now   time.Time
	zone  *time.Location
	seq   int
}

func newDecider(t *testing.T, r *rules.Rules, now time.Time, zone *time.Location) *decider {
	t.Helper()
	d := &decider{t: t, rules: r, now: now, zone: zone}
	lim, err := capping.New(context.Background(), testenv.ClusterClient(t), capping.Config{KeyPrefix: testenv.Unique("rules"), Clock: func() time.Time { return d.now }})
	if err != nil {
		t.Fatal(err)
	}
	d.lim = lim
	return d
}

// send decides one send of user 7 and returns "allowed", "capped by NAME"
// or "allowed, shadow NAME".
func (d *decider) send(channel, campaign string, tags ...string) (string, capping.Decision) {
	d.t.Helper()
	d.seq++
	req := capping.Request{UserID: 7, JobID: fmt.Sprint("j", d.seq), Channel: channel, Campaign: campaign, Tags: tags,
		Caps: d.rules.Caps(nil, "", false, rules.Send{Campaign: campaign, Zone: d.zone}, d.now), Retention: d.rules.Retention()}
	ds, err := d.lim.Decide(context.Background(), []capping.Request{req})
	if err != nil {
		d.t.Fatal(err)
	}
	switch dec := ds[0]; {
	case !dec.Allowed:
		return "capped by " + dec.Cap, dec
	case len(dec.Shadow) > 0:
		return "allowed, shadow " + strings.Join(dec.Shadow, ","), dec
	default:
		return "allowed", dec
	}
}

// TestCapsOfEveryKindOnOneUser decides a user's sends against a rolling cap,
// a tag-scoped calendar day, a per-campaign calendar week on two channels and
// a shadow cap, all in one script call per send, in Asia/Kolkata.
func TestCapsOfEveryKindOnOneUser(t *testing.T) {
	kolkata := zone(t, "Asia/Kolkata")
	r := compile(t, rules.Config{DefaultCaps: []rules.Cap{
		{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(4)},
		{Name: "promo-today", Calendar: "day", Limit: limit(1), Scope: rules.Scope{Tags: []string{"promotional"}}},
		{Name: "campaign-week", Calendar: "week", Limit: limit(1), Scope: rules.Scope{PerCampaign: true, Channels: []string{"push", "sms"}}},
		{Name: "today-shadow", Calendar: "day", Limit: limit(1), Shadow: true},
	}})
	start := time.Date(2026, 11, 22, 20, 0, 0, 0, kolkata) // a Sunday evening
	d := newDecider(t, r, start, kolkata)
	steps := []struct {
		advance  time.Duration
		channel  string
		campaign string
		tags     []string
		want     string
	}{
		{0, "email", "c1", []string{"marketing", "promotional"}, "allowed"},
		{time.Minute, "push", "c2", []string{"marketing", "promotional"}, "capped by promo-today"},
		{time.Minute, "push", "c1", []string{"marketing", "newsletter"}, "allowed, shadow today-shadow"},
		{time.Minute, "sms", "c1", []string{"marketing"}, "capped by campaign-week"},
		// 04:00 on Monday in Kolkata: a new day and a new week.
		{8 * time.Hour, "sms", "c1", []string{"marketing", "promotional"}, "allowed"},
		{time.Minute, "email", "c3", []string{"marketing"}, "allowed, shadow today-shadow"},
		{time.Minute, "email", "c4", []string{"marketing"}, "capped by daily"},
	}
	for i, s := range steps {
		d.now = d.now.Add(s.advance)
		got, dec := d.send(s.channel, s.campaign, s.tags...)
		if got != s.want {
			t.Fatalf("step %d (%s %s %v at %s): %s, want %s (counts %v)", i, s.channel, s.campaign, s.tags, d.now.Format(time.DateTime), got, s.want, dec.Counts)
		}
		if got == "capped by promo-today" {
			if want := time.Date(2026, 11, 23, 0, 0, 0, 0, kolkata); !dec.RetryAt.Equal(want) {
				t.Errorf("promo-today retry at %v, want the next local midnight %v", dec.RetryAt.In(kolkata), want)
			}
		}
		if got == "capped by campaign-week" {
			if want := time.Date(2026, 11, 23, 0, 0, 0, 0, kolkata); !dec.RetryAt.Equal(want) {
				t.Errorf("campaign-week retry at %v, want Monday 00:00 %v", dec.RetryAt.In(kolkata), want)
			}
		}
	}
}

// TestReloadedRulesCountEarlierHistory: sends recorded under rules without a
// newsletter cap count toward one that a reload adds.
func TestReloadedRulesCountEarlierHistory(t *testing.T) {
	v1 := compile(t, rules.Config{DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(10)}}})
	d := newDecider(t, v1, time.Date(2026, 11, 22, 9, 0, 0, 0, time.UTC), time.UTC)
	for i := 0; i < 2; i++ {
		if got, _ := d.send("email", "c1", "marketing", "newsletter"); got != "allowed" {
			t.Fatalf("newsletter %d under v1: %s", i, got)
		}
	}
	if got, _ := d.send("email", "c1", "marketing"); got != "allowed" {
		t.Fatalf("marketing under v1: %s", got)
	}
	v2, err := rules.Compile(rules.Config{DefaultCaps: []rules.Cap{
		{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(10)},
		{Name: "newsletter-today", Calendar: "day", Limit: limit(2), Scope: rules.Scope{Tags: []string{"newsletter"}}},
	}}, 2)
	if err != nil {
		t.Fatal(err)
	}
	d.rules, d.now = v2, d.now.Add(time.Hour)
	if got, dec := d.send("push", "c2", "marketing", "newsletter"); got != "capped by newsletter-today" || dec.Counts[1] != 2 {
		t.Fatalf("a third newsletter after the reload: %s (counts %v), want capped by newsletter-today with 2 counted", got, dec.Counts)
	}
	if got, _ := d.send("push", "c2", "marketing"); got != "allowed" {
		t.Fatalf("a send without the tag after the reload: %s, want allowed", got)
	}
}
