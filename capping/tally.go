package capping

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"time"
	"unsafe"

	"github.com/redis/go-redis/v9"
)

// A user's tally is the tally items of its log (score 0; see decide.lua):
// per tally cap's field (Cap.TallyField), its count of sends, until when it
// is kept, and for a rolling cap the times of the last MaxTallyTimes of them.
// The script counts a tally cap from its item and writes the item of an
// allowed send in the same step as its entry; it drops items kept until
// before now when it writes, and the log is kept until its last item's keep.
// A log with no tally item costs a decision nothing more. A log holds at most
// spillAt items: past them, the user's tally is in a key of its own, which
// only a request with a tally cap reads (see spilledField), so that the many
// counted scopes of a long-lived user do not slow the decisions that count
// none.

// TallyDedupe is how long the log keeps at least a send a tally counted,
// whatever its other caps' windows: a redelivery of the job within it is
// its duplicate, not counted again.
const TallyDedupe = 24 * time.Hour

// TallyField is the field of c's count in a user's tally: a digest of its
// scope (its campaign's too) and its window, so that the caps of one scope
// and window share a count whatever their names, segments and limits.
func (c Cap) TallyField() uint64 { return c.tallyField() }

// TallyCount is one item of a user's tally.
type TallyCount struct {
	Field uint64
	Count int       // sends counted
	Keep  time.Time // until when the item is kept
	Times []time.Time
}

// ReadTally returns the tally of the user whose log is at key (see
// Limiter.Key), sorted by field: the log's tally items, or its tally key's
// when the log holds more than a few (see spilledField).
func ReadTally(ctx context.Context, c redis.Cmdable, key string) ([]TallyCount, error) {
	v, err := c.Get(ctx, key).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("capping: read tally %s: %w", key, err)
	}
	out, err := readTally(v, 8)
	if err != nil || !slices.ContainsFunc(out, func(t TallyCount) bool { return t.Field == spilledField }) {
		return out, err
	}
	if v, err = c.Get(ctx, key+":t").Result(); err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("capping: read tally %s:t: %w", key, err)
	}
	return readTally(v, 0)
}

// readTally returns the tally items of log (its value; its items start at
// byte from), sorted by field.
func readTally(log string, from int) ([]TallyCount, error) {
	var out []TallyCount
	for p := from; p < len(log); {
		m, at, next, ok := nextEntry(log, p)
		if !ok {
			return nil, fmt.Errorf("capping: a log truncated at byte %d of %d", p, len(log))
		}
		p = next
		if at != 0 {
			continue
		}
		if len(m) < 20 || (len(m)-20)%8 != 0 {
			return nil, fmt.Errorf("capping: tally item %x is not one capper wrote", m)
		}
		c := TallyCount{Field: binary.BigEndian.Uint64([]byte(m[:8])), Count: int(be32(m, 8)), Keep: time.UnixMilli(int64(be64(m, 12)))}
		for q := 20; q < len(m); q += 8 {
			c.Times = append(c.Times, time.UnixMilli(int64(be64(m, q))))
		}
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b TallyCount) int { return cmp.Compare(a.Field, b.Field) })
	return out, nil
}

