package loadtest

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"time"
)

// manifestHeader names the manifest's columns.
var manifestHeader = []string{"id", "job_id", "user_id", "channel", "category", "kind", "campaign", "tags", "timezone", "expires_at", "priority"}

// WriteManifest writes sent as CSV: id,job_id,user_id,channel,category,kind,campaign,tags,timezone,expires_at,priority
// (tags separated by "|", expires_at RFC 3339 or empty, priority empty when the job has none).
func WriteManifest(w io.Writer, sent []Sent) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(manifestHeader); err != nil {
		return err
	}
	for _, s := range sent {
		if err := cw.Write([]string{s.ID, s.JobID, strconv.FormatUint(uint64(s.UserID), 10), s.Channel, s.Category, s.Kind,
			s.Campaign, strings.Join(s.Tags, "|"), s.Timezone, formatExpiry(s.ExpiresAt), formatPriority(s)}); err != nil {
			return err
		}
	}
	cw.Flush()
	return cw.Error()
}

func formatPriority(s Sent) string {
	if !s.HasPriority {
		return ""
	}
	return strconv.Itoa(s.Priority)
}

func formatExpiry(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.Format(time.RFC3339Nano)
}

// Manifest is a blast's manifest held compactly: capper report holds ten
// million lines at once, in about 8 bytes each.
//
//   - A line's user and an index into its distinct other fields (channel,
//     category, kind, campaign, tags, zone, expiry, priority: a blast has a
//     few thousand combinations) are all it keeps per line.
//   - loadgen's message ids are a prefix and the line's index, and its job
//     ids "job-" and the message id: neither is stored. Ids of any other form
//     are kept in maps, so a hand-written manifest works as well.
//   - A job id an earlier line has (a redelivery) points to that line: a
//     job is known by its first line.
type Manifest struct {
	users   []uint32
	attrs   []uint32 // index into protos
	protos  []Sent   // distinct fields, with ID, JobID and UserID empty
	protoOf map[protoKey]uint32
	prefix  string            // ids are prefix + the line's index ("" until a first line ending in "-0")
	ids     map[uint32]string // the ids that are not
	byID    map[string]uint32 // and their lines
	canon   map[uint32]uint32 // line -> the first line of its job id, when not itself
	jobIDs  map[uint32]string // first lines whose job id is not "job-" + their id
	byJob   map[string]uint32 // those job ids -> their first line
}

type protoKey struct {
	channel, category, kind, campaign, tags, timezone string
	expires                                           int64
	priority                                          int
	hasPriority                                       bool
}

func newManifest() *Manifest {
	return &Manifest{protoOf: map[protoKey]uint32{}, ids: map[uint32]string{}, byID: map[string]uint32{},
		canon: map[uint32]uint32{}, jobIDs: map[uint32]string{}, byJob: map[string]uint32{}}
}

// NewManifest holds sent as a Manifest.
func NewManifest(sent []Sent) *Manifest {
	m := newManifest()
	for i := range sent {
		m.add(sent[i], strings.Join(sent[i].Tags, "|"))
	}
	return m
}

// Len is the number of lines (produced messages).
func (m *Manifest) Len() int { return len(m.users) }

// Sent returns line i.
func (m *Manifest) Sent(i int) Sent {
	s := m.protos[m.attrs[i]]
	s.ID, s.JobID, s.UserID = m.ID(i), m.JobID(i), m.users[i]
	return s
}

// attrsOf is line i's fields but its ids and user: shared, read only.
func (m *Manifest) attrsOf(i int) *Sent { return &m.protos[m.attrs[i]] }

// user is line i's user.
func (m *Manifest) user(i int) uint32 { return m.users[i] }

// ID is line i's message id.
func (m *Manifest) ID(i int) string {
	if id, ok := m.ids[uint32(i)]; ok {
		return id
	}
	return m.prefix + strconv.Itoa(i)
}

// JobID is line i's job id.
func (m *Manifest) JobID(i int) string {
	j := m.job(i)
	if id, ok := m.jobIDs[uint32(j)]; ok {
		return id
	}
	return "job-" + m.ID(j)
}

// job is the first line of line i's job id.
func (m *Manifest) job(i int) int {
	if c, ok := m.canon[uint32(i)]; ok {
		return int(c)
	}
	return i
}

