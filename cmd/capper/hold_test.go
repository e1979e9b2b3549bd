package main_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/testenv"
)

// holdRules: users in no segment may get 2 sends in any 3 s and are held
// up to 30 s; "new" users (1, 2) 1 in 60 s, held at most 5 s (so beyond
// max_hold); "active" users (3, 4) none (never); the "dormant" user (5) drops.
// promo and digest sends are quiet from a few seconds ago until quietEnd (UTC);
// digest drops instead of holding.
func holdRules(quietStart, quietEnd time.Time) string {
	return fmt.Sprintf(`
rules:
  on_capped: {policy: hold, max_hold: 30s}
  segments:
    - name: new
      caps: [{name: slow, window: 60s, limit: 1, on_capped: {policy: hold, max_hold: 5s}}]
    - name: active
      caps: [{name: none, window: 60s, limit: 0}]
    - name: dormant
      on_capped: {policy: drop}
      caps: [{name: daily, window: 60s, limit: 1}]
  default_caps: [{name: burst, window: 3s, limit: 2}]
  categories:
    - {name: promo, quiet_hours: {from: "%s", to: "%s"}}
    - {name: digest, quiet_hours: {from: "%[1]s", to: "%[2]s"}, on_capped: {policy: drop}}
  exempt_categories: [transactional]
`, quietStart.UTC().Format("15:04:05"), quietEnd.UTC().Format("15:04:05"))
}

// finals indexes the final outputs (allowed, capped, dead-letter) by job id
// and fails on a job with outputs in two final topics.
func finals(t *testing.T, outs []testenv.Output) map[string]testenv.Output {
	t.Helper()
	by := map[string]testenv.Output{}
	for _, o := range outs {
		if prev, ok := by[o.JobID]; ok && prev.Topic != o.Topic {
			t.Errorf("job %s reached %s and %s", o.JobID, prev.Topic, o.Topic)
		}
		if _, ok := by[o.JobID]; !ok || o.Decision == "allowed" {
			by[o.JobID] = o
		}
	}
	return by
}

// checkReleases asserts that every released job was decided at or after its
// due time and at most maxLag after it, and returns the lags.
func checkReleases(t *testing.T, final map[string]testenv.Output, maxLag time.Duration) []time.Duration {
	t.Helper()
	var lags []time.Duration
	for id, o := range final {
		if o.HoldCount == 0 {
			continue
		}
		lag := o.DecidedAt.Sub(o.DueAt)
		switch {
		case o.DueAt.IsZero() || o.DecidedAt.IsZero():
			t.Errorf("job %s was held %d times but its output has no due or decision time", id, o.HoldCount)
		case lag < 0:
			t.Errorf("job %s released %v before its due time %s", id, -lag, o.DueAt.Format(time.RFC3339Nano))
		case lag > maxLag:
			t.Errorf("job %s released %v after its due time (at most %v)", id, lag, maxLag)
		}
		lags = append(lags, lag)
	}
	return lags
}

