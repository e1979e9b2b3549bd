package capping_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testclock"
	"github.com/capper-dev/capper/internal/testenv"
)

// decideAll decides reqs, retrying the requests that failed (as the consumer
// does) until all are decided or the deadline passes.
func decideAll(t *testing.T, lim *capping.Limiter, reqs []capping.Request, deadline time.Duration) ([]capping.Decision, int) {
	t.Helper()
	out := make([]capping.Decision, len(reqs))
	idx := make([]int, len(reqs))
	for i := range idx {
		idx[i] = i
	}
	retries := 0
	end := time.Now().Add(deadline)
	for len(idx) > 0 {
		batch := make([]capping.Request, len(idx))
		for j, i := range idx {
			batch[j] = reqs[i]
		}
		ds, err := lim.Decide(context.Background(), batch)
		var re capping.RequestErrors
		if err != nil && !errors.As(err, &re) {
			t.Fatalf("decide: %v", err)
		}
		var next []int
		for j, i := range idx {
			if re != nil && re[j] != nil {
				next = append(next, i)
				continue
			}
			out[i] = ds[j]
		}
		if len(next) > 0 {
			retries++
			if time.Now().After(end) {
				t.Fatalf("%d requests still failing after %v: %v", len(next), deadline, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
		idx = next
	}
	return out, retries
}

// TestConcurrentDecisionsNeverOverSend runs many goroutines deciding batches
// for the same users at once and checks the logs directly afterwards.
func TestConcurrentDecisionsNeverOverSend(t *testing.T) {
	e := newEnv(t)
	const users, workers, batches, perBatch, limit = 40, 8, 10, 64, 5
	caps := []capping.Cap{{Name: "daily", Window: capping.Daily, Limit: limit}, {Name: "push", Window: capping.Daily, Limit: 2, Scope: capping.NewScope([]string{"push"}, nil)}}
	var allowed [users]atomic.Int64
	var pushAllowed [users]atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for b := 0; b < batches; b++ {
				reqs := make([]capping.Request, perBatch)
				for i := range reqs {
					ch := "email"
					if (i+b+w)%3 == 0 {
						ch = "push"
					}
					reqs[i] = capping.Request{UserID: uint32(i % users), JobID: fmt.Sprintf("w%d-b%d-%d", w, b, i), Channel: ch, Caps: caps}
				}
				ds, err := e.lim.Decide(context.Background(), reqs)
				if err != nil {
					t.Errorf("decide: %v", err)
					return
				}
				for i, d := range ds {
					if d.Allowed {
						allowed[reqs[i].UserID].Add(1)
						if reqs[i].Channel == "push" {
							pushAllowed[reqs[i].UserID].Add(1)
						}
					}
				}
			}
		}(w)
	}
	wg.Wait()
	for u := 0; u < users; u++ {
		n := testenv.LogLen(t, e.rdb, e.lim.Key(0, uint32(u)))
		if n != limit || allowed[u].Load() != limit {
			t.Errorf("user %d: %d logged, %d allowed; want exactly %d of each", u, n, allowed[u].Load(), limit)
		}
		if p := pushAllowed[u].Load(); p > 2 {
			t.Errorf("user %d: %d push sends allowed, cap is 2", u, p)
		}
	}
}

// TestNodeErrorFailsOnlyItsUsers pauses one master: the users it owns fail,
// the others are decided; once it is back, the retried requests are answered
// without counting anything twice.
func TestNodeErrorFailsOnlyItsUsers(t *testing.T) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(t), ReadTimeout: 300 * time.Millisecond, MaxRedirects: 1})
	t.Cleanup(func() { rdb.Close() })
	clk := testclock.At(base)
	lim, err := capping.New(context.Background(), rdb, capping.Config{KeyPrefix: testenv.Unique("t"), Clock: clk.Now, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	caps := []capping.Cap{{Window: capping.Daily, Limit: 1}}
	var reqs []capping.Request
	owner := map[uint32]string{}
	for u := uint32(0); u < 30; u++ {
		reqs = append(reqs, capping.Request{UserID: u, JobID: fmt.Sprint("j", u), Channel: "email", Caps: caps})
		m, err := rdb.MasterForKey(ctx, lim.Key(0, u))
		if err != nil {
			t.Fatal(err)
		}
		owner[u] = m.Options().Addr
	}
	paused := owner[0]
	pc := redis.NewClient(&redis.Options{Addr: paused})
	defer pc.Close()
	if err := pc.Do(ctx, "CLIENT", "PAUSE", "2500", "ALL").Err(); err != nil {
		t.Fatal(err)
	}
	ds, err := lim.Decide(ctx, reqs)
	var re capping.RequestErrors
	if !errors.As(err, &re) {
		t.Fatalf("err = %v, want RequestErrors for the paused node's users", err)
	}
	for i, r := range reqs {
		onPaused := owner[r.UserID] == paused
		if onPaused != (re[i] != nil) {
			t.Errorf("user %d on %s (paused %s): err %v", r.UserID, owner[r.UserID], paused, re[i])
		}
		if !onPaused && !ds[i].Allowed {
			t.Errorf("user %d: %+v, want allowed", r.UserID, ds[i])
		}
	}
	pc.Do(ctx, "CLIENT", "UNPAUSE")
	again, _ := decideAll(t, lim, reqs, 10*time.Second)
	for i, d := range again {
		if !d.Allowed || !d.Duplicate && re[i] == nil {
			t.Errorf("retry of user %d: %+v, want allowed (a duplicate where the first try got through)", reqs[i].UserID, d)
		}
		if n := testenv.LogLen(t, rdb, lim.Key(0, reqs[i].UserID)); n != 1 {
			t.Errorf("user %d: %d logged, want 1", reqs[i].UserID, n)
		}
	}
}

// TestFunctionFlushMidRun flushes the function library of every master (and
// so of its replicas) while batches are being decided, and before every
// fourth: the limiter loads it again where a call answers "Function not
// found", and no request is lost.
func TestFunctionFlushMidRun(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	caps := []capping.Cap{{Window: capping.Daily, Limit: 3}}
	flush := func(ctx context.Context, c *redis.Client) error { return c.FunctionFlush(ctx).Err() }
	stop := make(chan struct{})
	var flushes atomic.Int64
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(5 * time.Millisecond):
			}
			_ = e.rdb.ForEachMaster(ctx, flush)
			flushes.Add(1)
		}
	}()
	total := 0
	for b := 0; b < 40; b++ {
		if b%4 == 3 {
			if err := e.rdb.ForEachMaster(ctx, flush); err != nil {
				t.Fatal(err)
			}
		}
		reqs := make([]capping.Request, 100)
		for i := range reqs {
			reqs[i] = capping.Request{UserID: uint32(i), JobID: fmt.Sprintf("b%d-%d", b, i), Channel: "email", Caps: caps}
		}
		ds, err := e.lim.Decide(ctx, reqs)
		if err != nil {
			close(stop)
			t.Fatalf("batch %d after %d flushes: %v", b, flushes.Load(), err)
		}
		for _, d := range ds {
			if d.Allowed {
				total++
			}
		}
	}
	close(stop)
	if flushes.Load() == 0 {
		t.Fatal("no FUNCTION FLUSH happened during the run")
	}
	if total != 300 {
		t.Fatalf("%d sends allowed for 100 users with a limit of 3, want 300", total)
	}
	if e.lim.Stats().FunctionLoads == 0 {
		t.Fatal("the library was never loaded again")
	}
}

