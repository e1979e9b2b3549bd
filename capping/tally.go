package capping

import (
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"time"
)

// A user's tally (see Cap.Tally) is a hash beside the log, at the log's key
// plus tallySuffix (one slot): per tally cap's field (Cap.TallyField, 8
// bytes), its count of sends, until when it is kept, and for a rolling cap
// the times of the last MaxTallyTimes of them, oldest first, packed
// big-endian (uint32, int64 ms, then int64 ms each). decide.lua reads it
// whole when a request has a tally cap that applies and writes the fields of
// an allowed send in the same call as its log entry; it deletes fields kept
// until before now when it writes, and the key expires with its longest-kept
// field. A user whose sends match no tally cap has no tally and pays nothing.
const tallySuffix = ":tally"

// TallyDedupe is how long the log keeps at least a send a tally counted,
// whatever its other caps' windows: a redelivery of the job within it is
// its duplicate, not counted again.
const TallyDedupe = 24 * time.Hour

// TallyKey returns the Redis key of a user's tally.
func (l *Limiter) TallyKey(s Space, userID uint32) string { return l.Key(s, userID) + tallySuffix }

// TallyField is the field of c's count in a user's tally: a digest of its
// scope (its campaign's too) and its window, so that the caps of one scope
// and window share a count whatever their names, segments and limits.
func (c Cap) TallyField() uint64 { return c.tallyField() }

// TallyCount is one field of a user's tally.
type TallyCount struct {
	Field uint64
	Count int       // sends counted
	Keep  time.Time // until when the field is kept
	Times []time.Time
}

// Tally returns a user's tally, sorted by field.
func (l *Limiter) Tally(ctx context.Context, s Space, userID uint32) ([]TallyCount, error) {
	pipe := l.client.Pipeline()
	cmd := pipe.HGetAll(ctx, l.TallyKey(s, userID))
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, fmt.Errorf("capping: tally of user %d: %w", userID, err)
	}
	m := cmd.Val()
	out := make([]TallyCount, 0, len(m))
	for f, v := range m {
		if len(f) != 8 || len(v) < 12 || (len(v)-12)%8 != 0 {
			return nil, fmt.Errorf("capping: tally field %x = %x is not one capper wrote", f, v)
		}
		c := TallyCount{Field: binary.BigEndian.Uint64([]byte(f)), Count: int(be32(v, 0)), Keep: time.UnixMilli(int64(be64(v, 4)))}
		for p := 12; p < len(v); p += 8 {
			c.Times = append(c.Times, time.UnixMilli(int64(be64(v, p))))
		}
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b TallyCount) int { return cmpUint(a.Field, b.Field) })
	return out, nil
}

func cmpUint(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
