package consumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/budget"
	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/internal/testclock"
	"github.com/capper-dev/capper/internal/testenv"
	"github.com/capper-dev/capper/output"
	"github.com/capper-dev/capper/rules"
)

// fakeBudgets grants a token of every want unless grant says otherwise, and
// keeps each key's balance: tokens taken minus tokens given back.
type fakeBudgets struct {
	mu      sync.Mutex
	calls   int
	grant   func(call int, w budget.Want) (budget.Grant, error) // nil: grant all
	taken   map[string]int
	returns int
	lapsed  int
	after   func() // called at the end of each Take (a stall after the tokens)
	// unclaimed are the wants whose claims were given back (Unclaim)
	unclaimed []budget.Want
	// putBack are the tokens given back by bucket (PutBack): key@until -> n
	putBack map[string]int
}

func (b *fakeBudgets) Take(_ context.Context, wants []budget.Want) ([]budget.Grant, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.calls++
	if b.taken == nil {
		b.taken = map[string]int{}
	}
	gs := make([]budget.Grant, 0, len(wants))
	for _, w := range wants {
		g := budget.Grant{OK: true}
		if b.grant != nil {
			var err error
			if g, err = b.grant(b.calls, w); err != nil {
				return gs, err // the grants so far, as budget.Budgets answers a failure
			}
		}
		if g.OK {
			b.taken[w.Key]++
		}
		gs = append(gs, g)
	}
	if b.after != nil {
		b.after()
	}
	return gs, nil
}

func (b *fakeBudgets) Lapse(w budget.Want, n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.taken[w.Key] -= n // never used: not forwarded
	b.lapsed += n
}

func (b *fakeBudgets) Return(w budget.Want, n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.taken[w.Key] -= n
	b.returns += n
}

func (b *fakeBudgets) PutBack(_ context.Context, w budget.Want, until time.Time, n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.taken[w.Key] -= n
	if b.putBack == nil {
		b.putBack = map[string]int{}
	}
	b.putBack[w.Key+"@"+until.UTC().Format(time.RFC3339Nano)] += n
}

func (b *fakeBudgets) Unclaim(_ context.Context, w budget.Want, _ time.Time) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.taken[w.Key]--
	b.unclaimed = append(b.unclaimed, w)
	return nil
}

func (b *fakeBudgets) balance() map[string]int {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := map[string]int{}
	for k, n := range b.taken {
		if n != 0 {
			out[k] = n
		}
	}
	return out
}

// budgetRules: every send has a daily cap of 10; SMS also need a token of
// "sms" and push of "push" (held for up to an hour).
func budgetRules(t *testing.T) *rules.Rules {
	t.Helper()
	return holdRules(t, rules.Config{
		DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: intp(10)}},
		Budgets: []rules.Budget{
			{Name: "sms", Limit: intp(5), Window: rules.Duration(time.Second), Scope: rules.Scope{Channel: "sms"}, MaxHold: rules.Duration(time.Hour)},
			{Name: "all-sms", Limit: intp(50), Window: rules.Duration(time.Second), Scope: rules.Scope{Channel: "sms"}, MaxHold: rules.Duration(time.Hour)},
		},
	})
}

func smsJob(id string, user uint32) kafka.Message {
	m := job(id, user, "")
	m.Value = []byte(`{"job_id":"` + id + `","user_id":1,"campaign_id":"c","channel":"sms"}`)
	return m
}

// TestBudgetTokensFollowTheOutcome: a forwarded send keeps its tokens; a
// capped one, a duplicate and one short of another budget's token give
// theirs back; the budgets are asked once per batch.
func TestBudgetTokensFollowTheOutcome(t *testing.T) {
	b := &fakeBudgets{grant: func(_ int, w budget.Want) (budget.Grant, error) {
		return budget.Grant{OK: true}, nil
	}}
	d := &fakeDecider{decide: func(_ int, r capping.Request) (capping.Decision, error) {
		switch r.JobID {
		case "capped":
			return capping.Decision{Cap: "daily", RetryAt: t0.Add(time.Hour), At: t0}, nil
		case "dup":
			return capping.Decision{Allowed: true, Duplicate: true, At: t0, Recorded: t0.Add(-time.Minute)}, nil
		}
		return capping.Decision{Allowed: true, At: t0}, nil
	}}
	h := start(t, consumer.Config{Rules: budgetRules(t), Decider: d, Budgets: b, Clock: func() time.Time { return t0 }, BatchSize: 3})
	h.send(smsJob("sent", 1), smsJob("capped", 2), smsJob("dup", 3))
	outs := byJob(h.waitOutputs(t, 3))
	for id, want := range map[string]string{"sent": "allowed", "capped": "capped", "dup": "duplicate"} {
		if got := header(outs[id], output.HeaderDecision); got != want {
			t.Errorf("%s: %q, want %q", id, got, want)
		}
	}
	if got := b.balance(); got["sms"] != 1 || got["all-sms"] != 1 || len(got) != 2 {
		t.Errorf("tokens kept: %v, want one of each budget (the forwarded send's)", got)
	}
}

