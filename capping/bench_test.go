package capping_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testenv"
)

// benchCaps has the default caps' shape (a daily and a weekly all-channel cap)
// with limits high enough that every decision takes the write path (evict,
// count, record, expire): the costlier branch of the script.
var benchCaps = []capping.Cap{
	{Name: "daily", Window: capping.Daily, Limit: 1 << 30},
	{Name: "weekly", Window: capping.Weekly, Limit: 1 << 30},
}

const benchUsers = 1_000_000

// BenchmarkDecide decides batches of 1, 64 and 512 requests for random users
// against the local Redis Cluster, one batch in flight per core (RunParallel),
// and at batch 512 with 1, 2 and 4 concurrent pipelines per batch, and with 4
// pipelines and durable decisions (a WAIT for one replica after each node's
// pipeline): compare the last two for the cost of min_replicas_acked.
// scripts/bench-capping.sh runs it beside redis-benchmark's EVALSHA of the same script.
func BenchmarkDecide(b *testing.B) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(b)})
	defer rdb.Close()
	prefix := testenv.Unique("bench")
	defer deletePrefix(b, rdb, prefix)
	var seq atomic.Int64
	for _, bc := range []struct{ size, pipelines, acked int }{{1, 1, 0}, {64, 1, 0}, {512, 1, 0}, {512, 2, 0}, {512, 4, 0}, {512, 4, 1}} {
		lim, err := capping.New(context.Background(), rdb, capping.Config{KeyPrefix: prefix, Pipelines: bc.pipelines, MinReplicasAcked: bc.acked})
		if err != nil {
			b.Fatal(err)
		}
		size := bc.size
		name := fmt.Sprintf("batch=%d/pipelines=%d", size, bc.pipelines)
		if bc.acked > 0 {
			name += fmt.Sprintf("/min_replicas_acked=%d", bc.acked)
		}
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				rng := rand.New(rand.NewPCG(uint64(seq.Add(1)), 7))
				reqs := make([]capping.Request, size)
				ctx := context.Background()
				for pb.Next() {
					for i := range reqs {
						reqs[i] = capping.Request{UserID: uint32(rng.IntN(benchUsers)), JobID: fmt.Sprint("j", seq.Add(1)), Channel: "email", Caps: benchCaps}
					}
					if _, err := lim.Decide(ctx, reqs); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.ReportMetric(float64(b.N*size)/b.Elapsed().Seconds(), "decisions/s")
		})
	}
}

// BenchmarkMemoryPerUser fills users' weekly logs and reports MEMORY USAGE of
// the key: bytes/user and bytes/send of a full log of 10 sends, and the mean
// over logs of 1 to 10 sends (where a log's length falls against Redis's
// doubling decides its room to grow):
//   - week: under the default caps (3 a day, 10 a week), 10 sends spread over
//     7 days, 16 h apart: each write is a whole SET (the key's TTL is due
//     again), so the string has its exact size;
//   - burst: 10 sends a minute apart (caps of 10 a day and 10 a week): each
//     send after the first is an APPEND, and Redis grows a string it must
//     reallocate to twice its length, so the log carries room to grow.
func BenchmarkMemoryPerUser(b *testing.B) {
	for _, bc := range []struct {
		name  string
		every time.Duration
		daily int
	}{{"week", 16 * time.Hour, 3}, {"burst", time.Minute, 10}} {
		b.Run(bc.name, func(b *testing.B) {
			rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(b)})
			defer rdb.Close()
			ctx := context.Background()
			now := time.Now()
			clk := func() time.Time { return now }
			prefix := testenv.Unique("mem")
			lim, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: prefix, Clock: clk})
			if err != nil {
				b.Fatal(err)
			}
			defer deletePrefix(b, rdb, prefix)
			caps := []capping.Cap{{Name: "daily", Window: capping.Daily, Limit: bc.daily}, {Name: "weekly", Window: capping.Weekly, Limit: 10}}
			var bytes, sum int64 // the full log's; all logs' of 1 to 10 sends
			for n := 0; n < b.N; n++ {
				sum = 0
				for k := 1; k <= 10; k++ {
					user := uint32(4_000_000_000 - 10*n - k) // a 10-digit id: the longest key
					start := time.Now().Add(-7 * 24 * time.Hour)
					for i := 0; i < k; i++ {
						now = start.Add(time.Duration(i)*bc.every + time.Minute)
						// What the worker records: the campaign and the category (a tag).
						d, err := lim.Decide(ctx, []capping.Request{{UserID: user, JobID: fmt.Sprintf("campaign-2026-11-%02d:user-%d:email", i, user), Channel: "email",
							Campaign: fmt.Sprintf("campaign-2026-11-%02d", i), Tags: []string{"marketing"}, Caps: caps}})
						if err != nil || !d[0].Allowed {
							b.Fatalf("send %d: %+v %v", i, d, err)
						}
					}
					if c := testenv.LogLen(b, rdb, lim.Key(0, user)); c != k {
						b.Fatalf("log holds %d sends, want %d", c, k)
					}
					bytes = rdb.MemoryUsage(ctx, lim.Key(0, user)).Val()
					sum += bytes
				}
			}
			b.ReportMetric(float64(bytes), "bytes/user")
			b.ReportMetric(float64(sum)/10, "bytes/log-of-1-to-10")
			b.ReportMetric(float64(bytes)/10, "bytes/send")
		})
	}
}

