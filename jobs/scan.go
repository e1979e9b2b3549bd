package jobs

import (
	"hash/maphash"
	"sync/atomic"
	"unique"
)

// scanJob is Decode's fast path: one pass over the message that fills r
// without reflection, validating every byte as JSON (the payload and any
// unknown field included). It handles the messages schedulers write: an
// object whose known fields have their exact names, once each, with plain
// strings (no escapes, ASCII), a user_id of plain digits and a list of
// plain strings for tags. For anything else it returns false and Decode
// uses encoding/json, whose answer (and error message) is the reference:
// FuzzScanJobMatchesEncodingJSON holds the two together.
func scanJob(b []byte, r *rawJob) bool {
	s := scanner{b: b}
	s.ws()
	if !s.byte('{') {
		return false
	}
	s.ws()
	if s.byte('}') {
		return s.end()
	}
	var seen uint16
	for {
		s.ws()
		k0, k1, plain := s.str()
		if k0 < 0 || !plain {
			return false
		}
		s.ws()
		if !s.byte(':') {
			return false
		}
		s.ws()
		key := b[k0:k1]
		f := fieldOf(key)
		if f == fieldNone {
			if foldsToField(key) { // encoding/json matches keys case-insensitively
				return false
			}
			if !s.skip(0) {
				return false
			}
		} else {
			if seen&(1<<f) != 0 { // a repeated key: the last one wins there
				return false
			}
			seen |= 1 << f
			if !s.field(f, r) {
				return false
			}
		}
		s.ws()
		if s.byte('}') {
			return s.end()
		}
		if !s.byte(',') {
			return false
		}
	}
}

type field uint8

const (
	fieldNone field = iota
	fieldJobID
	fieldUserID
	fieldCampaignID
	fieldChannel
	fieldCategory
	fieldTags
	fieldTimezone
	fieldExpiresAt
	fieldPriority
	fieldCampaignEndsAt
	fieldCollapseKey
	fieldWorkspace // the last: fieldOf and foldsToField go up to it
)

var fieldNames = [...]string{fieldJobID: "job_id", fieldUserID: "user_id", fieldCampaignID: "campaign_id", fieldChannel: "channel",
	fieldCategory: "category", fieldTags: "tags", fieldTimezone: "timezone", fieldExpiresAt: "expires_at", fieldPriority: "priority",
	fieldCampaignEndsAt: "campaign_ends_at", fieldCollapseKey: "collapse_key", fieldWorkspace: "workspace"}

func fieldOf(key []byte) field {
	for f := fieldJobID; f <= fieldWorkspace; f++ {
		if string(key) == fieldNames[f] {
			return f
		}
	}
	return fieldNone
}

// foldsToField reports whether key could match a field's name the way
// encoding/json matches (case folding, with the Kelvin sign and the long s
// folding to k and s): any ASCII case variant, or any non-ASCII key of a
// plausible length.
func foldsToField(key []byte) bool {
	for f := fieldJobID; f <= fieldWorkspace; f++ {
		name := fieldNames[f]
		if len(key) < len(name) || len(key) > 3*len(name) {
			continue
		}
		ascii := true
		for _, c := range key {
			if c >= 0x80 {
				ascii = false
				break
			}
		}
		if !ascii {
			return true
		}
		if len(key) != len(name) {
			continue
		}
		same := true
		for i := range key {
			if lower(key[i]) != name[i] {
				same = false
				break
			}
		}
		if same {
			return true
		}
	}
	return false
}

func lower(c byte) byte {
	if 'A' <= c && c <= 'Z' {
		return c + 'a' - 'A'
	}
	return c
}