// TestCappedSendPutsItsTokenBack: a send of one budget that took its token
// and was then capped by a user's cap gives it back by its bucket (PutBack,
// with the grant's Until: to Redis while the budget is short); a send of two
// budgets holds tokens of buckets it does not all know, and gives them to the
// reserve (Return).
func TestCappedSendPutsItsTokenBack(t *testing.T) {
	until := t0.Add(7 * time.Millisecond)
	b := &fakeBudgets{grant: func(_ int, w budget.Want) (budget.Grant, error) {
		return budget.Grant{OK: true, Until: until}, nil
	}}
	d := &fakeDecider{decide: func(_ int, r capping.Request) (capping.Decision, error) {
		if r.JobID != "sent" {
			return capping.Decision{Cap: "daily", RetryAt: t0.Add(time.Hour), At: t0}, nil
		}
		return capping.Decision{Allowed: true, At: t0}, nil
	}}
	rs := holdRules(t, rules.Config{
		DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: intp(10)}},
		Budgets: []rules.Budget{
			{Name: "push", Limit: intp(5), Window: rules.Duration(time.Second), Scope: rules.Scope{Channel: "push"}, MaxHold: rules.Duration(time.Hour)},
			{Name: "sms", Limit: intp(5), Window: rules.Duration(time.Second), Scope: rules.Scope{Channel: "sms"}, MaxHold: rules.Duration(time.Hour)},
			{Name: "all-sms", Limit: intp(50), Window: rules.Duration(time.Second), Scope: rules.Scope{Channel: "sms"}, MaxHold: rules.Duration(time.Hour)},
		},
	})
	h := start(t, consumer.Config{Rules: rs, Decider: d, Budgets: b, Clock: func() time.Time { return t0 }, BatchSize: 4})
	push := func(id string, user uint32) kafka.Message {
		m := job(id, user, "")
		m.Value = []byte(`{"job_id":"` + id + `","user_id":1,"campaign_id":"c","channel":"push"}`)
		return m
	}
	h.send(push("sent", 1), push("capped-1", 2), push("capped-2", 3), smsJob("capped-sms", 4))
	outs := byJob(h.waitOutputs(t, 4))
	for id, want := range map[string]string{"sent": "allowed", "capped-1": "capped", "capped-2": "capped", "capped-sms": "capped"} {
		if got := header(outs[id], output.HeaderDecision); got != want {
			t.Errorf("%s: %q, want %q", id, got, want)
		}
	}
	if got := b.balance(); got["push"] != 1 || len(got) != 1 {
		t.Errorf("tokens kept: %v, want the forwarded push's alone", got)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if want := map[string]int{"push@" + until.Format(time.RFC3339Nano): 2}; !reflect.DeepEqual(b.putBack, want) {
		t.Errorf("tokens put back by bucket %v, want %v (the two capped pushes', by their grant's bucket)", b.putBack, want)
	}
	if b.returns != 2 {
		t.Errorf("%d tokens returned to the reserve, want 2 (the capped SMS's, of two budgets)", b.returns)
	}
}