func deletePrefix(tb testing.TB, rdb *redis.ClusterClient, prefix string) {
	ctx := context.Background()
	_ = rdb.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		it := c.Scan(ctx, 0, prefix+":*", 1000).Iterator()
		var keys []string
		for it.Next(ctx) {
			keys = append(keys, it.Val())
			if len(keys) == 500 {
				for _, k := range keys {
					c.Unlink(ctx, k)
				}
				keys = keys[:0]
			}
		}
		for _, k := range keys {
			c.Unlink(ctx, k)
		}
		return it.Err()
	})
}

// BenchmarkPriority is the cost of priority, batches of 512 for random users
// as BenchmarkDecide/batch=512/pipelines=1: unused (the plain caps), with a
// reserved slot (the script only sees a smaller limit), arbitrated caps that
// never reach their last slot (the common case: the script never reads the
// candidates), and every send competing (a daily cap of 1 arbitrated: each
// send is a candidate: the candidates are read and one is written).
// scripts/bench-priority.sh alternates them and prints the medians.
func BenchmarkPriority(b *testing.B) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(b)})
	defer rdb.Close()
	prefix := testenv.Unique("bench")
	defer deletePrefix(b, rdb, prefix)
	lim, err := capping.New(context.Background(), rdb, capping.Config{KeyPrefix: prefix, Pipelines: 1})
	if err != nil {
		b.Fatal(err)
	}
	reserved := append([]capping.Cap(nil), benchCaps...)
	reserved[0].Limit, reserved[0].Reserved = reserved[0].Limit-1, 1
	arbitrated := append([]capping.Cap(nil), benchCaps...)
	arbitrated[0].Arbitrated = true
	competing := []capping.Cap{{Name: "daily", Window: capping.Daily, Limit: 1, Arbitrated: true}, benchCaps[1]}
	var seq atomic.Int64
	for _, m := range []struct {
		name        string
		caps        []capping.Cap
		arbitration time.Duration
	}{{"unused", benchCaps, 0}, {"reserved", reserved, 0}, {"arbitrated", arbitrated, time.Minute}, {"competing", competing, time.Minute}} {
		b.Run(m.name, func(b *testing.B) {
			b.RunParallel(func(pb *testing.PB) {
				rng := rand.New(rand.NewPCG(uint64(seq.Add(1)), 11))
				reqs := make([]capping.Request, 512)
				ctx := context.Background()
				for pb.Next() {
					for i := range reqs {
						reqs[i] = capping.Request{UserID: uint32(rng.IntN(benchUsers)), JobID: fmt.Sprint("p", seq.Add(1)), Channel: "email",
							Caps: m.caps, Arbitration: m.arbitration, Priority: rng.IntN(10)}
					}
					if _, err := lim.Decide(ctx, reqs); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.ReportMetric(float64(b.N*512)/b.Elapsed().Seconds(), "decisions/s")
		})
	}
}

// BenchmarkPreferences is the cost of reading users' own preferences in the
// decision, batches of 512 for 100,000 random users: off (not read), none
// (read; no user has any), every user (each has a limit of its email and an
// opt-out of a tag, neither refusing: the script parses both every time).
// scripts/bench-modes.sh alternates them and prints the medians.
func BenchmarkPreferences(b *testing.B) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(b)})
	defer rdb.Close()
	const users = 100_000
	ctx := context.Background()
	var seq atomic.Int64
	for _, m := range []struct {
		name       string
		read, have bool
	}{{"off", false, false}, {"none", true, false}, {"every_user", true, true}} {
		prefix := testenv.Unique("bench")
		lim, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: prefix, Pipelines: 1})
		if err != nil {
			b.Fatal(err)
		}
		if m.have {
			var wg sync.WaitGroup
			for g := range uint32(32) {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for u := g; u < users; u += 32 {
						_ = lim.SetPreference(ctx, 0, u, capping.Preference{Channel: "email", Limit: 1 << 20, Window: capping.Daily}, false)
						_ = lim.SetPreference(ctx, 0, u, capping.Preference{Tag: "never-sent", OptOut: true}, false)
					}
				}()
			}
			wg.Wait()
		}
		b.Run(m.name, func(b *testing.B) {
			b.RunParallel(func(pb *testing.PB) {
				rng := rand.New(rand.NewPCG(uint64(seq.Add(1)), 17))
				reqs := make([]capping.Request, 512)
				for pb.Next() {
					for i := range reqs {
						reqs[i] = capping.Request{UserID: uint32(rng.IntN(users)), JobID: fmt.Sprint("q", seq.Add(1)), Channel: "email",
							Tags: []string{"marketing"}, Caps: benchCaps, Preferences: m.read}
					}
					if _, err := lim.Decide(ctx, reqs); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.ReportMetric(float64(b.N*512)/b.Elapsed().Seconds(), "decisions/s")
		})
		deletePrefix(b, rdb, prefix)
	}
}

// BenchmarkLifetime decides batches of 512 requests for random users, one
// batch in flight per core, under benchCaps (none) and under benchCaps plus a
// lifetime cap of the job's campaign on every job (lifetime: each allowed
// send also counts in the user's tally item of its campaign), 40 campaigns:
// users of 1,000,000 (most of them new: a new user's log is one SET NX) and
// of 50,000 (warm: each has a log, decided by the script; spilled: each past
// 16 tally items, which the script moved to a tally key); each with the
// Limiter's defaults (script: every decision a script call) and with the
// near cache of the worker's default size (cache: an allowed send of a user
// whose log the cache holds whole is written as an APPEND, or with a tally
// item, as a patch of the log). scripts/bench-lifetime.sh alternates them,
// and BenchmarkDecide at the commit before the tally.
//
// A warm row first sends each of its users warmSends sends of as many
// campaigns (a spilled row spillSends), untimed, so that its users start
// from that log whatever ran before. No cap ever blocks, so every allowed
// send lengthens a log: a warm row's cost per decision grows with the
// decisions taken (a log past cacheMaxLog entries and items has no copy; a
// user past 16 tally items keeps the others in a tally key). Run a warm row
// for a count of batches (-test.benchtime 300x), not a time, so that rows
// and builds compared end in the same state.
func BenchmarkLifetime(b *testing.B) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(b)})
	defer rdb.Close()
	prefix := testenv.Unique("benchlife")
	defer deletePrefix(b, rdb, prefix)
	script, err := capping.New(context.Background(), rdb, capping.Config{KeyPrefix: prefix})
	if err != nil {
		b.Fatal(err)
	}
	cached, err := capping.New(context.Background(), rdb, capping.Config{KeyPrefix: prefix + "c", NearCache: 1_000_000})
	if err != nil {
		b.Fatal(err)
	}
	defer deletePrefix(b, rdb, prefix+"c")
	var seq atomic.Int64
	for _, bc := range []struct {
		users    int
		sends    int // each user's before the row (see warm)
		lifetime bool
		lim      *capping.Limiter
	}{
		{benchUsers, 0, false, script}, {benchUsers, 0, true, script}, {50_000, warmSends, false, script}, {50_000, warmSends, true, script},
		{benchUsers, 0, false, cached}, {benchUsers, 0, true, cached}, {50_000, warmSends, false, cached}, {50_000, warmSends, true, cached},
		{50_000, spillSends, false, cached}, {50_000, spillSends, true, cached},
	} {
		lifetime, lim := bc.lifetime, bc.lim
		name := "none/"
		if lifetime {
			name = "lifetime/"
		}
		switch bc.sends {
		case 0:
			name += "cold"
		case warmSends:
			name += "warm"
		default:
			name += "spilled"
		}
		if lim == cached {
			name += "/cache"
		} else {
			name += "/script"
		}
		request := func(r *capping.Request, caps []capping.Cap, user, campaign int, keep time.Time) {
			camp := fmt.Sprint("campaign-", campaign)
			c := append(caps[:0:lifetimeCaps], benchCaps...)
			if lifetime {
				c = append(c, capping.Cap{Name: "once", Limit: 1 << 30, Tally: true, Keep: keep, Scope: capping.Scope{}.Campaign(camp)})
			}
			*r = capping.Request{UserID: uint32(user), JobID: fmt.Sprint("j", seq.Add(1)), Channel: "email", Campaign: camp, Caps: c}
		}
		warmed := bc.sends == 0 // cold rows start from no log
		b.Run(name, func(b *testing.B) {
			if !warmed { // once a row, not for each b.N
				warm(b, lim, bc.users, bc.sends, func(r *capping.Request, caps []capping.Cap, user, k int) {
					request(r, caps, user, (user+k)%benchCampaigns, time.Now().Add(400*24*time.Hour))
				})
				warmed = true
				b.ResetTimer()
			}
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				rng := rand.New(rand.NewPCG(uint64(seq.Add(1)), 7))
				reqs := make([]capping.Request, 512)
				caps := make([]capping.Cap, len(reqs)*lifetimeCaps)
				ctx := context.Background()
				for pb.Next() {
					keep := time.Now().Add(400 * 24 * time.Hour)
					for i := range reqs {
						request(&reqs[i], caps[i*lifetimeCaps:], rng.IntN(bc.users), rng.IntN(benchCampaigns), keep)
					}
					if _, err := lim.Decide(ctx, reqs); err != nil {
						b.Fatal(err)
					}
				}
			})
			b.ReportMetric(float64(b.N*512)/b.Elapsed().Seconds(), "decisions/s")
		})
	}
}

