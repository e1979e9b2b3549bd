package main_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/capper-dev/capper/collapse"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestCollapseThroughKillAndFailover: price-drop pushes held overnight by
// quiet hours, three per user and product, and a deal series with a
// collapse_key of its own, reach two workers; one is SIGKILLed and
// restarted while they are held, and the Redis master of some users is
// killed (SIGKILL) and replaced by its replica (min_replicas_acked: 1).
// When the quiet hours end, each series releases exactly its newest send;
// every other send is capped as collapsed, naming it, in one final topic.
// Then, with a window of an hour, a news send of a key that reached its user
// collapses the next one of that key, and a send of another key goes.
func TestCollapseThroughKillAndFailover(t *testing.T) {
	s := testenv.NewStack(t, 6, nil)
	s.EnableHold(3, "1s", "5s")
	now := time.Now().UTC()
	quietEnd := now.Add(20 * time.Second).Truncate(time.Second)
	s.EditConfig(testenv.TestRules, fmt.Sprintf(`
rules:
  segments: [{name: new, caps: [{name: daily, window: 24h, limit: 50}]}]
  default_caps: [{name: daily, window: 24h, limit: 50}]
  on_capped: {policy: hold, max_hold: 2m}
  exempt_categories: [transactional]
  categories:
    - {name: promo, quiet_hours: {from: "%s", to: "%s"}}
  collapse:
    window: 1h
    keys: [{name: price, tags: [price_drop], per_campaign: true, tag_prefix: "product:"}]
`, now.Add(-time.Minute).Format("15:04:05"), quietEnd.Format("15:04:05")))
	s.EditConfig("decide_timeout: 1s", "decide_timeout: 1s\n  min_replicas_acked: 1\n  replica_timeout: 300ms")
	s.DefaultCap = 50
	const users, copies = 150, 3
	w1, w2 := start(s, true), start(s, true)
	w1.waitReady(t)
	w2.waitReady(t)
	// Wave c of every user: a deal (its own key), a price drop of product 1
	// and, for even users, one of product 2 (the rules derive their keys).
	// Each wave is produced after the last, so its sends are the newer.
	var held []testenv.JobSpec
	wave := func(c int) []testenv.JobSpec {
		var jobs []testenv.JobSpec
		for u := uint32(100); u < 100+users; u++ {
			jobs = append(jobs,
				testenv.JobSpec{ID: fmt.Sprintf("deal-%d-%d", u, c), User: u, Channel: "push", Category: "promo", CollapseKey: "deal"},
				testenv.JobSpec{ID: fmt.Sprintf("p1-%d-%d", u, c), User: u, Channel: "push", Category: "promo", Tags: []string{"price_drop", "product:1"}})
			if u%2 == 0 {
				jobs = append(jobs, testenv.JobSpec{ID: fmt.Sprintf("p2-%d-%d", u, c), User: u, Channel: "push", Category: "promo", Tags: []string{"price_drop", "product:2"}})
			}
		}
		return jobs
	}
	master := s.MasterOf(100)
	replica := testenv.ReplicaOf(t, master)
	for c := range copies {
		jobs := wave(c)
		s.Produce(jobs)
		held = append(held, jobs...)
		// Every send of the wave is held before the next is produced: the
		// next is then newer by submission time.
		if n := len(s.CollectFrom([]string{s.Held}, len(held), 60*time.Second)); n < len(held) {
			t.Fatalf("%d held records after wave %d, want %d", n, c, len(held))
		}
		switch c {
		case 0:
			w2.kill(t)
			start(s, false)
		case 1:
			restart := testenv.KillRedis(t, master)
			testenv.WaitMaster(t, replica, 30*time.Second)
			go restart() // the promoted master needs it back as its replica (min_replicas_acked)
		}
	}
	if time.Now().After(quietEnd) {
		t.Fatalf("the waves took until after the quiet hours (%s): the machine is too slow for this test's hold", quietEnd.Format(time.RFC3339))
	}
	outs := s.CollectJobs(held, 120*time.Second)
	final := finals(t, outs)
	if len(final) != len(held) {
		t.Fatalf("%d of %d jobs reached a final topic", len(final), len(held))
	}
	series := func(id string) string { return id[:strings.LastIndex(id, "-")] }
	newest := func(id string) string { return series(id) + fmt.Sprintf("-%d", copies-1) }
	newer := func(by, id string) bool { return series(by) == series(id) && by > id }
	keys := map[string]string{"deal": "deal", "p1": "price/c1/product:1", "p2": "price/c1/product:2"}
	for _, j := range held {
		o := final[j.ID]
		wantKey := keys[j.ID[:strings.Index(j.ID, "-")]]
		switch {
		case o.CollapseKey != wantKey:
			t.Errorf("job %s: collapse key %q, want %q", j.ID, o.CollapseKey, wantKey)
		case j.ID == newest(j.ID):
			if o.Decision != "allowed" || o.HoldCount == 0 || o.DecidedAt.Before(quietEnd) {
				t.Errorf("job %s, its series' newest: %s (held %d times, decided %s), want allowed after the quiet hours", j.ID, o.Decision, o.HoldCount, o.DecidedAt.Format(time.RFC3339Nano))
			}
		case o.Decision != "capped" || o.Cap != "collapsed" || o.Reason != "collapsed" || !newer(o.CollapsedBy, j.ID):
			// by the newest, or (a copy redelivered after the kill, decided
			// before the last wave) by a send of a wave between
			t.Errorf("job %s: %s cap %q reason %q by %q, want capped as collapsed by a newer send of its series", j.ID, o.Decision, o.Cap, o.Reason, o.CollapsedBy)
		}
	}
	s.CheckAccounting(held, outs, false)
	t.Logf("%d outputs for %d held jobs (%d duplicates after the kill and the failover)", len(outs), len(held), testenv.CountDecision(outs, "duplicate"))

	// The window: news-U-0 goes; news-U-1, of the same key an hour later at
	// most, collapses by it; weather-U-0, another key, goes.
	var news []testenv.JobSpec
	for u := uint32(100); u < 110; u++ {
		news = append(news, testenv.JobSpec{ID: fmt.Sprintf("news-%d-0", u), User: u, Channel: "email", CollapseKey: "news"})
	}
	s.Produce(news)
	first := s.CollectJobs(news, 60*time.Second)
	var later []testenv.JobSpec
	for u := uint32(100); u < 110; u++ {
		later = append(later,
			testenv.JobSpec{ID: fmt.Sprintf("news-%d-1", u), User: u, Channel: "email", CollapseKey: "news"},
			testenv.JobSpec{ID: fmt.Sprintf("weather-%d-0", u), User: u, Channel: "email", CollapseKey: "weather"})
	}
	s.Produce(later)
	second := finals(t, append(first, s.CollectJobs(later, 60*time.Second)...))
	for u := uint32(100); u < 110; u++ {
		for id, want := range map[string]string{fmt.Sprintf("news-%d-0", u): "allowed", fmt.Sprintf("weather-%d-0", u): "allowed", fmt.Sprintf("news-%d-1", u): "capped"} {
			if o := second[id]; o.Decision != want || want == "capped" && o.CollapsedBy != fmt.Sprintf("news-%d-0", u) {
				t.Errorf("job %s: %s by %q, want %s (a send of its key went within the window)", id, o.Decision, o.CollapsedBy, want)
			}
		}
	}
	// capper check shows a user's keys.
	reg, err := collapse.New(collapse.Config{Client: s.RedisClient()})
	if err != nil {
		t.Fatal(err)
	}
	entries, err := reg.Keys(context.Background(), fmt.Sprintf("%s:{%d}", s.Prefix, 100))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range entries {
		got = append(got, e.Key+"="+e.Newest+"/"+e.Sent)
	}
	if want := "deal=deal-100-2/deal-100-2 news=news-100-1/news-100-0 price/c1/product:1=p1-100-2/p1-100-2 price/c1/product:2=p2-100-2/p2-100-2 weather=weather-100-0/weather-100-0"; strings.Join(got, " ") != want {
		t.Errorf("user 100's keys:\n got %s\nwant %s", strings.Join(got, " "), want)
	}
	cmd := exec.Command(capperBin, "check", "--config", s.Config, "--user", "100", "--collapse-key", "news")
	cmd.Env = append(os.Environ(), "AWS_ACCESS_KEY_ID=test", "AWS_SECRET_ACCESS_KEY=test", "AWS_REGION=us-east-1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("capper check: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), `collapse key news: newest "news-100-1"`) || !strings.Contains(string(out), "this send's collapse key: news") {
		t.Errorf("capper check does not show user 100's collapse keys:\n%s", out)
	}
}

