package budget_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	. "github.com/capper-dev/capper/budget"
	"github.com/capper-dev/capper/internal/testenv"
)

// BenchmarkHotKey: one budget key that never binds, tokens taken one job at
// a time by 8 goroutines (a process's workers), with leasing and without
// (NoLease: exactly the tokens asked for, one call per take). Reports Redis
// calls per 1,000 tokens.
func BenchmarkHotKey(b *testing.B) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(b)})
	defer rdb.Close()
	for _, noLease := range []bool{false, true} {
		b.Run(fmt.Sprintf("lease=%v", !noLease), func(b *testing.B) {
			bs, err := New(Config{Client: rdb, KeyPrefix: testenv.Unique("bb"), NoLease: noLease})
			if err != nil {
				b.Fatal(err)
			}
			spec := &Spec{Name: "hot", Limit: 1_000_000_000, Window: time.Second}
			want := []Want{{Spec: spec, Key: "hot"}}
			var wg sync.WaitGroup
			per := b.N/8 + 1
			b.ResetTimer()
			for g := 0; g < 8; g++ {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := 0; i < per; i++ {
						if _, err := bs.Take(context.Background(), want); err != nil {
							b.Error(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			b.ReportMetric(1000*Calls(bs, "hot")/float64(8*per), "calls/1000tokens")
		})
	}
}

// BenchmarkMemoryPerDay: Redis memory of a 1,000,000-per-24h budget, full,
// as 10 bucket counters, against a sliding log of the same sends (one sorted
// set entry of an 8-byte id per send). At most 3 rounds whatever -benchtime says.
func BenchmarkMemoryPerDay(b *testing.B) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(b)})
	defer rdb.Close()
	ctx := context.Background()
	for i := 0; i < min(b.N, 3); i++ { // a million-entry set per round: a few rounds are plenty
		at := time.UnixMilli(1_800_000_000_000)
		clk := func() time.Time { return at }
		bs, err := New(Config{Client: rdb, KeyPrefix: testenv.Unique("bm"), Clock: clk})
		if err != nil {
			b.Fatal(err)
		}
		spec := &Spec{Name: "day", Limit: 1_000_000, Window: 24 * time.Hour}
		wants := make([]Want, 10_000)
		for j := range wants {
			wants[j] = Want{Spec: spec, Key: "day"}
		}
		for j := 0; j < 100; j++ { // 10,000 tokens every 14.4 minutes: every bucket gets some
			if _, err := bs.Take(ctx, wants); err != nil {
				b.Fatal(err)
			}
			at = at.Add(864 * time.Second)
		}
		buckets := rdb.MemoryUsage(ctx, bs.RedisKey("day")).Val()
		log := testenv.Unique("bm-log") + ":{x}"
		for j := 0; j < 1_000_000; j += 10_000 {
			zs := make([]redis.Z, 10_000)
			for k := range zs {
				var id [8]byte
				binary.BigEndian.PutUint64(id[:], uint64(j+k))
				zs[k] = redis.Z{Score: float64(1_800_000_000_000 + j + k), Member: string(id[:])}
			}
			rdb.ZAdd(ctx, log, zs...)
		}
		sliding := rdb.MemoryUsage(ctx, log).Val()
		rdb.Del(ctx, log, bs.RedisKey("day"))
		b.ReportMetric(float64(buckets), "bucket-bytes")
		b.ReportMetric(float64(sliding), "sliding-log-bytes")
	}
}
