package daemon_test

import (
	"context"
	"io"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/daemon"
	"github.com/capper-dev/capper/internal/testenv"
)

// startDaemon runs a daemon in process on the test's slice of the stack and
// stops it (SIGTERM's path: the context ends, Run drains and returns nil)
// when the test ends.
func startDaemon(t *testing.T, s *testenv.Stack) (*daemon.Daemon, *testenv.LogBuffer) {
	t.Helper()
	return startDaemonWith(t, s, daemon.Options{})
}

// startDaemonWith is startDaemon with opts (ConfigPath and Stderr are set here).
func startDaemonWith(t *testing.T, s *testenv.Stack, opts daemon.Options) (*daemon.Daemon, *testenv.LogBuffer) {
	t.Helper()
	t.Setenv("AWS_ACCESS_KEY_ID", "test")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "test")
	t.Setenv("AWS_REGION", "us-east-1")
	s.EditConfig(`metrics_addr: "off"`, `metrics_addr: "127.0.0.1:0"`)
	cfg, err := config.Load(s.Config)
	if err != nil {
		t.Fatal(err)
	}
	log := &testenv.LogBuffer{}
	ctx, cancel := context.WithCancel(context.Background())
	opts.ConfigPath, opts.Stderr = s.Config, log
	d, err := daemon.New(ctx, cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run after the context ended: %v", err)
		}
		d.Close()
		if t.Failed() {
			t.Logf("daemon log:\n%s", log.String())
		}
	})
	return d, log
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestReloadRules raises the default cap from 2 to 3 with ReloadRules (what
// SIGHUP calls): it applies from the next batch, without a restart. A broken
// file and a changed segment list are rejected, and the rules in force stay.
func TestReloadRules(t *testing.T) {
	s := testenv.NewStack(t, 1, nil)
	d, _ := startDaemon(t, s)
	if !d.Ready() {
		t.Error("not ready after New: the segment snapshot is loaded by then")
	}
	if code, _ := get(t, "http://"+d.MetricsAddr()+"/readyz"); code != http.StatusOK {
		t.Errorf("/readyz answered %d, want 200", code)
	}
	jobs := func(ids ...string) []testenv.JobSpec {
		var js []testenv.JobSpec
		for _, id := range ids {
			js = append(js, testenv.JobSpec{ID: id, User: 77, Channel: "email"})
		}
		return js
	}
	s.Produce(jobs("r1", "r2", "r3"))
	if capped := testenv.CountDecision(s.Collect(3, 60*time.Second), "capped"); capped != 1 {
		t.Fatalf("before the reload: %d of 3 capped (default cap 2), want 1", capped)
	}

	s.EditConfig("default_caps: [{name: daily, window: 24h, limit: 2}]", "default_caps: [{name: daily, window: 24h, limit: 3}]")
	if err := d.ReloadRules(context.Background()); err != nil {
		t.Fatalf("reload of a valid file: %v", err)
	}
	valid, err := os.ReadFile(s.Config)
	if err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]struct{ file, why string }{
		"a YAML error":           {string(valid) + "\nrules: [broken\n", "yaml"},
		"a changed segment list": {strings.Replace(string(valid), "- name: dormant", "- name: lapsed", 1), "segments changed"},
		// The worker started without delay tiers: rules that hold cannot run
		// on it, even when the new file adds tiers (they need a restart).
		// An earlier version accepted these, and held nothing.
		"a hold policy": {strings.Replace(string(valid), "default_caps:", "on_capped: {policy: hold, max_hold: 1h}\n  default_caps:", 1), "no delay tiers"},
		"tiers and a budget": {strings.Replace(strings.Replace(strings.Replace(string(valid), "  tiers: []", "  tiers: [1s]", 1),
			"dlq: ", "held: "+s.Topics[3]+".held, dlq: ", 1),
			"default_caps:", "budgets: [{name: all, limit: 100, window: 1s}]\n  default_caps:", 1), "no delay tiers"},
	} {
		if err := os.WriteFile(s.Config, []byte(c.file), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := d.ReloadRules(context.Background()); err == nil || !strings.Contains(err.Error(), c.why) {
			t.Errorf("reload of a file with %s: %v, want rejected (%s)", name, err, c.why)
		}
	}
	s.Produce(jobs("r4", "r5"))
	got := map[string]string{}
	for _, o := range s.Collect(5, 60*time.Second) {
		got[o.JobID] = o.Decision
	}
	if got["r4"] != "allowed" || got["r5"] != "capped" {
		t.Fatalf("after raising the cap to 3: r4 %q, r5 %q; want allowed, capped (decisions %v)", got["r4"], got["r5"], got)
	}
	if _, metrics := get(t, "http://"+d.MetricsAddr()+"/metrics"); !strings.Contains(metrics, "capper_rules_version 2") {
		t.Error("capper_rules_version is not 2 after one accepted reload")
	}
}

const ruleLanguage = `
rules:
  segments:
    - name: new
      caps: [{name: daily, window: 24h, limit: 2}]
    - name: active
      caps: [{name: daily, window: 24h, limit: 3}]
    - name: dormant
      caps: [{name: daily, window: 24h, limit: 1}]
  default_caps:
    - {name: daily, window: 24h, limit: 9}
    - {name: promo-today, calendar: day, limit: 1, tags: [promotional]}
    - {name: campaign-week, calendar: week, limit: 1, per_campaign: true, channel: push}
    - {name: two-today, calendar: day, limit: 2, shadow: true}
  exempt_categories: [transactional]
  count_only_categories: [receipt]
  default_timezone: Asia/Kolkata
`

// TestRuleLanguageEndToEnd runs a mixed stream (time zones, tags, campaigns,
// count-only and exempt categories) through the worker and asserts every
// decision, the shadow header and the shadow metric.
func TestRuleLanguageEndToEnd(t *testing.T) {
	s := testenv.NewStack(t, 1, nil)
	s.EditConfig(testenv.TestRules, ruleLanguage)
	d, _ := startDaemon(t, s)
	ny := "America/New_York"
	jobs := []testenv.JobSpec{
		{ID: "p1", User: 100, Channel: "email", Campaign: "c1", Timezone: ny, Tags: []string{"promotional"}},
		{ID: "p2", User: 100, Channel: "sms", Campaign: "c2", Timezone: ny, Tags: []string{"promotional"}},
		{ID: "n1", User: 100, Channel: "push", Campaign: "c1", Timezone: ny, Tags: []string{"newsletter"}},
		{ID: "n2", User: 100, Channel: "push", Campaign: "c1", Timezone: ny, Tags: []string{"newsletter"}},
		{ID: "r1", User: 100, Channel: "email", Campaign: "c9", Timezone: ny, Category: "receipt"},
		{ID: "m1", User: 100, Channel: "email", Campaign: "c3", Timezone: ny},
		{ID: "bad", User: 101, Channel: "email", Timezone: "Mars/Olympus", Tags: []string{"promotional"}},
		{ID: "e1", User: 101, Channel: "sms", Category: "transactional"},
		{ID: "k1", User: 101, Channel: "push", Tags: []string{"promotional"}}, // Kolkata, the default zone
	}
	s.Produce(jobs)
	got := map[string]testenv.Output{}
	for _, o := range s.Collect(len(jobs), 60*time.Second) {
		got[o.JobID] = o
	}
	for _, w := range []struct{ id, decision, cap, shadow string }{
		{"p1", "allowed", "", ""},
		{"p2", "capped", "promo-today", ""},   // a second promotional send today
		{"n1", "allowed", "", ""},             // c1 not pushed this week yet
		{"n2", "capped", "campaign-week", ""}, // c1 pushed this week
		{"r1", "allowed", "", ""},             // count-only: recorded, never capped
		{"m1", "allowed", "", "two-today"},    // p1, n1 and r1 counted today: the shadow cap would cap
		{"bad", "dlq", "", ""},                // unknown time zone
		{"e1", "exempt", "", ""},              // neither counted nor capped
		{"k1", "allowed", "", ""},             // another user
	} {
		o := got[w.id]
		if shadow := strings.Join(o.Shadow, ","); o.Decision != w.decision || o.Cap != w.cap || shadow != w.shadow {
			t.Errorf("%s: decision %q cap %q shadow %q, want %q %q %q (reason %q)", w.id, o.Decision, o.Cap, shadow, w.decision, w.cap, w.shadow, o.Reason)
		}
	}
	if r := got["bad"].Error; !strings.Contains(r, `unknown time zone "Mars/Olympus"`) {
		t.Errorf("dead-letter reason %q does not name the unknown zone", r)
	}
	if ra := got["p2"].RetryAt; ra.IsZero() || ra.In(mustZone(t, ny)).Format("15:04:05") != "00:00:00" {
		t.Errorf("promo-today retry-at %v, want the next local midnight in New York", ra)
	}
	if _, metrics := get(t, "http://"+d.MetricsAddr()+"/metrics"); !strings.Contains(metrics, `capper_shadow_capped_total{cap="two-today"} 1`) {
		t.Error(`capper_shadow_capped_total{cap="two-today"} is not 1`)
	}
}

func mustZone(t *testing.T, name string) *time.Location {
	t.Helper()
	l, err := time.LoadLocation(name)
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// TestCloseLeavesTheGroup: a daemon closed without Run (as New's error paths
// and a failed start do) takes its readers out of their consumer groups at
// once, instead of leaving members behind until the broker expires them.
func TestCloseLeavesTheGroup(t *testing.T) {
	t.Setenv("AWS_ACCESS_KEY_ID", "test")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "test")
	t.Setenv("AWS_REGION", "us-east-1")
	s := testenv.NewStack(t, 1, nil)
	s.EditConfig("session_timeout: 6s", "session_timeout: 60s") // the broker would keep a dead member a minute
	cfg, err := config.Load(s.Config)
	if err != nil {
		t.Fatal(err)
	}
	d, err := daemon.New(context.Background(), cfg, daemon.Options{ConfigPath: s.Config, Stderr: io.Discard})
	if err != nil {
		t.Fatal(err)
	}
	group := cfg.Kafka.GroupID
	client := &kafka.Client{Addr: kafka.TCP(s.Brokers...), Timeout: 10 * time.Second}
	members := func() int {
		resp, err := client.DescribeGroups(context.Background(), &kafka.DescribeGroupsRequest{GroupIDs: []string{group}})
		if err != nil || len(resp.Groups) != 1 {
			t.Fatalf("describe group %s: %v", group, err)
		}
		return len(resp.Groups[0].Members)
	}
	for end := time.Now().Add(30 * time.Second); members() == 0; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("the reader did not join its group within 30 s")
		}
	}
	d.Close()
	if n := members(); n != 0 {
		t.Errorf("%d members left in group %s after Close (the session timeout is 60 s)", n, group)
	}
}