// benchCampaigns are BenchmarkLifetime's campaigns, warmSends the sends each
// user of a warm row has before it is timed (one each of warmSends of its
// campaigns), spillSends those of a spilled row: past 16 campaigns, so that
// the user's tally is in a tally key.
const (
	benchCampaigns = 40
	warmSends      = 8
	spillSends     = 24
)

// lifetimeCaps is the most caps a BenchmarkLifetime request has: benchCaps
// and its lifetime cap.
var lifetimeCaps = len(benchCaps) + 1

// warm sends each of users sends requests that fill makes (the k-th of a
// user), in batches of 512.
func warm(b *testing.B, lim *capping.Limiter, users, sends int, fill func(r *capping.Request, caps []capping.Cap, user, k int)) {
	b.Helper()
	reqs := make([]capping.Request, 0, 512)
	caps := make([]capping.Cap, cap(reqs)*lifetimeCaps)
	flush := func() {
		if _, err := lim.Decide(context.Background(), reqs); err != nil {
			b.Fatal(err)
		}
		reqs = reqs[:0]
	}
	for k := range sends {
		for u := range users {
			reqs = reqs[:len(reqs)+1]
			i := len(reqs) - 1
			fill(&reqs[i], caps[i*lifetimeCaps:], u, k)
			if len(reqs) == cap(reqs) {
				flush()
			}
		}
	}
	if len(reqs) > 0 {
		flush()
	}
}

