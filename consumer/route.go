package consumer

// What happens to a job after its decision: held on the delay topics (or
// refused, with the reason), moved to a shorter tier, and the messages that
// carry it to its topics.

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/budget"
	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/rules"
)

// Why a capped job was not held (HeaderReason), and the cap names of
// refusals that are not a cap's (HeaderCap).
const (
	ReasonNever      = "never"           // a limit of 0: no slot will come
	ReasonExpired    = "expired"         // its expires_at passed, or comes before its slot
	ReasonMaxHold    = "beyond max_hold" // its slot comes after submission + max_hold
	ReasonQuietHours = "quiet_hours"     // in quiet hours under the drop policy
)

// refuseCaps is the request of a job that must not go (expired, quiet hours
// under drop): Redis only recognises it as a duplicate of an earlier allowed
// send (so a redelivered job keeps its one final topic); otherwise this cap,
// with a limit of 0, refuses it and nothing is recorded.
var refuseCaps = []capping.Cap{{Name: "refused", Limit: 0, Window: time.Millisecond}}

// released reads the hold state of a job from a delay tier. One that is not
// due yet moves on to the tier that fits what is left of its wait.
func (w *Worker) released(it *item, now time.Time) error {
	s, ok, err := hold.ParseState(it.msg.Headers)
	switch {
	case err != nil:
		return fmt.Errorf("%w: %v", ErrMalformed, err)
	case !ok:
		return fmt.Errorf("%w: a message on the delay tier %s without hold headers", ErrMalformed, w.cfg.Tier)
	}
	it.hold, it.since = s, s.Since
	if s.Due.After(now) {
		it.decision = decisionMove
		it.tier, it.hold.Wake = w.cfg.Wheel.Route(now, s.Due)
		return nil
	}
	w.m.releaseLag.Observe(now.Sub(s.Due).Seconds())
	return nil
}

// holdOrRefuse holds it until due under policy p, for cause (a cap's name or
// quiet_hours), and reports true; or sets it.reason to why it cannot be held
// and reports false: the drop policy (reason empty for a cap, quiet_hours for
// quiet hours), never (due is zero), expired, beyond max_hold.
func (w *Worker) holdOrRefuse(it *item, p rules.Policy, due time.Time, cause string, now time.Time) bool {
	switch {
	case !p.Hold || w.cfg.Wheel == nil:
		if cause == ReasonQuietHours {
			it.reason = ReasonQuietHours
		}
		return false
	case due.IsZero():
		it.reason = ReasonNever
	case !it.job.ExpiresAt.IsZero() && !due.Before(it.job.ExpiresAt):
		it.reason = ReasonExpired
	case !due.Before(it.since.Add(p.MaxHold)):
		it.reason = ReasonMaxHold
	default:
		it.decision = DecisionHeld
		it.cap = cause
		it.hold = hold.State{Since: it.since, Due: due, Count: it.hold.Count + 1, Reason: cause}
		it.tier, it.hold.Wake = w.cfg.Wheel.Route(now, due)
		label := "cap"
		switch {
		case cause == ReasonQuietHours:
			label = "quiet_hours"
		case it.byBudget:
			label = "budget"
		}
		w.m.held.WithLabelValues(label).Inc()
		return true
	}
	return false
}

// capped applies the policy to a job that Redis refused.
func (w *Worker) capped(rs *rules.Rules, it *item) {
	switch {
	case it.refuse != "":
		it.cap, it.reason, it.retryAt = it.refuseCap, it.refuse, time.Time{}
	case w.holdOrRefuse(it, rs.OnCapped(it.segment, it.inSegment, it.job.Category, it.cap), it.retryAt, it.cap, it.at):
		it.retryAt = time.Time{}
		return
	}
	w.countNotHeld(it)
}

// countNotHeld counts a capped job by the reason it was not held, if any.
func (w *Worker) countNotHeld(it *item) {
	if it.reason != "" {
		w.m.notHeld.WithLabelValues(strings.ReplaceAll(it.reason, " ", "_")).Inc()
	}
}

