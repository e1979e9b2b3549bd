// Package events reads the streams that tell capper about sends it did not
// decide itself and about its users: external sends (made by other tools, or
// in-app and inbox impressions), which count toward the caps like capper's
// own; delivery feedback, which gives back the slot of a send that failed or
// bounced; and each user's own preferences.
//
// Both are JSON objects, one per Kafka message; Decode* validate them and
// say what is wrong with one that is not usable (it goes to the dead-letter
// topic with that reason).
package events

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/jobs"
	"github.com/capper-dev/capper/rules"
)

// Bounds of an event's fields: a job's (package jobs).
const (
	MaxIDBytes  = jobs.MaxJobIDBytes
	MaxTags     = jobs.MaxTags
	MaxTagBytes = jobs.MaxTagBytes
)

// Send is an external send: one that happened elsewhere and counts toward
// the user's caps from its SentAt.
//
//	{"event_id": "esp-81723", "user_id": 123, "channel": "email", "campaign_id": "welcome",
//	 "category": "marketing", "tags": ["promotional"], "sent_at": "2026-11-23T09:12:00Z"}
type Send struct {
	EventID  string    `json:"event_id"`    // (Required) unique per send: a redelivered event is counted once
	UserID   uint32    `json:"user_id"`     // (Required)
	Channel  string    `json:"channel"`     // (Required)
	Campaign string    `json:"campaign_id"` // optional: per-campaign scopes match it
	Category string    `json:"category"`    // optional, default "marketing"; one of its tags
	Tags     []string  `json:"tags"`        // optional
	SentAt   time.Time `json:"sent_at"`     // (Required) when the user received it
	// Workspace is the user's workspace, as a job's (empty: the default).
	Workspace string `json:"workspace"`
}

// AllTags returns the send's category followed by its tags, without repeats.
func (s *Send) AllTags() []string { return jobs.AllTags(s.Category, s.Tags) }

// Feedback is what a delivery service says of one of capper's sends.
//
//	{"job_id": "cmp-42:user-123:email", "user_id": 123, "status": "bounced"}
type Feedback struct {
	JobID  string `json:"job_id"`  // (Required) the job capper forwarded
	UserID uint32 `json:"user_id"` // (Required)
	Status string `json:"status"`  // (Required) e.g. delivered, failed, bounced
	// Workspace is the send's workspace, as its job's (empty: the default).
	Workspace string `json:"workspace"`
}

// GivesBack reports whether the status gives the send's slot back: the
// user never received it.
func (f *Feedback) GivesBack() bool { return f.Status == "failed" || f.Status == "bounced" }

// Statuses capper counts by name; any other is counted as "other".
var Statuses = []string{"delivered", "failed", "bounced", "opened", "clicked"}

// DecodeSend parses and validates an external send.
func DecodeSend(value []byte) (Send, error) {
	var raw struct {
		Send
		UserID *int64 `json:"user_id"`
		SentAt string `json:"sent_at"`
	}
	if err := strict(value, &raw); err != nil {
		return Send{}, err
	}
	s := raw.Send
	switch {
	case s.EventID == "" || len(s.EventID) > MaxIDBytes:
		return Send{}, Malformed("event_id is missing, or over %d bytes", MaxIDBytes)
	case raw.UserID == nil || *raw.UserID < 0 || *raw.UserID > 1<<32-1:
		return Send{}, Malformed("user_id is missing, or not an integer in 0..4294967295")
	case s.Channel == "":
		return Send{}, Malformed("channel is missing or empty")
	case raw.SentAt == "":
		return Send{}, Malformed("sent_at is missing")
	case len(s.Tags) > MaxTags:
		return Send{}, Malformed("%d tags, at most %d", len(s.Tags), MaxTags)
	}
	for _, t := range s.Tags {
		if t == "" || len(t) > MaxTagBytes {
			return Send{}, Malformed("a tag is not 1..%d bytes", MaxTagBytes)
		}
	}
	at, err := time.Parse(time.RFC3339Nano, raw.SentAt)
	if err != nil {
		return Send{}, Malformed("sent_at %q is not an RFC 3339 time", truncate(raw.SentAt))
	}
	s.UserID, s.SentAt = uint32(*raw.UserID), at
	if s.Category == "" {
		s.Category = "marketing"
	}
	return s, nil
}

