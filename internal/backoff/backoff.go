// Package backoff is the one capped exponential backoff capper uses wherever it
// retries: decisions after a Redis failure, writes after a Kafka failure, the
// first segment snapshot, the connection to Redis at start-up.
package backoff

import (
	"context"
	"time"
)

// Backoff doubles a delay from Min up to Max. The zero value is not usable;
// make one with New. It is not safe for concurrent use: each retry loop has its own.
type Backoff struct {
	min, max, next time.Duration
	attempt        int
}

// New returns a Backoff whose first delay is min and whose delays never exceed max.
func New(min, max time.Duration) *Backoff {
	if max < min {
		max = min
	}
	return &Backoff{min: min, max: max, next: min}
}

// Next returns the delay before the next attempt and doubles the one after it.
func (b *Backoff) Next() time.Duration {
	d := b.next
	b.next = min(2*b.next, b.max)
	b.attempt++
	return d
}

// Attempt returns how many delays Next has handed out.
func (b *Backoff) Attempt() int { return b.attempt }

// Reset starts again from Min.
func (b *Backoff) Reset() { b.next, b.attempt = b.min, 0 }

// Sleep waits d or until ctx ends; it reports whether the full delay passed.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
