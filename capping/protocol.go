package capping

import (
	_ "embed"
	"encoding/binary"
	"fmt"
	"slices"
	"strings"
	"time"
	"unsafe"

	"github.com/cespare/xxhash/v2"
	"github.com/redis/go-redis/v9"
)

//go:embed decide.lua
var decideSource string

// decideScript is decide.lua as a script: EVAL sends it whole, when a node
// keeps losing the function library (see Decide).
var decideScript = redis.NewScript(decideSource)

// decideLibrary is decide.lua as a Redis 7 function library, loaded on every
// master with FUNCTION LOAD, and decideFunction the name FCALL calls it by.
// A script's chunk runs from the top on every EVALSHA, making its local
// functions anew (0.5 to 0.8 us a call); a library's run once, when it loads.
// Both names carry the script's SHA1, so that workers of two versions share a
// cluster during a rolling upgrade, each calling its own.
var decideFunction, decideLibraryName, decideLibrary = functionLibrary(decideSource, decideScript.Hash())

// functionLibrary makes the library of a script whose first line declares its
// flags and whose last calls run(KEYS, ARGV): the same chunk, with its flags
// on the registration, which takes the place of the last line.
func functionLibrary(src, sha string) (function, library, code string) {
	const flags, last = "#!lua flags=allow-cross-slot-keys\n", "return run(KEYS, ARGV)\n"
	if !strings.HasPrefix(src, flags) || !strings.HasSuffix(src, last) {
		panic("capping: decide.lua must start with " + flags + " and end with " + last)
	}
	v := sha[:16]
	function, library = "capper_decide_"+v, "capper_"+v
	code = "#!lua name=" + library + "\n" + strings.TrimSuffix(strings.TrimPrefix(src, flags), last) +
		"redis.register_function{function_name = '" + function + "', callback = run, flags = {'allow-cross-slot-keys'}}\n"
	return function, library, code
}

// The seam with decide.lua: the modes a request is sent in, the statuses its
// reply starts with, and a cap's flags. decide.lua declares locals of the same
// names and values, and TestSeamNamesAgree reads the script to check that the
// two lists agree.
const (
	modeLook    = 0 // decide, write nothing (Peek, capper check)
	modeRecord  = 1 // decide, and record the send if allowed
	modeExact   = 2 // as modeRecord, at exactly the send's time (a send made elsewhere)
	modeMark    = 3 // mark a send refused for good (expired, quiet hours, a budget, its caps' slot beyond its max_hold)
	modeAppend  = 4 // append the send if the log is still the worker's copy, else as modeRecord
	modeNewLog  = 5 // write the new log if the user has none (nor preferences), else as modeRecord
	modePatch   = 6 // patch the log if it is still the worker's copy (a send with tally caps), else as modeRecord
	modeSpilled = 7 // as modeAppend, the send's tally caps counted by the script from the tally key (which the copy lacks)

	statusCapped     = 0   // a cap refused the send
	statusAllowed    = 1   // allowed (recorded, unless looking); in modeMark: marked now
	statusDuplicate  = 2   // the job is in the log already
	statusCandidate  = 3   // a candidate of an arbitration window: back at retry_at
	statusPreference = 4   // the user's own preference refused it; its name follows the counts
	statusRefused    = 5   // marked refused before; the refusal's name follows the counts
	statusWhole      = 128 // added to a status: the log follows whole (header and entries)

	flagShadow     = 1 // count and report, never block
	flagArbitrated = 2 // the last slot goes to the highest priority of an arbitration window
	flagApplies    = 4 // the worker found the send in the cap's scope
	flagTally      = 8 // counted in the log's tally item of its field, not its entries; field and keep follow its scope

	// replyWritten is a request's whole reply in modeAppend and modeNewLog
	// when the log was written as the worker asked.
	replyWritten = "="

	// spillAt is the most tally items a log holds: a send that would add
	// more moves them to the user's tally key (see spilledField).
	spillAt = 16
)

// spilledField is the field of a spilled log's one tally item: its tally is in
// the user's tally key (the log's key and ":t"), read by the script only for
// a request with a tally cap. The near cache decides such a request's other
// caps from a copy that holds it, and the script its tally caps (mode 7).
const spilledField = ^uint64(0)

// Offsets of a member's parts (see Member).
const (
	memberChannel  = 8
	memberCampaign = 10
	memberTags     = 14
)

