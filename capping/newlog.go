package capping

import (
	"encoding/binary"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// New logs. A send to a user who has no log (no key: nothing sent, refused or
// recorded within the retention) passes every cap whose limit is 1 or more:
// every count is 0. decide.lua would read nothing and write the log whole
// (SET PX). The Limiter writes the same bytes itself with SET NX PX, which
// Redis applies only if the key does not exist, atomically: the send is
// recorded and allowed exactly when the script would have allowed it, and a
// user who has a log (written a moment ago by another worker, or long ago)
// gets nil and is decided by the script in the next round of the same batch.
// One plain command costs a master about a tenth of what a decision costs it
// in the script (`make bench-cost`), and first sends are most of a blast's
// writes (a quarter of bench-cost's jobs). Config.ScriptOnly turns it off.
//
// A send that reads the user's preferences goes to the script instead, in
// its mode 5: the same log written with SET PX if the user has neither a log
// nor preferences (two EXISTS), or else decided in full in the same call.
//
// A request goes this way only when nothing else could change its answer:
// it records (Decide), is not a refusal, a duplicate check or an
// arbitration candidate coming back, every blocking cap
// it is decided against has a limit of 1 or more, and none at 1 is
// arbitrated (its last slot would be registered, not taken); it is its user's
// only request sent to Redis in the batch (a user's requests are decided in
// order); and this Limiter has not sent a new log of its user lately (see
// seenUsers): a user it has seen most likely has a log, and a SET NX that
// finds one costs a round trip. A user is remembered when its SET NX is
// answered (recorded, or a log found), or when an eligible send of it goes to
// the script because the user has several in the batch; one whose sends were
// never eligible is not, so its first eligible send costs one SET NX that
// finds its log.

// newLogEligible reports whether r's send, with args a, is decided the same
// by a SET NX of a new log as by the script when the user has no log.
func newLogEligible(r *Request, a *reqArgs) bool {
	if r.DuplicateOnly || r.Refused != "" || r.Candidate {
		return false
	}
	for i := range a.caps {
		c := &a.caps[i]
		if c.Shadow {
			continue
		}
		if c.Limit < 1 || (c.Limit == 1 && c.Arbitrated && r.Arbitration > 0) {
			return false
		}
	}
	return true
}

// newLog returns, for a's send recorded at a.now in a new log, the log's
// value (its header, then the entry: see decide.lua) and its TTL in ms, as
// the script's save writes them, in buf (of capacity newLogLen(a) at least).
func newLog(buf []byte, a *reqArgs) (value string, ttl int64) {
	b := buf[:8] // the header, below: the TTL is known after the tally items
	var keep int64
	if a.tally {
		b, keep = appendTally(b, a)
	}
	ttl = max(a.retention, keep-a.now) + min(a.retention/8, 3_600_000)
	binary.BigEndian.PutUint64(b, uint64(a.now+ttl))
	b = appendEntry(b, a.now, a.member)
	return unsafe.String(unsafe.SliceData(b), len(b)), ttl
}

// newLogLen is the length of newLog's value for a.
func newLogLen(a *reqArgs) int {
	n := 8 + 10 + len(a.member)
	if a.tally {
		n += tallyLenOf(a)
	}
	return n
}

// seenUsers remembers, approximately, the users a Limiter sent a SET NX of a
// new log for lately, so that their next sends go to the script directly: one
// bit per hash of a user id, in two generations of seenBits bits (1 MiB
// each). Once seenFill bits are set in the current one, the older is cleared
// and becomes current. A user it wrongly reports seen (another user's bit, or
// a log that expired since) only goes to the script; one it wrongly reports
// unseen costs a SET NX that finds its log. Safe for concurrent use.
type seenUsers struct {
	mu   sync.Mutex // held to switch generations
	gens [2][]atomic.Uint64
	cur  atomic.Int32
	set  atomic.Int64 // bits set in the current generation
}

const (
	seenBits = 1 << 23
	seenFill = seenBits / 4 // a false "seen" for at most ~1 in 4 new users
)

func newSeenUsers() *seenUsers {
	s := &seenUsers{}
	for i := range s.gens {
		s.gens[i] = make([]atomic.Uint64, seenBits/64)
	}
	return s
}

func seenBit(user uint64) (word int, bit uint64) {
	h := (user ^ user>>32*0x9E3779B1) * 0x9E3779B97F4A7C15 >> (64 - 23)
	return int(h >> 6), 1 << (h & 63)
}

// has reports whether user was added lately.
func (s *seenUsers) has(user uint64) bool {
	w, b := seenBit(user)
	return s.gens[0][w].Load()&b != 0 || s.gens[1][w].Load()&b != 0
}

// add remembers user.
func (s *seenUsers) add(user uint64) {
	w, b := seenBit(user)
	if s.gens[s.cur.Load()][w].Or(b)&b == 0 && s.set.Add(1) >= seenFill {
		s.rotate()
	}
}

func (s *seenUsers) rotate() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.set.Load() < seenFill {
		return // rotated by another add
	}
	next := 1 - s.cur.Load()
	for i := range s.gens[next] {
		s.gens[next][i].Store(0)
	}
	s.set.Store(0)
	s.cur.Store(next)
}

// markNewLogs returns, by request, those of pending that go as new logs (see
// above), or nil when none does.
func (l *Limiter) markNewLogs(reqs []Request, args []reqArgs, pending []int, sc *scratch) []bool {
	var fresh []bool
	for _, i := range pending {
		if args[i].expect == "" && newLogEligible(&reqs[i], &args[i]) && !l.seen.has(reqs[i].who()) {
			if fresh == nil {
				fresh = grow(&sc.fresh, len(reqs))
			}
			fresh[i] = true
		}
	}
	if fresh == nil || len(pending) == 1 {
		return fresh
	}
	users := sc.users // a user's requests in the batch: each but its only one goes to the script
	if users == nil {
		users = make(map[uint64]int32, len(pending))
		sc.users = users
	}
	clear(users)
	for _, i := range pending {
		users[reqs[i].who()]++
	}
	for _, i := range pending {
		if fresh[i] && users[reqs[i].who()] > 1 {
			fresh[i] = false
			l.seen.add(reqs[i].who()) // the script writes its log now: its next sends go there directly
		}
	}
	return fresh
}

// newLogDecision is the decision of request i, recorded as the new log log:
// allowed at its time, every count 0, and, with the near cache, the log's
// entries (the send alone) for its copy, kept whole (see install).
func (b *batch) newLogDecision(i int, now time.Time, log string) (Decision, string, error) {
	a := &b.args[i]
	var buf [3 + maxCaps]int64
	ints := buf[:0]
	if 3+len(a.caps) > len(buf) {
		ints = make([]int64, 0, 3+len(a.caps))
	}
	ints = ints[:3+len(a.caps)]
	ints[0], ints[2] = statusAllowed, a.now // recorded at a.now
	d, err := decisionOf(ints, a.caps, a.member, now, a.counts, a.labels)
	if err != nil || b.maxLog == 0 {
		return d, "", err
	}
	return d, log[8:], nil // the value without its header: the cache keeps it whole (see install)
}
