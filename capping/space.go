package capping

// Key spaces: the users of one workspace, under a key prefix of their own.

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// Space is a key space: the keys of one workspace's users. The same user id
// in two spaces is two users, with two logs, two sets of preferences and two
// near cache copies (the cache's key is the space and the id, Request.who).
// Space 0 is Config.KeyPrefix's; AddSpace adds others.
type Space uint16

// AddSpace returns the Space whose users' logs are PREFIX:{USER_ID}, adding
// it if it is new. Spaces are never removed: a process that stops using one
// keeps its index, and its near cache's copies age out.
func (l *Limiter) AddSpace(prefix string) (Space, error) {
	if prefix == "" || strings.ContainsAny(prefix, "{}") {
		return 0, fmt.Errorf("capping: key prefix %q must not be empty nor contain { or }: the hash tag is the user id", prefix)
	}
	l.spaceMu.Lock()
	defer l.spaceMu.Unlock()
	var old []string
	if p := l.spaces.Load(); p != nil {
		old = *p
	}
	for i, p := range old {
		if p == prefix {
			return Space(i), nil
		}
	}
	if len(old) > 1<<16-1 {
		return 0, fmt.Errorf("capping: key space %q: there are already %d", prefix, len(old))
	}
	spaces := append(old[:len(old):len(old)], prefix)
	l.spaces.Store(&spaces)
	return Space(len(old)), nil
}

// prefix returns s's key prefix; an unknown space's is Space 0's (its
// requests fail validation: see round.pending).
func (l *Limiter) prefix(s Space) string {
	spaces := *l.spaces.Load()
	if int(s) < len(spaces) {
		return spaces[s]
	}
	return spaces[0]
}

// who is the near cache's key of user userID of space s (Request.who).
func who(s Space, userID uint32) uint64 { return uint64(s)<<32 | uint64(userID) }

// SpacePattern is the SCAN pattern of every key of space s's users: their
// logs, preferences and arbitration candidates.
func (l *Limiter) SpacePattern(s Space) string { return EscapeGlob(l.prefix(s)) + ":{*" }

// EscapeGlob escapes what a SCAN pattern would read as a wildcard in s.
func EscapeGlob(s string) string {
	return strings.NewReplacer(`\`, `\\`, "*", `\*`, "?", `\?`, "[", `\[`, "]", `\]`).Replace(s)
}

// ScanKeys counts the keys that match pattern on every master (on the node,
// without a cluster) and, with del, unlinks them. Keys written meanwhile may
// be missed or counted.
func (l *Limiter) ScanKeys(ctx context.Context, pattern string, del bool) (int, error) {
	if l.cluster != nil {
		var total atomic.Int64 // masters are scanned concurrently
		err := l.cluster.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			n, err := scanNode(ctx, c, pattern, del)
			total.Add(int64(n))
			return err
		})
		return int(total.Load()), err
	}
	c, ok := l.client.(*redis.Client)
	if !ok {
		return 0, fmt.Errorf("capping: cannot scan keys with a %T", l.client)
	}
	return scanNode(ctx, c, pattern, del)
}

func scanNode(ctx context.Context, c *redis.Client, pattern string, del bool) (int, error) {
	n := 0
	iter := c.Scan(ctx, 0, pattern, 1000).Iterator()
	var page []string
	flush := func() error {
		if del && len(page) > 0 {
			pipe := c.Pipeline()
			for _, k := range page {
				pipe.Unlink(ctx, k) // one key per command: a page's keys are in many slots
			}
			if _, err := pipe.Exec(ctx); err != nil {
				return err
			}
		}
		n += len(page)
		page = page[:0]
		return nil
	}
	for iter.Next(ctx) {
		if page = append(page, iter.Val()); len(page) == 1000 {
			if err := flush(); err != nil {
				return n, err
			}
		}
	}
	if err := iter.Err(); err != nil {
		return n, err
	}
	return n, flush()
}