// appendTally appends to b, as decide.lua packs them (by field), the tally
// items of a's tally caps (those that count its send) for a new log: a count
// of 1, kept until the cap's Keep, and the send's time for a rolling cap; and
// returns it with the latest Keep (0: none).
func appendTally(b []byte, a *reqArgs) ([]byte, int64) {
	var keep int64
	type capField struct {
		i     int
		field uint64
	}
	var order [maxCaps]capField // the tally caps, by field: the order decide.lua writes items in
	idx := order[:0]
	if len(a.caps) > maxCaps {
		idx = make([]capField, 0, len(a.caps))
	}
	for i := range a.caps {
		if c := &a.caps[i]; c.Tally && !sharesField(a.caps[:i], c) {
			idx = append(idx, capField{i, c.tallyField()})
		}
	}
	slices.SortFunc(idx, func(x, y capField) int { return cmp.Compare(x.field, y.field) })
	for _, cf := range idx {
		i, c := cf.i, &a.caps[cf.i]
		n := 20
		if c.Window > 0 {
			n += 8
		}
		b = append(b, tallyHead, byte(n))
		k := c.Keep.UnixMilli() // the latest of the caps of its field
		for j := i + 1; j < len(a.caps); j++ {
			if sharesField(a.caps[j:j+1], c) {
				k = max(k, a.caps[j].Keep.UnixMilli())
			}
		}
		b = binary.BigEndian.AppendUint64(b, cf.field)
		b = binary.BigEndian.AppendUint32(b, 1)
		b = binary.BigEndian.AppendUint64(b, uint64(k))
		if c.Window > 0 {
			b = binary.BigEndian.AppendUint64(b, uint64(a.now))
		}
		keep = max(keep, k)
	}
	return b, keep
}

// sharesField reports whether one of caps is a tally cap of c's field: one
// item serves both, kept until the later of their keeps.
func sharesField(caps []Cap, c *Cap) bool {
	for i := range caps {
		if caps[i].Tally && caps[i].Window == c.Window && caps[i].Scope == c.Scope {
			return true
		}
	}
	return false
}

// tallyLenOf is the length of appendTally's items for a.
func tallyLenOf(a *reqArgs) int {
	n := 0
	for i := range a.caps {
		if c := &a.caps[i]; c.Tally && !sharesField(a.caps[:i], c) {
			n += 2 + 20
			if c.Window > 0 {
				n += 8
			}
		}
	}
	return n
}

// splitTally splits a copy of a log (see the near cache), its tally items
// first (see tallyFirst), into its tally items (score 0) and its entries.
func splitTally(log []logItem) (tally, entries []logItem) {
	n := 0
	for n < len(log) && log[n].score == 0 {
		n++
	}
	return log[:n], log[n:]
}

// tallyFirst moves log's tally items before its entries, in place, each in
// its order: a patch (decide.lua's mode 6) appends new items after the
// entries, and the near cache reads a copy's items first (splitTally).
func tallyFirst(log []logItem) {
	k := 0
	for k < len(log) && log[k].score == 0 {
		k++
	}
	i := k
	for i < len(log) && log[i].score != 0 {
		i++
	}
	if i == len(log) {
		return // the usual case: items first, as the script writes a log whole
	}
	var buf [cacheMaxLog]logItem
	entries := buf[:0]
	for _, it := range log[k:] { // it is read before log[k], at or before it, is written
		if it.score == 0 {
			log[k] = it
			k++
		} else {
			entries = append(entries, it)
		}
	}
	copy(log[k:], entries)
}

// spilled reports whether log, a copy read by the near cache (its tally items
// first), holds the spill item: its tally is in the user's tally key.
func spilled(log []logItem) bool {
	for _, it := range log {
		if it.score != 0 {
			return false
		}
		if len(it.member) >= 8 && be64(it.member, 0) == spilledField {
			return true
		}
	}
	return false
}

// spillOnly reports whether the spill item is log's only tally item (its
// items first), as the script leaves a spilled log: modeSpilled counts the
// send in the tally key and writes no other item of the log.
func spillOnly(log []logItem) bool {
	return len(log) > 0 && log[0].score == 0 && len(log[0].member) == 20 && be64(log[0].member, 0) == spilledField &&
		(len(log) == 1 || log[1].score != 0)
}

// isSpilledReply reports whether v is the script's reply to a send it
// recorded in modeSpilled: replyWritten, then more (see spilledDecision); any
// other reply is a decision in full (its status first).
func isSpilledReply(v any) bool {
	s, ok := v.(string)
	return ok && len(s) >= 2 && s[0] == replyWritten[0]
}