// Member returns the log member of a send: the 8-byte xxhash64 digest of the
// job id, then 16-bit digests of the channel, a 32-bit digest of the campaign,
// and a 16-bit digest per tag, so that any scope a later rule names can be
// counted over the history. A redelivered job has the same member. Two jobs of
// one user inside the longest window collide with a probability of about
// n²/2⁶⁵ for n logged sends.
func Member(jobID, channel, campaign string, tags []string) string {
	return string(appendMember(nil, jobID, channel, campaign, tags))
}

// memberLen is the length of a member with n tags.
func memberLen(n int) int { return memberTags + 2*n }

// appendMember appends the member of a send (see Member) to b.
func appendMember(b []byte, jobID, channel, campaign string, tags []string) []byte {
	b = binary.BigEndian.AppendUint64(b, xxhash.Sum64String(jobID))
	b = binary.BigEndian.AppendUint16(b, uint16(xxhash.Sum64String(channel)))
	b = binary.BigEndian.AppendUint32(b, uint32(xxhash.Sum64String(campaign)))
	for _, t := range tags {
		b = binary.BigEndian.AppendUint16(b, uint16(xxhash.Sum64String(t)))
	}
	return b
}

// digest2 and digest4 are a name's digests as Member writes them, for scopes.
func digest2(s string) string {
	var b [2]byte
	binary.BigEndian.PutUint16(b[:], uint16(xxhash.Sum64String(s)))
	return string(b[:])
}

func digest4(s string) string {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], uint32(xxhash.Sum64String(s)))
	return string(b[:])
}

// reqArgs are one request's values for the script (and the cache), computed
// once per call.
type reqArgs struct {
	at        time.Time // the clock reading of the call
	now       int64     // at in ms
	member    string
	retention int64 // ms
	markFor   int64 // ms, with a refusal's name (mode 3): Request.MarkFor
	// caps are the caps decided: the request's, or for Decide only those
	// that apply to the send (see newArgs), each named as in the request.
	caps   []Cap
	orig   []int      // per cap decided, its index in the request's Caps; nil when caps are the request's
	since  []int64    // per cap decided: the first ms that counts
	reset  []int64    // per cap decided: a rolling window's ms, or minus a calendar period's end
	counts []int      // per cap decided: their counts
	labels *labelSlab // the round's, for its Decisions' cap names
	// applying: caps are only those that apply to the send (Decide; see
	// newArgs), which pack tells the script so that it need not check.
	applying bool
	all      []int // with orig, per cap of the request: the Decision's Counts (-1 where not decided)

	// expect, set by the near cache, is the user's whole log as its copy
	// holds it, from which the send was decided allowed (that decision in
	// the request's Decision until Redis answers): the script appends the
	// send if the log is still that (mode 4, see decide.lua), else decides it.
	expect string
	// patch, with expect, is the patch of the copy that records a send with
	// tally caps (see patch), which the script applies if the log is still
	// the copy (mode 6); patched is the log after it.
	patch, patched string

	// spill, with expect, says that the user's tally is in the tally key,
	// which the copy lacks: the send was decided allowed by its other caps,
	// and the script counts its tally caps (mode 7; see spilledDecision).
	spill bool

	// tally: one of caps is a Tally cap (decided from the log's tally items).
	tally bool

	// after, with expect, is what install needs of the log after the send
	// when Redis confirms it (see afterSend).
	after copyAfter

	// Set by send and pack for a call to Redis (the call points at them).
	key, arbKey, prefKey string // key in the batch's slab of keys
	packed               string // decide.lua's ARGV[2], in the batch's slab
	ttl                  int64  // a new log's, ms (its SET's PX)
	named                string // its ARGV[3]: the refusal's name, or expect
}