// BenchmarkTallyMemory sends each of 1,000 users one send of each of 8
// campaigns, with a lifetime cap per campaign and without, and reports what
// the tally adds to MEMORY USAGE of their logs: bytes per scope (the 8
// scopes' items), and for a user with one scope; and for 200 users of 40
// campaigns, whose tallies are in tally keys of their own (spillAt), what
// the log's spill item and the tally key add per scope.
func BenchmarkTallyMemory(b *testing.B) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(b)})
	defer rdb.Close()
	ctx := context.Background()
	prefix := testenv.Unique("memlife")
	defer deletePrefix(b, rdb, prefix)
	lim, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: prefix})
	if err != nil {
		b.Fatal(err)
	}
	const users = 1000
	daily := capping.Cap{Name: "daily", Window: capping.Daily, Limit: 100}
	usage := func(scopes int, lifetime bool, base uint32, users uint32) float64 { // mean MEMORY USAGE of the users' logs and tally keys
		var sum int64
		for u := range users {
			user := base - u // a 10-digit id: the longest key
			keep := time.Now().Add(400 * 24 * time.Hour)
			var reqs []capping.Request
			for k := range scopes {
				campaign := fmt.Sprintf("campaign-2026-11-%02d", k)
				caps := []capping.Cap{daily}
				if lifetime {
					caps = append(caps, capping.Cap{Name: "once", Limit: 1, Tally: true, Keep: keep, Scope: capping.Scope{}.Campaign(campaign)})
				}
				reqs = append(reqs, capping.Request{UserID: user, JobID: fmt.Sprintf("%s:user-%d:email", campaign, user), Channel: "email", Campaign: campaign,
					Tags: []string{"marketing"}, Caps: caps})
			}
			for _, r := range reqs { // one at a time, as a user's sends come
				if d, err := lim.Decide(ctx, []capping.Request{r}); err != nil || !d[0].Allowed {
					b.Fatalf("%+v %v", d, err)
				}
			}
			sum += rdb.MemoryUsage(ctx, lim.Key(0, user)).Val() + rdb.MemoryUsage(ctx, lim.Key(0, user)+":t").Val()
		}
		return float64(sum) / float64(users)
	}
	var one, eight, forty float64
	for n := range b.N {
		base := uint32(4_000_000_000 - n*5*users)
		eight = (usage(8, true, base, users) - usage(8, false, base-users, users)) / 8
		one = usage(1, true, base-2*users, users) - usage(1, false, base-3*users, users)
		forty = (usage(40, true, base-4*users, users/5) - usage(40, false, base-4*users-users/5, users/5)) / 40
	}
	b.ReportMetric(eight, "bytes/scope")
	b.ReportMetric(one, "bytes/user-of-1-scope")
	b.ReportMetric(forty, "bytes/scope-of-40")
}

