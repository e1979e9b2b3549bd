package main_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestLifetimeCapThroughKillAndFailover: "once per user per campaign, ever"
// as a lifetime cap, under a burst to two workers, one SIGKILLed and
// restarted mid-run, and the Redis master of some of the users killed
// (SIGKILL) and replaced by its replica (min_replicas_acked: 1). 600 users
// get each of 4 campaigns 3 times. Every job ends in one final topic;
// each user gets exactly one send per campaign (none lost to a redelivery,
// none over); every other copy is capped by the lifetime cap for good (no
// retry-at); a count-only receipt of a campaign counts toward its cap; and
// each user's tally holds one send per campaign, kept until the campaign's
// end where its jobs say it (retain_until: campaign_end), else 400 days.
// Users 600..699 got 13 other campaigns first: their tallies move to their
// tally keys as the 4 campaigns come, and are counted there through the kill
// and the failover.
func TestLifetimeCapThroughKillAndFailover(t *testing.T) {
	s := testenv.NewStack(t, 6, nil)
	s.EditConfig("default_caps: [{name: daily, window: 24h, limit: 2}]",
		"default_caps: [{name: daily, window: 24h, limit: 20}, {name: once, window: lifetime, limit: 1, per_campaign: true, retain_until: campaign_end}]\n  count_only_categories: [receipt]")
	s.EditConfig("decide_timeout: 1s", "decide_timeout: 1s\n  min_replicas_acked: 1\n  replica_timeout: 300ms")
	s.DefaultCap = 17 // the report's check: at most one send per campaign, 4 campaigns and 13 others (below)
	const users, campaigns, copies = 600, 4, 3
	const others, spilled = 13, 600 // users from spilled on got 13 other campaigns first: 17 scopes
	// Campaign w3 ends in 30 days (its jobs say so): its counts are kept until then; the others' 400 days.
	ends := time.Now().Add(30 * 24 * time.Hour).Truncate(time.Millisecond)
	var jobs []testenv.JobSpec
	for c := 0; c < copies; c++ {
		for k := 0; k < campaigns; k++ {
			for u := uint32(100); u < 100+users; u++ {
				j := testenv.JobSpec{ID: fmt.Sprintf("life-%d-%d-%d", u, k, c), User: u, Channel: "email", Campaign: fmt.Sprintf("w%d", k)}
				if k == 3 {
					j.CampaignEndsAt = ends
				}
				jobs = append(jobs, j)
			}
		}
	}
	// First, users 100..149 got a receipt of campaign w0 (count-only, it takes w0's one send), and users from
	// spilled on 13 other campaigns.
	var receipts []testenv.JobSpec
	for u := uint32(100); u < 150; u++ {
		receipts = append(receipts, testenv.JobSpec{ID: fmt.Sprintf("receipt-%d", u), User: u, Channel: "email", Campaign: "w0", Category: "receipt"})
	}
	for u := uint32(spilled); u < 100+users; u++ {
		for k := range others {
			receipts = append(receipts, testenv.JobSpec{ID: fmt.Sprintf("other-%d-%d", u, k), User: u, Channel: "email", Campaign: fmt.Sprintf("x%d", k)})
		}
	}
	s.Produce(receipts)
	w1, w2 := start(s, true), start(s, true)
	w1.waitReady(t)
	w2.waitReady(t)
	master := s.MasterOf(100)
	replica := testenv.ReplicaOf(t, master)
	const chunks = 24
	per := len(jobs) / chunks
	for c := 0; c < chunks; c++ {
		s.Produce(jobs[c*per : (c+1)*per])
		switch c {
		case 6:
			w2.kill(t)
			start(s, false)
		case 14:
			restart := testenv.KillRedis(t, master)
			testenv.WaitMaster(t, replica, 30*time.Second)
			go restart() // the promoted master needs it back as its replica (min_replicas_acked)
		}
	}
	all := append(receipts, jobs...)
	outs := s.CollectJobs(all, 180*time.Second)
	s.CheckAccounting(all, outs, false)
	t.Logf("%d outputs for %d jobs, %d redelivered jobs recognised as duplicates", len(outs), len(all), testenv.CountDecision(outs, "duplicate"))

	type pair struct {
		user     uint32
		campaign string
	}
	campaignOf := map[string]string{}
	for _, j := range all {
		campaignOf[j.ID] = j.Campaign
	}
	sent := map[pair]map[string]bool{}
	for _, o := range outs {
		p := pair{o.User, campaignOf[o.JobID]}
		switch o.Decision {
		case "allowed", "duplicate":
			if sent[p] == nil {
				sent[p] = map[string]bool{}
			}
			sent[p][o.JobID] = true
		case "capped":
			if o.Cap != "once" || !o.RetryAt.IsZero() {
				t.Errorf("job %s capped by %q, retry-at %v: want the lifetime cap once, for good", o.JobID, o.Cap, o.RetryAt)
			}
		default:
			t.Errorf("job %s: decision %q", o.JobID, o.Decision)
		}
	}
	for u := uint32(100); u < 100+users; u++ {
		names := []string{"w0", "w1", "w2", "w3"}
		for k := 0; u >= spilled && k < others; k++ {
			names = append(names, fmt.Sprintf("x%d", k))
		}
		for k, campaign := range names {
			p := pair{u, campaign}
			if len(sent[p]) != 1 {
				t.Errorf("user %d, campaign %s: %d distinct jobs sent, want exactly 1 (%v)", u, p.campaign, len(sent[p]), sent[p])
			}
			if u < 150 && k == 0 && !sent[p][fmt.Sprintf("receipt-%d", u)] {
				t.Errorf("user %d: the receipt of w0 was not its one send (%v)", u, sent[p])
			}
		}
	}
	rdb := s.RedisClient()
	for u := uint32(100); u < 100+users; u++ {
		tally, err := capping.ReadTally(context.Background(), rdb, fmt.Sprintf("%s:{%d}", s.Prefix, u))
		if err != nil {
			t.Fatal(err)
		}
		want, inKey := campaigns, int64(0)
		if u >= spilled {
			want, inKey = campaigns+others, 1
		}
		if len(tally) != want {
			t.Errorf("user %d: a tally of %d items, want one per campaign (%d)", u, len(tally), want)
			continue
		}
		if n := rdb.Exists(context.Background(), fmt.Sprintf("%s:{%d}:t", s.Prefix, u)).Val(); n != inKey {
			t.Errorf("user %d: %d tally keys, want %d (a tally of %d scopes)", u, n, inKey, want)
		}
		kept := 0
		for _, c := range tally {
			if c.Count != 1 {
				t.Errorf("user %d: tally item %x counts %d sends, want 1", u, c.Field, c.Count)
			}
			if c.Keep.Equal(ends) {
				kept++
			} else if until := time.Until(c.Keep); until < 399*24*time.Hour {
				t.Errorf("user %d: tally item %x kept for %v, want 400 days", u, c.Field, until)
			}
		}
		if kept != 1 {
			t.Errorf("user %d: %d tally items kept until w3's end, want 1", u, kept)
		}
	}
}
