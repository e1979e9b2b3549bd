package events_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/capper-dev/capper/events"
	"github.com/capper-dev/capper/jobs"
)

func TestDecodeSend(t *testing.T) {
	s, err := events.DecodeSend([]byte(`{"event_id":"e1","user_id":4294967295,"channel":"email","campaign_id":"c","tags":["promotional","marketing"],"sent_at":"2026-11-23T09:12:00+01:00","extra":1}`))
	if err != nil {
		t.Fatal(err)
	}
	at := time.Date(2026, 11, 23, 8, 12, 0, 0, time.UTC)
	if s.EventID != "e1" || s.UserID != 4294967295 || s.Channel != "email" || s.Campaign != "c" || s.Category != "marketing" || !s.SentAt.Equal(at) {
		t.Errorf("decoded %+v", s)
	}
	if tags := strings.Join(s.AllTags(), ","); tags != "marketing,promotional" {
		t.Errorf("all tags %q, want the category first, without repeats", tags)
	}
	for _, c := range []struct{ in, want string }{
		{`nope`, "not a JSON object"},
		{`{"user_id":1,"channel":"e","sent_at":"2026-11-23T09:12:00Z"}`, "event_id"},
		{`{"event_id":"e","channel":"e","sent_at":"2026-11-23T09:12:00Z"}`, "user_id"},
		{`{"event_id":"e","user_id":-1,"channel":"e","sent_at":"2026-11-23T09:12:00Z"}`, "user_id"},
		{`{"event_id":"e","user_id":1.5,"channel":"e","sent_at":"2026-11-23T09:12:00Z"}`, "user_id"},
		{`{"event_id":"e","user_id":1,"sent_at":"2026-11-23T09:12:00Z"}`, "channel"},
		{`{"event_id":"e","user_id":1,"channel":"e"}`, "sent_at is missing"},
		{`{"event_id":"e","user_id":1,"channel":"e","sent_at":"yesterday"}`, "RFC 3339"},
		{`{"event_id":"e","user_id":1,"channel":"e","sent_at":"2026-11-23T09:12:00Z","tags":[""]}`, "tag"},
		{`{"event_id":"e","user_id":1,"channel":"e","sent_at":"2026-11-23T09:12:00Z","tags":"x"}`, "tags"},
	} {
		if _, err := events.DecodeSend([]byte(c.in)); err == nil || !errors.Is(err, jobs.ErrMalformed) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want malformed, naming %q", c.in, err, c.want)
		}
	}
}

func TestDecodeFeedback(t *testing.T) {
	f, err := events.DecodeFeedback([]byte(`{"job_id":"j1","user_id":7,"status":"bounced"}`))
	if err != nil || f.JobID != "j1" || f.UserID != 7 || !f.GivesBack() {
		t.Fatalf("decoded %+v, %v", f, err)
	}
	if f, _ := events.DecodeFeedback([]byte(`{"job_id":"j1","user_id":7,"status":"delivered"}`)); f.GivesBack() {
		t.Error("delivered gives the slot back")
	}
	for _, c := range []struct{ in, want string }{
		{`{"user_id":7,"status":"failed"}`, "job_id"},
		{`{"job_id":"j","status":"failed"}`, "user_id"},
		{`{"job_id":"j","user_id":7}`, "status"},
		{`[]`, "not a JSON object"},
	} {
		if _, err := events.DecodeFeedback([]byte(c.in)); err == nil || !errors.Is(err, jobs.ErrMalformed) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want malformed, naming %q", c.in, err, c.want)
		}
	}
}

func TestDecodePreference(t *testing.T) {
	for _, c := range []struct {
		in   string
		want string // the decoded preference's String(), or "clear <field>"
	}{
		{`{"user_id":7,"channel":"email","limit":1,"window":"7d"}`, "preference:channel:email at most 1 per 168h0m0s"},
		{`{"user_id":7,"tag":"promotional","opt_out":true}`, "preference:tag:promotional opted out"},
		{`{"user_id":7,"vip_until":"2026-12-31T00:00:00Z"}`, "vip until 2026-12-31T00:00:00Z"},
		{`{"user_id":7,"channel":"email","clear":true}`, "clear"},
	} {
		p, err := events.DecodePreference([]byte(c.in))
		got := p.Pref.String()
		if p.Clear {
			got = "clear"
		}
		if err != nil || p.UserID != 7 || got != c.want {
			t.Errorf("%s: %q, %v; want %q", c.in, got, err, c.want)
		}
	}
	for _, c := range []struct{ in, want string }{
		{`{"channel":"email","limit":1,"window":"7d"}`, "user_id"},
		{`{"user_id":7,"channel":"email","limit":1}`, "a limit of at least 1"},
		{`{"user_id":7,"channel":"email","limit":1,"window":"soon"}`, "window"},
		{`{"user_id":7,"channel":"email","tag":"x","opt_out":true}`, "exactly one"},
		{`{"user_id":7,"vip_until":"tomorrow"}`, "vip_until"},
		{`{"user_id":7}`, "exactly one"},
	} {
		if _, err := events.DecodePreference([]byte(c.in)); err == nil || !errors.Is(err, jobs.ErrMalformed) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want malformed, naming %q", c.in, err, c.want)
		}
	}
}
