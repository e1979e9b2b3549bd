package capping

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/cespare/xxhash/v2"
)

// A Cap limits how many sends of its scope a user may receive in a window:
// a rolling one (any Window of time) or a calendar period [Since, Until)
// that the caller computed (a local day, week or month). It applies to a send
// that matches its Scope, and counts the logged sends that match it.
type Cap struct {
	// Name identifies the cap in decisions and logs, e.g. "daily" or "push-daily".
	Name string
	// Limit is the most sends allowed in the window. 0 blocks every send. (>= 0)
	Limit int
	// Window is the length of a rolling window (whole milliseconds): a send
	// counts for Window after it was made. Zero for a calendar cap.
	Window time.Duration
	// Since and Until bound a calendar cap's period: sends at or after Since
	// count, and a capped send may go at Until. Zero for a rolling cap.
	Since, Until time.Time
	// Scope says which sends the cap applies to and counts. The zero Scope is every send.
	Scope Scope
	// Shadow caps are counted and reported (Decision.Shadow) but never block.
	Shadow bool
	// Arbitrated: the cap's last slot goes to the highest priority among the
	// sends that ask for it within an arbitration window (Request.Arbitration).
	Arbitrated bool
	// Reserved is how many more slots the cap has that this send may not use
	// (kept for more important sends): Limit is what the send may use, Limit
	// + Reserved the cap's own limit. Decision.Reserved says when they made
	// the difference. Informational: the script checks Limit.
	Reserved int
	// Tally counts the cap in the user's tally (an item of the log per scope
	// and window, see tally.go) instead of from the log's sends: a lifetime
	// cap (Window 0) keeps the number of sends of its scope, a rolling one the
	// times of the last MaxTallyTimes of them. Either costs a few bytes per
	// scope, where a long window counted from the sends would keep every send
	// of the window in every user's log and on every decision's path. The
	// count is kept until Keep (refreshed by each send it counts); the log's
	// retention does not include the cap's window.
	Tally bool
	// Keep, for a Tally cap, is until when the tally keeps the cap's count
	// if this send is allowed.
	Keep time.Time
}

// MaxTallyTimes bounds the limit of a rolling Tally cap: the tally keeps
// the times of that many sends of its scope.
const MaxTallyTimes = 16

// label is the cap's name in decisions: Name, or "cap<i>" for the i-th cap of a request.
func (c Cap) label(i int) string {
	if c.Name != "" {
		return c.Name
	}
	return "cap" + strconv.Itoa(i)
}

// Validate reports whether the cap is usable.
func (c Cap) Validate() error {
	calendar := !c.Since.IsZero() || !c.Until.IsZero()
	switch {
	case c.Limit < 0 || c.Reserved < 0:
		return fmt.Errorf("cap %q: limit %d and reserved %d must not be negative", c.Name, c.Limit, c.Reserved)
	case c.Limit > math.MaxInt32:
		return fmt.Errorf("cap %q: limit %d is above %d", c.Name, c.Limit, math.MaxInt32)
	case len(c.Scope.channels)/2 > 255 || len(c.Scope.tags)/2 > 255:
		return fmt.Errorf("cap %q: a scope of more than 255 channels or tags", c.Name)
	case calendar && c.Window != 0:
		return fmt.Errorf("cap %q: a window and a calendar period: choose one", c.Name)
	case calendar && !c.Until.After(c.Since):
		return fmt.Errorf("cap %q: calendar period %v to %v is empty", c.Name, c.Since, c.Until)
	case !calendar && c.Window < time.Millisecond && !(c.Tally && c.Window == 0):
		return fmt.Errorf("cap %q: window %v must be at least 1ms", c.Name, c.Window)
	case c.Window%time.Millisecond != 0:
		return fmt.Errorf("cap %q: window %v must be whole milliseconds", c.Name, c.Window)
	case c.Tally && calendar:
		return fmt.Errorf("cap %q: a tally cap is rolling or lifetime, not a calendar period", c.Name)
	case c.Tally && c.Window > 0 && c.Limit+c.Reserved > MaxTallyTimes:
		return fmt.Errorf("cap %q: a tally cap over a window has a limit of at most %d", c.Name, MaxTallyTimes)
	case c.Tally && c.Keep.IsZero():
		return fmt.Errorf("cap %q: a tally cap needs Keep", c.Name)
	}
	return nil
}

