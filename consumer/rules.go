package consumer

import (
	"errors"
	"fmt"
	"time"

	"github.com/capper-dev/capper/capping"
)

// Rules say which caps apply to whom. A Rules value is immutable once handed
// to a Worker; swap in a new one with Worker.SetRules.
type Rules struct {
	// Segments lists the segments in priority order with their caps.
	Segments []SegmentRule
	// Default are the caps of users in no segment.
	Default []capping.Cap
	// Exempt lists categories that bypass the caps and are not counted.
	Exempt []string
	// FailOpen lists the categories and segments whose jobs may be forwarded
	// unchecked (decision "unchecked") once Redis has been unavailable for
	// longer than After. Every other job waits for Redis (fail-closed).
	FailOpen []FailOpenRule
	// Version identifies the rules in logs and metrics (e.g. a counter or hash).
	Version int64

	bySegment     map[string][]capping.Cap
	exempt        map[string]bool
	failOpenByCat map[string]time.Duration
	failOpenBySeg map[string]time.Duration
}

// FailOpenRule chooses availability over caps for one category or one
// segment (exactly one of the two is set).
type FailOpenRule struct {
	Category string
	Segment  string // a segment name, or "default" for users in no segment
	// After is how long Redis may be unavailable before such jobs go out
	// unchecked. (Required, > 0)
	After time.Duration
}

// SegmentRule is one segment's caps.
type SegmentRule struct {
	Name string
	Caps []capping.Cap
}

// Validate checks the rules and indexes them; call it before use.
func (r *Rules) Validate() error {
	r.bySegment = map[string][]capping.Cap{}
	r.exempt = map[string]bool{}
	if len(r.Default) == 0 {
		return errors.New("rules: default_caps: at least one cap is required (the caps of users in no segment)")
	}
	for i, c := range r.Default {
		if err := c.Validate(); err != nil {
			return fmt.Errorf("rules: default_caps[%d]: %w", i, err)
		}
	}
	for i, s := range r.Segments {
		if s.Name == "" {
			return fmt.Errorf("rules: segments[%d]: name is required", i)
		}
		if _, dup := r.bySegment[s.Name]; dup {
			return fmt.Errorf("rules: segments[%d]: segment %q is listed twice", i, s.Name)
		}
		if len(s.Caps) == 0 {
			return fmt.Errorf("rules: segments[%d] (%s): at least one cap is required", i, s.Name)
		}
		for j, c := range s.Caps {
			if err := c.Validate(); err != nil {
				return fmt.Errorf("rules: segments[%d] (%s): caps[%d]: %w", i, s.Name, j, err)
			}
		}
		r.bySegment[s.Name] = s.Caps
	}
	for _, c := range r.Exempt {
		r.exempt[c] = true
	}
	r.failOpenByCat = map[string]time.Duration{}
	r.failOpenBySeg = map[string]time.Duration{}
	for i, f := range r.FailOpen {
		var m map[string]time.Duration
		var name string
		switch {
		case (f.Category == "") == (f.Segment == ""):
			return fmt.Errorf("rules: fail_open[%d]: set exactly one of category and segment", i)
		case f.After <= 0:
			return fmt.Errorf("rules: fail_open[%d]: after must be a positive duration (how long Redis may be unavailable)", i)
		case f.Category != "":
			m, name = r.failOpenByCat, f.Category
		default:
			m, name = r.failOpenBySeg, f.Segment
		}
		if _, dup := m[name]; dup {
			return fmt.Errorf("rules: fail_open[%d]: %q is listed twice", i, name)
		}
		m[name] = f.After
	}
	return nil
}

// FailOpenAfter returns how long Redis may be unavailable before a job of
// category for a user of segment goes out unchecked: the shorter of the two
// rules that apply, or 0 when none does (fail-closed).
func (r *Rules) FailOpenAfter(category, segment string) time.Duration {
	c, s := r.failOpenByCat[category], r.failOpenBySeg[segment]
	if c == 0 || (s > 0 && s < c) {
		return s
	}
	return c
}

// SegmentNames returns the segments in priority order.
func (r *Rules) SegmentNames() []string {
	out := make([]string, len(r.Segments))
	for i, s := range r.Segments {
		out[i] = s.Name
	}
	return out
}

// CapsFor returns the caps of segment, or the default caps when ok is false
// or the segment has no rule.
func (r *Rules) CapsFor(segment string, ok bool) []capping.Cap {
	if ok {
		if caps, found := r.bySegment[segment]; found {
			return caps
		}
	}
	return r.Default
}

// IsExempt reports whether category bypasses the caps.
func (r *Rules) IsExempt(category string) bool { return r.exempt[category] }
