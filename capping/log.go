package capping

import (
	"context"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// LogEntry is one item of a user's log as decide.lua keeps it.
type LogEntry struct {
	Member string // the send's member (see Member); a mark's is its length byte, the member, the refusal's name
	At     int64  // ms the send was recorded at; a mark of a refused send: minus the refusal's time and keep
}

// ReadLog returns the log at key (see Limiter.Key), marks first, then the
// sends oldest first (its tally items apart, see ReadTally): what an operator or a test inspects. It reads the
// string decide.lua keeps (an 8-byte header, then entries packed as score
// int64, member length uint16, member, big-endian) and the sorted set an
// older capper kept.
func ReadLog(ctx context.Context, c redis.Cmdable, key string) ([]LogEntry, error) {
	v, err := c.Get(ctx, key).Result()
	switch {
	case errors.Is(err, redis.Nil):
		return nil, nil
	case err != nil && redis.HasErrorPrefix(err, "WRONGTYPE"):
		zs, err := c.ZRangeWithScores(ctx, key, 0, -1).Result()
		if err != nil {
			return nil, fmt.Errorf("capping: read log %s: %w", key, err)
		}
		out := make([]LogEntry, len(zs))
		for i, z := range zs {
			out[i] = LogEntry{Member: z.Member.(string), At: int64(z.Score)}
		}
		return out, nil
	case err != nil:
		return nil, fmt.Errorf("capping: read log %s: %w", key, err)
	}
	if v == "" {
		return nil, nil
	}
	if len(v) < 8 {
		return nil, fmt.Errorf("capping: read log %s: %d bytes, shorter than its header", key, len(v))
	}
	var out []LogEntry
	for p := 8; p < len(v); { // after the header: until when the key's TTL was set (see decide.lua)
		m, at, next, ok := nextEntry(v, p)
		if !ok {
			return nil, fmt.Errorf("capping: read log %s: truncated at byte %d of %d", key, p, len(v))
		}
		if at != 0 { // a tally item is no send (see ReadTally)
			out = append(out, LogEntry{Member: m, At: at})
		}
		p = next
	}
	return out, nil
}

// LogLen returns how many items (sends and marks) the log at key holds.
func LogLen(ctx context.Context, c redis.Cmdable, key string) (int, error) {
	l, err := ReadLog(ctx, c, key)
	return len(l), err
}