// Scope selects sends by channel, tag and campaign. A send matches when its
// channel is one of Channels (or Channels is empty), one of its tags is one of
// Tags (or Tags is empty), and, for a per-campaign scope, its campaign is the
// scope's. Values are kept as 16-bit digests (campaigns as 32-bit), as in the
// log: two names with the same digest are one, which can only make a scope
// count more sends (cap earlier), never fewer. Make it with NewScope, once per
// rules version; Campaign narrows it per job.
type Scope struct {
	channels string // 2-byte digests
	tags     string // 2-byte digests
	campaign string // 4-byte digest; "" = any campaign
}

// NewScope returns the scope of the given channels and tags (empty: any).
func NewScope(channels, tags []string) Scope {
	var s Scope
	for _, c := range channels {
		s.channels += digest2(c)
	}
	for _, t := range tags {
		s.tags += digest2(t)
	}
	return s
}

// filterLen is the length of the cap's flags and scope as appendFilter packs them.
func (c *Cap) filterLen() int {
	s := &c.Scope
	n := 1 + 2 + len(s.channels) + 2 + len(s.tags) + 1 + len(s.campaign)
	if c.Tally {
		n += tallyLen
	}
	return n
}

// tallyLen is the length of what a Tally cap adds to its filter: its field
// in the user's tally and until when the tally keeps it.
const tallyLen = 8 + 8

// tallyField is the field of c's count in the user's tally: a digest of its
// scope (its campaign's too) and its window, so that the caps of one scope
// and window share a count whatever their names, segments and limits.
func (c *Cap) tallyField() uint64 {
	s := &c.Scope
	var b [256]byte
	k := binary.BigEndian.AppendUint64(b[:0], uint64(c.Window.Milliseconds()))
	k = append(k, byte(len(s.channels)))
	k = append(k, s.channels...)
	k = append(k, byte(len(s.tags)))
	k = append(k, s.tags...)
	k = append(k, s.campaign...)
	return xxhash.Sum64(k)
}

// appendFilter appends the cap's flags and scope packed for decide.lua (see
// its header): flags (flagShadow, flagArbitrated, flagApplies: the send is in the scope,
// applies, when the caller checked it), then the channel digests, the tag
// digests (each after its length in bytes, 2 bytes) and the campaign digest
// (after its length, 1 byte: 0 or 4). One struct.unpack reads them all.
func (c *Cap) appendFilter(b []byte, applies bool) []byte {
	s := &c.Scope
	flags := byte(0)
	if c.Shadow {
		flags = flagShadow
	}
	if c.Arbitrated {
		flags |= flagArbitrated
	}
	if applies {
		flags |= flagApplies
	}
	if c.Tally {
		flags |= flagTally
	}
	b = append(b, flags)
	b = binary.BigEndian.AppendUint16(b, uint16(len(s.channels)))
	b = append(b, s.channels...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(s.tags)))
	b = append(b, s.tags...)
	b = append(b, byte(len(s.campaign)))
	b = append(b, s.campaign...)
	if c.Tally {
		b = binary.BigEndian.AppendUint64(b, c.tallyField())
		b = binary.BigEndian.AppendUint64(b, uint64(c.Keep.UnixMilli()))
	}
	return b
}

// Campaign returns the scope narrowed to one campaign's sends.
func (s Scope) Campaign(id string) Scope {
	s.campaign = digest4(id)
	return s
}

// appliesTo reports whether c applies to the send of member: it can cap it.
func (c *Cap) appliesTo(member string) bool {
	return c.Scope.any() || c.Scope.Matches(member)
}