// BenchmarkManyScopes measures what a user's many tally scopes cost the
// decisions of that user: each of 256 users is first sent one send of each of
// S campaigns under a lifetime cap per campaign (S tally items in their logs;
// those sends 30 days old, out of the caps' windows), then sends of random
// campaigns are decided for them with benchCaps only (none: the sends match
// no tally cap) and with a lifetime cap of their campaign (lifetime; kept 400
// days from the batch's time, as a rule's retain keeps it), every decision a
// script call and with the near cache. Each row adds its sends to
// the same 256 logs, so run it with a fixed count (-benchtime 100x) and
// compare a row with the same row of scopes=0.
func BenchmarkManyScopes(b *testing.B) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(b)})
	defer rdb.Close()
	ctx := context.Background()
	const users = 256
	once := func(campaign string) capping.Cap {
		return capping.Cap{Name: "once", Limit: 1 << 30, Tally: true, Keep: time.Now().Add(400 * 24 * time.Hour), Scope: capping.Scope{}.Campaign(campaign)}
	}
	var seq atomic.Int64
	for _, scopes := range []int{0, 60, 200, 500} {
		b.Run(fmt.Sprintf("scopes=%d", scopes), func(b *testing.B) {
			prefix := testenv.Unique("benchscopes")
			defer deletePrefix(b, rdb, prefix)
			past, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: prefix, Clock: func() time.Time { return time.Now().Add(-30 * 24 * time.Hour) }})
			if err != nil {
				b.Fatal(err)
			}
			reqs := make([]capping.Request, users)
			for k := range scopes { // one batch per campaign: each user's sends in campaign order
				campaign := fmt.Sprint("old-", k)
				for u := range reqs {
					reqs[u] = capping.Request{UserID: uint32(u), JobID: fmt.Sprint("old", k, "-", u), Channel: "email", Campaign: campaign,
						Caps: append([]capping.Cap{once(campaign)}, benchCaps...)}
				}
				if _, err := past.Decide(ctx, reqs); err != nil {
					b.Fatal(err)
				}
			}
			script, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: prefix})
			if err != nil {
				b.Fatal(err)
			}
			cached, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: prefix, NearCache: 100_000})
			if err != nil {
				b.Fatal(err)
			}
			for _, row := range []struct {
				name     string
				lifetime bool
				lim      *capping.Limiter
			}{{"none/script", false, script}, {"lifetime/script", true, script}, {"none/cache", false, cached}, {"lifetime/cache", true, cached}} {
				b.Run(row.name, func(b *testing.B) {
					b.RunParallel(func(pb *testing.PB) {
						rng := rand.New(rand.NewPCG(uint64(seq.Add(1)), 11))
						reqs := make([]capping.Request, 64)
						for pb.Next() {
							for i := range reqs {
								campaign := fmt.Sprint("new-", rng.IntN(40))
								caps := benchCaps
								if row.lifetime {
									caps = append([]capping.Cap{once(campaign)}, benchCaps...)
								}
								reqs[i] = capping.Request{UserID: uint32(rng.IntN(users)), JobID: fmt.Sprint("j", seq.Add(1)), Channel: "email", Campaign: campaign, Caps: caps}
							}
							if _, err := row.lim.Decide(ctx, reqs); err != nil {
								b.Fatal(err)
							}
						}
					})
					b.ReportMetric(float64(b.N*64)/b.Elapsed().Seconds(), "decisions/s")
				})
			}
		})
	}
}