// TestFunctionLoadedAgain flushes every master's functions between two
// batches of users on every node: the second batch is decided in full, as if
// nothing happened, each master that answered "Function not found" got the
// library loaded again (FunctionLoads), and a master keeps it.
func TestFunctionLoadedAgain(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	caps := []capping.Cap{{Window: capping.Daily, Limit: 1}}
	batch := func(b int) []capping.Decision {
		reqs := make([]capping.Request, 300)
		for i := range reqs {
			reqs[i] = capping.Request{UserID: uint32(i), JobID: fmt.Sprintf("l%d-%d", b, i), Channel: "email", Caps: caps}
		}
		ds, err := e.lim.Decide(ctx, reqs)
		if err != nil {
			t.Fatalf("batch %d: %v", b, err)
		}
		return ds
	}
	for i, d := range batch(0) {
		if !d.Allowed {
			t.Fatalf("user %d's first send: %+v, want allowed", i, d)
		}
	}
	if err := e.rdb.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		return c.FunctionFlush(ctx).Err()
	}); err != nil {
		t.Fatal(err)
	}
	before := e.lim.Stats().FunctionLoads
	for i, d := range batch(1) {
		if d.Allowed || d.Counts[0] != 1 {
			t.Fatalf("user %d's second send after the flush: %+v, want capped at 1", i, d)
		}
	}
	// Every master had users of the batch; another test's limiter may have
	// loaded the library on some first, so at least one load is this one's.
	if loads := e.lim.Stats().FunctionLoads - before; loads < 1 || loads > 3 {
		t.Fatalf("%d loads of the library after a flush of the masters, want 1 to 3", loads)
	}
	if err := e.rdb.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
		libs, err := c.FunctionList(ctx, redis.FunctionListQuery{LibraryNamePattern: "capper_*"}).Result()
		if err != nil {
			return err
		}
		for _, l := range libs {
			for _, f := range l.Functions {
				if strings.HasPrefix(f.Name, "capper_decide_") && slices.Contains(f.Flags, "allow-cross-slot-keys") {
					return nil
				}
			}
		}
		return fmt.Errorf("%s: no capper_decide_ function with allow-cross-slot-keys in %+v", c.Options().Addr, libs)
	}); err != nil {
		t.Fatal(err)
	}
}