func TestHoldAndRelease(t *testing.T) {
	s := testenv.NewStack(t, 3, nil)
	s.EnableHold(3, "1s", "5s")
	now := time.Now()
	quietEnd := now.Add(14 * time.Second).Truncate(time.Second)
	s.EditConfig(testenv.TestRules, holdRules(now.Add(-time.Minute), quietEnd))
	w := start(s, true)
	w.waitReady(t)
	t0 := time.Now()
	var jobs []testenv.JobSpec
	for u := uint32(100); u < 110; u++ { // 5 sends each: 2 go, 3 wait for the 3 s window
		for i := 0; i < 5; i++ {
			jobs = append(jobs, testenv.JobSpec{ID: fmt.Sprintf("burst-%d-%d", u, i), User: u, Channel: "email"})
		}
	}
	jobs = append(jobs,
		testenv.JobSpec{ID: "new-0", User: 1, Channel: "email"},
		testenv.JobSpec{ID: "new-1", User: 1, Channel: "email"},    // slot in 60 s, max_hold 5 s
		testenv.JobSpec{ID: "active-0", User: 3, Channel: "email"}, // limit 0
		testenv.JobSpec{ID: "dormant-0", User: 5, Channel: "email"},
		testenv.JobSpec{ID: "dormant-1", User: 5, Channel: "email"}, // drop policy
		testenv.JobSpec{ID: "exp-0", User: 110, Channel: "email"},
		testenv.JobSpec{ID: "exp-1", User: 110, Channel: "email"},
		testenv.JobSpec{ID: "exp-2", User: 110, Channel: "email", ExpiresAt: t0.Add(1500 * time.Millisecond)}, // slot after expiry
		testenv.JobSpec{ID: "fit-0", User: 111, Channel: "email"},
		testenv.JobSpec{ID: "fit-1", User: 111, Channel: "email"},
		testenv.JobSpec{ID: "fit-2", User: 111, Channel: "email", ExpiresAt: t0.Add(10 * time.Second)}, // slot before expiry
		testenv.JobSpec{ID: "late", User: 112, Channel: "email", ExpiresAt: t0.Add(-time.Second)},      // expired on arrival
		testenv.JobSpec{ID: "promo", User: 120, Channel: "push", Category: "promo"},                    // quiet: held
		testenv.JobSpec{ID: "digest", User: 121, Channel: "push", Category: "digest"},                  // quiet: dropped
		testenv.JobSpec{ID: "promo-kolkata", User: 122, Channel: "push", Category: "promo", Timezone: "Asia/Kolkata"},
		testenv.JobSpec{ID: "receipt", User: 123, Channel: "push", Category: "transactional"},
	)
	s.Produce(jobs)
	outs := s.CollectJobs(jobs, 60*time.Second)
	final := finals(t, outs)
	if len(final) != len(jobs) {
		t.Fatalf("%d of %d jobs reached a final topic", len(final), len(jobs))
	}
	want := map[string]struct{ decision, cap, reason string }{
		"new-0": {"allowed", "", ""}, "new-1": {"capped", "slow", "beyond max_hold"},
		"active-0":  {"capped", "none", "never"},
		"dormant-0": {"allowed", "", ""}, "dormant-1": {"capped", "daily", ""},
		"exp-2": {"capped", "burst", "expired"}, // or cap "expired" when decided after its expiry: see below
		"fit-2": {"allowed", "", ""},
		"late":  {"capped", "expired", "expired"},
		"promo": {"allowed", "", ""}, "digest": {"capped", "quiet_hours", "quiet_hours"},
		"promo-kolkata": {"allowed", "", ""}, "receipt": {"exempt", "", ""},
	}
	for u := 100; u < 110; u++ {
		for i := 0; i < 5; i++ {
			want[fmt.Sprintf("burst-%d-%d", u, i)] = struct{ decision, cap, reason string }{"allowed", "", ""}
		}
	}
	if o := final["exp-2"]; o.Cap == "expired" && o.Reason == "expired" {
		want["exp-2"] = want["late"] // a slow machine reached it after its expiry
	}
	for id, w := range want {
		o := final[id]
		if o.Decision != w.decision || o.Cap != w.cap || o.Reason != w.reason {
			t.Errorf("job %s: decision %q cap %q reason %q, want %q %q %q", id, o.Decision, o.Cap, o.Reason, w.decision, w.cap, w.reason)
		}
	}
	// Held jobs: the three later sends of each burst user, fit-2 and promo;
	// the others never waited.
	for id, o := range final {
		held := strings.HasPrefix(id, "burst-") && id[len(id)-1] >= '2' || id == "fit-2" || id == "promo"
		if (o.HoldCount > 0) != held {
			t.Errorf("job %s: held %d times, want held=%v", id, o.HoldCount, held)
		}
	}
	// Quiet hours under drop say when they end; no header capper
	// writes is null, where a Java or librdkafka consumer would read no value
	// (a limit of 0 and an expired job have an empty retry-at).
	if o := final["digest"]; !o.RetryAt.Equal(quietEnd) {
		t.Errorf("digest, dropped in quiet hours: retry-at %v, want their end %v", o.RetryAt, quietEnd)
	}
	if nulls := s.NullHeaders(s.Topics[2]); len(nulls) > 0 {
		t.Errorf("null header values on the capped topic: %v", nulls)
	}
	if o := final["promo"]; o.DecidedAt.Before(quietEnd) {
		t.Errorf("promo sent at %s, inside its quiet hours (until %s)", o.DecidedAt.Format(time.RFC3339Nano), quietEnd.Format(time.RFC3339Nano))
	}
	if o := final["promo-kolkata"]; o.HoldCount != 0 {
		t.Errorf("a promo in Asia/Kolkata, outside its local quiet hours, was held")
	}
	lags := checkReleases(t, final, 2*time.Second)
	t.Logf("%d released jobs, release lag %s", len(lags), summarize(lags))
	checkWindow(t, final, 100, 110, 3*time.Second, 2)
	checkHoldMetrics(t, w)
	checkHeldRecords(t, s, final)
	// Redis logged each allowed send once.
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: s.Redis})
	defer rdb.Close()
	for u := 100; u < 110; u++ {
		if n := testenv.LogLen(t, rdb, fmt.Sprintf("%s:{%d}", s.Prefix, u)); n != 5 {
			t.Errorf("user %d: %d sends logged, want 5", u, n)
		}
	}
}