// TestBudgetShortHoldsOrCaps: a send short of a token is held until one is
// expected back (on the delay tiers, with the budget named), without asking
// Redis, and gives back the tokens of its other budgets. Without delay tiers
// it is capped naming the budget, with the retry-at, after Redis only
// checked whether it is a redelivery (an earlier version capped it by a cap
// called "refused" with no retry-at). So is a send whose expected token the
// budget does not keep for it (budget.Grant.Promised: it comes back too
// close to its max_hold), beyond max_hold, though the time is before it.
func TestBudgetShortHoldsOrCaps(t *testing.T) {
	due := t0.Add(1500 * time.Millisecond)
	for _, c := range []struct{ tiers, kept bool }{{true, true}, {false, true}, {true, false}} {
		tiers := c.tiers
		b := &fakeBudgets{grant: func(_ int, w budget.Want) (budget.Grant, error) {
			if w.Key == "sms" {
				return budget.Grant{RetryAt: due, Promised: c.kept}, nil
			}
			return budget.Grant{OK: true}, nil
		}}
		cfg := consumer.Config{Rules: budgetRules(t), Budgets: b, Clock: func() time.Time { return t0 }}
		if tiers {
			cfg.Wheel = wheel(t)
		}
		h := start(t, cfg)
		h.send(smsJob("short", 1))
		if !c.kept {
			o := h.waitOutputs(t, 1)[0]
			if o.Topic != "capped" || header(o, output.HeaderCap) != "sms" || header(o, output.HeaderReason) != "beyond max_hold" ||
				header(o, output.HeaderRetryAt) != "2026-11-22T12:00:01.5Z" {
				t.Errorf("its token not kept for it: on %q, cap %q, reason %q, retry-at %q; want capped by sms beyond max_hold, retry at 12:00:01.5",
					o.Topic, header(o, output.HeaderCap), header(o, output.HeaderReason), header(o, output.HeaderRetryAt))
			}
		} else if tiers {
			outs := h.waitOutputs(t, 2)
			var audit, tier kafka.Message
			for _, o := range outs {
				if o.Topic == "held" {
					audit = o
				} else {
					tier = o
				}
			}
			if tier.Topic != "delay.1s" || header(audit, output.HeaderCap) != "sms" || header(audit, "capper-due-at") != "2026-11-22T12:00:01.500Z" {
				t.Errorf("with tiers: on %q and %q, cap %q due %q; want held on delay.1s for sms until 12:00:01.500",
					tier.Topic, audit.Topic, header(audit, output.HeaderCap), header(audit, "capper-due-at"))
			}
			if n := len(h.d.requests()); n != 0 {
				t.Errorf("with tiers: Redis asked %d times, want never (a held job is decided when it is due)", n)
			}
		} else {
			o := h.waitOutputs(t, 1)[0]
			if o.Topic != "capped" || header(o, output.HeaderCap) != "sms" || header(o, output.HeaderRetryAt) != "2026-11-22T12:00:01.5Z" {
				t.Errorf("without tiers: on %q, cap %q, retry-at %q; want capped by sms, retry at 12:00:01.5", o.Topic, header(o, output.HeaderCap), header(o, output.HeaderRetryAt))
			}
			calls := h.d.requests()
			if len(calls) != 1 || !calls[0][0].DuplicateOnly || len(calls[0][0].Caps) != 0 {
				t.Errorf("without tiers: Redis was asked %+v, want one duplicate check without caps", calls)
			}
		}
		if got := b.balance(); len(got) != 0 {
			t.Errorf("%+v: tokens kept %v, want none (all-sms's token given back)", c, got)
		}
	}
}

// TestBudgetFailureIsRetried: tokens granted before a failed call go back,
// and the batch asks again; nothing goes out before the tokens are taken.
func TestBudgetFailureIsRetried(t *testing.T) {
	b := &fakeBudgets{grant: func(call int, w budget.Want) (budget.Grant, error) {
		if call == 1 && w.Key == "all-sms" {
			return budget.Grant{}, errors.New("i/o timeout")
		}
		return budget.Grant{OK: true}, nil
	}}
	h := start(t, consumer.Config{Rules: budgetRules(t), Budgets: b, Clock: func() time.Time { return t0 }})
	h.send(smsJob("a", 1))
	o := h.waitOutputs(t, 1)[0]
	if header(o, output.HeaderDecision) != "allowed" {
		t.Fatalf("after a failed token call: %q, want allowed", header(o, output.HeaderDecision))
	}
	b.mu.Lock()
	calls, returns := b.calls, b.returns
	b.mu.Unlock()
	if got := b.balance(); calls != 2 || returns != 1 || got["sms"] != 1 || got["all-sms"] != 1 {
		t.Errorf("%d calls, %d tokens given back, kept %v; want 2 calls, sms's first token given back, one of each kept", calls, returns, got)
	}
}