// TestPreferences: each user's own preferences, from the preferences topic,
// applied in the same script call as the caps (default cap 2 a day): an
// opt-out of SMS, a limit of one email a day, a VIP exemption that ends
// mid-run (the daemon's clock is moved past it), and an opt-out set twice
// (a redelivery) and cleared. capper-cap names the preference that capped.
func TestPreferences(t *testing.T) {
	s := testenv.NewStack(t, 1, nil)
	s.EnableEvents(1)
	s.EditConfig("log_level: warn", "log_level: warn\nmax_clock_skew: 1h") // the test moves the clock
	var offset atomic.Int64
	clock := func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }
	d, _ := startDaemonWith(t, s, daemon.Options{Clock: clock})
	vipUntil := clock().Add(10 * time.Minute).UTC()
	s.ProduceEvents(s.Preferences,
		map[string]any{"user_id": 1, "channel": "sms", "opt_out": true},
		map[string]any{"user_id": 2, "channel": "email", "limit": 1, "window": "24h"},
		map[string]any{"user_id": 3, "vip_until": vipUntil.Format(time.RFC3339Nano)},
		map[string]any{"user_id": 4, "channel": "sms", "opt_out": true},
		map[string]any{"user_id": 4, "channel": "sms", "opt_out": true},
		map[string]any{"user_id": 4, "channel": "sms", "clear": true},
		map[string]any{"user_id": 4, "channel": "sms", "window": "400d", "limit": 1}, // longer than the log keeps a send: dead-lettered
	)
	want := map[uint32]int{1: 1, 2: 1, 3: 1, 4: 0}
	ctx := context.Background()
	for end := time.Now().Add(60 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		ok := true
		for u, n := range want {
			ps, err := d.Limiter.Preferences(ctx, 0, u)
			if err != nil || len(ps) != n {
				ok = false
			}
		}
		if dl := s.CollectFrom([]string{s.Topics[3]}, 1, 100*time.Millisecond); ok && len(dl) == 1 {
			if !strings.Contains(dl[0].Error, "longer than the rules keep a send") {
				t.Errorf("dead letter of a too-long window: %q", dl[0].Error)
			}
			break
		}
		if time.Now().After(end) {
			t.Fatal("the preferences were not applied within 60 s")
		}
	}
	// The cache reader holds a user's copies off from reading an event until
	// the preferences group has committed past it. It reads from the topic's
	// end once its own group has joined, which may come after the events
	// above: user 9's preference is sent again until it has read one, and
	// then every hold must be released.
	var sent time.Time
	for end := time.Now().Add(60 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		st := d.Limiter.Stats()
		if st.CacheHolds > 0 && st.CacheHeld == 0 {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("%d holds, %d users still held after 60 s (is the preferences group's commit read?)", st.CacheHolds, st.CacheHeld)
		}
		if st.CacheHolds == 0 && time.Since(sent) > 3*time.Second {
			s.ProduceEvents(s.Preferences, map[string]any{"user_id": 9, "channel": "push", "limit": 5, "window": "24h"})
			sent = time.Now()
		}
	}
	jobs := []testenv.JobSpec{
		{ID: "1-sms", User: 1, Channel: "sms"}, {ID: "1-email", User: 1, Channel: "email"},
		{ID: "2-email", User: 2, Channel: "email"}, {ID: "2-email-again", User: 2, Channel: "email"}, {ID: "2-push", User: 2, Channel: "push"},
		{ID: "3-a", User: 3, Channel: "email"}, {ID: "3-b", User: 3, Channel: "email"}, {ID: "3-c", User: 3, Channel: "email"},
		{ID: "4-sms", User: 4, Channel: "sms"},
	}
	s.Produce(jobs)
	outs := s.CollectJobs(jobs, 60*time.Second)
	offset.Store(int64(20 * time.Minute)) // user 3 is no longer VIP
	late := []testenv.JobSpec{{ID: "3-d", User: 3, Channel: "email"}}
	s.Produce(late)
	outs = append(outs, s.CollectJobs(late, 60*time.Second)...)
	got := map[string]testenv.Output{}
	for _, o := range outs {
		got[o.JobID] = o
	}
	for id, w := range map[string]struct{ decision, cap string }{
		"1-sms": {"capped", "preference:channel:sms"}, "1-email": {"allowed", ""},
		"2-email": {"allowed", ""}, "2-email-again": {"capped", "preference:channel:email"}, "2-push": {"allowed", ""},
		"3-a": {"allowed", ""}, "3-b": {"allowed", ""}, "3-c": {"allowed", ""}, "3-d": {"capped", "daily"},
		"4-sms": {"allowed", ""},
	} {
		if o := got[id]; o.Decision != w.decision || o.Cap != w.cap {
			t.Errorf("%s: %s by %q, want %s by %q", id, o.Decision, o.Cap, w.decision, w.cap)
		}
	}
	if o := got["1-sms"]; !o.RetryAt.IsZero() {
		t.Errorf("an opted-out send's retry-at: %v, want none (empty)", o.RetryAt)
	}
}