// spilledDecision is the decision of a's send, recorded by the script in
// modeSpilled (see decide.lua) from s, its reply: the copy's decision (its
// counts in a.counts) with the tally caps' counts the reply carries; and
// whether the script raised the spill item's keep (the log is then not the
// copy with the send appended).
func (a *reqArgs) spilledDecision(s string) (d Decision, raised bool, err error) {
	n := 0
	for i := range a.caps {
		if a.caps[i].Tally {
			n++
		}
	}
	if len(s) != 2+4*n || s[1] > 1 || len(a.caps) > maxCaps {
		return Decision{}, false, fmt.Errorf("unexpected script reply %q: want %q, a byte and %d counts", s, replyWritten, n)
	}
	var buf [3 + maxCaps]int64
	h := buf[:3+len(a.caps)]
	h[0], h[1], h[2] = statusAllowed, 0, a.now // as the copy decided it (see appendable)
	k := 0
	for i := range a.caps {
		h[3+i] = int64(a.counts[i])
		if a.caps[i].Tally {
			h[3+i] = int64(be32(s, 2+4*k))
			k++
		}
	}
	d, err = decisionOf(h, a.caps, a.member, a.at, a.counts, a.labels)
	return d, s[1] == 1, err
}

// tallyItem returns the member of the tally item of field among tally ("": none).
func tallyItem(tally []logItem, field uint64) string {
	for _, it := range tally {
		if len(it.member) >= 20 && be64(it.member, 0) == field {
			return it.member
		}
	}
	return ""
}

// tallyCount is decide.lua's tallied: the sends a tally item's member t
// counts in a window from since (reset 0: every send, ever).
func tallyCount(t string, since, reset int64) int64 {
	if t == "" {
		return 0
	}
	if reset == 0 {
		return int64(be32(t, 8))
	}
	n := int64(0)
	for p := 20; p+8 <= len(t); p += 8 {
		if int64(be64(t, p)) >= since {
			n++
		}
	}
	return n
}

// tallyKth is the time of the k-th oldest send of t in the window from since (0: none).
func tallyKth(t string, since, k int64) int64 {
	for p := 20; p+8 <= len(t); p += 8 {
		if at := int64(be64(t, p)); at >= since {
			if k--; k == 0 {
				return at
			}
		}
	}
	return 0
}