// newArgs computes the arguments of every request, on a few backing arrays.
// The retention is the longest window plus margin (Config.ClockMargin).
//
// With applying (Decide), a request's caps whose scope the send does not
// match are left out of the decision: they can neither cap the send nor be
// used by it, and counting them is most of what a scoped cap costs the
// script. caps (from capSlab, nil without applying) holds the ones kept of
// such requests. Their counts in the Decision are -1.
//
// The working arrays come from sc (nil: allocated); the counts and the
// labels' slab, which the Decisions keep, are always allocated.
func newArgs(reqs []Request, now time.Time, margin time.Duration, caps *[]Cap, sc *scratch) []reqArgs {
	ncaps := 0
	for i := range reqs {
		ncaps += len(reqs[i].Caps)
	}
	// The members, one after the other in arrays of their own (never
	// reused: nothing may write where a member's string points) of 8 KiB, a
	// small allocation (an array above 32 KiB is a large one, zeroed apart:
	// more than the members' own allocations cost).
	var members []byte
	var intsBuf *[]int64
	var origBuf *[]int
	var argsBuf *[]reqArgs
	if sc != nil {
		intsBuf, origBuf, argsBuf = &sc.ints, &sc.orig, &sc.args
	}
	ints := grow(intsBuf, 2*ncaps)
	counts := make([]int, ncaps)
	labels := new(labelSlab)
	var orig, all []int
	if caps != nil {
		*caps = (*caps)[:0]
		if cap(*caps) < ncaps { // never grown below: the requests' caps point into it
			*caps = make([]Cap, 0, ncaps)
		}
		orig = grow(origBuf, ncaps)[:0]
	}
	args := grow(argsBuf, len(reqs))
	nowMs := now.UnixMilli()
	for i := range reqs {
		r := &reqs[i]
		a := &args[i]
		a.at, a.now, a.labels = now, nowMs, labels
		if !r.SentAt.IsZero() {
			a.at, a.now = r.SentAt, r.SentAt.UnixMilli()
		} else if !r.At.IsZero() {
			a.at, a.now = r.At, r.At.UnixMilli()
		}
		if need := memberLen(len(r.Tags)); cap(members)-len(members) < need {
			members = make([]byte, 0, max(need, 8<<10))
		}
		m := len(members)
		members = appendMember(members, r.JobID, r.Channel, r.Campaign, r.Tags)
		a.member = unsafe.String(&members[m], len(members)-m)
		a.caps = r.Caps
		retention := r.Retention
		for j := range r.Caps {
			c := &r.Caps[j]
			switch {
			case c.Tally: // counted in the tally: the log keeps its send only to know it again
				retention = max(retention, TallyDedupe)
			case c.Window > 0:
				retention = max(retention, c.Window)
			default:
				retention = max(retention, c.Until.Sub(c.Since))
			}
		}
		a.retention = (retention + margin).Milliseconds()
		if r.Refused != "" {
			a.markFor = r.MarkFor.Milliseconds()
		}
		if caps != nil { // the indices of the caps that apply; kept only when some do not
			a.applying = true
			start := len(orig)
			for j := range r.Caps {
				if r.Caps[j].appliesTo(a.member) {
					orig = append(orig, j)
				}
			}
			if len(orig)-start == len(r.Caps) {
				orig = orig[:start]
			} else {
				a.orig = orig[start:len(orig):len(orig)]
			}
		}
		if a.orig != nil {
			first := len(*caps)
			for _, j := range a.orig {
				c := r.Caps[j]
				c.Name = c.label(j)
				*caps = append(*caps, c)
			}
			a.caps = (*caps)[first:len(*caps):len(*caps)]
			if all == nil {
				all = make([]int, ncaps)
			}
			a.all, all = all[:len(r.Caps):len(r.Caps)], all[len(r.Caps):]
		}
		n := len(a.caps)
		a.since, a.reset, ints = ints[:n:n], ints[n:2*n:2*n], ints[2*n:]
		a.counts, counts = counts[:n:n], counts[n:]
		a.tally = false
		for j := range a.caps {
			c := &a.caps[j]
			switch {
			case c.Window > 0:
				a.reset[j] = c.Window.Milliseconds()
				a.since[j] = nowMs - a.reset[j] + 1
			case c.Tally: // lifetime: every send tallied counts, none leaves
				a.since[j], a.reset[j] = 0, 0
			default:
				a.since[j], a.reset[j] = c.Since.UnixMilli(), -c.Until.UnixMilli()
			}
			a.tally = a.tally || c.Tally
		}
	}
	return args
}

// requestCounts turns d's counts, of the caps decided, into the request's:
// one per cap of the request, -1 for those left out.
func (a *reqArgs) requestCounts(d *Decision) {
	if a.orig == nil || d.Counts == nil {
		return
	}
	for i := range a.all {
		a.all[i] = -1
	}
	for k, j := range a.orig {
		a.all[j] = d.Counts[k]
	}
	d.Counts = a.all
}