// checkHoldMetrics: what an operator sees of TestHoldAndRelease's holds.
func checkHoldMetrics(t *testing.T, w *worker) {
	t.Helper()
	for series, want := range map[string]func(float64) bool{
		`capper_held_total{reason="cap"}`:                 func(v float64) bool { return v >= 31 }, // re-holds add more
		`capper_held_total{reason="quiet_hours"}`:         func(v float64) bool { return v == 1 },
		`capper_not_held_total{reason="never"}`:           func(v float64) bool { return v == 1 },
		`capper_not_held_total{reason="expired"}`:         func(v float64) bool { return v == 2 },
		`capper_not_held_total{reason="beyond_max_hold"}`: func(v float64) bool { return v == 1 },
		`capper_not_held_total{reason="quiet_hours"}`:     func(v float64) bool { return v == 1 },
		`capper_release_lag_seconds_count`:                func(v float64) bool { return v >= 32 },
		`capper_jobs_total{decision="allowed"}`:           func(v float64) bool { return v == 59 },
	} {
		if v := scrapeMetric(t, w.metrics, series); v < 0 || !want(v) {
			t.Errorf("%s = %v (-1: absent)", series, v)
		}
	}
}

// checkHeldRecords: every hold of a final job has its audit record on the
// held topic.
func checkHeldRecords(t *testing.T, s *testenv.Stack, final map[string]testenv.Output) {
	t.Helper()
	audits := s.CollectAll(s.Held, 30*time.Second) // written before the releases that made the outputs above
	holds := map[string]int{}
	for _, a := range audits {
		if a.Decision != "held" || a.DueAt.IsZero() {
			t.Errorf("held record of %s: decision %q due %v", a.JobID, a.Decision, a.DueAt)
		}
		holds[a.JobID]++
	}
	for id, o := range final {
		if holds[id] < o.HoldCount {
			t.Errorf("job %s held %d times, %d held records", id, o.HoldCount, holds[id])
		}
	}
}

// summarize returns the median and the largest of lags.
func summarize(lags []time.Duration) string {
	if len(lags) == 0 {
		return "none"
	}
	s := slices.Clone(lags)
	slices.Sort(s)
	return fmt.Sprintf("p50 %v, max %v", s[len(s)/2], s[len(s)-1])
}

// checkWindow asserts that users [from, to) got at most limit allowed sends
// in any window, by decision time.
func checkWindow(t *testing.T, final map[string]testenv.Output, from, to uint32, window time.Duration, limit int) {
	t.Helper()
	byUser := map[uint32][]time.Time{}
	for _, o := range final {
		if o.Decision == "allowed" && o.User >= from && o.User < to {
			byUser[o.User] = append(byUser[o.User], o.DecidedAt)
		}
	}
	for u, ts := range byUser {
		for _, a := range ts {
			n := 0
			for _, b := range ts {
				if !b.Before(a) && b.Sub(a) < window {
					n++
				}
			}
			if n > limit {
				t.Errorf("user %d: %d sends within %v of %s (cap %d)", u, n, window, a.Format(time.RFC3339Nano), limit)
			}
		}
	}
}

