package capping

import (
	"context"
	_ "embed"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/cespare/xxhash/v2"
	"github.com/redis/go-redis/v9"
)

//go:embed forget.lua
var forgetSource string

var forgetScript = redis.NewScript(forgetSource)

// Forget removes the logged send of job jobID from user's log, so the slot it
// used comes back at once (its delivery failed). found is false when the job
// is not in the log (capper never recorded it, or it aged out). It drops the
// near cache's copy of the user's log; other processes' copies stay (their
// answers err on the side of capping, see DropCached).
func (l *Limiter) Forget(ctx context.Context, s Space, userID uint32, jobID string) (found bool, err error) {
	sc, ok := l.client.(redis.Scripter)
	if l.cluster != nil {
		sc, ok = l.cluster, true
	}
	if !ok {
		return false, errors.New("capping: the Redis client cannot run scripts")
	}
	if l.cfg.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, l.cfg.Timeout)
		defer cancel()
	}
	var d [8]byte
	binary.BigEndian.PutUint64(d[:], xxhash.Sum64String(jobID))
	n, err := forgetScript.Run(ctx, sc, []string{l.Key(s, userID)}, string(d[:])).Int()
	l.DropCached(s, userID)
	if err != nil {
		return false, fmt.Errorf("capping: forget job %q of user %d: %w", jobID, userID, err)
	}
	return n > 0, nil
}

// DropCached drops the near cache's copy of user's log: call it when the log
// lost an entry elsewhere (another process's Forget).
func (l *Limiter) DropCached(s Space, userID uint32) {
	if l.cache != nil {
		l.cache.drop(who(s, userID))
	}
}

// HoldCopies drops the near cache's copy of user's log and keeps none until
// ReleaseCopies: call it when another process is about to change the log or
// the user's preferences (an event read that the replica owning its
// partition will apply). Dropping once is not enough: a decision between the
// drop and the change would read the log from before and install a copy
// that answers "capped" after. Holds of one user add up.
func (l *Limiter) HoldCopies(s Space, userID uint32) {
	if l.cache != nil {
		l.cache.hold(who(s, userID))
	}
}

// ReleaseCopies ends a hold of each of users, once their changes are in
// Redis (the event's group committed past it). A copy installed afterwards
// by a decision that began before is dropped.
func (l *Limiter) ReleaseCopies(s Space, users []uint32) {
	if l.cache != nil && len(users) > 0 {
		whos := make([]uint64, len(users))
		for i, u := range users {
			whos[i] = who(s, u)
		}
		l.cache.release(whos)
	}
}