// The first two values of a call, boxed once: FCALL and the function's name,
// or EVAL and the script's body.
var (
	fcallHead = [2]any{"fcall", decideFunction}
	evalHead  = [2]any{"eval", decideSource}
)

// keyCount is how many keys a request of r has in a call: its log, its
// arbitration candidates and its preferences.
func keyCount(r *Request) int {
	n := 1
	if r.Arbitration > 0 {
		n++
	}
	if r.Preferences {
		n++
	}
	return n
}

// callArgs returns one call of decide.lua, FCALL (or EVAL with its body
// when eval is set), for the requests idx of reqs, whose args pack filled:
// the first one's log as its one declared key, then the packed values, the
// member, the refusal's name and the keys of each, in order (see the script's
// header). The values are pointers to the args' and requests' fields
// (go-redis writes a *string as its value): a string put in an interface
// would be copied to the heap, a pointer is not. So they must not change
// until the call is sent.
func callArgs(eval bool, reqs []Request, args []reqArgs, idx []int) []any {
	n := 4
	for _, i := range idx {
		n += 3 + keyCount(&reqs[i])
	}
	v := make([]any, 4, n)
	head := &fcallHead
	if eval {
		head = &evalHead
	}
	v[0], v[1], v[2], v[3] = head[0], head[1], 1, &args[idx[0]].key
	for _, i := range idx {
		a := &args[i]
		v = append(v, &a.packed, &a.member, &a.named, &a.key)
		if reqs[i].Arbitration > 0 {
			v = append(v, &a.arbKey)
		}
		if reqs[i].Preferences {
			v = append(v, &a.prefKey)
		}
	}
	return v
}

// The sizes of decide.lua's packed values (its ARGV[2]): the call's, then each cap's before its filter.
const (
	packedHead = 8 + 1 + 8 + 2 + 8 + 1 + 1 // now, mode, retention, maxlog, window, priority, prefs
	packedCap  = 8 + 4 + 8                 // since, limit, reset
)

// packedLen is the length of a's packed values (see pack).
func packedLen(a *reqArgs) int {
	n := packedHead
	if a.patch != "" {
		n += 2 + len(a.patch)
	}
	if a.markFor > 0 {
		n += 8
	}
	for i := range a.caps {
		n += packedCap + a.caps[i].filterLen()
	}
	return n
}

// pack fills a's other keys (from a.key) and packs r's values for decide.lua
// (its ARGV[2]) into buf, of capacity packedLen(a) at least and not written
// again until the call is sent: a.packed points into it. fresh, when not
// empty, is the new log to write in mode 5 (see newlog.go).
func pack(buf []byte, r *Request, a *reqArgs, record bool, maxLog int, fresh string) {
	if r.Arbitration > 0 {
		a.arbKey = a.key + ":arb"
	}
	if r.Preferences {
		a.prefKey = a.key + ":prefs"
	}
	mode := byte(modeLook)
	a.named = r.Refused
	switch {
	case r.Refused != "":
		mode = modeMark
	case record && a.expect != "" && a.patch != "":
		mode, a.named = modePatch, a.expect
	case record && a.expect != "" && a.spill:
		mode, a.named = modeSpilled, a.expect
	case record && a.expect != "":
		mode, a.named = modeAppend, a.expect
	case record && fresh != "":
		mode, a.named = modeNewLog, fresh
	case record && !r.SentAt.IsZero():
		mode = modeExact
	case record:
		mode = modeRecord
	}
	b := binary.BigEndian.AppendUint64(buf[:0], uint64(a.now))
	b = append(b, mode)
	b = binary.BigEndian.AppendUint64(b, uint64(a.retention))
	b = binary.BigEndian.AppendUint16(b, uint16(maxLog))
	b = binary.BigEndian.AppendUint64(b, uint64(r.Arbitration.Milliseconds()))
	prefs := byte(0)
	if r.Preferences {
		prefs = 1
	}
	b = append(b, byte(r.Priority), prefs)
	if mode == modePatch {
		b = binary.BigEndian.AppendUint16(b, uint16(len(a.patch)))
		b = append(b, a.patch...)
	}
	if mode == modeMark && a.markFor > 0 { // a mark has no caps: its keep follows the header
		b = binary.BigEndian.AppendUint64(b, uint64(a.markFor))
	}
	for i := range a.caps {
		c := &a.caps[i]
		b = binary.BigEndian.AppendUint64(b, uint64(a.since[i]))
		b = binary.BigEndian.AppendUint32(b, uint32(c.Limit))
		b = binary.BigEndian.AppendUint64(b, uint64(a.reset[i]))
		b = c.appendFilter(b, a.applying)
	}
	a.packed = unsafe.String(unsafe.SliceData(b), len(b))
}

