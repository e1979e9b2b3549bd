package loadtest

// The report's judgment of collapse keys, from the outputs alone: every
// output of a keyed send says its key (capper-collapse-key), and a
// collapsed one the send that replaced it (capper-collapsed-by).

import (
	"cmp"
	"slices"
	"time"

	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/output"
)

// collapseSlack is how much earlier than a send's decision a newer send of
// its key may have been decided without the send being wrong to go: two
// replicas can decide a user's sends at once while a rebalance moves its
// partitions, and a send's key is checked before it is decided.
const collapseSlack = time.Second

// keyedJob is what the report keeps of a send with a collapse key.
type keyedJob struct {
	key  string
	user uint32
	id   string // its job id
	// since and latest are its first and last submission: a resent job
	// (a new message of the same job id) is its key's newest as of the
	// resend. Each output's is its capper-held-since, else loadgen's
	// produce stamp.
	since, latest time.Time
	seen          time.Time // its first decision (held, or final)
	allowed       time.Time // its first allowed (not duplicate) decision; zero: none
	by            string    // collapsed: the send that replaced it
	byAt          time.Time // when it was collapsed
}

// mayBeNewer reports whether some copy of k was submitted after some copy
// of o (at the same time: the greater job id), as capper orders a key's
// sends: what a collapse of o by k needs.
func (k *keyedJob) mayBeNewer(o *keyedJob) bool { return after(k.latest, k.id, o.since, o.id) }

// newer reports whether every copy of k was submitted after every copy of
// o: then o must not go once k was seen.
func (k *keyedJob) newer(o *keyedJob) bool { return after(k.since, k.id, o.latest, o.id) }

func after(t time.Time, id string, u time.Time, uid string) bool {
	if c := t.Compare(u); c != 0 {
		return c > 0
	}
	return id > uid
}

// collapse records o of a keyed send.
func (c *Checker) collapse(o *Output) {
	if o.CollapseKey == "" {
		return
	}
	i, ok := c.m.Index(o.ID)
	if !ok {
		return
	}
	job := uint32(c.m.job(i))
	if c.keyed == nil {
		c.keyed = map[uint32]*keyedJob{}
	}
	k := c.keyed[job]
	if k == nil {
		k = &keyedJob{key: c.in.get(o.CollapseKey), user: c.m.user(i), id: c.m.JobID(i)}
		c.keyed[job] = k
	}
	since := o.HeldSince
	if since.IsZero() {
		since = o.ProducedAt
	}
	if !since.IsZero() && (k.since.IsZero() || since.Before(k.since)) {
		k.since = since
	}
	if since.After(k.latest) {
		k.latest = since
	}
	if at := o.at(); k.seen.IsZero() || at.Before(k.seen) {
		k.seen = at
	}
	switch {
	case o.Decision == output.DecisionAllowed && (k.allowed.IsZero() || o.at().Before(k.allowed)):
		k.allowed = o.at()
	case o.Reason == consumer.ReasonCollapsed:
		k.by, k.byAt = o.CollapsedBy, o.at()
	}
}

// collapses judges the keyed sends of each user and key:
//   - a collapsed send names a send of its user and key that is newer, or
//     (with collapse.window) that went within the window before it;
//   - no send goes after a newer one of its key was decided (held or sent),
//     more than collapseSlack before;
//   - with a window, no send goes within it after another of its key went,
//     when it was first decided more than collapseSlack after that one.
func (c *Checker) collapses() {
	type series struct {
		user uint32
		key  string
	}
	var window time.Duration
	if c.p.Rules.Collapse != nil {
		window = time.Duration(c.p.Rules.Collapse.Window)
	}
	by := map[series][]*keyedJob{}
	c.r.Keyed = len(c.keyed)
	for _, k := range c.keyed {
		if k.by != "" {
			c.r.Collapsed++
		}
		s := series{k.user, k.key}
		by[s] = append(by[s], k)
	}
	for s, ks := range by {
		slices.SortFunc(ks, func(a, b *keyedJob) int { return cmp.Or(a.since.Compare(b.since), cmp.Compare(a.id, b.id)) })
		var sent []*keyedJob
		for _, k := range ks {
			if !k.allowed.IsZero() {
				sent = append(sent, k)
			}
			if k.by == "" {
				continue
			}
			r := slices.IndexFunc(ks, func(o *keyedJob) bool { return o.id == k.by })
			switch {
			case r < 0:
				c.r.Violations++
				c.r.problem("user %d: job %q collapsed by %q, which is no send of its key %q", s.user, k.id, k.by, s.key)
			case ks[r].mayBeNewer(k):
			case window > 0 && !ks[r].allowed.IsZero() && !ks[r].allowed.After(k.byAt) && k.byAt.Sub(ks[r].allowed) < window:
			default:
				c.r.Violations++
				c.r.problem("user %d: job %q collapsed by %q, which is neither newer nor sent within the window before", s.user, k.id, k.by)
			}
		}
		for _, a := range sent {
			for _, b := range ks {
				if b.newer(a) && b.seen.Before(a.allowed.Add(-collapseSlack)) {
					c.r.Violations++
					c.r.problem("user %d: job %q of key %q sent at %s, after a newer one, %q, was decided at %s", s.user, a.id, s.key,
						a.allowed.Format(time.RFC3339Nano), b.id, b.seen.Format(time.RFC3339Nano))
					break
				}
			}
		}
		if window > 0 {
			slices.SortFunc(sent, func(a, b *keyedJob) int { return a.allowed.Compare(b.allowed) })
			for i := 1; i < len(sent); i++ {
				if d := sent[i].allowed.Sub(sent[i-1].allowed); d < window && sent[i].seen.Sub(sent[i-1].allowed) >= collapseSlack {
					c.r.Violations++
					c.r.problem("user %d: jobs %q and %q of key %q sent %v apart, within the collapse window %v", s.user, sent[i-1].id, sent[i].id, s.key, d, window)
				}
			}
		}
	}
}