// TestEvalFallbackDecidesAsTheFunction sends the same requests of two users
// as capper's FCALL and as the EVAL of the script's body that Decide falls
// back to: the replies are the same, byte for byte, send after send (a
// first, a second, a third over the limit of 2, a duplicate).
func TestEvalFallbackDecidesAsTheFunction(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	caps := []capping.Cap{{Name: "daily", Window: capping.Daily, Limit: 2}}
	at := time.Now()
	for i, job := range []string{"a", "b", "c", "b"} {
		var replies [2]any
		for k, user := range []uint32{1, 2} {
			call, err := capping.ScriptCall([]string{e.lim.Key(0, user)},
				[]capping.Request{{UserID: user, JobID: job, Channel: "email", Caps: caps, Retention: 48 * time.Hour}}, at.Add(time.Duration(i)*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			if call[0] != "fcall" {
				t.Fatalf("capper's call starts %v, want fcall", call[:2])
			}
			if k == 1 {
				call = capping.EvalOf(call)
			}
			if replies[k], err = e.rdb.Do(ctx, call...).Result(); err != nil {
				t.Fatalf("send %d (%s) as %v: %v", i, job, call[0], err)
			}
		}
		if fmt.Sprint(replies[0]) != fmt.Sprint(replies[1]) {
			t.Errorf("send %d (%s): FCALL answered %q, EVAL %q", i, job, replies[0], replies[1])
		}
	}
	for _, user := range []uint32{1, 2} {
		if n := testenv.LogLen(t, e.rdb, e.lim.Key(0, user)); n != 2 {
			t.Errorf("user %d: %d sends logged, want 2", user, n)
		}
	}
}

// TestFailoverMidRun promotes a replica with CLUSTER FAILOVER while batches are
// decided: redirects are followed, the promoted node has the function library
// (replicated, never loaded again), and every request is decided exactly once.
func TestFailoverMidRun(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	var replica *redis.Client
	var mu sync.Mutex
	_ = e.rdb.ForEachSlave(ctx, func(ctx context.Context, c *redis.Client) error {
		mu.Lock()
		defer mu.Unlock()
		if replica == nil {
			replica = redis.NewClient(&redis.Options{Addr: c.Options().Addr})
		}
		return nil
	})
	if replica == nil {
		t.Fatal("the cluster has no replica")
	}
	defer replica.Close()
	caps := []capping.Cap{{Window: capping.Daily, Limit: 3}}
	const users = 200
	failedOver := false
	retries := 0
	for b := 0; b < 30; b++ {
		if b == 5 {
			if err := replica.Do(ctx, "CLUSTER", "FAILOVER").Err(); err != nil {
				t.Fatalf("CLUSTER FAILOVER on %s: %v", replica.Options().Addr, err)
			}
			failedOver = true
		}
		reqs := make([]capping.Request, users)
		for i := range reqs {
			reqs[i] = capping.Request{UserID: uint32(i), JobID: fmt.Sprintf("f%d-%d", b, i), Channel: "email", Caps: caps}
		}
		_, r := decideAll(t, e.lim, reqs, 20*time.Second)
		retries += r
		time.Sleep(20 * time.Millisecond)
	}
	if !failedOver {
		t.Fatal("no failover happened")
	}
	role := replica.Do(ctx, "ROLE").Val()
	if arr, ok := role.([]any); !ok || len(arr) == 0 || arr[0] != "master" {
		t.Logf("replica %s has role %v after the run (failover may not have completed)", replica.Options().Addr, role)
	}
	for u := 0; u < users; u++ {
		if n := testenv.LogLen(t, e.rdb, e.lim.Key(0, uint32(u))); n != 3 {
			t.Errorf("user %d: %d logged, want 3", u, n)
		}
	}
	// The promoted replica had the function library by replication: no
	// call answered "Function not found".
	if n := e.lim.Stats().FunctionLoads; n != 0 {
		t.Errorf("%d loads of the function library after the failover, want 0 (the replica had it)", n)
	}
	t.Logf("failover of %s: %d retried rounds", replica.Options().Addr, retries)
	testenv.WaitClusterOK(t, e.rdb)
}