// expire turns the requests of jobs whose expires_at has passed into
// refusals, right before they go to Redis (a retry can come late).
func (w *Worker) expire(reqs []capping.Request, reqItems []int, items []item) {
	now := w.cfg.Now()
	for j, i := range reqItems {
		it := &items[i]
		if exp := it.job.ExpiresAt; !exp.IsZero() && !now.Before(exp) && it.refuse == "" {
			it.refuse, it.refuseCap = ReasonExpired, ReasonExpired
			reqs[j].Caps = refuseCaps
		}
	}
}

// headerValues hands out one []byte per distinct header value of a batch:
// decisions, caps, segments and decision times repeat across its jobs (the
// writer only reads them).
type headerValues struct {
	m    map[string][]byte
	t    time.Time // the last time formatted, and its value
	tval []byte
}

func newHeaderValues() *headerValues { return &headerValues{m: make(map[string][]byte, 16)} }

func (h *headerValues) get(s string) []byte {
	if b, ok := h.m[s]; ok {
		return b
	}
	b := []byte(s)
	h.m[s] = b
	return b
}

// time formats t (ms), once for the run of jobs decided at one instant.
func (h *headerValues) time(t time.Time) []byte {
	if !t.Equal(h.t) || h.tval == nil {
		h.t, h.tval = t, []byte(hold.FormatTime(t))
	}
	return h.tval
}

// outputs appends the messages that carry it to its topics: its original key,
// value and headers (without the hold headers of a delay tier) and capper's.
// A held job has two: the audit record on the held topic and the job on its
// delay tier; a moved job only the latter.
func (w *Worker) outputs(outs []kafka.Message, it *item, hv *headerValues) []kafka.Message {
	orig := it.msg.Headers
	if w.cfg.Tier != "" {
		orig = make([]kafka.Header, 0, len(it.msg.Headers))
		for _, h := range it.msg.Headers {
			if !hold.IsHeader(h.Key) {
				orig = append(orig, h)
			}
		}
	}
	m := kafka.Message{Key: it.msg.Key, Value: it.msg.Value}
	m.Headers = append(make([]kafka.Header, 0, len(orig)+8), orig...)
	add := func(k string, v []byte) { m.Headers = append(m.Headers, kafka.Header{Key: k, Value: v}) }
	switch it.decision {
	case decisionMove:
		m.Topic = it.tier.Topic
		m.Headers = it.hold.AppendHeaders(m.Headers)
		w.m.moves.WithLabelValues(it.tier.Name).Inc()
		return append(outs, m)
	case DecisionHeld:
		wait := kafka.Message{Key: m.Key, Value: m.Value, Topic: it.tier.Topic, Headers: it.hold.AppendHeaders(append([]kafka.Header(nil), orig...))}
		outs = append(outs, wait)
		m.Topic = w.cfg.Topics.Held
		add(HeaderDecision, hv.get(DecisionHeld))
		add(HeaderCap, hv.get(it.cap))
		add(hold.HeaderDue, []byte(hold.FormatTime(it.hold.Due)))
		add(hold.HeaderCount, hv.get(strconv.Itoa(it.hold.Count)))
		add(HeaderDecidedAt, hv.time(it.at))
		add(HeaderSegment, hv.get(it.segment))
		return append(outs, m)
	}
	add(HeaderDecision, hv.get(it.decision))
	switch it.decision {
	case DecisionDLQ:
		m.Topic = w.cfg.Topics.DLQ
		add(HeaderError, []byte(it.reason))
		if it.truncate && len(m.Value) > truncatedValueBytes {
			m.Value = m.Value[:truncatedValueBytes]
		}
		if over := messageBytes(&m) - w.cfg.MaxOutputBytes; over > 0 {
			// Keep as much of the value as fits and the headers; drop the
			// original headers too if they alone are too large.
			keep := max(0, len(m.Value)-over-64)
			m.Value = m.Value[:keep]
			if messageBytes(&m) > w.cfg.MaxOutputBytes {
				m.Headers = m.Headers[len(orig):]
			}
		}
		return append(outs, m)
	case DecisionCapped:
		m.Topic = w.cfg.Topics.Capped
		add(HeaderCap, hv.get(it.cap))
		var retry []byte
		if !it.retryAt.IsZero() {
			retry = it.retryAt.UTC().AppendFormat(make([]byte, 0, 24), time.RFC3339Nano)
		}
		add(HeaderRetryAt, retry)
		if it.reason != "" {
			add(HeaderReason, hv.get(it.reason))
		}
	default:
		m.Topic = w.cfg.Topics.Allowed
		if len(it.shadow) > 0 {
			add(HeaderShadow, hv.get(strings.Join(it.shadow, ",")))
		}
	}
	add(HeaderDecidedAt, hv.time(it.at))
	if it.hold.Count > 0 { // released: how often and how long it was held
		add(hold.HeaderCount, hv.get(strconv.Itoa(it.hold.Count)))
		add(hold.HeaderSince, []byte(hold.FormatTime(it.hold.Since)))
		add(hold.HeaderDue, []byte(hold.FormatTime(it.hold.Due)))
		add(HeaderHeldFor, strconv.AppendFloat(nil, it.at.Sub(it.hold.Since).Seconds(), 'f', 3, 64))
	}
	add(HeaderSegment, hv.get(it.segment))
	return append(outs, m)
}

