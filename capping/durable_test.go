package capping_test

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestDurableDecisionsSurviveMasterCrash reproduces the loss of recorded sends
// in a failover, deterministically: the replica of the user's master is cut
// off (SIGSTOP, and the master drops its replication link), two sends are
// decided on the master, the master is crashed with SIGKILL and the stale
// replica is promoted. Without MinReplicasAcked both sends are answered
// allowed, are lost with the master, and two more pass on the promoted
// replica: 4 sends reach a user whose cap is 2. With MinReplicasAcked = 1
// the first two are never answered allowed (their WAIT falls short); retried
// after the failover they are decided again, and exactly 2 sends pass.
func TestDurableDecisionsSurviveMasterCrash(t *testing.T) {
	for _, tc := range []struct {
		name    string
		acked   int
		forward int // sends the user receives
	}{
		{"async replication loses sends", 0, 4},
		{"min_replicas_acked=1 keeps the cap", 1, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(t), ReadTimeout: 300 * time.Millisecond, DialTimeout: 300 * time.Millisecond, DialerRetries: 1})
			t.Cleanup(func() { rdb.Close() })
			lim, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: testenv.Unique("dur"), Timeout: time.Second, MinReplicasAcked: tc.acked, ReplicaTimeout: 200 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			const user = 42
			caps := []capping.Cap{{Name: "daily", Window: capping.Daily, Limit: 2}}
			req := func(id string) capping.Request {
				return capping.Request{UserID: user, JobID: id, Channel: "email", Caps: caps}
			}
			master, err := rdb.MasterForKey(ctx, lim.Key(0, user))
			if err != nil {
				t.Fatal(err)
			}
			maddr := master.Options().Addr
			raddr := testenv.ReplicaOf(t, maddr)
			rpid := testenv.RedisPID(t, raddr)

			// Cut the replica off: stopped, so it cannot reconnect, and the
			// master drops the link, so nothing more reaches its socket.
			if err := syscall.Kill(rpid, syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			resumed := false
			resume := func() {
				if !resumed {
					resumed = true
					_ = syscall.Kill(rpid, syscall.SIGCONT)
				}
			}
			t.Cleanup(resume)
			mc := redis.NewClient(&redis.Options{Addr: maddr})
			defer mc.Close()
			if err := mc.Do(ctx, "CLIENT", "KILL", "TYPE", "replica").Err(); err != nil {
				t.Fatalf("drop the replication link of %s: %v", maddr, err)
			}

			forwarded := map[string]bool{}
			first := []capping.Request{req("j1"), req("j2")}
			ds, err := lim.Decide(ctx, first)
			var re capping.RequestErrors
			if err != nil && !errors.As(err, &re) {
				t.Fatal(err)
			}
			for i, r := range first {
				switch {
				case re != nil && re[i] != nil:
					if !errors.Is(re[i], capping.ErrNotReplicated) {
						t.Errorf("%s: %v, want ErrNotReplicated", r.JobID, re[i])
					}
				case ds[i].Allowed:
					forwarded[r.JobID] = true
				}
			}
			if tc.acked == 0 && len(forwarded) != 2 {
				t.Fatalf("without durability %d of j1, j2 allowed before the crash, want 2 (%v)", len(forwarded), err)
			}
			if tc.acked > 0 && len(forwarded) != 0 {
				t.Fatalf("with min_replicas_acked %d, %v answered allowed while no replica acknowledged", tc.acked, forwarded)
			}

			crashed := time.Now()
			restart := testenv.KillRedis(t, maddr)
			resume()
			promoted := testenv.WaitMaster(t, raddr, 30*time.Second)
			t.Logf("master %s killed; replica %s promoted %v later", maddr, raddr, promoted.Sub(crashed).Round(10*time.Millisecond))
			restart() // the old master rejoins as the new master's replica, so WAIT can succeed again

			// The scheduler still holds j1, j2 if they were not answered; then j3, j4 come.
			var next []capping.Request
			for _, r := range first {
				if !forwarded[r.JobID] {
					next = append(next, r)
				}
			}
			next = append(next, req("j3"), req("j4"))
			after, _ := decideAll(t, lim, next, 30*time.Second)
			for i, d := range after {
				if d.Allowed {
					forwarded[next[i].JobID] = true
				}
			}
			if len(forwarded) != tc.forward {
				t.Errorf("user received %d sends %v with a cap of 2, want %d", len(forwarded), forwarded, tc.forward)
			}
			logged := testenv.LogLen(t, rdb, lim.Key(0, user))
			t.Logf("forwarded %d sends, %d in the promoted master's log", len(forwarded), logged)
			if tc.acked > 0 && int(logged) != len(forwarded) {
				t.Errorf("%d sends logged, %d forwarded: a forwarded send is missing from the log", logged, len(forwarded))
			}
			testenv.WaitClusterOK(t, rdb)
		})
	}
}

// TestReplicaWaitCostsNoDecision checks that durability changes no decision on
// a healthy cluster: the same sends get the same answers with and without it.
func TestReplicaWaitCostsNoDecision(t *testing.T) {
	rdb := testenv.ClusterClient(t)
	ctx := context.Background()
	caps := []capping.Cap{{Window: capping.Daily, Limit: 3}, {Window: capping.Daily, Limit: 1, Scope: capping.NewScope([]string{"push"}, nil)}}
	var got [2][]bool
	for k, acked := range []int{0, 1} {
		lim, err := capping.New(ctx, rdb, capping.Config{KeyPrefix: testenv.Unique("w"), MinReplicasAcked: acked})
		if err != nil {
			t.Fatal(err)
		}
		var reqs []capping.Request
		for i := 0; i < 300; i++ {
			ch := "email"
			if i%4 == 0 {
				ch = "push"
			}
			reqs = append(reqs, capping.Request{UserID: uint32(i % 50), JobID: fmt.Sprint("j", i%250), Channel: ch, Caps: caps})
		}
		ds, err := lim.Decide(ctx, reqs)
		if err != nil {
			t.Fatalf("min_replicas_acked %d: %v", acked, err)
		}
		for _, d := range ds {
			got[k] = append(got[k], d.Allowed)
		}
	}
	for i := range got[0] {
		if got[0][i] != got[1][i] {
			t.Fatalf("request %d: allowed %v without WAIT, %v with", i, got[0][i], got[1][i])
		}
	}
}