// TestDecisionDatedWithinItsTokensBucket: a send holding budget tokens is
// decided and recorded at a time within the bucket its tokens are counted in
// (budget.Grant.Until), so the budget holds by capper-decided-at: at the
// clock's reading while the bucket lasts; dated back to the bucket's last
// millisecond when the decision comes up to TokenGrace after it (a slow call,
// a stall); and beyond that its tokens lapse and it is refused for the
// budget (here without delay tiers: capped after a duplicate check) instead
// of being sent outside the bucket.
func TestDecisionDatedWithinItsTokensBucket(t *testing.T) {
	until := t0.Add(100 * time.Millisecond) // the tokens' bucket ends
	for _, c := range []struct {
		name  string
		stall time.Duration // from the tokens to the decision
		at    time.Time     // the decision's date; zero: not decided, refused
	}{
		{"within the bucket", 50 * time.Millisecond, t0.Add(50 * time.Millisecond)},
		{"after it, within the grace", 700 * time.Millisecond, until.Add(-time.Millisecond)},
		{"beyond the grace", 1500 * time.Millisecond, time.Time{}},
	} {
		t.Run(c.name, func(t *testing.T) {
			clk := testclock.At(t0)
			b := &fakeBudgets{grant: func(int, budget.Want) (budget.Grant, error) { return budget.Grant{OK: true, Until: until}, nil },
				after: func() { clk.Add(c.stall) }}
			d := &fakeDecider{decide: func(_ int, r capping.Request) (capping.Decision, error) {
				if r.DuplicateOnly {
					return capping.Decision{At: clk.Now()}, nil
				}
				return capping.Decision{Allowed: true, At: r.At}, nil
			}}
			h := start(t, consumer.Config{Rules: budgetRules(t), Decider: d, Budgets: b, Clock: clk.Now, TokenGrace: time.Second})
			h.send(smsJob("s", 1))
			o := byJob(h.waitOutputs(t, 1))["s"]
			d.mu.Lock()
			reqs := d.calls[0]
			d.mu.Unlock()
			if c.at.IsZero() {
				if got := header(o, output.HeaderDecision); got != "capped" || header(o, output.HeaderCap) != "sms" || !reqs[0].DuplicateOnly {
					t.Errorf("decision %q by %q (asked %+v); want capped by the budget sms after a duplicate check", got, header(o, output.HeaderCap), reqs[0])
				}
				if b.lapsed != 2 || len(b.balance()) != 0 {
					t.Errorf("lapsed %d tokens, kept %v; want both budgets' tokens lapsed, none kept", b.lapsed, b.balance())
				}
				return
			}
			if !reqs[0].At.Equal(c.at) || header(o, output.HeaderDecidedAt) != output.FormatTime(c.at) || header(o, output.HeaderDecision) != "allowed" {
				t.Errorf("asked at %v, output %q decided at %s; want allowed at %v", reqs[0].At, header(o, output.HeaderDecision), header(o, output.HeaderDecidedAt), c.at)
			}
			if b.lapsed != 0 {
				t.Errorf("%d tokens lapsed", b.lapsed)
			}
		})
	}
}

