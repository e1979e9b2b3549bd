package loadtest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/segmentio/kafka-go"
)

// Headers loadgen adds to every message; capper forwards them untouched.
const (
	HeaderID         = "capper-loadgen-id"  // unique per produced message
	HeaderProducedAt = "capper-produced-at" // ms since the epoch, when the message was handed to the producer
)

// Kinds of produced messages.
const (
	KindJob       = "job"       // a marketing job
	KindDuplicate = "duplicate" // the same job id sent again (a redelivery)
	KindExempt    = "exempt"    // category transactional
	KindCountOnly = "countonly" // category receipt: counted, never capped (when the rules say so)
	KindMalformed = "malformed" // not a valid job
)

// Zones are the users' time zones in a blast (user id modulo their count):
// one with DST, one with a non-hour offset, one behind UTC.
var Zones = []string{"UTC", "America/New_York", "Asia/Kolkata", "Australia/Adelaide"}

// Sent is one produced message, as recorded in the manifest.
type Sent struct {
	ID       string // HeaderID
	JobID    string // empty for malformed messages
	UserID   uint32
	Channel  string
	Category string
	Kind     string
	Campaign string
	Tags     []string
	Timezone string
	// ExpiresAt is the job's expires_at (zero: none).
	ExpiresAt time.Time
	// Priority is the job's own priority field when HasPriority.
	Priority    int
	HasPriority bool
}

// GenConfig shapes a blast.
type GenConfig struct {
	Jobs  int // messages to produce, duplicates and malformed included (Required)
	Users int // users 1..Users receive the jobs (Required)
	// RepeatShare is the share of jobs that go to a small hot set of users
	// (a tenth of Users), so caps bite. Defaults to 0.3.
	RepeatShare float64
	// DuplicateShare, ExemptShare, CountOnlyShare and MalformedShare are
	// shares of Jobs. Default to 0.02, 0.02, 0.02 and 0.005. Jobs also get
	// one of three campaigns, tags (promotional half of the time, newsletter
	// a fifth) and their user's zone from Zones.
	DuplicateShare, ExemptShare, CountOnlyShare, MalformedShare float64
	// ExpireShare of the jobs carry expires_at, ExpiresIn after the blast
	// is generated. Default to 0 and 10m.
	ExpireShare float64
	ExpiresIn   time.Duration
	// PriorityShare of the jobs carry a priority of their own, 0..9 at
	// random. Defaults to 0.
	PriorityShare float64
	// CollapseShare of the jobs carry a collapse_key, one of three ("k0",
	// "k1", "k2") at random. Defaults to 0.
	CollapseShare float64
	// Channels to spread jobs over. Defaults to email, push, sms.
	Channels []string
	// Seed makes the blast reproducible; RunID prefixes ids so runs never collide.
	Seed  uint64
	RunID string
}

// Validate reports whether the configuration is usable.
func (c *GenConfig) Validate() error {
	if c.Jobs < 1 || c.Users < 1 {
		return errors.New("loadgen: --jobs and --users must be at least 1")
	}
	for _, s := range []float64{c.RepeatShare, c.DuplicateShare, c.ExemptShare, c.CountOnlyShare, c.MalformedShare, c.ExpireShare, c.PriorityShare, c.CollapseShare} {
		if s < 0 || s > 1 {
			return fmt.Errorf("loadgen: share %v is not in 0..1", s)
		}
	}
	if c.DuplicateShare+c.ExemptShare+c.CountOnlyShare+c.MalformedShare > 0.9 {
		return errors.New("loadgen: duplicate, exempt and malformed shares add up to more than 0.9")
	}
	return nil
}

func (c GenConfig) withDefaults() GenConfig {
	if c.RepeatShare == 0 {
		c.RepeatShare = 0.3
	}
	if c.DuplicateShare == 0 {
		c.DuplicateShare = 0.02
	}
	if c.ExemptShare == 0 {
		c.ExemptShare = 0.02
	}
	if c.CountOnlyShare == 0 {
		c.CountOnlyShare = 0.02
	}
	if c.MalformedShare == 0 {
		c.MalformedShare = 0.005
	}
	if len(c.Channels) == 0 {
		c.Channels = []string{"email", "push", "sms"}
	}
	if c.ExpiresIn == 0 {
		c.ExpiresIn = 10 * time.Minute
	}
	if c.RunID == "" {
		c.RunID = strconv.FormatInt(time.Now().UnixNano(), 36)
	}
	return c
}

var malformedBodies = []string{
	`not json`,
	`{"job_id":"","user_id":1,"campaign_id":"c","channel":"email"}`,
	`{"job_id":"m","user_id":-5,"campaign_id":"c","channel":"email"}`,
	`{"job_id":"m","user_id":7,"channel":"email"}`,
	`[1,2,3]`,
}