// DecodeFeedback parses and validates a feedback event.
func DecodeFeedback(value []byte) (Feedback, error) {
	var raw struct {
		Feedback
		UserID *int64 `json:"user_id"`
	}
	if err := strict(value, &raw); err != nil {
		return Feedback{}, err
	}
	f := raw.Feedback
	switch {
	case f.JobID == "" || len(f.JobID) > MaxIDBytes:
		return Feedback{}, Malformed("job_id is missing, or over %d bytes", MaxIDBytes)
	case raw.UserID == nil || *raw.UserID < 0 || *raw.UserID > 1<<32-1:
		return Feedback{}, Malformed("user_id is missing, or not an integer in 0..4294967295")
	case f.Status == "" || len(f.Status) > 32:
		return Feedback{}, Malformed("status is missing, or over 32 bytes")
	}
	f.UserID = uint32(*raw.UserID)
	return f, nil
}

func strict(value []byte, v any) error {
	if err := json.Unmarshal(value, v); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) && te.Field != "" {
			return Malformed("%s has the wrong type (%s)", te.Field, te.Value)
		}
		return Malformed("not a JSON object: %v", err)
	}
	return nil
}

// Malformed returns the error of an event that is not usable: "malformed
// event: " and the reason, wrapping jobs.ErrMalformed.
func Malformed(format string, args ...any) error {
	return fmt.Errorf("%w event: %s", jobs.ErrMalformed, fmt.Sprintf(format, args...))
}

func truncate(s string) string { return jobs.Truncate(s, 40) }

// Preference is one of a user's own wishes, from the preferences topic or
// capper prefs set:
//
//	{"user_id": 7, "channel": "email", "limit": 1, "window": "7d"}   at most one email a week
//	{"user_id": 7, "tag": "promotional", "opt_out": true}            no promotions at all
//	{"user_id": 7, "vip_until": "2026-12-31T00:00:00Z"}              the rules' caps do not apply until then
//	{"user_id": 7, "channel": "email", "clear": true}                forget the email preference ("vip" with neither)
type Preference struct {
	UserID    uint32
	Workspace string // the user's workspace (field "workspace"), as a job's (empty: the default)
	Pref      capping.Preference
	Clear     bool
}

// DecodePreference parses and validates a preference event.
func DecodePreference(value []byte) (Preference, error) {
	var raw struct {
		UserID    *int64 `json:"user_id"`
		Channel   string `json:"channel"`
		Tag       string `json:"tag"`
		Limit     int    `json:"limit"`
		Window    string `json:"window"`
		OptOut    bool   `json:"opt_out"`
		VIPUntil  string `json:"vip_until"`
		Clear     bool   `json:"clear"`
		Workspace string `json:"workspace"`
	}
	if err := strict(value, &raw); err != nil {
		return Preference{}, err
	}
	if raw.UserID == nil || *raw.UserID < 0 || *raw.UserID > 1<<32-1 {
		return Preference{}, Malformed("user_id is missing, or not an integer in 0..4294967295")
	}
	p := Preference{UserID: uint32(*raw.UserID), Workspace: raw.Workspace, Clear: raw.Clear,
		Pref: capping.Preference{Channel: raw.Channel, Tag: raw.Tag, Limit: raw.Limit, OptOut: raw.OptOut}}
	if raw.Window != "" {
		w, err := rules.ParseDuration(raw.Window)
		if err != nil {
			return Preference{}, Malformed("window %q: %v", truncate(raw.Window), err)
		}
		p.Pref.Window = w
	}
	if raw.VIPUntil != "" {
		t, err := time.Parse(time.RFC3339Nano, raw.VIPUntil)
		if err != nil {
			return Preference{}, Malformed("vip_until %q is not an RFC 3339 time", truncate(raw.VIPUntil))
		}
		p.Pref.VIPUntil = t
	}
	if p.Clear {
		if raw.Channel != "" && raw.Tag != "" {
			return Preference{}, Malformed("clear names one of channel and tag (or neither, for vip_until)")
		}
		return p, nil
	}
	if err := p.Pref.Validate(); err != nil {
		return Preference{}, Malformed("%v", strings.TrimPrefix(err.Error(), "capping: "))
	}
	return p, nil
}
