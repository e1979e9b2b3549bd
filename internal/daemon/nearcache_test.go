package daemon

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestAFullNearCacheIsSaid: a near cache too small for the users it sees
// drops copies to make room, and the worker says so in a warning that names
// how many it dropped and the size to raise; a look that finds none dropped
// since the last says nothing.
func TestAFullNearCacheIsSaid(t *testing.T) {
	ctx := context.Background()
	const size = 16 // one copy a shard
	lim, err := capping.New(ctx, testenv.ClusterClient(t), capping.Config{KeyPrefix: testenv.Unique("nearfull"), NearCache: size})
	if err != nil {
		t.Fatal(err)
	}
	log := &testenv.LogBuffer{}
	d := &Daemon{Backends: &Backends{Limiter: lim, Log: slog.New(slog.NewJSONHandler(log, nil))}}
	caps := []capping.Cap{{Name: "daily", Window: 2 * time.Second, Limit: 1}} // the keys expire with the test
	// decide sends one job for each of users from..to-1; each new log leaves
	// a copy in the cache, in the shard of its user.
	decide := func(from, to int) {
		t.Helper()
		var reqs []capping.Request
		for u := from; u < to; u++ {
			reqs = append(reqs, capping.Request{UserID: uint32(u), JobID: fmt.Sprint("j", u), Channel: "email", Caps: caps})
		}
		if _, err := lim.Decide(ctx, reqs); err != nil {
			t.Fatal(err)
		}
	}
	// said returns the copies dropped that each warning logged so far names.
	said := func() (dropped []uint64) {
		t.Helper()
		sc := bufio.NewScanner(strings.NewReader(log.String()))
		for sc.Scan() {
			var l struct {
				Level, Msg    string
				Dropped       uint64
				Within        string
				NearCacheSize int `json:"near_cache_size"`
			}
			if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
				t.Fatalf("log line %q: %v", sc.Text(), err)
			}
			if l.Level != "WARN" || !strings.Contains(l.Msg, "near cache is full") || !strings.Contains(l.Msg, "redis.near_cache_size") ||
				l.NearCacheSize != size || l.Within != "1m0s" {
				t.Fatalf("log line %q: want a warning of the near cache, its size and the copies dropped within a minute", sc.Text())
			}
			dropped = append(dropped, l.Dropped)
		}
		return dropped
	}

	decide(0, 1)
	last := d.sayNearCacheFull(0, size, time.Minute)
	if got := said(); len(got) != 0 || last != 0 {
		t.Fatalf("one user's copy: warnings %v, %d dropped; want none", got, last)
	}
	decide(1, 400) // 400 users in 16 shards of one copy
	last = d.sayNearCacheFull(last, size, time.Minute)
	if got := said(); len(got) != 1 || got[0] == 0 || got[0] != last || last != lim.Stats().CacheEvictions {
		t.Fatalf("400 users: warnings of %v copies dropped, the cache %d (%+v); want one of them all", got, last, lim.Stats())
	}
	if d.sayNearCacheFull(last, size, time.Minute); len(said()) != 1 {
		t.Fatalf("a look after no copy was dropped: warnings of %v copies dropped, want no new one", said())
	}
}