// patch returns, for a's send with tally caps allowed from the whole copy
// raw (appendable found its items all kept, no entry aged out or after now),
// the patch decide.lua's mode 6 applies to the log if it is still raw, which
// records the send as the script would count it (each tally item of a's caps
// that apply counted, in place; the new ones, by field, and the entry
// appended; a new header and TTL when the send's keeps or the retention
// outlast the log's), and the log after it. It returns "", "" when a counted
// item would change its length (a rolling cap's times, until MaxTallyTimes
// of them), or the log would hold more than spillAt items: the script
// decides that send, and writes the log whole or moves its items. log is
// raw read by the cache (cacheShard.items: its members are raw's bytes, its
// tally items first), so that an item's place in raw is its member's address.
func patch(raw string, log []logItem, a *reqArgs) (arg, after string, items int) {
	type item struct {
		at    int // where its member starts in raw (-1: a new item)
		field uint64
		m     string
	}
	var found [cacheMaxLog]item // the copy's tally items (a copy holds at most cacheMaxLog items)
	have := found[:0]
	tkeep := int64(0) // the latest keep of the log's items after the patch
	base := uintptr(unsafe.Pointer(unsafe.StringData(raw)))
	for _, it := range log {
		if it.score != 0 {
			break // the entries, after every item
		}
		m, at := it.member, int(uintptr(unsafe.Pointer(unsafe.StringData(it.member)))-base)
		if len(m) < 20 || at < 10 || at+len(m) > len(raw) { // (not raw's: cannot happen)
			return "", "", 0
		}
		have = append(have, item{at, be64(m, 0), m})
		tkeep = max(tkeep, int64(be64(m, 12)))
	}
	var buf [maxCaps]item // the items the send counts
	counts := buf[:0]
	for i := range a.caps {
		c := &a.caps[i]
		if !c.Tally || !c.appliesTo(a.member) {
			continue
		}
		f := c.tallyField()
		if slices.ContainsFunc(counts, func(it item) bool { return it.field == f }) {
			continue
		}
		keep := c.Keep.UnixMilli() // the latest of the caps of its field that apply
		for j := i + 1; j < len(a.caps); j++ {
			if o := &a.caps[j]; o.Tally && o.appliesTo(a.member) && sharesField(a.caps[i:i+1], o) {
				keep = max(keep, o.Keep.UnixMilli())
			}
		}
		it := item{at: -1, field: f}
		if k := slices.IndexFunc(have, func(h item) bool { return h.field == f }); k >= 0 {
			it = have[k]
		}
		m := countItem(it.m, f, keep, c.Window > 0, a.now)
		if it.at >= 0 && len(m) != len(it.m) {
			return "", "", 0
		}
		it.m = m
		counts = append(counts, it)
		tkeep = max(tkeep, int64(be64(m, 12)))
	}
	slices.SortFunc(counts, func(x, y item) int { return cmp.Compare(x.field, y.field) })
	var expiry int64 // the header's new expiry (0: it stays): as the script's ttl
	if h := int64(be64(raw, 0)); h-a.now < a.retention || h < tkeep {
		expiry = a.now + max(a.retention, tkeep-a.now) + min(a.retention/8, 3_600_000)
	}
	edits, plen, tail := 0, 9, 0 // items counted in place; the patch's length; its new items'
	for _, it := range counts {
		if it.at >= 0 {
			edits++
			plen += 6 + len(it.m)
		} else {
			tail += 2 + len(it.m)
		}
	}
	if len(have)+len(counts)-edits > spillAt { // the script moves the log's items to the tally key
		return "", "", 0
	}
	plen += tail
	nw := len(raw) + tail + 10 + len(a.member)
	all := make([]byte, 0, nw+plen) // the log after the patch, then the patch: one allocation
	w, b := all[:0:nw], all[nw:nw]
	w = append(w, raw...)
	if expiry != 0 {
		binary.BigEndian.PutUint64(w, uint64(expiry))
	}
	b = binary.BigEndian.AppendUint64(b, uint64(expiry))
	b = append(b, byte(edits))
	for _, it := range counts {
		if it.at >= 0 {
			copy(w[it.at:], it.m)
			b = binary.BigEndian.AppendUint32(b, uint32(it.at))
			b = binary.BigEndian.AppendUint16(b, uint16(len(it.m)))
			b = append(b, it.m...)
		}
	}
	for _, it := range counts {
		if it.at < 0 {
			b = appendItem(b, it.m)
			w = appendItem(w, it.m)
		}
	}
	w = appendEntry(w, a.now, a.member)
	return unsafe.String(unsafe.SliceData(b), len(b)), unsafe.String(unsafe.SliceData(w), len(w)), len(counts) - edits
}

// countItem is decide.lua's counted: tally item member t ("": a new one, of
// field) with one more send at now, kept until the later of its keep and
// keep, and for a rolling cap's (timed) now added to its times, the last
// MaxTallyTimes kept.
func countItem(t string, field uint64, keep int64, timed bool, now int64) string {
	var count uint32
	var kept int64
	times := ""
	if t != "" {
		count, kept, times = be32(t, 8), int64(be64(t, 12)), t[20:]
	}
	b := binary.BigEndian.AppendUint64(make([]byte, 0, 20+len(times)+8), field)
	b = binary.BigEndian.AppendUint32(b, count+1)
	b = binary.BigEndian.AppendUint64(b, uint64(max(kept, keep)))
	if timed {
		if len(times) >= 8*MaxTallyTimes {
			times = times[len(times)-8*(MaxTallyTimes-1):]
		}
		b = binary.BigEndian.AppendUint64(append(b, times...), uint64(now))
	}
	return string(b)
}