// TestReportJudgesCollapseKeys: a blast with collapse keys on half its jobs,
// under a cap that holds most of a hot user's sends: capper report finds
// every series released at most its newest and every collapse named by a
// newer send. A second blast of the same users and keys, sent once the first
// is done, goes (the worker has no collapse window); judged with a window of
// an hour, the two blasts' outputs fail: sends of a key went seconds apart.
func TestReportJudgesCollapseKeys(t *testing.T) {
	s := testenv.NewStack(t, 2, nil)
	s.EnableHold(2, "1s", "5s")
	s.EditConfig(testenv.TestRules, `
rules:
  segments: [{name: new, caps: [{name: burst, window: 2s, limit: 1}]}]
  default_caps: [{name: burst, window: 2s, limit: 1}]
  on_capped: {policy: hold, max_hold: 20s}
  count_only_categories: [receipt]
  exempt_categories: [transactional]
`)
	w := start(s, true)
	w.waitReady(t)
	env := []string{"AWS_ACCESS_KEY_ID=test", "AWS_SECRET_ACCESS_KEY=test", "AWS_REGION=us-east-1"}
	dir := t.TempDir()
	blast := func(name string, seed int) string {
		manifest := filepath.Join(dir, name+".csv")
		if out, err := capper(t, "", env, "loadgen", "--config", s.Config, "--manifest", manifest, "--jobs", "1500", "--users", "100",
			"--collapse-share", "0.5", "--seed", fmt.Sprint(seed)); err != nil {
			t.Fatalf("loadgen: %v\n%s", err, out)
		}
		return manifest
	}
	report := func(manifest string) (string, error) {
		return capper(t, "", env, "report", "--config", s.Config, "--manifest", manifest, "--idle", "3s", "--wait", "2m")
	}
	first := blast("first", 5)
	out, err := report(first)
	m := regexp.MustCompile(`collapse +(\d+) jobs with a collapse key, (\d+) of them collapsed`).FindStringSubmatch(out)
	if err != nil || !strings.Contains(out, `"violations":0`) || m == nil || m[2] == "0" {
		t.Fatalf("report of a blast with collapse keys: %v, want it to pass with collapsed sends\n%s", err, out)
	}
	t.Logf("report:\n%s", out)
	second := blast("second", 6)
	if out, err := report(second); err != nil || !strings.Contains(out, `"violations":0`) {
		t.Fatalf("report of the second blast: %v\n%s", err, out)
	}
	a, err := os.ReadFile(first)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(second)
	if err != nil {
		t.Fatal(err)
	}
	both := filepath.Join(dir, "both.csv")
	if err := os.WriteFile(both, append(a, b[bytes.IndexByte(b, '\n')+1:]...), 0o644); err != nil { // one header
		t.Fatal(err)
	}
	s.EditConfig("  exempt_categories: [transactional]\n", "  exempt_categories: [transactional]\n  collapse: {window: 1h}\n")
	if out, err := report(both); err == nil || !strings.Contains(out, "within the collapse window") {
		t.Fatalf("two blasts' outputs judged with a collapse window of an hour: %v, want a failed report\n%s", err, out)
	}
}