// Generate returns the messages of a blast and their manifest, in send order.
// Duplicates repeat an earlier job's exact value and key.
func Generate(cfg GenConfig) ([]kafka.Message, []Sent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, nil, err
	}
	cfg = cfg.withDefaults()
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x5eed))
	expires := time.Now().Add(cfg.ExpiresIn).UTC().Truncate(time.Millisecond)
	hot := max(1, cfg.Users/10)
	msgs := make([]kafka.Message, 0, cfg.Jobs)
	sent := make([]Sent, 0, cfg.Jobs)
	var jobs []int // indexes of valid jobs, for duplicates
	for i := 0; i < cfg.Jobs; i++ {
		id := fmt.Sprintf("%s-%d", cfg.RunID, i)
		r := rng.Float64()
		var s Sent
		var value []byte
		switch {
		case r < cfg.MalformedShare:
			s = Sent{ID: id, Kind: KindMalformed}
			value = []byte(malformedBodies[i%len(malformedBodies)])
		case r < cfg.MalformedShare+cfg.DuplicateShare && len(jobs) > 0:
			orig := jobs[rng.IntN(len(jobs))]
			s = sent[orig]
			s.ID, s.Kind = id, KindDuplicate
			value = msgs[orig].Value
		default:
			user := uint32(1 + rng.IntN(cfg.Users))
			if rng.Float64() < cfg.RepeatShare { // hot users are spread over the id range, so over the segments
				user = uint32(1 + (rng.IntN(hot)*(cfg.Users/hot))%cfg.Users)
			}
			s = Sent{ID: id, JobID: "job-" + id, UserID: user, Channel: cfg.Channels[rng.IntN(len(cfg.Channels))], Category: "marketing", Kind: KindJob,
				Campaign: fmt.Sprintf("blast-%s-%d", cfg.RunID, rng.IntN(3)), Timezone: Zones[int(user)%len(Zones)]}
			switch r := rng.Float64() * (1 - cfg.MalformedShare - cfg.DuplicateShare); {
			case r < cfg.ExemptShare:
				s.Category, s.Kind = "transactional", KindExempt
			case r < cfg.ExemptShare+cfg.CountOnlyShare:
				s.Category, s.Kind = "receipt", KindCountOnly
			default:
				if rng.Float64() < 0.5 {
					s.Tags = append(s.Tags, "promotional")
				}
				if rng.Float64() < 0.2 {
					s.Tags = append(s.Tags, "newsletter")
				}
			}
			job := map[string]any{
				"job_id": s.JobID, "user_id": s.UserID, "campaign_id": s.Campaign, "timezone": s.Timezone,
				"channel": s.Channel, "category": s.Category, "payload": map[string]string{"template": "promo-42"},
			}
			if len(s.Tags) > 0 {
				job["tags"] = s.Tags
			}
			if rng.Float64() < cfg.ExpireShare {
				s.ExpiresAt = expires
				job["expires_at"] = expires.Format(time.RFC3339Nano)
			}
			if cfg.PriorityShare > 0 && rng.Float64() < cfg.PriorityShare {
				s.Priority, s.HasPriority = rng.IntN(10), true
				job["priority"] = s.Priority
			}
			if cfg.CollapseShare > 0 && rng.Float64() < cfg.CollapseShare {
				job["collapse_key"] = fmt.Sprint("k", rng.IntN(3))
			}
			value, _ = json.Marshal(job)
			jobs = append(jobs, len(sent))
		}
		key := []byte(strconv.FormatUint(uint64(s.UserID), 10))
		if s.Kind == KindMalformed {
			key = []byte(id)
		}
		msgs = append(msgs, kafka.Message{Key: key, Value: value, Headers: []kafka.Header{{Key: HeaderID, Value: []byte(id)}}})
		sent = append(sent, s)
	}
	return msgs, sent, nil
}

// Produce writes msgs in chunks, stamping HeaderProducedAt on each chunk (and
// the messages' timestamps with the same instant, so that the report orders
// them as capper does: collapse keys), and calls progress after each chunk
// with the count written so far.
func Produce(ctx context.Context, w interface {
	WriteMessages(context.Context, ...kafka.Message) error
}, msgs []kafka.Message, chunk int, progress func(done int)) error {
	for start := 0; start < len(msgs); start += chunk {
		end := min(start+chunk, len(msgs))
		now := time.Now().Truncate(time.Millisecond)
		at := []byte(strconv.FormatInt(now.UnixMilli(), 10))
		for i := start; i < end; i++ {
			msgs[i].Headers = append(msgs[i].Headers[:1], kafka.Header{Key: HeaderProducedAt, Value: at})
			msgs[i].Time = now
		}
		if err := w.WriteMessages(ctx, msgs[start:end]...); err != nil {
			return fmt.Errorf("loadgen: produce messages %d..%d: %w", start, end-1, err)
		}
		if progress != nil {
			progress(end)
		}
	}
	return nil
}

// InWorkspace adds a "workspace" field to every message of msgs whose value
// is a JSON object with a user_id (a job or an event; a malformed body is
// left as it is), so a blast or its events go to workspaces of a deployment
// with workspaces: users 1..users in as many contiguous blocks, one per
// workspace in order (a brand's users are a range of its own), all of a
// user's messages to one.
func InWorkspace(msgs []kafka.Message, workspaces []string, users int) {
	if len(workspaces) == 0 {
		return
	}
	block := max(1, (users+len(workspaces)-1)/len(workspaces))
	for i := range msgs {
		var v map[string]any
		if json.Unmarshal(msgs[i].Value, &v) != nil || v == nil {
			continue
		}
		u, _ := v["user_id"].(float64)
		v["workspace"] = workspaces[min(max(0, int(u)-1)/block, len(workspaces)-1)]
		msgs[i].Value, _ = json.Marshal(v)
	}
}
