package consumer

// Collapse keys: of a user's sends with one key, only the newest goes
// (package collapse). Each keyed send is checked, and registered as its
// key's newest, before its budget tokens; one that collapses is refused as
// collapsed (after a duplicate check, as every refusal); with a window, a
// forwarded one is recorded before its outputs are written.

import (
	"context"
	"fmt"
	"time"

	"github.com/capper-dev/capper/collapse"
)

// ReasonCollapsed is the cap and reason of a send that a newer one of its
// collapse key replaced (HeaderCollapsedBy names it).
const ReasonCollapsed = "collapsed"

// Collapser keeps the users' collapse keys (*collapse.Registry).
type Collapser interface {
	Check(ctx context.Context, sends []collapse.Send, now time.Time) ([]collapse.Verdict, error)
	Sent(ctx context.Context, sends []collapse.Send, at []time.Time, now time.Time) error
}

// collapsed is what the collapse keys said of a job (facts.collapse).
type collapsed struct {
	asked bool
	by    string // the job that replaces it; "": it may go
	why   string // newer, window
}

// collapseSend is e's send as the collapse keys know it.
func (w *Worker) collapseSend(e *entry) collapse.Send {
	c := &e.plan.Collapse
	return collapse.Send{User: w.cfg.UserKey(e.ws.Space, e.job.UserID), Key: c.Key, Job: e.job.JobID, Since: e.facts.since,
		Window: c.Window, Retain: c.Retain}
}

// checkCollapse checks the keyed jobs that wait for it, retrying while
// Redis fails; a job whose fail-open limit passes meanwhile goes on
// unchecked by its key (decide then lets it out unchecked, or not).
func (w *Worker) checkCollapse(ctx context.Context, es []entry) error {
	var owners []int
	for i := range es {
		e := &es[i]
		if e.out.Ask != AskCollapse {
			continue
		}
		if w.cfg.Collapse == nil { // collapse keys are not kept
			e.facts.collapse.asked = true
			w.route(e)
			continue
		}
		owners = append(owners, i)
	}
	retry := w.newRetry("redis_collapse", w.cfg.RedisRetryMin, w.cfg.RedisRetryMax)
	for len(owners) > 0 {
		sends := make([]collapse.Send, len(owners))
		for j, i := range owners {
			sends[j] = w.collapseSend(&es[i])
		}
		now := w.cfg.Clock()
		vs, err := w.cfg.Collapse.Check(ctx, sends, now)
		if err == nil {
			for j, i := range owners {
				e := &es[i]
				e.facts.collapse = collapsed{asked: true, by: vs[j].By, why: vs[j].Why}
				if vs[j].Collapsed() {
					w.m.collapsed.WithLabelValues(vs[j].Why).Inc()
				}
				w.route(e)
			}
			return nil
		}
		w.redisHealth(true, err, now)
		owners = w.failingOpen(es, owners, now, func(e *entry) {
			e.facts.collapse.asked = true
			w.route(e)
		})
		if len(owners) > 0 && !retry.wait(ctx, "collapse keys failed; retrying", len(owners), err) {
			return fmt.Errorf("consumer: stopped waiting for collapse keys (batch left uncommitted): %w", ctx.Err())
		}
	}
	return nil
}

// failingOpen calls open for each job of owners whose fail-open limit has
// passed at now, and returns the others.
func (w *Worker) failingOpen(es []entry, owners []int, now time.Time, open func(*entry)) []int {
	kept := owners[:0]
	for _, i := range owners {
		if w.failOpen(&es[i], now) {
			open(&es[i])
			continue
		}
		kept = append(kept, i)
	}
	return kept
}

// recordSent records the forwarded sends whose collapse key has a window,
// retrying while Redis fails (a job whose fail-open limit passes meanwhile
// goes unrecorded): a send of its key within the window then collapses. A
// duplicate is recorded again (at when it was first allowed), in case its
// first copy's outputs were written and its record was not; an unchecked
// send is not recorded (Redis was not there to decide it).
func (w *Worker) recordSent(ctx context.Context, es []entry) error {
	var owners []int
	for i := range es {
		e := &es[i]
		if (e.out.Kind == Allowed || e.out.Kind == Duplicate) && w.cfg.Collapse != nil && e.plan.Collapse.Key != "" && e.plan.Collapse.Window > 0 {
			owners = append(owners, i)
		}
	}
	retry := w.newRetry("redis_collapse", w.cfg.RedisRetryMin, w.cfg.RedisRetryMax)
	for len(owners) > 0 {
		sends, at := make([]collapse.Send, len(owners)), make([]time.Time, len(owners))
		for j, i := range owners {
			sends[j], at[j] = w.collapseSend(&es[i]), es[i].out.DecidedAt
		}
		now := w.cfg.Clock()
		err := w.cfg.Collapse.Sent(ctx, sends, at, now)
		if err == nil {
			return nil
		}
		w.redisHealth(true, err, now)
		owners = w.failingOpen(es, owners, now, func(*entry) {})
		if len(owners) > 0 && !retry.wait(ctx, "recording collapse keys failed; retrying", len(owners), err) {
			return fmt.Errorf("consumer: stopped recording collapse keys (batch left uncommitted): %w", ctx.Err())
		}
	}
	return nil
}
