package consumer

// One batch on its way through the worker, as a data flow:
//
//	decode -> release (tiers) -> plan -> collapse keys -> budget tokens ->
//	Redis (retry, fail-open) -> give tokens back -> record collapse keys
//	sent -> encode
//
// After each step that learns something of a job, route (route.go) gives its
// outcome, or the step it waits for (Outcome.Ask).

import (
	"cmp"
	"context"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/cespare/xxhash/v2"
	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/budget"
	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/jobs"
	"github.com/capper-dev/capper/rules"
)

// entry is one job of a batch.
type entry struct {
	msg       *kafka.Message
	job       jobs.Job
	tags      []string // its category and tags (the log's and the scopes')
	segment   string   // the user's segment, or "default"
	inSegment bool
	ws        *Workspace
	plan      rules.Plan
	facts     facts
	at        time.Time // when its last step was taken: route's clock reading
	out       Outcome
}

// route routes e at e.at.
func (w *Worker) route(e *entry) { e.out = route(&e.plan, &e.facts, w.cfg.Wheel, e.at) }

// decided is a batch whose outputs are ready to be written.
type decided struct {
	batch     []kafka.Message
	outs      []kafka.Message
	decisions map[Kind]int          // final and held jobs by kind, counted once the outputs are acknowledged
	byWS      [][DeadLetter + 1]int // the same by workspace (Workspace.index), with workspaces
	spaces    *Workspaces
	shadow    map[string]int // allowed jobs that a shadow cap would have capped, by cap
	cappedBy  map[string]int // capped jobs, by the cap that refused them
	start     time.Time
}

// prepare takes one batch through its steps and builds its outputs. It
// returns an error only when ctx ends before the batch is decided.
func (w *Worker) prepare(ctx context.Context, batch []kafka.Message) (*decided, error) {
	start := w.cfg.Clock()
	var trips0 uint64
	if w.cfg.RoundTrips != nil {
		trips0 = w.cfg.RoundTrips()
	}
	segs := segmenters{spaces: w.spaces.Load()} // one rules version, and one snapshot per workspace, for the whole batch
	// The batch's working arrays are the last batch's, cleared: nothing
	// outlives prepare but the outputs, which do not point into them.
	es := w.buf.entries[:0]
	if cap(es) < len(batch) {
		es = make([]entry, len(batch))
	}
	es = es[:len(batch)]
	clear(es)
	w.buf.plans.Reset()
	w.buf.tags = w.buf.tags[:0]
	defer func() { w.buf.entries = es }()
	for i := range batch {
		e := &es[i]
		e.msg, e.at = &batch[i], start
		if !w.decode(e, &segs, start) {
			w.route(e) // dead-lettered or moved on: route needs no plan
			continue
		}
		e.plan = e.ws.Rules.Plan(rules.Job{Channel: e.job.Channel, Category: e.job.Category, Tags: e.tags, Campaign: e.job.CampaignID, CampaignEnds: e.job.CampaignEndsAt,
			Zone: e.job.Zone, Segment: e.segment, InSegment: e.inSegment, Priority: e.job.Priority, HasPriority: e.job.HasPriority, CollapseKey: e.job.CollapseKey}, start, &w.buf.plans)
		w.route(e)
	}
	if err := w.checkCollapse(ctx, es); err != nil {
		return nil, err
	}
	if err := w.takeTokens(ctx, es); err != nil {
		return nil, err
	}
	if err := w.decide(ctx, es); err != nil {
		return nil, err
	}
	w.returnTokens(ctx, es)
	if err := w.recordSent(ctx, es); err != nil {
		return nil, err
	}
	if w.cfg.RoundTrips != nil { // only this stage talks to Redis, so the delta is this batch's
		w.m.roundTrips.Observe(float64(w.cfg.RoundTrips() - trips0))
	}
	return w.encode(batch, es, segs.spaces, start), nil
}

