// Package testclock is the settable clock tests give capper's packages in
// place of time.Now, for window edges, bucket boundaries and day rollovers
// that a real clock cannot reach on demand.
package testclock

import (
	"sync"
	"time"
)

// Clock is a clock that moves only when told. Its Now is the func() time.Time
// every Config's Clock field takes. It is safe for concurrent use.
type Clock struct {
	mu sync.Mutex
	t  time.Time
}

// At returns a Clock reading t.
func At(t time.Time) *Clock { return &Clock{t: t} }

// Now returns the clock's reading.
func (c *Clock) Now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }

// Set moves the clock to t.
func (c *Clock) Set(t time.Time) { c.mu.Lock(); defer c.mu.Unlock(); c.t = t }

// Add moves the clock by d.
func (c *Clock) Add(d time.Duration) { c.mu.Lock(); defer c.mu.Unlock(); c.t = c.t.Add(d) }
