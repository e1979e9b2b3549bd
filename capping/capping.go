package capping

import (
	"errors"
	"fmt"
	"strconv"
	"time"
)

// A Cap limits how many sends a user may receive in any window of the given
// length: at most Limit sends in any Window, counting only Channel's sends when
// Channel is set and every channel's when it is empty.
type Cap struct {
	// Name identifies the cap in decisions and logs, e.g. "daily" or "push-daily".
	Name string
	// Window is the length of the sliding window. (Required, > 0, whole milliseconds.)
	Window time.Duration
	// Limit is the most sends allowed in any Window. 0 blocks every send. (>= 0)
	Limit int
	// Channel restricts the cap to one channel, e.g. "push". Empty counts all channels.
	Channel string
}

// label is the cap's name in decisions: Name, or "cap<i>" for the i-th cap of a request.
func (c Cap) label(i int) string {
	if c.Name != "" {
		return c.Name
	}
	return "cap" + strconv.Itoa(i)
}

// Validate reports whether the cap is usable.
func (c Cap) Validate() error {
	switch {
	case c.Window < time.Millisecond:
		return fmt.Errorf("cap %q: window %v must be at least 1ms", c.Name, c.Window)
	case c.Window%time.Millisecond != 0:
		return fmt.Errorf("cap %q: window %v must be whole milliseconds", c.Name, c.Window)
	case c.Limit < 0:
		return fmt.Errorf("cap %q: limit %d must not be negative", c.Name, c.Limit)
	}
	return nil
}

// Daily and Weekly are the rolling windows users mostly write.
const (
	Daily  = 24 * time.Hour
	Weekly = 7 * 24 * time.Hour
)

// ErrInvalidRequest marks a request that can never be decided (no job id, no
// channel, no caps, a bad cap): retrying it is pointless. Other per-request
// errors are transient (network, timeout, failover) and worth retrying.
var ErrInvalidRequest = errors.New("invalid request")

// Request asks whether one send may go to one user.
type Request struct {
	// UserID is the user the send goes to.
	UserID uint32
	// JobID identifies the send; a request with a JobID already in the user's log
	// is a duplicate. (Required)
	JobID string
	// Channel is the send's channel, e.g. "email". (Required)
	Channel string
	// Caps are the caps that apply, usually the user's segment's. (At least one)
	Caps []Cap
}

func (r *Request) validate() error {
	if r.JobID == "" {
		return errors.New("empty job id")
	}
	if r.Channel == "" {
		return errors.New("empty channel")
	}
	if len(r.Caps) == 0 {
		return errors.New("no caps")
	}
	for _, c := range r.Caps {
		if err := c.Validate(); err != nil {
			return err
		}
	}
	return nil
}

// Decision is the answer to one Request. Being over a cap is a decision, not an error.
type Decision struct {
	// Allowed reports whether the send may go out. When it comes from Decide, an
	// allowed send has been recorded.
	Allowed bool
	// Duplicate reports that the job id was already in the log: the job was
	// allowed before and is not counted again. Allowed is true.
	Duplicate bool
	// Cap names the cap that decides RetryAt when the send is capped (its
	// Name, or "cap<i>" for the unnamed i-th cap of the request); empty otherwise.
	Cap string
	// RetryAt is when the send would pass every cap it exceeds, so a scheduler can
	// defer it. Zero when allowed, or when a cap with limit 0 blocks it for good.
	RetryAt time.Time
	// Counts holds, for each cap of the request, the sends in its window before
	// this decision.
	Counts []int
	// At is the clock reading the decision was taken at.
	At time.Time
}

// RequestErrors lines up one error per request of a batch, nil where the
// request was decided. Decide returns it when some requests failed; the
// caller should retry just those.
type RequestErrors []error

func (e RequestErrors) Error() string {
	n, first := 0, error(nil)
	for _, err := range e {
		if err != nil {
			if first == nil {
				first = err
			}
			n++
		}
	}
	return fmt.Sprintf("%d of %d decisions failed, first: %v", n, len(e), first)
}

// Unwrap returns the non-nil errors, for errors.Is and errors.As.
func (e RequestErrors) Unwrap() []error {
	var out []error
	for _, err := range e {
		if err != nil {
			out = append(out, err)
		}
	}
	return out
}
