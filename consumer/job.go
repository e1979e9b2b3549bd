package consumer

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
)

// Job is one send job of the input topic.
//
//	{"job_id": "...", "user_id": 123, "campaign_id": "...", "channel": "email",
//	 "category": "marketing", "payload": {...}}
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
}

// MaxJobIDBytes bounds a job id.
const MaxJobIDBytes = 128

// DefaultCategory is the category of a job that names none.
const DefaultCategory = "marketing"

// ErrMalformed wraps every reason a message is not a valid job.
var ErrMalformed = errors.New("malformed job")

type rawJob struct {
	JobID      *string         `json:"job_id"`
	UserID     json.RawMessage `json:"user_id"`
	CampaignID *string         `json:"campaign_id"`
	Channel    *string         `json:"channel"`
	Category   *string         `json:"category"`
	Payload    json.RawMessage `json:"payload"`
}

// DecodeJob parses and validates one message value. Errors wrap ErrMalformed
// and say what is wrong; it never panics.
func DecodeJob(value []byte, maxBytes int) (Job, error) {
	bad := func(format string, args ...any) (Job, error) {
		return Job{}, fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
	}
	if maxBytes > 0 && len(value) > maxBytes {
		return bad("message of %d bytes exceeds %d", len(value), maxBytes)
	}
	var r rawJob
	dec := json.NewDecoder(bytes.NewReader(value))
	if err := dec.Decode(&r); err != nil {
		return bad("not a JSON object: %v", err)
	}
	if dec.More() {
		return bad("trailing data after the JSON object")
	}
	var j Job
	switch {
	case r.JobID == nil || *r.JobID == "":
		return bad("job_id is missing or empty")
	case len(*r.JobID) > MaxJobIDBytes:
		return bad("job_id is %d bytes, at most %d", len(*r.JobID), MaxJobIDBytes)
	case r.CampaignID == nil || *r.CampaignID == "":
		return bad("campaign_id is missing or empty")
	case r.Channel == nil || *r.Channel == "":
		return bad("channel is missing or empty")
	case r.UserID == nil:
		return bad("user_id is missing")
	}
	var uid float64
	if err := json.Unmarshal(r.UserID, &uid); err != nil {
		return bad("user_id is not a number: %s", truncate(string(r.UserID), 40))
	}
	if uid < 0 || uid > math.MaxUint32 || uid != math.Trunc(uid) {
		return bad("user_id %s is not an integer in 0..4294967295", truncate(string(r.UserID), 40))
	}
	j.JobID, j.UserID, j.CampaignID, j.Channel = *r.JobID, uint32(uid), *r.CampaignID, *r.Channel
	j.Category = DefaultCategory
	if r.Category != nil && *r.Category != "" {
		j.Category = *r.Category
	}
	return j, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