// TestReleasedJobClaimsItsPromise: a job held because a budget was short
// comes back from its delay tier claiming the token that budget promised it
// at its due time (budget.Want.Promised); its other budgets' wants, and a
// job held by a cap, claim nothing.
func TestReleasedJobClaimsItsPromise(t *testing.T) {
	var mu sync.Mutex
	claims := map[string][]time.Time{} // budget key -> Want.Promised of each want
	b := &fakeBudgets{grant: func(_ int, w budget.Want) (budget.Grant, error) {
		mu.Lock()
		defer mu.Unlock()
		claims[w.Key] = append(claims[w.Key], w.Promised)
		return budget.Grant{OK: true}, nil
	}}
	d := &fakeDecider{decide: func(_ int, r capping.Request) (capping.Decision, error) {
		return capping.Decision{Allowed: true, At: t0}, nil
	}}
	h := start(t, consumer.Config{Rules: budgetRules(t), Budgets: b, Decider: d, Wheel: wheel(t), Tier: "10s", Clock: func() time.Time { return t0 }})
	due := t0.Add(-3 * time.Millisecond)
	for _, reason := range []string{"sms", "daily"} {
		m := tierMessage("held-by-"+reason, 1, hold.State{Since: t0.Add(-time.Minute), Due: due, Wake: due, Count: 1, Reason: reason})
		m.Value = smsJob("held-by-"+reason, 1).Value
		h.send(m)
	}
	for _, o := range h.waitOutputs(t, 2) {
		if o.Topic != "allowed" {
			t.Fatalf("a released job went to %q, want allowed", o.Topic)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	slices.SortFunc(claims["sms"], func(a, b time.Time) int { return a.Compare(b) })
	if got, want := claims, (map[string][]time.Time{"sms": {{}, due}, "all-sms": {{}, {}}}); !reflect.DeepEqual(got, want) {
		t.Errorf("wants asked with Promised %v, want %v: only the job sms held claims, and only sms's token", got, want)
	}
}

// TestDuplicateGivesItsClaimBack: a held job delivered twice by its tier (a
// rebalance redelivers what was not committed) claims its promised token
// twice; the second copy is a duplicate, and the token it claimed, promised
// to another job at the same time, goes back with that promise (Unclaim)
// instead of to the reserve. A duplicate that did not claim gives its token
// to the reserve as before.
func TestDuplicateGivesItsClaimBack(t *testing.T) {
	b := &fakeBudgets{grant: func(_ int, w budget.Want) (budget.Grant, error) {
		return budget.Grant{OK: true, Until: t0.Add(time.Millisecond), Claimed: !w.Promised.IsZero()}, nil
	}}
	var mu sync.Mutex
	seen := map[string]bool{}
	d := &fakeDecider{decide: func(_ int, r capping.Request) (capping.Decision, error) {
		mu.Lock()
		defer mu.Unlock()
		dup := seen[r.JobID]
		seen[r.JobID] = true
		return capping.Decision{Allowed: true, Duplicate: dup, At: t0}, nil
	}}
	h := start(t, consumer.Config{Rules: budgetRules(t), Budgets: b, Decider: d, Wheel: wheel(t), Tier: "10s", Clock: func() time.Time { return t0 }})
	due := t0.Add(-3 * time.Millisecond)
	for range 2 { // the same held job twice
		m := tierMessage("held", 1, hold.State{Since: t0.Add(-time.Minute), Due: due, Wake: due, Count: 1, Reason: "sms"})
		m.Value = smsJob("held", 1).Value
		h.send(m)
	}
	outs := h.waitOutputs(t, 2)
	if outs[0].Topic != "allowed" || outs[1].Topic != "allowed" {
		t.Fatalf("outputs to %q and %q, want allowed twice (the second a duplicate)", outs[0].Topic, outs[1].Topic)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.unclaimed) != 1 || b.unclaimed[0].Key != "sms" || !b.unclaimed[0].Promised.Equal(due) {
		t.Errorf("claims given back %+v, want the duplicate's claim of sms promised at %v", b.unclaimed, due)
	}
	if b.returns != 1 { // all-sms, which it did not claim, goes to the reserve
		t.Errorf("%d tokens returned to the reserve, want 1 (all-sms's)", b.returns)
	}
}

// TestMissedClaimMovesToItsToken: a held job that comes back to find the
// token promised to it missing, and is promised the next one back within
// consumer's follow wait, moves on to that time on the shortest tier (no
// hold record, its hold count and since unchanged, its due time the new
// promise), and a job granted a token in the same batch is decided at once;
// one promised beyond that wait, and a job of two budgets, are held again
// until their new promise; one told the next token but not promised it (it
// comes back past its max_hold: budget.Grant.Promised) is capped beyond
// max_hold.
func TestMissedClaimMovesToItsToken(t *testing.T) {
	oneBudget := holdRules(t, rules.Config{
		DefaultCaps: []rules.Cap{{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: intp(10)}},
		Budgets: []rules.Budget{{Name: "sms", Limit: intp(5), Window: rules.Duration(time.Second), Scope: rules.Scope{Channel: "sms"},
			MaxHold: rules.Duration(time.Hour)}},
	})
	due := t0.Add(-3 * time.Millisecond)
	since := t0.Add(-time.Minute)
	for _, c := range []struct {
		name   string
		rules  *rules.Rules
		follow time.Duration // the next token back, from the clock
		other  bool          // a job granted a token shares the batch
		want   string        // the claiming job's output topic
		lost   bool          // the next token is not promised to it (past its max_hold)
	}{
		{"promised again soon", oneBudget, 40 * time.Millisecond, false, "delay.1s", false},
		{"promised again soon, a granted token in the batch", oneBudget, 40 * time.Millisecond, true, "delay.1s", false},
		{"promised again later", oneBudget, 5 * time.Second, false, "held", false},
		{"two budgets", budgetRules(t), 40 * time.Millisecond, false, "held", false},
		{"the next token not promised to it", oneBudget, 40 * time.Millisecond, false, "capped", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			var mu sync.Mutex
			var claims []time.Time
			b := &fakeBudgets{grant: func(_ int, w budget.Want) (budget.Grant, error) {
				switch {
				case w.Key != "sms":
					return budget.Grant{OK: true}, nil
				case w.Promised.IsZero(): // the other job's
					return budget.Grant{OK: true, Until: t0.Add(10 * time.Millisecond)}, nil
				}
				mu.Lock()
				defer mu.Unlock()
				claims = append(claims, w.Promised)
				return budget.Grant{RetryAt: t0.Add(c.follow), Promised: !c.lost}, nil // the token is not back yet: promised the next one
			}}
			d := &fakeDecider{decide: func(_ int, r capping.Request) (capping.Decision, error) {
				return capping.Decision{Allowed: true, At: r.At}, nil
			}}
			batch := []kafka.Message{tierMessage("claim", 1, hold.State{Since: since, Due: due, Wake: due, Count: 1, Reason: "sms"})}
			batch[0].Value = smsJob("claim", 1).Value
			if c.other { // held by a cap: it asks for a new token
				batch = append(batch, tierMessage("other", 2, hold.State{Since: since, Due: due, Wake: due, Count: 1, Reason: "daily"}))
				batch[1].Value = smsJob("other", 2).Value
			}
			h := start(t, consumer.Config{Rules: c.rules, Budgets: b, Decider: d, Wheel: wheel(t), Tier: "10s", Clock: func() time.Time { return t0 },
				BatchSize: len(batch)})
			h.send(batch...)
			n := len(batch)
			if c.want == "held" {
				n++ // its hold record and its message on the tier
			}
			var topics []string
			var reason string
			for _, o := range h.waitOutputs(t, n) { // a batch's outputs are written together
				if o.Key != nil && string(o.Key) != string(batch[0].Key) {
					if c.other && o.Topic != "allowed" {
						t.Errorf("the job granted a token went to %s, want allowed", o.Topic)
					}
					continue
				}
				topics = append(topics, o.Topic)
				if o.Topic == "capped" {
					reason = header(o, output.HeaderReason)
				}
				if o.Topic == "held" || o.Topic == "delay.1s" {
					if got := header(o, output.HeaderDueAt); got != output.FormatTime(t0.Add(c.follow)) {
						t.Errorf("%s until %s, want its new promise %s", o.Topic, got, output.FormatTime(t0.Add(c.follow)))
					}
				}
				if o.Topic == "delay.1s" {
					count := 1 // moved: its hold goes on
					if c.want == "held" {
						count = 2
					}
					s, ok, err := hold.ParseState(o.Headers)
					if !ok || err != nil || s.Count != count || !s.Since.Equal(since) || s.Reason != "sms" {
						t.Errorf("on the tier with %+v (%v), want hold count %d, since %v, reason sms", s, err, count, since)
					}
				}
			}
			if !slices.Contains(topics, c.want) || c.want != "held" && len(topics) != 1 {
				t.Errorf("the claiming job's outputs went to %v, want %s", topics, c.want)
			}
			if c.lost && reason != consumer.ReasonMaxHold {
				t.Errorf("capped with reason %q, want %q", reason, consumer.ReasonMaxHold)
			}
			mu.Lock()
			defer mu.Unlock()
			if len(claims) != 1 || !claims[0].Equal(due) {
				t.Errorf("claims of sms promised at %v, want one, at %v", claims, due)
			}
		})
	}
}

// TestACopyOfAHeldJobKeepsItsPromise, on the real budgets (Redis) and a
// fixed clock: an SMS budget of 5 per second (spread: a token a bucket),
// used up. A job short of its token is held until the first token back; a
// copy of it decided again (its input message redelivered, as after a
// rebalance before the offset was committed) is held until the same time,
// and the budget promises it nothing: four of the five jobs after it are
// promised the four other tokens back within the second, as if the copy had
// not asked. Back from the tier together, one copy takes the job's token and
// is allowed, the other is its duplicate, and the four find theirs.
// (Promised a token of its own, the copy took one the fourth job needed and
// its token waited for no one; refused beyond max_hold, it was capped, and
// the held copy after it.)
func TestACopyOfAHeldJobKeepsItsPromise(t *testing.T) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(t)})
	t.Cleanup(func() { rdb.Close() })
	clock := testclock.At(t0)
	prefix := testenv.Unique("copy")
	budgets := func() *budget.Budgets { // a replica's
		b, err := budget.New(budget.Config{Client: rdb, KeyPrefix: prefix, Clock: clock.Now})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	var mu sync.Mutex
	allowed := map[string]bool{}
	d := &fakeDecider{decide: func(_ int, r capping.Request) (capping.Decision, error) {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case allowed[r.JobID]:
			return capping.Decision{Allowed: true, Duplicate: true, At: clock.Now(), Recorded: t0}, nil
		case r.DuplicateOnly:
			return capping.Decision{At: clock.Now()}, nil
		}
		allowed[r.JobID] = true
		return capping.Decision{Allowed: true, At: clock.Now()}, nil
	}}
	in := start(t, consumer.Config{Rules: budgetRules(t), Budgets: budgets(), Decider: d, Wheel: wheel(t), Clock: clock.Now})
	for i := range 5 {
		in.send(smsJob(fmt.Sprint("first-", i), 1))
	}
	in.waitOutputs(t, 5)
	clock.Add(10 * time.Millisecond)
	held := func(outs []kafka.Message) (hs []kafka.Message) { // the held records (each hold also writes its tier's message)
		for _, o := range outs {
			if o.Topic == "held" {
				hs = append(hs, o)
			}
		}
		return hs
	}
	in.send(smsJob("held", 1))
	in.waitOutputs(t, 7)
	in.send(smsJob("held", 1)) // its copy
	outs := held(in.waitOutputs(t, 9))
	back := t0.Add(time.Second + time.Second/budget.Buckets) // the first bucket's 5 tokens come back
	for _, o := range outs {
		if out, _ := output.Parse(o.Headers); !out.DueAt.Equal(back) {
			t.Fatalf("held and its copy: held until %v, want both until %v", out.DueAt, back)
		}
	}
	for i := range 5 {
		in.send(smsJob(fmt.Sprint("next-", i), 1))
	}
	outs = held(in.waitOutputs(t, 19))
	var told []time.Time
	soon, last := 0, back
	for _, o := range outs[2:] {
		out, _ := output.Parse(o.Headers)
		told = append(told, out.DueAt)
		if out.DueAt.Before(back.Add(time.Second)) { // spread: a token a bucket, from the one after the held job's
			soon++
			if out.DueAt.After(last) {
				last = out.DueAt
			}
		}
	}
	if soon != 4 {
		t.Errorf("the five next jobs held until %v; want four within a second of %v (the copy promised nothing)", told, back)
	}

	// Back at their time, on a tier's worker of another replica.
	clock.Set(last.Add(time.Millisecond))
	tier := start(t, consumer.Config{Rules: budgetRules(t), Budgets: budgets(), Decider: d, Wheel: wheel(t), Tier: "1s", Clock: clock.Now})
	var ms []kafka.Message
	for _, o := range outs {
		out, _ := output.Parse(o.Headers)
		if out.DueAt.After(last) {
			continue
		}
		var v struct {
			JobID string `json:"job_id"`
		}
		_ = json.Unmarshal(o.Value, &v)
		m := tierMessage(v.JobID, 1, hold.State{Since: t0, Due: out.DueAt, Wake: out.DueAt, Count: 1, Reason: "sms"})
		m.Value = o.Value
		ms = append(ms, m)
	}
	tier.send(ms...)
	decisions := map[string]int{}
	for _, o := range tier.waitOutputs(t, len(ms)) {
		out, _ := output.Parse(o.Headers)
		decisions[o.Topic+" "+out.Decision]++
	}
	if want := map[string]int{"allowed allowed": 5, "allowed duplicate": 1}; !maps.Equal(decisions, want) {
		t.Errorf("back from the tier: %v, want %v (the held job once, its copy a duplicate, the four next)", decisions, want)
	}
}