// decode reads the job of e and, for a delay tier's worker, the hold state
// it arrived with, into e's facts. It reports false when route needs no
// plan: the job is malformed (or too large for its output), or it is not
// due yet (moved on to a shorter tier).
func (w *Worker) decode(e *entry, segs *segmenters, now time.Time) bool {
	m := e.msg
	if n := messageBytes(m) + reservedHeaderBytes; n > w.cfg.MaxOutputBytes {
		e.facts.malformed, e.facts.truncate = jobs.Malformed("message of %d bytes with capper's headers would exceed the output limit of %d bytes (kafka.max_batch_bytes); value truncated to its first %d bytes", n, w.cfg.MaxOutputBytes, truncatedValueBytes).Error(), true
		return false
	}
	job, err := jobs.Decode(m.Value, w.cfg.MaxMessageBytes)
	if err == nil && w.cfg.Tier != "" {
		e.facts.arrived, err = w.arrived(m)
	}
	if err != nil {
		e.facts.malformed = err.Error()
		return false
	}
	if w.cfg.Tier != "" {
		switch a := &e.facts.arrived; {
		case !a.Due.After(now):
			w.m.releaseLag.Observe(now.Sub(a.Due).Seconds())
		case w.cfg.Early != nil && a.Wake.After(now): // released early: route says whether it claims a token
			e.facts.early = true
		default: // route moves it on
			return false
		}
	}
	n := len(w.buf.tags)
	w.buf.tags = jobs.AppendAllTags(w.buf.tags, job.Category, job.Tags)
	e.job, e.tags = job, w.buf.tags[n:len(w.buf.tags):len(w.buf.tags)] // its own capacity: an append to it copies
	e.facts.expiresAt = job.ExpiresAt
	e.facts.since = cmp.Or(m.Time, now) // submitted now, or when its producer stamped it
	if e.facts.arrived.Count > 0 {
		e.facts.since = e.facts.arrived.Since
	}
	if e.ws, err = segs.spaces.Lookup(job.Workspace); err != nil {
		e.facts.malformed = jobs.Malformed("%v", err).Error()
		return false
	}
	if e.segment, e.inSegment = segs.of(e.ws).Lookup(job.UserID); !e.inSegment {
		e.segment = "default"
	}
	return true
}

// segmenters are a batch's workspaces and the segment snapshot of each, taken
// at its first job (by Workspace.index).
type segmenters struct {
	spaces *Workspaces
	segs   []Segmenter
}

func (s *segmenters) of(w *Workspace) Segmenter {
	if s.segs == nil {
		s.segs = make([]Segmenter, s.spaces.Len())
	}
	seg := s.segs[w.index]
	if seg == nil {
		seg = w.Segments()
		s.segs[w.index] = seg
	}
	return seg
}

// arrived reads the hold state of a message from a delay tier.
func (w *Worker) arrived(m *kafka.Message) (hold.State, error) {
	s, ok, err := hold.ParseState(m.Headers)
	switch {
	case err != nil:
		return s, jobs.Malformed("%v", err)
	case !ok:
		return s, jobs.Malformed("a message on the delay tier %s without hold headers", w.cfg.Tier)
	}
	return s, nil
}

