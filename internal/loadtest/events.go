package loadtest

import (
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/segmentio/kafka-go"
)

// Event is one external send or feedback event loadgen produced, as recorded
// in the events manifest (the blast's manifest with ".events" appended).
type Event struct {
	Kind   string // EventExternal or EventFeedback
	ID     string // the external send's event_id; the feedback's job_id
	UserID uint32
	Status string // feedback: failed or bounced
	// ProducedAt is when its chunk was handed to the producer: no worker can
	// have applied it earlier. A preference's is when loadgen saw it applied.
	ProducedAt time.Time
	// SentAt is a preference's produce time: no worker applied it earlier
	// (zero for the other events).
	SentAt time.Time
}

// Event kinds.
const (
	EventExternal = "external"
	EventFeedback = "feedback"
	// EventPreference: ID is the field ("c:<channel>" or "t:<tag>"), Status
	// "<limit>:<window_ms>" (limit 0: opted out); or ID "vip", Status the
	// exemption's end (ms since the epoch). ProducedAt is when loadgen saw it
	// applied in Redis (every send decided later is held to it).
	EventPreference = "preference"
)

// Pref is a user's own limit, or VIP exemption, as the report reads it from
// the events manifest.
type Pref struct {
	Channel, Tag string
	Limit        int // 0: opted out
	Window       time.Duration
	VIPUntil     time.Time // not zero: the rules' caps do not apply until then (Channel and Tag empty)
	From         time.Time // applied by then
	Sent         time.Time // not applied before then (produced); zero: From
}

// vipAt reports whether p exempts the user from the rules' caps at t, for
// certain: it was applied by then.
func (p *Pref) vipAt(t time.Time) bool {
	return !p.VIPUntil.IsZero() && !t.Before(p.From) && t.Before(p.VIPUntil)
}

// mayBeVIPAt reports whether p may have exempted the user at t: it was sent
// by then (applied between its Sent and From, which a send decided in
// between cannot tell).
func (p *Pref) mayBeVIPAt(t time.Time) bool {
	sent := p.Sent
	if sent.IsZero() {
		sent = p.From
	}
	return !p.VIPUntil.IsZero() && !t.Before(sent) && t.Before(p.VIPUntil)
}

// GeneratePreferences gives a share of the users 1..users a preference
// (events.Preference JSON): at most one email a day, no promotions at all,
// or a VIP exemption from the rules' caps for a day from now.
func GeneratePreferences(users int, share float64, seed uint64, now time.Time) (msgs []kafka.Message, evs []Event) {
	rng := rand.New(rand.NewPCG(seed, 19))
	vipUntil := now.Add(24 * time.Hour).Truncate(time.Millisecond)
	for u := 1; u <= users; u++ {
		if rng.Float64() >= share {
			continue
		}
		ev := map[string]any{"user_id": u, "channel": "email", "limit": 1, "window": "24h"}
		e := Event{Kind: EventPreference, ID: "c:email", UserID: uint32(u), Status: "1:86400000"}
		switch rng.IntN(3) {
		case 0:
			ev = map[string]any{"user_id": u, "tag": "promotional", "opt_out": true}
			e.ID, e.Status = "t:promotional", "0:0"
		case 1:
			ev = map[string]any{"user_id": u, "vip_until": vipUntil.Format(time.RFC3339Nano)}
			e.ID, e.Status = "vip", strconv.FormatInt(vipUntil.UnixMilli(), 10)
		}
		v, _ := json.Marshal(ev)
		msgs = append(msgs, kafka.Message{Key: []byte(strconv.Itoa(u)), Value: v, Headers: []kafka.Header{{Key: HeaderID, Value: []byte(fmt.Sprint("pref-", u))}}})
		evs = append(evs, e)
	}
	return msgs, evs
}

// GenerateVIP gives a share of the users 1..users a VIP exemption from the
// rules' caps for a day from now: a wave sent while a blast goes on (loadgen
// --vip-midway-share). Users with a preference in earlier
// (GeneratePreferences') are left out, and so are users with a job sent twice
// in blast (KindDuplicate): a copy of a job capped by a rules' cap before the
// exemption would be allowed after it, a second final topic for the job (a
// known gap: a cap's refusal leaves no mark in the log).
func GenerateVIP(users int, share float64, seed uint64, now time.Time, earlier []Event, blast []Sent) (msgs []kafka.Message, evs []Event) {
	rng := rand.New(rand.NewPCG(seed, 23))
	had := map[uint32]bool{}
	for _, e := range earlier {
		had[e.UserID] = true
	}
	for _, s := range blast {
		if s.Kind == KindDuplicate {
			had[s.UserID] = true
		}
	}
	vipUntil := now.Add(24 * time.Hour).Truncate(time.Millisecond)
	for u := 1; u <= users; u++ {
		if rng.Float64() >= share || had[uint32(u)] {
			continue
		}
		v, _ := json.Marshal(map[string]any{"user_id": u, "vip_until": vipUntil.Format(time.RFC3339Nano)})
		msgs = append(msgs, kafka.Message{Key: []byte(strconv.Itoa(u)), Value: v, Headers: []kafka.Header{{Key: HeaderID, Value: []byte(fmt.Sprint("vip-", u))}}})
		evs = append(evs, Event{Kind: EventPreference, ID: "vip", UserID: uint32(u), Status: strconv.FormatInt(vipUntil.UnixMilli(), 10)})
	}
	return msgs, evs
}