// parseReply checks the script's reply (one packed string, see decide.lua)
// against the request's caps and returns its decision and the log entries
// that follow it, as the log packs them (empty if none), and, when the
// script sent the log whole (status + 128: an array of the packed string
// and the log's pieces), that log (its header, then the same entries); it
// never panics on a bad reply. member is the send's, to tell which shadow caps apply; counts
// (of len(caps)) becomes the Decision's Counts, or nil.
func parseReply(v any, caps []Cap, member string, now time.Time, counts []int, labels *labelSlab) (d Decision, tail, whole string, err error) {
	ncaps := len(caps)
	s, ok := v.(string)
	var pieces []any // the log whole, when the reply is an array
	if a, isArray := v.([]any); isArray && len(a) > 0 {
		s, ok = a[0].(string)
		pieces = a[1:]
	}
	head := replyHead + 4*ncaps
	if !ok || len(s) < head {
		return Decision{}, "", "", fmt.Errorf("unexpected script reply %q: want a string of %d bytes or more (status, cap, retry_at, %d counts)", v, head, ncaps)
	}
	if pieces != nil {
		if len(s) > head || s[0] < statusWhole {
			return Decision{}, "", "", fmt.Errorf("unexpected script reply %q: an array, but not of a whole log", v)
		}
		if s, ok = joined(s, pieces); !ok {
			return Decision{}, "", "", fmt.Errorf("unexpected script reply %q: the log's pieces are not strings", v)
		}
	}
	var buf [3 + maxCaps]int64
	ints := buf[:0]
	if 3+ncaps > len(buf) {
		ints = make([]int64, 0, 3+ncaps)
	}
	ints = ints[:3+ncaps]
	status, isWhole := s[0], s[0] >= statusWhole // the log whole follows
	if isWhole {
		status -= statusWhole
	}
	ints[0], ints[1], ints[2] = int64(status), int64(be16(s, 1)), int64(be64(s, 3))
	for i := range ncaps {
		ints[3+i] = int64(be32(s, replyHead+4*i))
	}
	if d, err = decisionOf(ints, caps, member, now, counts, labels); err != nil {
		return Decision{}, "", "", fmt.Errorf("unexpected script reply %v: %w", slices.Clone(ints), err)
	}
	rest := s[head:]
	switch {
	case (ints[0] == statusPreference || ints[0] == statusRefused) && !isWhole: // capped by a preference, or refused before: its name last
		if rest == "" {
			return Decision{}, "", "", fmt.Errorf("unexpected script reply %q: no preference or refusal named", s)
		}
		if d.RefusedBefore {
			d.Cap = rest
			return d, "", "", nil
		}
		d.Cap = PreferenceCap(rest)
		d.Exceeded = []string{d.Cap}
		return d, "", "", nil
	case isWhole && rest == "": // no log
		return d, "", "", nil
	case isWhole && (ints[0] == statusPreference || ints[0] == statusRefused || len(rest) < 8 || countEntries(rest[8:]) < 0):
		return Decision{}, "", "", fmt.Errorf("unexpected script reply %q: the log after its counts is not a header and packed entries", s)
	case isWhole:
		return d, rest[8:], rest, nil
	case countEntries(rest) < 0:
		return Decision{}, "", "", fmt.Errorf("unexpected script reply %q: the log after its counts is not packed entries", s)
	}
	return d, rest, "", nil
}

// joined returns head followed by pieces (strings), and whether they all
// were.
func joined(head string, pieces []any) (string, bool) {
	n := len(head)
	for _, p := range pieces {
		s, ok := p.(string)
		if !ok {
			return "", false
		}
		n += len(s)
	}
	b := make([]byte, 0, n)
	b = append(b, head...)
	for _, p := range pieces {
		b = append(b, p.(string)...)
	}
	return unsafe.String(unsafe.SliceData(b), len(b)), true
}

// replyHead is the size of a reply's status, cap and retry_at (decide.lua).
const replyHead = 1 + 2 + 8