// takeTokens takes a token of every budget each job that asks for them
// needs, retrying while Redis fails. A job short of a token gives back the
// tokens it got and is told when one is expected back for it: the latest
// such time of its budgets, which promised it that token; held until then,
// it claims it when it comes back.
func (w *Worker) takeTokens(ctx context.Context, es []entry) error {
	var wants []budget.Want
	var owners []int
	for i := range es {
		e := &es[i]
		if e.out.Ask != AskTokens {
			continue
		}
		if w.cfg.Budgets == nil { // budgets are not enforced
			e.facts.tokens.taken = true
			w.route(e)
			continue
		}
		job := jobName(e)
		for _, wt := range e.plan.Wants {
			wt.Until, wt.Job = holdUntil(&e.facts, e.plan.OnShort(wt.Spec.Name), w.cfg.Wheel, e.at), job
			if a := &e.facts.arrived; a.Count > 0 && a.Reason == wt.Spec.Name {
				wt.Promised = a.Due // back when this budget promised it a token: it claims that token
				wt.Early = e.facts.early && a.Due.After(e.at)
			}
			wants = append(wants, wt)
			owners = append(owners, i)
		}
	}
	if len(wants) == 0 {
		return nil
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
	w.followClaims(es, wants, grants, owners)
	for j, g := range grants {
		t := &es[owners[j]].facts.tokens
		t.taken = true
		if g.Copy { // another copy of the job took its token: checked as its duplicate, or back shortly
			t.copy, g.RetryAt = true, es[owners[j]].at.Add(copyRetry)
		}
		if !g.OK && (t.short == "" || g.RetryAt.After(t.retryAt)) {
			t.short, t.retryAt = wants[j].Spec.Name, g.RetryAt
		}
		if !g.OK && !g.Copy && !g.Promised {
			t.unkept = true
		}
		if g.OK && (t.until.IsZero() || g.Until.Before(t.until)) {
			t.until = g.Until
		}
		if g.Claimed {
			t.claimed, t.promise = true, wants[j].Promised
		}
		// An early claim granted (its hold ends now), or promised a token sooner, gave its promise up: at
		// that time, the next early claim.
		if e := &es[owners[j]]; wants[j].Early && (g.OK || g.Promised && g.RetryAt.Before(wants[j].Promised)) {
			if g.OK {
				e.facts.arrived.Due = e.at
			}
			w.cfg.Early.Release(wants[j].Spec.Name, wants[j].Promised)
		}
	}
	for j, g := range grants {
		if g.OK && es[owners[j]].facts.tokens.short != "" {
			w.cfg.Budgets.Return(wants[j], 1)
		}
	}
	for j, i := range owners {
		if j == 0 || owners[j-1] != i {
			w.route(&es[i])
		}
	}
	return nil
}

// copyRetry is when a job whose budget token another copy of it claimed
// (budget.Grant.Copy) comes back, when Redis does not know it as a duplicate
// yet: that copy is being decided, or was not forwarded.
const copyRetry = 250 * time.Millisecond

// jobName names e's job to the budgets (budget.Want.Job): the same for each
// copy of it, whatever replica decides it; a digest of its workspace, user
// and job id.
func jobName(e *entry) string {
	var b [12]byte
	binary.BigEndian.PutUint32(b[:4], e.job.UserID)
	binary.BigEndian.PutUint64(b[4:], xxhash.Sum64String(e.ws.Name+"\x00"+e.job.JobID))
	return hex.EncodeToString(b[:])
}

// followWait is the farthest a claim that found its token missing may be
// promised again and still move on to that time rather than be held again
// (followClaims).
const followWait = time.Second

// followClaims marks the held sends that came back for their promised token,
// found it missing and were promised the next token back within followWait:
// they move on to that time as jobs not due yet (route: Moved, no hold
// record, their hold count unchanged) and claim it then. A token claimed
// late comes back late (a rebalance stops every tier's reader for a second
// or so, and the sends due meanwhile claim theirs when it ends), so the send
// promised it next finds it missing and is promised the next token back,
// which is that one, a few hundred milliseconds later (budget.lua). Held
// again, each such send would cost a hold record, and the shift would reach
// every send of the backlog in turn. Waiting for it in the tier's worker
// stops the tier's other releases with it: in a burst after a SIGKILL, the
// sends due in the 0.8 s of such a wait came out together after it, in the
// next window of a second, and the window of the wait got 11 of 50.
// Only a send of one budget moves (its tokens of other budgets would lapse
// meanwhile); one promised later, or not before its until, is held.
func (w *Worker) followClaims(es []entry, wants []budget.Want, grants []budget.Grant, owners []int) {
	if w.cfg.Tier == "" {
		return
	}
	now := w.cfg.Clock()
	for j, g := range grants {
		wt := wants[j]
		switch {
		case g.OK, g.Copy, wt.Promised.IsZero(), g.RetryAt.Sub(now) > followWait, !g.Promised:
			continue // granted, another copy's, not a claim, promised too late, or not promised at all
		case j > 0 && owners[j-1] == owners[j], j+1 < len(owners) && owners[j+1] == owners[j]:
			continue // a send of several budgets
		}
		es[owners[j]].facts.tokens.follow = true
	}
}

// holdsTokens reports whether e took the tokens of its plan.
func (w *Worker) holdsTokens(e *entry) bool {
	return w.cfg.Budgets != nil && e.facts.tokens.taken && e.facts.tokens.short == "" && len(e.plan.Wants) > 0
}

// returnTokens gives back the tokens of jobs that were not forwarded after
// all (capped, duplicate: sent before, dead-lettered), once per budget key
// (and bucket). A duplicate that claimed the token promised to it when it was
// held is a copy of a job that claimed it before (a tier's message delivered
// twice): its token goes back to Redis with the promise it took from another
// job (budget.Budgets.Unclaim), or, if Redis fails, as the others. A send of
// one budget knows the bucket its token is counted in (its grant's Until):
// its token goes back with PutBack, to Redis while the budget is short or
// when it was a held send's claim, and then the budget's next held send is
// released early for it (hold.Early). A send of several holds tokens of
// several buckets and knows the first to end: its tokens go to the reserve.
func (w *Worker) returnTokens(ctx context.Context, es []entry) {
	type bucket struct {
		key   string
		until time.Time
		claim bool // a held send's claim (its want's Promised set): budget.PutBack keeps it for another
	}
	type putBack struct {
		want budget.Want
		n    int
	}
	var back map[string]int
	var put map[bucket]*putBack
	var wants map[string]budget.Want
	for i := range es {
		e := &es[i]
		if !w.holdsTokens(e) || e.out.Kind == Allowed || e.out.Kind == Unchecked {
			continue // forwarded: the tokens are used
		}
		if back == nil {
			back, put, wants = map[string]int{}, map[bucket]*putBack{}, map[string]budget.Want{}
		}
		for _, wt := range e.plan.Wants {
			if a := &e.facts.arrived; e.facts.tokens.claimed && e.out.Kind == Duplicate && a.Count > 0 && a.Reason == wt.Spec.Name {
				wt.Promised = e.facts.tokens.promise
				if err := w.cfg.Budgets.Unclaim(ctx, wt, e.facts.tokens.until); err == nil {
					continue
				} else {
					w.log.Warn("giving a duplicate's budget claim back failed; its token is put back as an unused one", "budget", wt.Key, "err", err)
				}
			}
			if len(e.plan.Wants) == 1 && !e.facts.tokens.until.IsZero() {
				if e.facts.tokens.claimed {
					wt.Promised = e.facts.tokens.promise
				}
				b := bucket{wt.Key, e.facts.tokens.until, e.facts.tokens.claimed}
				if put[b] == nil {
					put[b] = &putBack{want: wt}
				}
				put[b].n++
			} else {
				wants[wt.Key] = wt
				back[wt.Key]++
			}
		}
	}
	for key, n := range back {
		w.cfg.Budgets.Return(wants[key], n)
	}
	for b, p := range put {
		w.cfg.Budgets.PutBack(ctx, p.want, b.until, p.n)
		if w.cfg.Early != nil && b.claim { // a held send's token: another held send may take it now (hold.Early)
			for range p.n {
				w.cfg.Early.Release(p.want.Spec.Name, w.cfg.Clock())
			}
		}
	}
}

// request is e's request to Redis: a decision, or a duplicate check.
func (w *Worker) request(e *entry) capping.Request {
	r := capping.Request{UserID: e.job.UserID, Space: e.ws.Space, JobID: e.job.JobID, Channel: e.job.Channel, Campaign: e.job.CampaignID,
		Tags: e.tags, Retention: e.plan.Retention}
	if e.out.Ask == AskDuplicate {
		r.DuplicateOnly, r.Refused = true, e.out.Cap
		if r.Refused != "" { // marked until the copies held before may come back
			r.MarkFor = e.plan.LongestHold
		}
		return r
	}
	r.Caps, r.Preferences = e.plan.Caps, w.cfg.Preferences && !e.plan.CountOnly // a count-only send is never capped
	if arbitrates(&e.plan, &e.facts, w.cfg.Wheel, e.at) {
		r.Arbitration, r.Priority = max(e.plan.Arbitration, time.Millisecond), e.plan.Priority
		r.Candidate = e.facts.arrived.Reason == ReasonArbitration
	}
	return r
}

// decide asks Redis what the jobs waiting for it need to know, retrying the
// failed requests with capped exponential backoff until all are answered or
// ctx ends. Each attempt routes its jobs again first (one may have expired
// while Redis failed: it is then only checked for a duplicate). A request
// Redis can never decide goes to the dead-letter topic; a job whose
// fail-open limit has passed goes out unchecked.
func (w *Worker) decide(ctx context.Context, es []entry) error {
	var pending []int
	for i := range es {
		if a := es[i].out.Ask; a == AskDecision || a == AskDuplicate {
			pending = append(pending, i)
		}
	}
	retry := w.newRetry("redis", w.cfg.RedisRetryMin, w.cfg.RedisRetryMax)
	reqs := w.buf.reqs[:0]
	defer func() { clear(reqs); w.buf.reqs = reqs }()
	for len(pending) > 0 {
		now := w.cfg.Clock()
		if pending = w.lapseTokens(es, pending, now); len(pending) == 0 {
			return nil
		}
		reqs = reqs[:0]
		for _, i := range pending {
			e := &es[i]
			e.at = now
			w.route(e)
			r := w.request(e)
			if e.out.Ask == AskDecision && w.holdsTokens(e) && !e.facts.tokens.until.IsZero() {
				r.At = minTime(now, tokenDate(e.facts.tokens.until)) // within its tokens' bucket
			}
			reqs = append(reqs, r)
		}
		ds, err := w.cfg.Decider.Decide(ctx, reqs)
		re := requestErrors(err, len(reqs))
		failed, again := false, pending[:0]
		for j, i := range pending {
			e := &es[i]
			a := &e.facts.redis
			if a.asked { // the caps refused it for good: this was the look that marks it (markRefusal)
				a = &e.facts.mark
			}
			switch {
			case re != nil && re[j] != nil && errors.Is(re[j], capping.ErrInvalidRequest):
				*a = answer{asked: true, invalid: re[j].Error()}
			case re != nil && re[j] != nil:
				failed = true
				if !w.failOpen(e, now) {
					again = append(again, i)
					continue
				}
				*a = answer{asked: true, unchecked: true}
			default:
				*a = answer{asked: true, dec: ds[j]}
			}
			if w.route(e); e.out.Ask == AskDuplicate { // to be marked refused now
				again = append(again, i)
			}
		}
		w.redisHealth(failed, err, now)
		if len(again) == 0 {
			return nil
		}
		if failed && !retry.wait(ctx, "redis decisions failed; retrying", len(again), err) {
			return fmt.Errorf("consumer: stopped with %d undecided jobs (left uncommitted): %w", len(again), ctx.Err())
		}
		pending = again
	}
	return nil
}

// tokenDate is the latest instant a send whose tokens' buckets end at until
// may be decided at: the budget holds by decision time.
func tokenDate(until time.Time) time.Time { return until.Add(-time.Millisecond) }

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// lapseTokens lets the budget tokens of the pending jobs lapse whose
// decision cannot be dated within their tokens' bucket any more (it ended
// more than TokenGrace before now: the batch stalled, or Redis failed for
// that long). Such a job is short of a token again, held until one is
// expected back (or capped, after a duplicate check, when it cannot wait);
// the jobs still pending for Redis are returned.
func (w *Worker) lapseTokens(es []entry, pending []int, now time.Time) []int {
	kept := pending[:0]
	for _, i := range pending {
		e := &es[i]
		t := &e.facts.tokens
		if !w.holdsTokens(e) || t.until.IsZero() || !now.After(tokenDate(t.until).Add(w.cfg.TokenGrace)) {
			kept = append(kept, i)
			continue
		}
		for _, wt := range e.plan.Wants {
			w.cfg.Budgets.Lapse(wt, 1)
		}
		t.short, t.retryAt, t.until = e.plan.Wants[0].Spec.Name, now, time.Time{}
		e.at = now
		w.route(e)
		if e.out.Kind == Pending { // capped after a duplicate check: still Redis's
			kept = append(kept, i)
		}
	}
	return kept
}

// redisHealth tracks how long decisions have been failing: it starts the
// clock at the first failure and, at the first attempt without one, logs and
// records how long Redis was unavailable.
func (w *Worker) redisHealth(failed bool, err error, now time.Time) {
	switch {
	case failed && w.redisDownSince.IsZero():
		w.redisDownSince, w.redisAttempts = now, 1
		w.cfg.Logger.Warn("redis decisions failing", "err", err)
	case failed:
		w.redisAttempts++
	case !w.redisDownSince.IsZero():
		down := now.Sub(w.redisDownSince)
		w.m.redisOutage.Observe(down.Seconds())
		w.cfg.Logger.Info("redis decisions recovered", "unavailable_seconds", down.Seconds(), "failed_attempts", w.redisAttempts)
		w.redisDownSince, w.redisAttempts = time.Time{}, 0
	}
}

// failOpen reports whether e may go out unchecked at now: Redis has been
// failing for longer than its plan's fail-open limit.
func (w *Worker) failOpen(e *entry, now time.Time) bool {
	after := e.plan.FailOpenAfter
	return after > 0 && !w.redisDownSince.IsZero() && now.Sub(w.redisDownSince) >= after
}

// encode builds the batch's messages from its outcomes and counts them.
func (w *Worker) encode(batch []kafka.Message, es []entry, spaces *Workspaces, start time.Time) *decided {
	headers := 0
	for i := range es {
		headers += len(es[i].msg.Headers)
	}
	enc := newEncoder(w.cfg.Topics, w.cfg.Tier != "", w.cfg.MaxOutputBytes, len(es), headers)
	d := &decided{batch: batch, outs: make([]kafka.Message, 0, len(es)), decisions: make(map[Kind]int, 5),
		shadow: map[string]int{}, cappedBy: map[string]int{}, start: start}
	for i := range es {
		e := &es[i]
		o := &e.out
		d.outs = enc.append(d.outs, e.msg, e.segment, o)
		switch o.Kind {
		case Moved: // not a decision
			w.m.moves.WithLabelValues(o.Tier.Name).Inc()
			continue
		case Held:
			w.m.held.WithLabelValues(o.HeldBy).Inc()
		case Allowed:
			for _, c := range o.Shadow {
				d.shadow[c]++
			}
		case Capped:
			d.cappedBy[o.Cap]++
			if o.Reason != "" {
				w.m.notHeld.WithLabelValues(strings.ReplaceAll(o.Reason, " ", "_")).Inc()
			}
		}
		d.decisions[o.Kind]++
		if e.ws != nil && e.ws.Name != "" {
			if d.byWS == nil {
				d.byWS, d.spaces = make([][DeadLetter + 1]int, spaces.Len()), spaces
			}
			d.byWS[e.ws.index][o.Kind]++
		}
		if o.Arbitration != "" {
			w.m.arbitrations.WithLabelValues(o.Arbitration).Inc()
		}
	}
	return d
}

// requestErrors lines an error of a Decide call up with its requests: the
// call's own RequestErrors, or err for every request; nil when err is.
func requestErrors(err error, n int) capping.RequestErrors {
	var re capping.RequestErrors
	if err != nil && !errors.As(err, &re) {
		re = make(capping.RequestErrors, n)
		for i := range re {
			re[i] = err
		}
	}
	return re
}