// field reads the value of a known field into r: false for anything the
// fast path leaves to encoding/json (null, another type, escapes).
func (s *scanner) field(f field, r *rawJob) bool {
	switch f {
	case fieldUserID:
		v, ok := s.uint32()
		r.UserID = userID{v: v, set: true}
		return ok
	case fieldPriority:
		v, ok := s.uint32()
		r.Priority = userID{v: v, set: true}
		return ok
	case fieldTags:
		if !s.byte('[') {
			return false
		}
		s.ws()
		if s.byte(']') {
			r.Tags = []string{}
			return true
		}
		for {
			s.ws()
			v, ok := s.plainString()
			if !ok {
				return false
			}
			r.Tags = append(r.Tags, intern(v))
			s.ws()
			if s.byte(']') {
				return true
			}
			if !s.byte(',') {
				return false
			}
		}
	}
	v, ok := s.plainString()
	if !ok {
		return false
	}
	switch f {
	case fieldJobID:
		r.JobID = string(v)
	case fieldCampaignID:
		r.CampaignID = intern(v)
	case fieldChannel:
		r.Channel = intern(v)
	case fieldCategory:
		r.Category = intern(v)
	case fieldTimezone:
		r.Timezone = intern(v)
	case fieldExpiresAt:
		r.ExpiresAt = string(v)
	case fieldCampaignEndsAt:
		r.CampaignEndsAt = string(v)
	case fieldCollapseKey:
		r.CollapseKey = string(v)
	case fieldWorkspace:
		r.Workspace = intern(v)
	}
	return true
}

// scanner reads JSON from b at i. Its methods return false (or -1) on
// anything they do not accept, leaving i anywhere: the caller gives up.
type scanner struct {
	b []byte
	i int
}

func (s *scanner) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

func (s *scanner) byte(c byte) bool {
	if s.i < len(s.b) && s.b[s.i] == c {
		s.i++
		return true
	}
	return false
}

// end reports whether only white space follows.
func (s *scanner) end() bool {
	s.ws()
	return s.i == len(s.b)
}

// str reads a string and returns the bounds of its raw contents, and
// whether they are plain (ASCII, no escapes); k0 is -1 when it is not a
// valid JSON string.
func (s *scanner) str() (k0, k1 int, plain bool) {
	if !s.byte('"') {
		return -1, 0, false
	}
	start := s.i
	plain = true
	for {
		i := s.i
		for i < len(s.b) && strClass[s.b[i]] == strPlain { // most of a string: one load and compare a byte
			i++
		}
		if s.i = i; i == len(s.b) {
			return -1, 0, false
		}
		switch strClass[s.b[i]] {
		case strQuote:
			s.i++
			return start, s.i - 1, plain
		case strEscape:
			plain = false
			if !s.escape() {
				return -1, 0, false
			}
		case strControl:
			return -1, 0, false
		default: // non-ASCII
			plain = false
			s.i++
		}
	}
}

// What a byte is inside a JSON string (str).
const (
	strPlain = iota
	strQuote
	strEscape
	strControl
	strNonASCII
)

var strClass = func() (t [256]uint8) {
	for c := range t {
		switch {
		case c == '"':
			t[c] = strQuote
		case c == '\\':
			t[c] = strEscape
		case c < 0x20:
			t[c] = strControl
		case c >= 0x80:
			t[c] = strNonASCII
		}
	}
	return t
}()

