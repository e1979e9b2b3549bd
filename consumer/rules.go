package consumer

import (
	"errors"
	"fmt"

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
	// Version identifies the rules in logs and metrics (e.g. a counter or hash).
	Version int64

	bySegment map[string][]capping.Cap
	exempt    map[string]bool
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
	return nil
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