// any reports whether s is every send's (no channel, tag or campaign): three
// lengths, where comparing s with Scope{} is a call comparing three strings.
func (s *Scope) any() bool { return len(s.channels)|len(s.tags)|len(s.campaign) == 0 }

// Matches reports whether a logged send's member (see Member) is in the scope.
func (s Scope) Matches(member string) bool {
	if len(member) < memberTags {
		return false
	}
	if s.channels != "" && !hasDigest(s.channels, member[memberChannel:memberChannel+2]) {
		return false
	}
	if s.campaign != "" && member[memberCampaign:memberTags] != s.campaign {
		return false
	}
	if s.tags != "" {
		for i := memberTags; i+2 <= len(member); i += 2 {
			if hasDigest(s.tags, member[i:i+2]) {
				return true
			}
		}
		return false
	}
	return true
}

func hasDigest(set, d string) bool {
	for i := 0; i+len(d) <= len(set); i += len(d) {
		if set[i:i+len(d)] == d {
			return true
		}
	}
	return false
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
	// Space is the key space of the user's keys (a workspace's): 0, Config.KeyPrefix's, unless
	// another was added (Limiter.AddSpace). The same UserID in two spaces is two users.
	Space Space
	// JobID identifies the send; a request with a JobID already in the user's log
	// is a duplicate. (Required)
	JobID string
	// Channel is the send's channel, e.g. "email". (Required)
	Channel string
	// Campaign and Tags are the send's campaign and tags (its category among
	// them), recorded with it for the scopes of caps.
	Campaign string
	Tags     []string
	// Caps are the caps of the user (usually its segment's). None: the send is
	// recorded without a check (a count-only category).
	Caps []Cap
	// Retention is how long the log keeps the send: at least the longest
	// window of any cap the rules may apply to the user. Zero: the longest of Caps.
	Retention time.Duration
	// DuplicateOnly asks only whether the job id is in the user's log, for a
	// send that must not go (expired, in quiet hours, short of a budget token,
	// refused for good by its caps back from a hold) but may be a redelivery
	// of one that went: nothing is checked, recorded or evicted, and Caps
	// must be empty. Its Decision is Duplicate (with Recorded) when the job
	// is in the log, else the zero decision.
	DuplicateOnly bool
	// Refused, with DuplicateOnly, names what refuses the send (an expiry,
	// quiet hours, a budget, a cap): unless the job is in the log, it is
	// marked refused in the same call, so that a later copy of it (a
	// redelivery, a resend) is answered RefusedBefore instead of decided, and
	// every job keeps one final outcome. At most 200 bytes; the mark is kept for
	// Retention (which a refusal needs) and MarkFor.
	Refused string
	// MarkFor, with Refused, is how much longer than Retention the mark is
	// kept: how long another copy of the job may still come back from the
	// delay tiers (the rules' longest hold), when that is longer than the
	// history the caps need.
	MarkFor time.Duration
	// Arbitration, when above 0, is the arbitration window of the request's
	// Arbitrated caps: a send that would take the last slot of one of them is
	// not recorded but answered Candidate, to be decided again at RetryAt
	// (the window's end), when the highest Priority of the window wins.
	Arbitration time.Duration
	// Priority is the send's, for arbitration (0..100).
	Priority int
	// Candidate marks a send that comes back at the end of its arbitration
	// window: the near cache does not answer it.
	Candidate bool
	// SentAt, when set, records a send made elsewhere (an external send) at
	// that instant instead of the clock's: it needs no caps (it is never
	// capped) and a Retention; it counts toward every cap whose scope it
	// matches from SentAt on.
	SentAt time.Time
	// At, when set, is the instant the send is decided and recorded at
	// instead of the clock's reading (Decision.At is At): a caller dates a
	// decision within the bucket of the budget tokens it holds. It must not
	// be later than the clock, nor earlier than Config.ClockMargin before it.
	At time.Time
	// Preferences reads the user's own preferences (SetPreference) in the
	// same call: a VIP exemption lifts Caps, and the user's limits and
	// opt-outs apply as caps of their own (Decision.Cap names them
	// "preference:channel:..." or "preference:tag:..."). A user with
	// preferences is never answered by the near cache.
	Preferences bool
}