// Index returns the line of a message id.
func (m *Manifest) Index(id string) (int, bool) {
	if i, ok := m.byID[id]; ok {
		return int(i), true
	}
	if m.prefix == "" || !strings.HasPrefix(id, m.prefix) {
		return 0, false
	}
	n, err := strconv.ParseUint(id[len(m.prefix):], 10, 32)
	if err != nil || int(n) >= len(m.users) || strconv.FormatUint(n, 10) != id[len(m.prefix):] {
		return 0, false
	}
	if _, other := m.ids[uint32(n)]; other {
		return 0, false
	}
	return int(n), true
}

// firstWithJob returns the first line with job id job.
func (m *Manifest) firstWithJob(job string) (int, bool) {
	if i, ok := m.byJob[job]; ok {
		return int(i), true
	}
	id, ok := strings.CutPrefix(job, "job-")
	if !ok {
		return 0, false
	}
	i, ok := m.Index(id)
	if !ok || m.job(i) != i {
		return 0, false
	}
	if _, other := m.jobIDs[uint32(i)]; other {
		return 0, false
	}
	return i, true
}

func (m *Manifest) add(s Sent, tags string) {
	i := uint32(len(m.users))
	if i == math.MaxUint32 {
		panic("manifest: more than 4,294,967,294 lines")
	}
	k := protoKey{s.Channel, s.Category, s.Kind, s.Campaign, tags, s.Timezone, 0, s.Priority, s.HasPriority}
	if !s.ExpiresAt.IsZero() {
		k.expires = s.ExpiresAt.UnixNano()
	}
	p, ok := m.protoOf[k]
	if !ok {
		p = uint32(len(m.protos))
		k.tags = strings.Clone(k.tags)
		m.protoOf[k] = p
		proto := s
		proto.ID, proto.JobID, proto.UserID = "", "", 0
		m.protos = append(m.protos, proto)
	}
	first, seen := m.firstWithJob(s.JobID) // before line i exists: never itself
	m.users = append(m.users, s.UserID)
	m.attrs = append(m.attrs, p)
	if i == 0 && strings.HasSuffix(s.ID, "-0") {
		m.prefix = strings.Clone(strings.TrimSuffix(s.ID, "0"))
	}
	if m.prefix == "" || s.ID != m.prefix+strconv.Itoa(int(i)) {
		id := strings.Clone(s.ID)
		m.ids[i] = id
		if _, dup := m.byID[id]; !dup {
			m.byID[id] = i
		}
	}
	switch {
	case seen:
		m.canon[i] = uint32(first)
	case s.JobID != "job-"+s.ID:
		job := strings.Clone(s.JobID)
		m.jobIDs[i] = job
		m.byJob[job] = i
	}
}

// ReadManifest reads what WriteManifest wrote (and manifests of versions
// without the expires_at and priority columns).
func ReadManifest(r io.Reader) (*Manifest, error) {
	cr := csv.NewReader(r)
	cr.FieldsPerRecord = -1
	cr.ReuseRecord = true
	m := newManifest()
	in, tags := interner{}, map[string][]string{}
	for line := 1; ; line++ {
		f, err := cr.Read()
		if errors.Is(err, io.EOF) {
			return m, nil
		}
		if err != nil {
			return nil, fmt.Errorf("manifest: %w", err)
		}
		if n := len(f); n < len(manifestHeader)-2 || n > len(manifestHeader) {
			return nil, fmt.Errorf("manifest line %d: %d fields, want %d", line, n, len(manifestHeader))
		}
		if line == 1 {
			continue // the header
		}
		uid, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil {
			return nil, fmt.Errorf("manifest line %d: user id %q", line, f[2])
		}
		// The fields a line shares with others are interned; add copies the ids it keeps.
		sent := Sent{ID: f[0], JobID: f[1], UserID: uint32(uid), Channel: in.get(f[3]),
			Category: in.get(f[4]), Kind: in.get(f[5]), Campaign: in.get(f[6]), Timezone: in.get(f[8])}
		if f[7] != "" { // a tag list is shared by the jobs that have it: read only
			t, ok := tags[f[7]]
			if !ok {
				t = strings.Split(in.get(f[7]), "|")
				if len(tags) < 10000 {
					tags[strings.Clone(f[7])] = t
				}
			}
			sent.Tags = t
		}
		if len(f) > 9 && f[9] != "" {
			if sent.ExpiresAt, err = time.Parse(time.RFC3339Nano, f[9]); err != nil {
				return nil, fmt.Errorf("manifest line %d: expires_at %q", line, f[9])
			}
		}
		if len(f) > 10 && f[10] != "" {
			if sent.Priority, err = strconv.Atoi(f[10]); err != nil {
				return nil, fmt.Errorf("manifest line %d: priority %q", line, f[10])
			}
			sent.HasPriority = true
		}
		m.add(sent, f[7])
	}
}
