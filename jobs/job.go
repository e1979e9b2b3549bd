package jobs

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strconv"
	"time"

	"github.com/capper-dev/capper/rules"
)

// Job is one send job of the input topic.
//
//	{"job_id": "...", "user_id": 123, "campaign_id": "...", "channel": "email",
//	 "category": "marketing", "tags": ["promotional"], "timezone": "Asia/Singapore",
//	 "expires_at": "2026-11-22T18:00:00Z", "payload": {...}}
type Job struct {
	// JobID is unique per send, at most MaxJobIDBytes bytes. (Required)
	JobID string `json:"job_id"`
	// UserID is 0..4294967295. (Required)
	UserID uint32 `json:"user_id"`
	// CampaignID identifies the campaign. (Required)
	CampaignID string `json:"campaign_id"`
	// Channel is the delivery channel, e.g. email, push, sms. (Required)
	Channel string `json:"channel"`
	// Category defaults to "marketing"; exempt categories bypass the caps.
	Category string `json:"category"`
	// Tags label the send for the caps' scopes (with its category): at most
	// MaxTags, each 1..MaxTagBytes bytes.
	Tags []string `json:"tags"`
	// Timezone is the user's IANA time zone for calendar windows, e.g.
	// "Asia/Singapore"; empty: the rules' default.
	Timezone string `json:"timezone"`
	// Zone is Timezone resolved; nil for the rules' default.
	Zone *time.Location `json:"-"`
	// ExpiresAt, when set (RFC 3339), is when the send stops being
	// relevant: it is never allowed at or after it, nor held beyond it.
	ExpiresAt time.Time `json:"expires_at"`
	// Priority is 0..rules.MaxPriority, higher is more important (a cap's
	// reserved slots are for sends of its min_priority and above); when the
	// job has none (HasPriority false), the rules give its default.
	Priority    int  `json:"priority"`
	HasPriority bool `json:"-"`
	// Workspace names the brand or app whose rules, segments and users the
	// send belongs to, in a deployment with workspaces; empty: the default
	// workspace. A deployment without workspaces ignores it.
	Workspace string `json:"workspace"`
	// CampaignEndsAt, when set (RFC 3339), is when the job's campaign ends:
	// a tally cap with retain_until: campaign_end keeps its count until then.
	CampaignEndsAt time.Time `json:"campaign_ends_at"`
	// CollapseKey, when set (at most MaxCollapseKeyBytes), makes the send
	// one of a series of which only the newest may go: a send older than
	// another of its user with the same key (by submission time) is capped
	// as collapsed (see the rules' collapse section, which can also derive
	// keys for jobs without one).
	CollapseKey string `json:"collapse_key"`
}

// AllTags returns the job's category followed by its tags, without repeats:
// what the log records and tag scopes match.
func (j *Job) AllTags() []string { return AllTags(j.Category, j.Tags) }

// AllTags returns category followed by tags, without repeats: the tags of a
// job or an event, as the log records them and tag scopes match them.
func AllTags(category string, tags []string) []string {
	return AppendAllTags(make([]string, 0, 1+len(tags)), category, tags)
}

// AppendAllTags appends AllTags(category, tags) to dst, as append does: a
// batch cuts every job's tags from one array.
func AppendAllTags(dst []string, category string, tags []string) []string {
	n := len(dst)
	dst = append(dst, category)
	for _, t := range tags {
		if !slices.Contains(dst[n:], t) {
			dst = append(dst, t)
		}
	}
	return dst
}

// Bounds of a job's fields, and of an event's.
const (
	MaxJobIDBytes = 128
	MaxTags       = 8
	MaxTagBytes   = 64
	// MaxCollapseKeyBytes bounds a job's collapse_key.
	MaxCollapseKeyBytes = 128
)

// DefaultCategory is the category of a job that names none.
const DefaultCategory = "marketing"

// ErrMalformed wraps every reason a message is not a valid job or event: it
// can never be decided, and goes to the dead-letter topic with its reason.
var ErrMalformed = errors.New("malformed")

// Malformed returns the error of a message that is not a valid job: "malformed
// job: " and the reason, wrapping ErrMalformed.
func Malformed(format string, args ...any) error {
	return fmt.Errorf("%w job: %s", ErrMalformed, fmt.Sprintf(format, args...))
}

// rawJob is what Decode reads. The payload is not a field: json still
// checks that it is valid JSON, but nothing copies it.
type rawJob struct {
	JobID          string   `json:"job_id"`
	UserID         userID   `json:"user_id"`
	CampaignID     string   `json:"campaign_id"`
	Channel        string   `json:"channel"`
	Category       string   `json:"category"`
	Tags           []string `json:"tags"`
	Timezone       string   `json:"timezone"`
	ExpiresAt      string   `json:"expires_at"`
	Priority       userID   `json:"priority"`
	Workspace      string   `json:"workspace"`
	CampaignEndsAt string   `json:"campaign_ends_at"`
	CollapseKey    string   `json:"collapse_key"`
}