// BenchmarkBacklog decides a backlog as the worker does, one batch of 2,000
// at a time with the near cache on: users of 4 sends each, in random order
// (each chunk of 100,000 users new), on three channels and 40 campaigns,
// under caps of the example's shape (a daily cap of 2 that a user's third
// and fourth sends find full, so the near cache answers them, a weekly, a
// per-channel and a per-campaign one). One op is a batch. Beside
// decisions/s it reports what the benchmark's process spent per decision
// (user and system CPU: the worker's side of the Limiter, its garbage
// collection included; Redis runs apart) and the allocations of its Decide
// calls per decision, which compare builds where the wall clock, shared with
// Redis on a busy machine, does not. Run it for a count of batches
// (-test.benchtime 300x) so that the builds compared decide the same sends.
func BenchmarkBacklog(b *testing.B) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(b), Protocol: 2}) // RESP2, as the worker's
	defer rdb.Close()
	prefix := testenv.Unique("benchlog")
	defer deletePrefix(b, rdb, prefix)
	lim, err := capping.New(context.Background(), rdb, capping.Config{KeyPrefix: prefix, NearCache: 1_000_000})
	if err != nil {
		b.Fatal(err)
	}
	const (
		batchSize = 2000
		chunk     = 100_000 // users of one shuffled chunk of sends
		perUser   = 4
	)
	channels := []string{"email", "push", "sms"}
	pushDaily := capping.NewScope([]string{"push"}, nil)
	pushSMS := capping.NewScope([]string{"push", "sms"}, nil)
	base := []capping.Cap{
		{Name: "daily", Window: capping.Daily, Limit: 2},
		{Name: "weekly", Window: capping.Weekly, Limit: 7},
		{Name: "push-daily", Window: capping.Daily, Limit: 1, Scope: pushDaily},
	}
	perCampaign := make([][]capping.Cap, benchCampaigns) // the same slices for every send of a campaign, as a rules version's plans
	for k := range perCampaign {
		perCampaign[k] = append(append([]capping.Cap(nil), base...),
			capping.Cap{Name: "campaign-weekly", Window: capping.Weekly, Limit: 1, Scope: pushSMS.Campaign(fmt.Sprint("campaign-", k))})
	}
	rng := rand.New(rand.NewPCG(42, 7))
	var sends []capping.Request
	next, users := 0, 0
	refill := func() {
		sends = sends[:0]
		for u := range chunk {
			for range perUser {
				k := rng.IntN(benchCampaigns)
				sends = append(sends, capping.Request{UserID: uint32(users + u + 1), JobID: fmt.Sprint("j", len(sends), "-", users), Channel: channels[rng.IntN(len(channels))],
					Campaign: fmt.Sprint("campaign-", k), Caps: perCampaign[k]})
			}
		}
		rng.Shuffle(len(sends), func(i, j int) { sends[i], sends[j] = sends[j], sends[i] })
		users += chunk
		next = 0
	}
	ctx := context.Background()
	var cpu time.Duration
	var decided, capped int
	var mallocs uint64 // in the Limiter's calls alone: not the requests' making
	var ms runtime.MemStats
	b.ResetTimer()
	for range b.N {
		if next+batchSize > len(sends) {
			b.StopTimer()
			refill()
			b.StartTimer()
		}
		reqs := sends[next : next+batchSize]
		next += batchSize
		runtime.ReadMemStats(&ms)
		before, m0 := processCPU(b), ms.Mallocs
		ds, err := lim.Decide(ctx, reqs)
		cpu += processCPU(b) - before
		runtime.ReadMemStats(&ms)
		mallocs += ms.Mallocs - m0
		if err != nil {
			b.Fatal(err)
		}
		for _, d := range ds {
			if !d.Allowed {
				capped++
			}
		}
		decided += len(reqs)
	}
	b.StopTimer() // before the keys are deleted
	b.ReportMetric(float64(decided)/b.Elapsed().Seconds(), "decisions/s")
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(decided), "cpu-ns/decision")
	b.ReportMetric(float64(capped)/float64(decided), "capped/decision")
	b.ReportMetric(float64(mallocs)/float64(decided), "allocs/decision")
}

// processCPU is the user and system CPU the process has used.
func processCPU(tb testing.TB) time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
