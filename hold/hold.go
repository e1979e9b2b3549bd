// Package hold keeps capped sends waiting on Kafka until they may go: a
// timing wheel of delay topics ("tiers") with fixed delays, e.g. 1s, 10s, 1m,
// 10m, 1h and 6h. A held job is written to the longest tier whose delay is not
// after its due time; each tier is consumed in order by a Reader that returns
// a message no earlier than its wake time (written in the message: when it
// was queued plus the tier's delay, or its due time if that is sooner), and
// the worker then either decides the job again (it is due) or moves it to the
// tier that fits what is left. Nothing is held in memory or in Redis: a
// message leaves a tier only when its offset is committed, after the job has
// moved on, so a crash or a rebalance redelivers it.
//
// A tier's messages do not come in wake order: in the shortest tier a job
// with a few milliseconds left is queued behind jobs with the whole delay
// left, and in every tier the consumer group interleaves the partitions as
// their fetches come. A Reader reads ahead while it waits and returns the
// earliest wake first, so a job is released when it is due, not when the
// messages fetched before it are.
package hold

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/capper-dev/capper/output"
	"github.com/segmentio/kafka-go"
)

// Tier is one delay topic.
type Tier struct {
	Name  string        // e.g. "10s", "1m", "6h"
	Delay time.Duration // how long a message waits in it
	Topic string
}

// Wheel is the set of tiers, shortest first. Immutable, safe for concurrent use.
type Wheel struct{ tiers []Tier }

// DefaultDelays are the tiers of a wheel when none are configured.
// The shortest, 100ms, is how often a job with less than a second left hops
// while it waits (its reader returns it at its due time, reading past the
// jobs queued before it).
var DefaultDelays = []time.Duration{100 * time.Millisecond, time.Second, 10 * time.Second, time.Minute, 10 * time.Minute, time.Hour, 6 * time.Hour}

// NewWheel returns the wheel of delays, each tier's topic being prefix plus
// its name ("sends.delay." + "10s").
func NewWheel(prefix string, delays []time.Duration) (*Wheel, error) {
	if len(delays) == 0 {
		return nil, errors.New("hold: at least one delay is required")
	}
	ds := slices.Clone(delays)
	slices.Sort(ds)
	w := &Wheel{}
	for i, d := range ds {
		switch {
		case d < 100*time.Millisecond || d%time.Millisecond != 0:
			return nil, fmt.Errorf("hold: delay %v must be whole milliseconds, at least 100ms", d)
		case i > 0 && d == ds[i-1]:
			return nil, fmt.Errorf("hold: delay %v is listed twice", d)
		}
		name := Name(d)
		w.tiers = append(w.tiers, Tier{Name: name, Delay: d, Topic: prefix + name})
	}
	return w, nil
}

// Name is a delay as a tier name: 500ms, 10s, 1m, 6h, 1d.
func Name(d time.Duration) string {
	for _, u := range []struct {
		d      time.Duration
		suffix string
	}{{24 * time.Hour, "d"}, {time.Hour, "h"}, {time.Minute, "m"}, {time.Second, "s"}} {
		if d%u.d == 0 {
			return strconv.FormatInt(int64(d/u.d), 10) + u.suffix
		}
	}
	return strconv.FormatInt(d.Milliseconds(), 10) + "ms"
}

// Tiers returns the tiers, shortest first.
func (w *Wheel) Tiers() []Tier { return slices.Clone(w.tiers) }

// Longest returns the longest tier's delay.
func (w *Wheel) Longest() time.Duration { return w.tiers[len(w.tiers)-1].Delay }

// Route returns the tier a job due at due goes to at now, and when that
// tier's reader should look at it again: the longest tier whose delay is not
// after due, waking after its delay; when even the shortest is too long, the
// shortest, waking at due.
func (w *Wheel) Route(now, due time.Time) (Tier, time.Time) {
	left := due.Sub(now)
	for i := len(w.tiers) - 1; i >= 0; i-- {
		if t := w.tiers[i]; t.Delay <= left {
			return t, now.Add(t.Delay)
		}
	}
	return w.tiers[0], due
}

// State is a held job's hold record, carried in the headers of its messages
// on the delay topics and of its final output.
type State struct {
	Since  time.Time // when the job was submitted (its input message's timestamp): max_hold counts from it
	Due    time.Time // when it may be decided again
	Wake   time.Time // when its tier's reader returns it (<= Due)
	Count  int       // how often it was held, this hold included
	Reason string    // why: the cap that refused it, or "quiet_hours"
}

// AppendHeaders appends s's headers to h.
func (s State) AppendHeaders(h []kafka.Header) []kafka.Header {
	return append(h,
		kafka.Header{Key: output.HeaderHeldSince, Value: []byte(output.FormatTime(s.Since))},
		kafka.Header{Key: output.HeaderDueAt, Value: []byte(output.FormatTime(s.Due))},
		kafka.Header{Key: output.HeaderWakeAt, Value: []byte(output.FormatTime(s.Wake))},
		kafka.Header{Key: output.HeaderHoldCount, Value: []byte(strconv.Itoa(s.Count))},
		kafka.Header{Key: output.HeaderHoldReason, Value: []byte(s.Reason)},
	)
}

// ParseState reads the state from a delay-topic message's headers; ok is
// false when it carries none (the Count header is absent).
func ParseState(hs []kafka.Header) (s State, ok bool, err error) {
	for _, h := range hs {
		var perr error
		switch h.Key {
		case output.HeaderHeldSince:
			s.Since, perr = time.Parse(time.RFC3339Nano, string(h.Value))
		case output.HeaderDueAt:
			s.Due, perr = time.Parse(time.RFC3339Nano, string(h.Value))
		case output.HeaderWakeAt:
			s.Wake, perr = time.Parse(time.RFC3339Nano, string(h.Value))
		case output.HeaderHoldCount:
			ok = true
			s.Count, perr = strconv.Atoi(string(h.Value))
		case output.HeaderHoldReason:
			s.Reason = string(h.Value)
		}
		if perr != nil {
			return State{}, false, fmt.Errorf("hold: header %s: %w", h.Key, perr)
		}
	}
	if ok && (s.Due.IsZero() || s.Since.IsZero() || s.Count < 1) {
		return State{}, false, errors.New("hold: incomplete hold headers")
	}
	return s, ok, nil
}
