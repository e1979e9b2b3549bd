package capping

import (
	"cmp"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"
)

// A user's tally is the tally items of its log (score 0; see decide.lua):
// per tally cap's field (Cap.TallyField), its count of sends, until when it
// is kept, and for a rolling cap the times of the last MaxTallyTimes of them.
// The script counts a tally cap from its item and writes the item of an
// allowed send in the same step as its entry; it drops items kept until
// before now when it writes, and the log is kept until its last item's keep.
// A log with no tally item costs a decision nothing more.

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
// Limiter.Key), sorted by field.
func ReadTally(ctx context.Context, c redis.Cmdable, key string) ([]TallyCount, error) {
	v, err := c.Get(ctx, key).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("capping: read tally %s: %w", key, err)
	}
	return readTally(v)
}

// readTally returns the tally items of log (its value), sorted by field.
func readTally(log string) ([]TallyCount, error) {
	var out []TallyCount
	for p := 8; p < len(log); {
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
		b = binary.BigEndian.AppendUint64(b, 0)
		b = binary.BigEndian.AppendUint16(b, uint16(n))
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
			n += 10 + 20
			if c.Window > 0 {
				n += 8
			}
		}
	}
	return n
}

// splitTally splits a copy of a log (see the near cache) into its tally
// items, which come first (score 0), and its entries.
func splitTally(log []logItem) (tally, entries []logItem) {
	n := 0
	for n < len(log) && log[n].score == 0 {
		n++
	}
	return log[:n], log[n:]
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

// swapped returns the log decide.lua would write for a's send with tally
// caps, allowed from the whole copy raw (log: its items, tally items first,
// which appendable found all kept, no entry aged out or after now): the
// items of a's tally caps that apply to it counted (counted), all of them by
// field, the copy's entries and the send's, after a header of now plus the
// TTL the script would set.
func swapped(raw string, log []logItem, a *reqArgs) string {
	tally, _ := splitTally(log)
	off := 8 // where the copy's entries start in raw
	type item struct {
		field uint64
		m     string
	}
	var buf [maxCaps]item
	items := buf[:0]
	for _, it := range tally {
		off += 10 + len(it.member)
		items = append(items, item{be64(it.member, 0), it.member})
	}
	var done [maxCaps]uint64 // fields counted already: caps of one field count once
	counted := done[:0]
	for i := range a.caps {
		c := &a.caps[i]
		f := c.tallyField()
		if !c.Tally || !c.appliesTo(a.member) || slices.Contains(counted, f) {
			continue
		}
		counted = append(counted, f)
		keep := c.Keep.UnixMilli() // the latest of the caps of its field that apply
		for j := i + 1; j < len(a.caps); j++ {
			if o := &a.caps[j]; o.Tally && o.appliesTo(a.member) && sharesField(a.caps[i:i+1], o) {
				keep = max(keep, o.Keep.UnixMilli())
			}
		}
		k := slices.IndexFunc(items, func(it item) bool { return it.field == f })
		var old string
		if k >= 0 {
			old = items[k].m
		}
		m := countItem(old, f, keep, c.Window > 0, a.now)
		if k >= 0 {
			items[k].m = m
		} else {
			items = append(items, item{f, m})
		}
	}
	slices.SortFunc(items, func(x, y item) int { return cmp.Compare(x.field, y.field) })
	ttl := a.retention + min(a.retention/8, 3_600_000)
	n := len(raw) - off + 10 + len(a.member) + 8
	for _, it := range items {
		ttl = max(ttl, int64(be64(it.m, 12))-a.now)
		n += 10 + len(it.m)
	}
	b := binary.BigEndian.AppendUint64(make([]byte, 0, n), uint64(a.now+ttl))
	for _, it := range items {
		b = appendEntry(b, 0, it.m)
	}
	b = appendEntry(append(b, raw[off:]...), a.now, a.member)
	return string(b)
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

// swapArg is decide.lua's ARGV[3] in mode 6: the copy's length, the copy,
// then the log to write in its place.
func swapArg(expect, swap string) string {
	b := binary.BigEndian.AppendUint32(make([]byte, 0, 4+len(expect)+len(swap)), uint32(len(expect)))
	return string(append(append(b, expect...), swap...))
}