// countEntries returns how many entries log holds, packed as decide.lua
// packs a log's (see nextEntry), or -1 if it is not such entries.
func countEntries(log string) int {
	n := 0
	for p := 0; p < len(log); n++ {
		var ok bool
		if _, _, p, ok = nextEntry(log, p); !ok {
			return -1
		}
	}
	return n
}

// nextEntry reads the entry at log[p:], packed as decide.lua packs a log's
// entries (score int64, member length uint16, member; big-endian) or its
// tally items (tallyHead, member length uint8, member: read with score 0),
// and returns it and where the next one starts; ok is false if log ends
// within it.
func nextEntry(log string, p int) (member string, score int64, next int, ok bool) {
	if len(log)-p >= 2 && log[p] == tallyHead {
		next = p + 2 + int(log[p+1])
		if next > len(log) {
			return "", 0, p, false
		}
		return log[p+2 : next], 0, next, true
	}
	if len(log)-p < 10 {
		return "", 0, p, false
	}
	next = p + 10 + int(be16(log, p+8))
	if next > len(log) {
		return "", 0, p, false
	}
	return log[p+10 : next], int64(be64(log, p)), next, true
}

// tallyHead is a tally item's first byte in a log. An entry's first is its
// score's: 0 for a send's time, 0xff for a mark's (minus a time).
const tallyHead = 1

// labelSlab holds the cap names of a round's Decisions (Exceeded, Shadow) in
// a few arrays a batch, where a slice each cost a capped decision an
// allocation. A Decision keeps its slice: nothing is written where one
// points, and a slab is a round's alone (see newArgs).
type labelSlab struct{ buf []string }

// of returns the labels of the caps that in reports true for (nil when
// none): in s's room, or allocated when s is nil.
func (s *labelSlab) of(caps []Cap, in func(c *Cap, i int) bool) []string {
	n := 0
	for i := range caps {
		if in(&caps[i], i) {
			n++
		}
	}
	if n == 0 {
		return nil
	}
	var out []string
	if s == nil {
		out = make([]string, 0, n)
	} else {
		if cap(s.buf)-len(s.buf) < n {
			s.buf = make([]string, 0, max(n, 64))
		}
		k := len(s.buf)
		s.buf = s.buf[:k+n]
		out = s.buf[k : k : k+n]
	}
	for i := range caps {
		if in(&caps[i], i) {
			out = append(out, caps[i].label(i))
		}
	}
	return out
}

// entryLen is the length of member's entry as appendEntry packs it.
func entryLen(member string) int { return 8 + 2 + len(member) }

// appendEntry appends an entry packed as decide.lua packs a log's (see
// nextEntry, which reads it back).
func appendEntry(b []byte, score int64, member string) []byte {
	b = binary.BigEndian.AppendUint64(b, uint64(score))
	b = binary.BigEndian.AppendUint16(b, uint16(len(member)))
	return append(b, member...)
}

// appendItem appends a tally item of member (at most 255 bytes; see
// MaxTallyTimes) packed as decide.lua packs a log's.
func appendItem(b []byte, member string) []byte {
	return append(append(b, tallyHead, byte(len(member))), member...)
}

// be16, be32 and be64 read a big-endian number at s[i:]: one bounds check
// each, and a load the compiler makes one instruction (a log's copy is read
// entry by entry on every lookup).
func be16(s string, i int) uint16 {
	s = s[i : i+2]
	return uint16(s[1]) | uint16(s[0])<<8
}

func be32(s string, i int) uint32 {
	s = s[i : i+4]
	return uint32(s[3]) | uint32(s[2])<<8 | uint32(s[1])<<16 | uint32(s[0])<<24
}

func be64(s string, i int) uint64 {
	s = s[i : i+8]
	return uint64(s[7]) | uint64(s[6])<<8 | uint64(s[5])<<16 | uint64(s[4])<<24 |
		uint64(s[3])<<32 | uint64(s[2])<<40 | uint64(s[1])<<48 | uint64(s[0])<<56
}