// userID parses a JSON number into 0..4294967295 without allocating (a
// user_id, or a priority: Decode checks its range).
type userID struct {
	v   uint32
	set bool
	err string
}

func (u *userID) UnmarshalJSON(b []byte) error {
	u.set = true
	if n, err := strconv.ParseUint(string(b), 10, 32); err == nil { // the usual case: plain digits
		u.v = uint32(n)
		return nil
	}
	f, err := strconv.ParseFloat(string(b), 64)
	switch {
	case err != nil:
		u.err = fmt.Sprintf("user_id is not a number: %s", Truncate(string(b), 40))
	case f < 0 || f > math.MaxUint32 || f != math.Trunc(f):
		u.err = fmt.Sprintf("user_id %s is not an integer in 0..4294967295", Truncate(string(b), 40))
	default:
		u.v = uint32(f) // e.g. 1e3 or 12.0
	}
	return nil
}

// Decode parses and validates one message value of the input topic. Errors
// wrap ErrMalformed and say what is wrong; it never panics.
func Decode(value []byte, maxBytes int) (Job, error) {
	var err error
	bad := func(format string, args ...any) (Job, error) { return Job{}, Malformed(format, args...) }
	if maxBytes > 0 && len(value) > maxBytes {
		return bad("message of %d bytes exceeds %d", len(value), maxBytes)
	}
	var r rawJob // on the stack: the fallback decodes into a copy of its own, which escapes to json
	if !scanJob(value, &r) {
		r, err = unmarshalJob(value)
	}
	if err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) && te.Field != "" {
			return bad("%s must be a %s, not %s", te.Field, jsonKind(te.Type.Kind()), te.Value)
		}
		return bad("not a JSON object: %v", err)
	}
	switch {
	case r.JobID == "":
		return bad("job_id is missing or empty")
	case len(r.JobID) > MaxJobIDBytes:
		return bad("job_id is %d bytes, at most %d", len(r.JobID), MaxJobIDBytes)
	case r.CampaignID == "":
		return bad("campaign_id is missing or empty")
	case r.Channel == "":
		return bad("channel is missing or empty")
	case !r.UserID.set:
		return bad("user_id is missing")
	case r.UserID.err != "":
		return bad("%s", r.UserID.err)
	}
	if len(r.Tags) > MaxTags {
		return bad("%d tags, at most %d", len(r.Tags), MaxTags)
	}
	for _, t := range r.Tags {
		if t == "" || len(t) > MaxTagBytes {
			return bad("tag %q is not 1..%d bytes", Truncate(t, 40), MaxTagBytes)
		}
	}
	if len(r.CollapseKey) > MaxCollapseKeyBytes {
		return bad("collapse_key is %d bytes, at most %d", len(r.CollapseKey), MaxCollapseKeyBytes)
	}
	switch p := r.Priority; {
	case p.err != "" || (p.set && p.v > rules.MaxPriority):
		return bad("priority must be an integer in 0..%d", rules.MaxPriority)
	}
	j := Job{JobID: r.JobID, UserID: r.UserID.v, CampaignID: r.CampaignID, Channel: r.Channel, Category: r.Category, Tags: r.Tags, Timezone: r.Timezone,
		Priority: int(r.Priority.v), HasPriority: r.Priority.set, Workspace: r.Workspace,
		CollapseKey: r.CollapseKey}
	if r.Timezone != "" {
		zone, err := rules.Location(r.Timezone)
		if err != nil {
			return bad("timezone: %v", err)
		}
		j.Zone = zone
	}
	if r.ExpiresAt != "" {
		t, err := time.Parse(time.RFC3339Nano, r.ExpiresAt)
		if err != nil {
			return bad("expires_at %q is not an RFC 3339 time", Truncate(r.ExpiresAt, 40))
		}
		j.ExpiresAt = t
	}
	if r.CampaignEndsAt != "" {
		t, err := time.Parse(time.RFC3339Nano, r.CampaignEndsAt)
		if err != nil {
			return bad("campaign_ends_at %q is not an RFC 3339 time", Truncate(r.CampaignEndsAt, 40))
		}
		j.CampaignEndsAt = t
	}
	if j.Category == "" {
		j.Category = DefaultCategory
	}
	return j, nil
}

// unmarshalJob decodes value with encoding/json, for what scanJob does not
// take (escapes, other spellings of the keys, anything malformed).
func unmarshalJob(value []byte) (rawJob, error) {
	var r rawJob
	err := json.Unmarshal(value, &r)
	return r, err
}

func jsonKind(k reflect.Kind) string {
	switch k {
	case reflect.String:
		return "string"
	case reflect.Slice:
		return "list of strings"
	}
	return "number"
}

// Truncate shortens s to n bytes and "..." for an error message.
func Truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
