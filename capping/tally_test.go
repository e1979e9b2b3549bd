package capping_test

import (
	"context"
	"testing"
	"time"

	"github.com/capper-dev/capper/capping"
)

// TestLifetimeTally: a lifetime cap of 2 per campaign, kept 400 days, beside
// a daily cap, on a fixed clock. Two sends of the campaign pass, however far
// apart; the third is capped for good (no retry-at) and names the cap; a
// redelivery of an allowed send is its duplicate and not counted again;
// another campaign has a count of its own; the tally holds the counts and
// expires with its longest-kept field; a send that matches no tally cap
// leaves no tally; the log keeps only the daily window's sends.
func TestLifetimeTally(t *testing.T) {
	for _, mode := range []struct {
		name string
		opt  func(*capping.Config)
	}{{"near cache", func(*capping.Config) {}}, {"script only", scriptOnly}} {
		t.Run(mode.name, func(t *testing.T) {
			e := newEnv(t, mode.opt)
			ctx := context.Background()
			life := func(campaign string) capping.Cap {
				return capping.Cap{Name: "welcome-once", Limit: 2, Tally: true, Keep: e.clock.Now().Add(400 * 24 * time.Hour),
					Scope: capping.NewScope(nil, []string{"welcome"}).Campaign(campaign)}
			}
			send := func(user uint32, campaign string) capping.Request {
				r := job(user, "email", daily3, life(campaign))
				r.Campaign, r.Tags = campaign, []string{"welcome"}
				return r
			}
			first := send(31, "w1")
			if d := e.decide(t, first, first); !d[0].Allowed || !d[1].Duplicate {
				t.Fatalf("first send and its redelivery: %+v", d)
			}
			e.clock.Add(200 * 24 * time.Hour)
			if d := e.decide(t, send(31, "w1"))[0]; !d.Allowed || d.Counts[1] != 1 {
				t.Fatalf("second send 200 days later: %+v, want allowed over a count of 1", d)
			}
			e.clock.Add(100 * 24 * time.Hour)
			d := e.decide(t, send(31, "w1"))[0]
			if d.Allowed || d.Cap != "welcome-once" || !d.RetryAt.IsZero() || d.Counts[1] != 2 {
				t.Fatalf("third send: %+v, want capped for good by welcome-once at a count of 2", d)
			}
			if d := e.decide(t, send(31, "w2"))[0]; !d.Allowed || d.Counts[1] != 0 {
				t.Fatalf("another campaign: %+v, want allowed over a count of 0", d)
			}
			tally, err := e.lim.Tally(ctx, 0, 31)
			if err != nil {
				t.Fatal(err)
			}
			// Each field is kept 400 days from its last send: w1's from day 200, w2's from day 300.
			w2Keep := e.clock.Now().Add(400 * 24 * time.Hour)
			want := map[uint64]TallyWant{life("w1").TallyField(): {2, w2Keep.Add(-100 * 24 * time.Hour)}, life("w2").TallyField(): {1, w2Keep}}
			if len(tally) != 2 {
				t.Fatalf("tally %+v, want 2 fields", tally)
			}
			for _, f := range tally {
				if w := want[f.Field]; w.count != f.Count || len(f.Times) != 0 || !f.Keep.Equal(w.keep) {
					t.Errorf("tally field %+v, want count %d, no times, kept until %v", f, w.count, w.keep)
				}
			}
			// The key expires with its longest-kept field (Redis counts on its own clock, not the test's).
			ttl := e.rdb.PTTL(ctx, e.lim.TallyKey(0, 31)).Val()
			if d := ttl - time.Until(w2Keep); d < -time.Minute || d > time.Minute {
				t.Errorf("tally expires in %v, want %v", ttl, time.Until(w2Keep))
			}
			if n := e.rdb.Exists(ctx, e.lim.TallyKey(0, 32)).Val(); n != 0 {
				t.Fatal("a user never sent to has a tally")
			}
			if d := e.decide(t, job(32, "push", daily3, life("w1")))[0]; !d.Allowed || d.Counts[1] != -1 {
				t.Fatalf("a send outside the tally cap's scope: %+v, want allowed, the cap not counted", d)
			}
			if n := e.rdb.Exists(ctx, e.lim.TallyKey(0, 32)).Val(); n != 0 {
				t.Error("a send that matches no tally cap wrote a tally")
			}
			if ttl := e.rdb.PTTL(ctx, e.lim.Key(0, 31)).Val(); ttl > 2*24*time.Hour {
				t.Errorf("the log expires in %v: it keeps the lifetime cap's sends", ttl)
			}
		})
	}
}

type TallyWant struct {
	count int
	keep  time.Time
}

// TestRollingTally: "not again within 90 days" as a tally cap, and one of 2
// in 90 days: the times of the last sends decide, the retry-at is when the
// oldest counted one leaves the window, and a field kept until before now is
// deleted by the next write.
func TestRollingTally(t *testing.T) {
	e := newEnv(t, scriptOnly)
	ctx := context.Background()
	day := 24 * time.Hour
	survey := func(limit int, keep time.Duration) capping.Cap {
		return capping.Cap{Name: "survey", Limit: limit, Window: 90 * day, Tally: true, Keep: e.clock.Now().Add(keep),
			Scope: capping.NewScope(nil, []string{"survey"})}
	}
	send := func(c capping.Cap) capping.Request {
		r := job(41, "email", daily3, c)
		r.Tags = []string{"survey"}
		return r
	}
	if d := e.decide(t, send(survey(1, 90*day)))[0]; !d.Allowed {
		t.Fatalf("first survey: %+v", d)
	}
	e.clock.Add(30 * day)
	d := e.decide(t, send(survey(1, 90*day)))[0]
	if d.Allowed || d.Cap != "survey" || !d.RetryAt.Equal(base.Add(90*day)) {
		t.Fatalf("30 days later: %+v, want capped until 90 days after the first", d)
	}
	if d := e.decide(t, send(survey(2, 90*day)))[0]; !d.Allowed || d.Counts[1] != 1 {
		t.Fatalf("with a limit of 2: %+v, want allowed over a count of 1", d)
	}
	e.clock.Add(61 * day) // the first has left the window, the second not
	if d := e.decide(t, send(survey(1, 90*day)))[0]; d.Allowed || !d.RetryAt.Equal(base.Add(120*day)) {
		t.Fatalf("91 days after the first: %+v, want capped until 90 days after the second", d)
	}
	// A field kept for a day only, then one of another scope written after it has lapsed.
	other := capping.Cap{Name: "other", Limit: 5, Tally: true, Keep: e.clock.Now().Add(day)}
	if d := e.decide(t, job(41, "sms", other))[0]; !d.Allowed {
		t.Fatalf("other: %+v", d)
	}
	if tally, _ := e.lim.Tally(ctx, 0, 41); len(tally) != 2 {
		t.Fatalf("tally %+v, want the survey's and other's fields", tally)
	}
	e.clock.Add(100 * day) // survey's field was kept 90 days from its last send: both have lapsed
	if d := e.decide(t, send(survey(1, 90*day)))[0]; !d.Allowed || d.Counts[1] != 0 {
		t.Fatalf("after both fields lapsed: %+v, want allowed over a count of 0", d)
	}
	tally, err := e.lim.Tally(ctx, 0, 41)
	if err != nil {
		t.Fatal(err)
	}
	if len(tally) != 1 || tally[0].Count != 1 || len(tally[0].Times) != 1 {
		t.Fatalf("tally %+v, want the survey's field alone, one send", tally)
	}
}