// escape reads one escape sequence at i (at the backslash).
func (s *scanner) escape() bool {
	s.i++
	if s.i >= len(s.b) {
		return false
	}
	switch s.b[s.i] {
	case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
		s.i++
		return true
	case 'u':
		if s.i+4 >= len(s.b) {
			return false
		}
		for _, c := range s.b[s.i+1 : s.i+5] {
			if !isHex(c) {
				return false
			}
		}
		s.i += 5
		return true
	}
	return false
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

// plainString reads a string that is plain (see str).
func (s *scanner) plainString() ([]byte, bool) {
	k0, k1, plain := s.str()
	if k0 < 0 || !plain {
		return nil, false
	}
	return s.b[k0:k1], true
}

// uint32 reads a number of plain digits in 0..4294967295.
func (s *scanner) uint32() (uint32, bool) {
	start := s.i
	var v uint64
	for s.i < len(s.b) && '0' <= s.b[s.i] && s.b[s.i] <= '9' {
		v = 10*v + uint64(s.b[s.i]-'0')
		if v > 1<<32-1 {
			return 0, false
		}
		s.i++
	}
	n := s.i - start
	if n == 0 || (n > 1 && s.b[start] == '0') {
		return 0, false
	}
	if s.i < len(s.b) { // a fraction or an exponent: encoding/json's path
		switch s.b[s.i] {
		case '.', 'e', 'E':
			return 0, false
		}
	}
	return uint32(v), true
}

// maxDepth bounds the nesting the fast path follows (encoding/json allows 10,000).
const maxDepth = 256

// skip reads and validates any JSON value.
func (s *scanner) skip(depth int) bool {
	if depth > maxDepth || s.i >= len(s.b) {
		return false
	}
	switch c := s.b[s.i]; {
	case c == '"':
		k0, _, _ := s.str()
		return k0 >= 0
	case c == '{':
		s.i++
		s.ws()
		if s.byte('}') {
			return true
		}
		for {
			s.ws()
			if k0, _, _ := s.str(); k0 < 0 {
				return false
			}
			s.ws()
			if !s.byte(':') {
				return false
			}
			s.ws()
			if !s.skip(depth + 1) {
				return false
			}
			s.ws()
			if s.byte('}') {
				return true
			}
			if !s.byte(',') {
				return false
			}
		}
	case c == '[':
		s.i++
		s.ws()
		if s.byte(']') {
			return true
		}
		for {
			s.ws()
			if !s.skip(depth + 1) {
				return false
			}
			s.ws()
			if s.byte(']') {
				return true
			}
			if !s.byte(',') {
				return false
			}
		}
	case c == 't':
		return s.literal("true")
	case c == 'f':
		return s.literal("false")
	case c == 'n':
		return s.literal("null")
	default:
		return s.number()
	}
}

func (s *scanner) literal(w string) bool {
	if len(s.b)-s.i >= len(w) && string(s.b[s.i:s.i+len(w)]) == w {
		s.i += len(w)
		return true
	}
	return false
}

// number reads -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
func (s *scanner) number() bool {
	s.byte('-')
	switch {
	case s.byte('0'):
	case s.i < len(s.b) && '1' <= s.b[s.i] && s.b[s.i] <= '9':
		s.digits()
	default:
		return false
	}
	if s.byte('.') && !s.digits() {
		return false
	}
	if s.byte('e') || s.byte('E') {
		if !s.byte('+') {
			s.byte('-')
		}
		if !s.digits() {
			return false
		}
	}
	return true
}

// digits reads one or more digits.
func (s *scanner) digits() bool {
	start := s.i
	for s.i < len(s.b) && '0' <= s.b[s.i] && s.b[s.i] <= '9' {
		s.i++
	}
	return s.i > start
}

// intern returns the one copy of a short string that repeats across jobs
// (channels, categories, tags, zones, campaigns), so decoding them does not
// allocate. The copies are the standard library's unique handles: weak, so a
// campaign id that no job carries any more is collected (a map of its own
// only grew, or stopped interning once full). A small direct-mapped cache
// of the latest handles' strings comes first: unique.Make looks up its map
// of the type, then its own, and was 4% of the worker's CPU (a blast's
// profile); a hit costs a hash and a compare. The cache holds at most
// len(internCache) strings alive, whatever the jobs carry.
//
// A slot keeps the string's unique handle, not the string alone: while it
// holds it, unique keeps that copy and hands it to every caller. (With the
// string alone, a collection could drop unique's copy while the slot still
// answered with it, and unique.Make then make a second one.)
func intern(b []byte) string {
	slot := &internCache[maphash.Bytes(internSeed, b)%uint64(len(internCache))]
	if e := slot.Load(); e != nil && e.s == string(b) {
		return e.s
	}
	h := unique.Make(string(b))
	e := &interned{h, h.Value()}
	slot.Store(e)
	return e.s
}

// interned is a slot of intern's cache: a string and its unique handle.
type interned struct {
	h unique.Handle[string]
	s string
}

var (
	internSeed  = maphash.MakeSeed()
	internCache [1024]atomic.Pointer[interned]
)