// takeBudgets takes a token of every budget each job to be decided needs,
// retrying while Redis fails. A job that finds a budget exhausted is held
// until a token is expected back for it (the latest such time of its
// budgets), up to the budget's max_hold, and gives back the tokens it got.
func (w *Worker) takeBudgets(ctx context.Context, rs *rules.Rules, items []item, now time.Time) error {
	var wants []budget.Want
	var owners []int
	for i := range items {
		if items[i].decide {
			for _, wt := range items[i].wants {
				wants = append(wants, wt)
				owners = append(owners, i)
			}
		}
	}
	retry := w.newRetry("redis_budget", w.cfg.RedisRetryMin, w.cfg.RedisRetryMax)
	var grants []budget.Grant
	for {
		var err error
		if grants, err = w.cfg.Budgets.Take(ctx, wants); err == nil {
			break
		}
		for j, g := range grants { // what was granted before the failure goes back
			if g.OK {
				w.cfg.Budgets.Return(wants[j], 1)
			}
		}
		if !retry.wait(ctx, "budget tokens failed; retrying", len(wants), err) {
			return fmt.Errorf("consumer: stopped waiting for budget tokens (batch left uncommitted): %w", ctx.Err())
		}
	}
	short := map[int]int{} // item -> index of its want with the latest retry-at
	for j, g := range grants {
		i := owners[j]
		if !g.OK {
			if k, ok := short[i]; !ok || g.RetryAt.After(grants[k].RetryAt) {
				short[i] = j
			}
		}
	}
	for j, g := range grants {
		i := owners[j]
		if _, refused := short[i]; refused && g.OK {
			w.cfg.Budgets.Return(wants[j], 1)
		}
	}
	for i := range items {
		it := &items[i]
		k, refused := short[i]
		if !refused {
			it.taken = len(it.wants) > 0
			continue
		}
		name := wants[k].Spec.Name
		it.byBudget = true
		if w.holdOrRefuse(it, rules.Policy{Hold: true, MaxHold: rs.BudgetMaxHold(name)}, grants[k].RetryAt, name, now) {
			it.decide = false
			continue
		}
		// Not holdable (expired, beyond max_hold): refused, after a duplicate check.
		it.refuse, it.refuseCap = it.reason, name
		it.req.Caps = refuseCaps
	}
	return nil
}

// returnBudgets gives back the tokens of jobs that were not forwarded after
// all, once per budget key.
func (w *Worker) returnBudgets(items []item) {
	var back map[string]int
	var wants map[string]budget.Want
	for i := range items {
		it := &items[i]
		if !it.taken || it.decision == DecisionAllowed || it.decision == DecisionUnchecked {
			continue // forwarded: the tokens are used
		}
		if back == nil { // capped, duplicate (sent before), dead-lettered
			back, wants = map[string]int{}, map[string]budget.Want{}
		}
		for _, wt := range it.wants {
			back[wt.Key]++
			wants[wt.Key] = wt
		}
	}
	for key, n := range back {
		w.cfg.Budgets.Return(wants[key], n)
	}
}