// Prefs returns the preference events of evs by user, for Policy.Preferences.
func Prefs(evs []Event) map[uint32][]Pref {
	out := map[uint32][]Pref{}
	for _, e := range evs {
		if e.Kind != EventPreference || len(e.ID) < 3 {
			continue
		}
		if e.ID == "vip" {
			if ms, err := strconv.ParseInt(e.Status, 10, 64); err == nil {
				out[e.UserID] = append(out[e.UserID], Pref{VIPUntil: time.UnixMilli(ms), From: e.ProducedAt, Sent: e.SentAt})
			}
			continue
		}
		var limit int
		var ms int64
		if _, err := fmt.Sscanf(e.Status, "%d:%d", &limit, &ms); err != nil {
			continue
		}
		p := Pref{Limit: limit, Window: time.Duration(ms) * time.Millisecond, From: e.ProducedAt}
		if e.ID[0] == 'c' {
			p.Channel = e.ID[2:]
		} else {
			p.Tag = e.ID[2:]
		}
		out[e.UserID] = append(out[e.UserID], p)
	}
	return out
}

// GenerateEvents makes, for a share of the blast's jobs, an external send to
// the same user (sent during the last six hours) and a failed or bounced
// feedback for the job itself. evs lines up with ext and then fb.
func GenerateEvents(sent []Sent, externalShare, feedbackShare float64, seed uint64, now time.Time) (ext, fb []kafka.Message, evs []Event) {
	var fbEvs []Event
	defer func() { evs = append(evs, fbEvs...) }()
	rng := rand.New(rand.NewPCG(seed, 13))
	channels := []string{"email", "push", "sms", "inapp"}
	for i := range sent {
		s := &sent[i]
		if s.Kind != KindJob {
			continue
		}
		if rng.Float64() < externalShare {
			id := "ext-" + s.ID
			v, _ := json.Marshal(map[string]any{"event_id": id, "user_id": s.UserID, "channel": channels[rng.IntN(len(channels))],
				"campaign_id": "elsewhere", "sent_at": now.Add(-time.Duration(rng.IntN(6*3600)) * time.Second).Format(time.RFC3339Nano)})
			ext = append(ext, kafka.Message{Key: []byte(strconv.FormatUint(uint64(s.UserID), 10)), Value: v, Headers: []kafka.Header{{Key: HeaderID, Value: []byte(id)}}})
			evs = append(evs, Event{Kind: EventExternal, ID: id, UserID: s.UserID})
		}
		if rng.Float64() < feedbackShare {
			status := []string{"failed", "bounced"}[rng.IntN(2)]
			v, _ := json.Marshal(map[string]any{"job_id": s.JobID, "user_id": s.UserID, "status": status})
			fb = append(fb, kafka.Message{Key: []byte(strconv.FormatUint(uint64(s.UserID), 10)), Value: v, Headers: []kafka.Header{{Key: HeaderID, Value: []byte("fb-" + s.ID)}}})
			fbEvs = append(fbEvs, Event{Kind: EventFeedback, ID: s.JobID, UserID: s.UserID, Status: status})
		}
	}
	return ext, fb, evs
}

// ProducedAt is the HeaderProducedAt Produce stamped on m (zero without one).
func ProducedAt(m kafka.Message) time.Time {
	for _, h := range m.Headers {
		if h.Key == HeaderProducedAt {
			if ms, err := strconv.ParseInt(string(h.Value), 10, 64); err == nil {
				return time.UnixMilli(ms)
			}
		}
	}
	return time.Time{}
}

var eventsHeader = []string{"kind", "id", "user_id", "status", "produced_at_ms", "sent_at_ms"}

// WriteEvents writes the events manifest.
func WriteEvents(w io.Writer, evs []Event) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(eventsHeader); err != nil {
		return err
	}
	for _, e := range evs {
		sent := ""
		if !e.SentAt.IsZero() {
			sent = strconv.FormatInt(e.SentAt.UnixMilli(), 10)
		}
		if err := cw.Write([]string{e.Kind, e.ID, strconv.FormatUint(uint64(e.UserID), 10), e.Status, strconv.FormatInt(e.ProducedAt.UnixMilli(), 10), sent}); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

// ReadEvents reads what WriteEvents wrote.
func ReadEvents(r io.Reader) ([]Event, error) {
	cr := csv.NewReader(r)
	var out []Event
	for line := 1; ; line++ {
		f, err := cr.Read()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return nil, fmt.Errorf("events manifest: %w", err)
		}
		if len(f) != len(eventsHeader) {
			return nil, fmt.Errorf("events manifest line %d: %d fields, want %d", line, len(f), len(eventsHeader))
		}
		if line == 1 {
			continue
		}
		u, err1 := strconv.ParseUint(f[2], 10, 32)
		ms, err2 := strconv.ParseInt(f[4], 10, 64)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("events manifest line %d: bad user id or time", line)
		}
		e := Event{Kind: f[0], ID: f[1], UserID: uint32(u), Status: f[3], ProducedAt: time.UnixMilli(ms)}
		if f[5] != "" {
			sent, err := strconv.ParseInt(f[5], 10, 64)
			if err != nil {
				return nil, fmt.Errorf("events manifest line %d: bad sent time", line)
			}
			e.SentAt = time.UnixMilli(sent)
		}
		out = append(out, e)
	}
}