// who identifies r's user among every space's.
func (r *Request) who() uint64 { return who(r.Space, r.UserID) }

func (r *Request) validate() error {
	if r.JobID == "" {
		return errors.New("empty job id")
	}
	if r.Channel == "" {
		return errors.New("empty channel")
	}
	if r.Priority < 0 || r.Priority > 100 {
		return fmt.Errorf("priority %d, want 0..100", r.Priority)
	}
	if len(r.Tags) > MaxTags {
		return fmt.Errorf("%d tags, at most %d", len(r.Tags), MaxTags)
	}
	if !r.At.IsZero() && !r.SentAt.IsZero() {
		return errors.New("both At and SentAt")
	}
	if (r.DuplicateOnly || !r.SentAt.IsZero()) && len(r.Caps) > 0 {
		return errors.New("a duplicate check or an external send with caps")
	}
	if r.Refused != "" && (!r.DuplicateOnly || len(r.Refused) > 200) {
		return errors.New("a refusal's name without a duplicate check, or longer than 200 bytes")
	}
	if r.MarkFor < 0 || (r.MarkFor > 0 && r.Refused == "") {
		return errors.New("a mark's keep without a refusal's name, or below 0")
	}
	if len(r.Caps) == 0 && r.Retention <= 0 && (!r.DuplicateOnly || r.Refused != "") {
		return errors.New("no caps and no retention (an external send and a refusal's mark need one)")
	}
	for _, c := range r.Caps {
		if err := c.Validate(); err != nil {
			return err
		}
	}
	return nil
}

// MaxTags bounds the tags recorded with one send (2 bytes each in the log).
const MaxTags = 16

// Decision is the answer to one Request. Being over a cap is a decision, not an error.
type Decision struct {
	// Allowed reports whether the send may go out. When it comes from Decide, an
	// allowed send has been recorded.
	Allowed bool
	// Duplicate reports that the job id was already in the log: the job was
	// allowed before and is not counted again. Allowed is true.
	Duplicate bool
	// RefusedBefore reports that the job was marked refused (Request.Refused)
	// by an earlier copy: it is refused again, nothing is recorded, and Cap is
	// the name it was refused with.
	RefusedBefore bool
	// Cap names the cap that decides RetryAt when the send is capped (its
	// Name, or "cap<i>" for the unnamed i-th cap of the request); empty otherwise.
	Cap string
	// RetryAt is when the send would pass every cap it exceeds, so a scheduler can
	// defer it. Zero when allowed, or when a cap with limit 0 blocks it for good.
	RetryAt time.Time
	// Exceeded names every cap that refused the send (Cap among them); the
	// caller may apply the strictest of their policies.
	Exceeded []string
	// Reserved reports that Cap refused the send only because its slots left
	// are reserved for more important sends (Cap.Reserved).
	Reserved bool
	// Candidate: the send would take the last slot of Cap, which is
	// arbitrated; it is registered (not recorded, not allowed) and must be
	// sent again at RetryAt, the end of its arbitration window.
	Candidate bool
	// Shadow names the shadow caps that apply to the send and would have
	// capped it (their count had reached their limit).
	Shadow []string
	// Counts holds, for each cap of the request, the sends of its scope in its
	// window before this decision. Decide counts only the caps that apply to
	// the send (whose scope it matches: the others cannot cap it) and gives -1
	// for the others; Peek counts every cap.
	Counts []int
	// At is the clock reading the decision was taken at.
	At time.Time
	// Recorded is when the send is in the log: for an allowed send, At or,
	// if another decision for the user ran first with a later clock reading,
	// that one's time, so a user's log keeps the order of its decisions; for
	// a duplicate, when the job was first allowed (an earlier attempt may have
	// recorded it and failed to answer, so this can be before any output).
	Recorded time.Time
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
