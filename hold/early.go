package hold

import (
	"context"
	"slices"
	"sync"
	"time"
)

// earlyLapse is how long a request to release a held message early waits
// for a Reader that holds one of its reason; then it is dropped (the token
// it was for has gone to a new send, or lapsed).
const earlyLapse = 100 * time.Millisecond

// earlyMax bounds the requests kept: those no Reader looks at (none holds a
// message) are dropped at their lapse only when one does.
const earlyMax = 1024

// Early is a process's requests to return a held message before its wake
// time, shared by the Readers of its tiers. A budget promises each send it
// refuses a token at a later time; when a token comes free before the send
// it was promised to could take it (a held send took its token and was then
// capped by its user's caps, or gave its promise up), and no new send is
// there to take it (every send left is held), the token would go unsent.
// The worker asks for a message held by that budget at once, or at the time
// of a promise given up; the Reader returns the one of that reason that
// wakes first, and the worker claims the budget's token early with it
// (budget.Want.Early). Safe for concurrent use.
type Early struct {
	mu    sync.Mutex
	wants []earlyWant
	// poke is cancelled at each request, and replaced: Readers waiting for a
	// wake time or a fetch look again.
	poke   context.Context
	cancel context.CancelFunc
}

type earlyWant struct {
	reason string
	at     time.Time
}

// NewEarly returns an Early with no request.
func NewEarly() *Early {
	e := &Early{}
	e.poke, e.cancel = context.WithCancel(context.Background())
	return e
}

// Release asks for one held message of reason (the hold's reason: the
// budget that held it) to be returned at at, before its wake time: the
// first Reader that holds one then returns its soonest. A request no
// Reader can serve within a tenth of a second of at is dropped.
func (e *Early) Release(reason string, at time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if len(e.wants) >= earlyMax { // the oldest request first
		e.wants = slices.Delete(e.wants, 0, len(e.wants)-earlyMax+1)
	}
	e.wants = append(e.wants, earlyWant{reason, at})
	e.cancel()
	e.poke, e.cancel = context.WithCancel(context.Background())
}

// Pending returns how many requests wait for a Reader.
func (e *Early) Pending() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.wants)
}

// take removes and returns the reason of the first request due by now that
// holds says a message is held for; it drops those past their lapse.
func (e *Early) take(now time.Time, holds func(reason string) bool) (string, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.wants = slices.DeleteFunc(e.wants, func(w earlyWant) bool { return now.Sub(w.at) > earlyLapse })
	for i, w := range e.wants {
		if !w.at.After(now) && holds(w.reason) {
			e.wants = slices.Delete(e.wants, i, i+1)
			return w.reason, true
		}
	}
	return "", false
}

// watch returns the context cancelled at the next request, and the time of
// the first request not due by now (zero: none).
func (e *Early) watch(now time.Time) (context.Context, time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	var next time.Time
	for _, w := range e.wants {
		if w.at.After(now) && (next.IsZero() || w.at.Before(next)) {
			next = w.at
		}
	}
	return e.poke, next
}
