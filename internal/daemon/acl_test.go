package daemon

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/capper-dev/capper/budget"
	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/collapse"
	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/testenv"
	"github.com/capper-dev/capper/skew"
)

// TestRedisACLCoversEveryCommand runs every Redis command path of the worker
// as the secured stack's user capper, whose rules are exactly docs/security.md's ACL
// line: script loading, decisions that record, age entries out and wait for
// a replica, the EVAL fallback after the script cache was flushed, lifetime
// caps counted through the near cache and in a tally key, and budgets taken, peeked at and given back, collapse keys kept and read,
// the clock skew measured (TIME). Any command the line lacks fails
// with NOPERM.
func TestRedisACLCoversEveryCommand(t *testing.T) {
	sec := testenv.SecureStack(t)
	ctx := context.Background()
	var logged bytes.Buffer // go-redis's own lines (it reports a denied COMMAND only there)
	NewLogger("debug", &logged)
	defer NewLogger("info", io.Discard)
	rdb, err := newRedis(config.Redis{Addrs: sec.Redis, Username: "capper", Password: config.Secret(sec.Secret(t, "redis-capper")),
		TLS: config.TLS{Enabled: true, CAFile: sec.Path("tls/ca.crt")}, DialTimeout: config.Duration(time.Second),
		ReadTimeout: config.Duration(time.Second), WriteTimeout: config.Duration(time.Second)}, &roundTrips{})
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	prefix := "fc:" + testenv.Unique("acl")
	lim, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: prefix, MinReplicasAcked: 1, ReplicaTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	caps := []capping.Cap{{Name: "second", Limit: 1, Window: 500 * time.Millisecond}}
	decide := func(job string, wantAllowed bool) {
		t.Helper()
		ds, err := lim.Decide(ctx, []capping.Request{{UserID: 7, JobID: job, Channel: "email", Caps: caps, Retention: 500 * time.Millisecond}})
		if err != nil {
			t.Fatalf("decide %s as capper: %v", job, err)
		}
		if ds[0].Allowed != wantAllowed {
			t.Fatalf("decide %s: allowed %v, want %v", job, ds[0].Allowed, wantAllowed)
		}
	}
	decide("j1", true)
	decide("j2", false)
	time.Sleep(600 * time.Millisecond) // j1 ages out: the next write drops it
	decide("j3", true)
	// Nodes that lost the function library (restarted without persistence)
	// and the script cache: "Function not found", then FUNCTION LOAD as
	// capper; the budgets' scripts (below): NOSCRIPT, then EVAL.
	tc, err := tlsConfig(config.TLS{Enabled: true, CAFile: sec.Path("tls/ca.crt")}, "redis.tls")
	if err != nil {
		t.Fatal(err)
	}
	admin := redis.NewClusterClient(&redis.ClusterOptions{Addrs: sec.Redis, Username: "admin", Password: sec.Secret(t, "redis-admin"), TLSConfig: tc})
	defer admin.Close()
	if err := admin.ForEachShard(ctx, func(ctx context.Context, c *redis.Client) error { return c.ScriptFlush(ctx).Err() }); err != nil {
		t.Fatal(err)
	}
	if err := admin.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return c.FunctionFlush(ctx).Err() }); err != nil {
		t.Fatal(err)
	}
	time.Sleep(600 * time.Millisecond)
	decide("j4", true)

	// Lifetime caps through the near cache: a new log (SET NX), then patches
	// of its copy: a new scope's item appended, a scope's item counted in
	// place (SETRANGE).
	life, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: prefix, NearCache: 100})
	if err != nil {
		t.Fatal(err)
	}
	for i, campaign := range []string{"a", "b", "a"} {
		once := capping.Cap{Name: "twice-ever", Limit: 2, Tally: true, Keep: time.Now().Add(400 * 24 * time.Hour), Scope: capping.Scope{}.Campaign(campaign)}
		ds, err := life.Decide(ctx, []capping.Request{{UserID: 12, JobID: fmt.Sprint("life-", i), Channel: "email", Campaign: campaign, Caps: []capping.Cap{once}}})
		if err != nil || !ds[0].Allowed {
			t.Fatalf("a send with a lifetime cap as capper: %+v %v", ds, err)
		}
	}
	if s := life.Stats(); s.CopyAppends != 2 {
		t.Fatalf("%d sends with a lifetime cap patched the near cache's copy, want 2 (%+v)", s.CopyAppends, s)
	}
	// A user's tally past a log's few items: moved to its tally key (SET PX), a new scope's item appended
	// there (APPEND), a scope's counted in place (SETRANGE, PEXPIRE).
	for i := range 19 {
		campaign := fmt.Sprint("c", i%18)
		once := capping.Cap{Name: "twice-ever", Limit: 2, Tally: true, Keep: time.Now().Add(400 * 24 * time.Hour), Scope: capping.Scope{}.Campaign(campaign)}
		ds, err := life.Decide(ctx, []capping.Request{{UserID: 13, JobID: fmt.Sprint("many-", i), Channel: "email", Campaign: campaign, Caps: []capping.Cap{once}}})
		if err != nil || !ds[0].Allowed {
			t.Fatalf("send %d with a lifetime cap as capper: %+v %v", i, ds, err)
		}
	}
	tally, err := capping.ReadTally(ctx, rdb, life.Key(0, 13))
	sum := 0
	for _, c := range tally {
		sum += c.Count
	}
	if err != nil || len(tally) != 18 || sum != 19 {
		t.Fatalf("the tally of 18 campaigns as capper: %+v %v, want 18 counts of 19 sends", tally, err)
	}

	arb, at := arbitrateAs(t, ctx, rdb, prefix) // HSET, PEXPIRE, HGET, HGETALL, HDEL; arb's clock stays at

	// Feedback gives a failed send back (GET, then DEL: the log is empty); an
	// external send is recorded at its time.
	if found, err := arb.Forget(ctx, 0, 8, "cand"); err != nil || !found {
		t.Fatalf("forget a recorded send as capper: %v %v", found, err)
	}
	// A log an older capper kept as a sorted set: read (ZRANGE) and written
	// back as a string by a decision; a send forgotten from one (ZREM).
	for _, u := range []uint32{10, 11} {
		if err := admin.ZAdd(ctx, lim.Key(0, u), redis.Z{Score: float64(at.Add(-time.Minute).UnixMilli()), Member: capping.Member("old", "email", "", nil)}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if ds, err := arb.Decide(ctx, []capping.Request{{UserID: 10, JobID: "after-old", Channel: "email", Caps: caps[:1]}}); err != nil || ds[0].Counts[0] != 0 {
		t.Fatalf("a send over a sorted-set log as capper: %+v %v", ds, err)
	}
	if found, err := arb.Forget(ctx, 0, 11, "old"); err != nil || !found {
		t.Fatalf("forget from a sorted-set log as capper: %v %v", found, err)
	}
	if _, err := arb.Decide(ctx, []capping.Request{{UserID: 9, JobID: "external:e1", Channel: "email", Retention: time.Hour, SentAt: at.Add(-time.Minute)}}); err != nil {
		t.Fatalf("record an external send as capper: %v", err)
	}

	b, err := budget.New(budget.Config{Client: rdb, KeyPrefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	for _, spread := range []bool{true, false} { // spread keeps its pace in a second key
		spec := &budget.Spec{Name: "acl", Limit: 3, Window: time.Second, Spread: spread}
		key := fmt.Sprint("acl-", spread)
		gs, err := b.Take(ctx, []budget.Want{{Spec: spec, Key: key}, {Spec: spec, Key: key}})
		if err != nil || !gs[0].OK {
			t.Fatalf("budget take as capper (spread %v): %v %v", spread, gs, err)
		}
	}
	// A token of a send capped after all, put back while the budget refuses
	// sends: to Redis as a spare token (HGET, HINCRBY, HSET, PTTL, PEXPIRE),
	// taken by the next new send (HGET, HDEL).
	back := &budget.Spec{Name: "acl", Limit: 2, Window: time.Minute, Spread: true}
	want := budget.Want{Spec: back, Key: "acl-back"}
	gs, err := b.Take(ctx, []budget.Want{want, want, want}) // 2 granted, 1 refused: short
	if err != nil || !gs[0].OK || gs[2].OK {
		t.Fatalf("budget take as capper: %v %v, want 2 of 3 granted", gs, err)
	}
	b.PutBack(ctx, want, gs[0].Until, 1)
	if u, err := b.Peek(ctx, want); err != nil || u.Used != 1 {
		t.Fatalf("budget put back as capper: %d tokens counted after one of 2 was put back (%v), want 1", u.Used, err)
	}
	if gs, err := b.Take(ctx, []budget.Want{want}); err != nil || !gs[0].OK {
		t.Fatalf("budget spare token taken as capper: %v %v", gs, err)
	}
	// Named wants (a held job's promise kept by job): refused and promised
	// (ZADD), asked again by a copy (ZSCORE), claimed (ZADD, ZREM), lapsed
	// ones dropped (ZREMRANGEBYSCORE).
	short := &budget.Spec{Name: "acl", Limit: 1, Window: 100 * time.Millisecond}
	named := func(job string, promised time.Time) budget.Grant {
		t.Helper()
		gs, err := b.Take(ctx, []budget.Want{{Spec: short, Key: "acl-named", Job: job, Promised: promised}})
		if err != nil {
			t.Fatalf("budget take of a named want as capper: %v", err)
		}
		return gs[0]
	}
	named("first", time.Time{})
	held := named("held", time.Time{})
	if held.OK || named("held", time.Time{}).RetryAt != held.RetryAt {
		t.Fatalf("a named want refused, then its copy: want both told the same time (%+v)", held)
	}
	time.Sleep(time.Until(held.RetryAt) + time.Millisecond) // its token comes back
	if g := named("held", held.RetryAt); !g.OK {
		t.Fatalf("a named claim as capper: %+v", g)
	}
	spec := &budget.Spec{Name: "acl", Limit: 3, Window: time.Second}
	if _, err := b.Peek(ctx, budget.Want{Spec: spec, Key: "acl"}); err != nil {
		t.Fatalf("budget peek as capper: %v", err)
	}
	if err := b.Close(ctx); err != nil {
		t.Fatalf("budget give-back as capper: %v", err)
	}
	// Collapse keys, durable: registered (HGET, HSET, PEXPIRE; HLEN, and
	// HGETALL and HDEL once a user has many), a send recorded, and read
	// back as capper check does (HGETALL, PTTL).
	reg, err := collapse.New(collapse.Config{Client: rdb, MinReplicasAcked: 1, ReplicaTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	user := lim.Key(0, 12)
	var sends []collapse.Send
	for i := range 70 {
		sends = append(sends, collapse.Send{User: user, Key: fmt.Sprint("k", i), Job: "j", Since: at, Window: time.Minute, Retain: time.Hour})
	}
	if _, err := reg.Check(ctx, sends, at); err != nil {
		t.Fatalf("collapse keys as capper: %v", err)
	}
	later := collapse.Send{User: user, Key: "later", Job: "l", Since: at.Add(2 * time.Hour), Window: time.Minute, Retain: time.Hour}
	if _, err := reg.Check(ctx, []collapse.Send{later}, later.Since); err != nil {
		t.Fatalf("collapse keys pruned as capper: %v", err)
	}
	if err := reg.Sent(ctx, []collapse.Send{later}, []time.Time{later.Since}, later.Since); err != nil {
		t.Fatalf("a collapse key's send recorded as capper: %v", err)
	}
	if keys, err := reg.Keys(ctx, user); err != nil || len(keys) != 1 {
		t.Fatalf("collapse keys read as capper: %d keys, %v", len(keys), err)
	}
	m, err := skew.New(skew.Config{Client: rdb})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Check(ctx); err != nil {
		t.Fatalf("clock skew as capper: %v", err)
	}
	if strings.Contains(logged.String(), "NOPERM") {
		t.Errorf("the redis client was denied a command:\n%s", logged.String())
	}
	readme, err := os.ReadFile("../../docs/security.md")
	if err != nil {
		t.Fatal(err)
	}
	if line := "ACL SETUSER capper on >PASSWORD " + sec.RedisACL; !strings.Contains(string(readme), line) {
		t.Errorf("docs/security.md does not print the ACL line this test ran with:\n%s", line)
	}
}

// arbitrateAs runs an arbitration of the last slot through rdb: a candidate
// is registered (HSET, PEXPIRE), and at its window's end resolved (HGET,
// HGETALL, HDEL). It returns the Limiter it decided with and its clock's
// reading, which stays.
func arbitrateAs(t *testing.T, ctx context.Context, rdb capping.Client, prefix string) (*capping.Limiter, time.Time) {
	t.Helper()
	at := time.Now()
	arb, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: prefix, Clock: func() time.Time { return at }})
	if err != nil {
		t.Fatal(err)
	}
	req := capping.Request{UserID: 8, JobID: "cand", Channel: "email", Caps: []capping.Cap{{Name: "one", Limit: 1, Window: time.Hour, Arbitrated: true}},
		Arbitration: time.Second, Priority: 5}
	if ds, err := arb.Decide(ctx, []capping.Request{req}); err != nil || !ds[0].Candidate {
		t.Fatalf("an arbitration candidate as capper: %+v %v", ds, err)
	}
	at, req.Candidate = at.Add(time.Second), true
	if ds, err := arb.Decide(ctx, []capping.Request{req}); err != nil || !ds[0].Allowed {
		t.Fatalf("the candidate back at its window's end, as capper: %+v %v", ds, err)
	}
	return arb, at
}