// decisionOf turns a script's answer (status, cap, retry_at, counts...),
// from Redis or the near cache, into a Decision. Its Counts are counts when
// that has one per cap (the caller's array: no allocation per decision).
func decisionOf(ints []int64, caps []Cap, member string, now time.Time, counts []int, labels *labelSlab) (Decision, error) {
	ncaps := len(caps)
	if len(counts) != ncaps {
		counts = make([]int, ncaps)
	}
	d := Decision{At: now, Counts: counts}
	for i := range d.Counts {
		d.Counts[i] = int(ints[3+i])
	}
	full := func(c *Cap, i int) bool { return d.Counts[i] >= c.Limit && c.Scope.Matches(member) }
	if ints[0] != statusDuplicate {
		d.Shadow = labels.of(caps, func(c *Cap, i int) bool { return c.Shadow && full(c, i) })
	}
	switch ints[0] {
	case statusAllowed:
		d.Allowed = true
		if ints[2] > 0 {
			d.Recorded = time.UnixMilli(ints[2])
		}
	case statusDuplicate:
		d.Allowed, d.Duplicate = true, true
		d.Recorded = time.UnixMilli(ints[2])
	case statusRefused: // Cap is the refusal's: the caller names it
		d.RefusedBefore = true
	case statusPreference: // Cap is the preference's: the caller names it
		if ints[2] > 0 {
			d.RetryAt = time.UnixMilli(ints[2])
		}
	case statusCandidate:
		if ints[1] < 1 || int(ints[1]) > ncaps {
			return Decision{}, fmt.Errorf("cap index %d out of range", ints[1])
		}
		d.Candidate, d.Cap, d.RetryAt = true, caps[ints[1]-1].label(int(ints[1]-1)), time.UnixMilli(ints[2])
	case statusCapped:
		if ints[1] < 1 || int(ints[1]) > ncaps {
			return Decision{}, fmt.Errorf("cap index %d out of range", ints[1])
		}
		i := int(ints[1]) - 1
		d.Cap = caps[i].label(i)
		d.Reserved = caps[i].Reserved > 0 && d.Counts[i] < caps[i].Limit+caps[i].Reserved
		d.Exceeded = labels.of(caps, func(c *Cap, j int) bool { return !c.Shadow && full(c, j) })
		if ints[2] > 0 {
			d.RetryAt = time.UnixMilli(ints[2])
		}
	default:
		return Decision{}, fmt.Errorf("status %d", ints[0])
	}
	return d, nil
}

// ScriptCall returns the values of the decide.lua call that Decide sends to
// record reqs at now, keys[i] being the log of reqs[i] (FCALL first; the
// near cache's log not asked for), for tools that call the script themselves:
// capper-devstack calls, which scripts/bench-calls.sh and bench-capping.sh
// measure. The members and the packed values are binary, so no text tool
// (redis-benchmark) can send them.
func ScriptCall(keys []string, reqs []Request, now time.Time) ([]any, error) {
	return callOfScript(keys, reqs, nil, now, 0)
}

// CopyCall is ScriptCall for sends the near cache decided allowed from its
// whole copies of the users' logs, logs[i] being reqs[i]'s (decide.lua's
// mode 4: appended if the log is the copy, else decided in full).
func CopyCall(keys []string, reqs []Request, logs []string, now time.Time) ([]any, error) {
	if len(logs) != len(reqs) {
		return nil, fmt.Errorf("capping: %d logs for %d requests", len(logs), len(reqs))
	}
	return callOfScript(keys, reqs, logs, now, 0)
}

// callOfScript packs maxLog as the most entries and tally items of a copy
// of the log to reply with (the near cache's: cacheMaxLog; 0: none).
func callOfScript(keys []string, reqs []Request, logs []string, now time.Time, maxLog int) ([]any, error) {
	if len(keys) != len(reqs) {
		return nil, fmt.Errorf("capping: %d keys for %d requests", len(keys), len(reqs))
	}
	idx := make([]int, len(reqs))
	for i := range reqs {
		if err := reqs[i].validate(); err != nil {
			return nil, fmt.Errorf("capping: %w: %w", ErrInvalidRequest, err)
		}
		idx[i] = i
	}
	var caps []Cap
	args := newArgs(reqs, now, 0, &caps, nil)
	for i := range args {
		args[i].key = keys[i]
		if logs != nil {
			args[i].expect = logs[i]
		}
		pack(make([]byte, 0, packedLen(&args[i])), &reqs[i], &args[i], true, maxLog, "")
	}
	v := callArgs(false, reqs, args, idx)
	for i, x := range v { // the values themselves: args and reqs are this call's
		if p, ok := x.(*string); ok {
			v[i] = *p
		}
	}
	return v, nil
}