// TestHeldJobsSurviveWorkerCrashes holds jobs on three tiers and SIGKILLs
// replicas while they wait: two replicas share the groups, one is killed
// (its partitions move to the other), a third starts, and the second is
// killed too. Every job is released once, none early, none over the cap.
func TestHeldJobsSurviveWorkerCrashes(t *testing.T) {
	s := testenv.NewStack(t, 3, nil)
	s.EnableHold(3, "1s", "4s", "10s")
	s.EditConfig(testenv.TestRules, `
rules:
  on_capped: {policy: hold, max_hold: 2m}
  segments:
    - name: new
      caps: [{name: slow, window: 12s, limit: 1}]
  default_caps: [{name: slow, window: 12s, limit: 1}]
`)
	a, b := start(s, true), start(s, true)
	a.waitReady(t)
	b.waitReady(t)
	var jobs []testenv.JobSpec
	for u := uint32(100); u < 160; u++ { // 3 sends each: at 0, held to 12 s, held to 24 s
		for i := 0; i < 3; i++ {
			jobs = append(jobs, testenv.JobSpec{ID: fmt.Sprintf("j-%d-%d", u, i), User: u, Channel: "email"})
		}
	}
	s.Produce(jobs)
	// The first crash once the second sends are held (a held record each): they wait on the tiers.
	if n := len(s.CollectFrom([]string{s.Held}, 60, time.Minute)); n < 60 {
		t.Fatalf("%d held records before the crash, want the 60 second sends held", n)
	}
	a.kill(t)
	start(s, false)
	// The second crash once a second send is released (after the 60 first sends): the third sends' holds
	// are moving through the tiers.
	if n := len(s.CollectFrom([]string{s.Topics[1]}, 61, time.Minute)); n < 61 {
		t.Fatalf("%d allowed sends before the second crash, want the 60 first sends and a released one", n)
	}
	b.kill(t)
	outs := s.CollectJobs(jobs, 90*time.Second)
	final := finals(t, outs)
	allowed := 0
	for _, o := range final {
		if o.Decision == "allowed" {
			allowed++
		}
	}
	if len(final) != len(jobs) || allowed != len(jobs) {
		t.Errorf("%d of %d jobs reached a final topic, %d allowed; want all allowed", len(final), len(jobs), allowed)
	}
	// Session timeouts of the killed members delay releases (6 s each), so
	// lateness is bounded by the outage, not by the tiers.
	lags := checkReleases(t, final, 30*time.Second)
	t.Logf("%d released jobs after two crashes (%d outputs for %d jobs), release lag %s", len(lags), len(outs), len(jobs), summarize(lags))
	checkWindow(t, final, 100, 160, 12*time.Second, 1)
}

// TestHeldJobsGauge: capper_held_jobs{tier} counts the jobs waiting on a tier
// (its group's uncommitted messages), capper_consumer_lag the input's.
func TestHeldJobsGauge(t *testing.T) {
	s := testenv.NewStack(t, 3, nil)
	s.EnableHold(3, "1s", "5s")
	s.EditConfig(testenv.TestRules, `
rules:
  on_capped: {policy: hold, max_hold: 2h}
  segments:
    - name: new
      caps: [{name: hourly, window: 1h, limit: 1}]
  default_caps: [{name: hourly, window: 1h, limit: 1}]
`)
	w := start(s, true)
	w.waitReady(t)
	var jobs []testenv.JobSpec
	for u := uint32(100); u < 120; u++ { // the second send of each user waits an hour
		jobs = append(jobs, testenv.JobSpec{ID: fmt.Sprintf("a-%d", u), User: u, Channel: "email"}, testenv.JobSpec{ID: fmt.Sprintf("b-%d", u), User: u, Channel: "email"})
	}
	s.Produce(jobs)
	var held, lag float64
	for end := time.Now().Add(40 * time.Second); time.Now().Before(end); time.Sleep(500 * time.Millisecond) {
		held, lag = scrapeMetric(t, w.metrics, `capper_held_jobs{tier="5s"}`), scrapeMetric(t, w.metrics, "capper_consumer_lag")
		if held == 20 && lag == 0 {
			return
		}
	}
	t.Errorf("capper_held_jobs{tier=\"5s\"} = %v, capper_consumer_lag = %v; want the 20 held jobs and 0", held, lag)
}

// TestSendsHeldAfterAKillWaitForNoOne: of two replicas, one is SIGKILLed;
// the sends the other holds afterwards come back at their due time while
// the groups still wait for the dead member (a session timeout of 30 s).
// Each replica holds its sends on its own partitions of the delay tiers:
// by key, half of them would wait on the dead replica's until it expired.
func TestSendsHeldAfterAKillWaitForNoOne(t *testing.T) {
	s := testenv.NewStack(t, 4, nil)
	s.EnableHold(6, "1s", "4s") // not the input's count: by key, a tier partition would follow the input's
	s.EditConfig("session_timeout: 6s", "session_timeout: 30s")
	s.EditConfig(testenv.TestRules, `
rules:
  on_capped: {policy: hold, max_hold: 2m}
  segments:
    - name: new
      caps: [{name: slow, window: 2s, limit: 1}]
  default_caps: [{name: slow, window: 2s, limit: 1}]
`)
	a := start(s, true)
	a.waitReady(t)
	b := start(s, true)
	b.waitReady(t)
	// Both replicas know their partitions of each tier, and own two of the
	// input's (every group settled: the input's may still be rebalancing
	// after the tiers' have).
	for end := time.Now().Add(90 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		known := 0
		for _, w := range []*worker{a, b} {
			for _, tier := range []string{"1s", "4s"} {
				if scrapeMetric(t, w.metrics, fmt.Sprintf("capper_hold_owned_partitions{tier=%q}", tier)) == 3 {
					known++
				}
			}
			if in, _ := s.ProcessPartitions(t, "", s.Topics[0], w.cmd.Process.Pid); len(in) == 2 {
				known++
			}
		}
		if known == 6 {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("the replicas never owned 3 partitions of each tier and 2 of the input (%d of 6 known)", known)
		}
	}
	a.kill(t)
	// Jobs only for users on the live replica's input partitions (the dead
	// one's wait for the group): the second send of each is held 2 s.
	live, _ := s.ProcessPartitions(t, "", s.Topics[0], b.cmd.Process.Pid)
	if len(live) != 2 {
		t.Fatalf("the live replica owns input partitions %v, want 2 of 4", live)
	}
	all := []int{0, 1, 2, 3}
	var jobs []testenv.JobSpec
	for u := uint32(1); len(jobs) < 80; u++ {
		if slices.Contains(live, (kafka.Murmur2Balancer{}).Balance(kafka.Message{Key: []byte(fmt.Sprint(u))}, all...)) {
			jobs = append(jobs, testenv.JobSpec{ID: fmt.Sprintf("j-%d-0", u), User: u, Channel: "email"},
				testenv.JobSpec{ID: fmt.Sprintf("j-%d-1", u), User: u, Channel: "email"})
		}
	}
	s.Produce(jobs)
	final := finals(t, s.CollectJobs(jobs, 45*time.Second))
	held := 0
	for _, j := range jobs {
		switch o, ok := final[j.ID]; {
		case !ok:
			t.Errorf("job %s has no final output", j.ID)
		case o.Decision != "allowed":
			t.Errorf("job %s: %s, want allowed", j.ID, o.Decision)
		case o.HoldCount > 0:
			held++
		}
	}
	if held < len(jobs)/2 {
		t.Errorf("%d of %d jobs were held, want at least the %d second sends", held, len(jobs), len(jobs)/2)
	}
	// Every release came while the dead replica still owned its partitions.
	for _, tier := range []string{"1s", "4s"} {
		if dead, members := s.ProcessPartitions(t, ".delay."+tier, s.Topics[0]+".delay."+tier, a.cmd.Process.Pid); len(dead) != 3 || members != 2 {
			t.Errorf("tier %s: the dead replica owns %v of %d members' partitions; want 3 of 2 members' (the session timeout had not passed)", tier, dead, members)
		}
	}
	lags := checkReleases(t, final, 10*time.Second) // by key: about half wait out the session timeout
	t.Logf("%d jobs, %d held and released by the live replica, release lag %s", len(jobs), held, summarize(lags))
}
