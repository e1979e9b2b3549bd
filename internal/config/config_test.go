package config_test

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/rules"
)

func env(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func TestExampleConfigLoads(t *testing.T) {
	data, err := os.ReadFile("../../config.example.yaml")
	if err != nil {
		t.Fatal(err)
	}
	c, err := config.Parse(data, env(nil))
	if err != nil {
		t.Fatal(err)
	}
	r, err := rules.Compile(c.Rules, 1)
	if err != nil {
		t.Fatal(err)
	}
	if got := r.SegmentNames(); strings.Join(got, ",") != "new,active,dormant" {
		t.Errorf("segments %v", got)
	}
	now := time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)
	if caps := r.Caps(nil, "active", true, rules.Send{Campaign: "c"}, now); len(caps) < 3 || caps[1].Window != 7*24*time.Hour {
		t.Errorf("active caps %+v", caps)
	}
	if !r.IsExempt("transactional") || r.IsExempt("marketing") {
		t.Error("exempt categories wrong")
	}
}

func TestEnvironmentOverridesAndSecrets(t *testing.T) {
	data, _ := os.ReadFile("../../config.example.yaml")
	c, err := config.Parse(data, env(map[string]string{
		"CAPPER_KAFKA_BROKERS":          "a:1, b:2",
		"CAPPER_KAFKA_TOPICS_INPUT":     "jobs",
		"CAPPER_BATCH_SIZE":             "64",
		"CAPPER_BATCH_MAX_WAIT":         "250ms",
		"CAPPER_SEGMENTS_S3_PATH_STYLE": "false",
		"CAPPER_REDIS_PASSWORD":         "hunter2",
	}))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(c.Kafka.Brokers, ",") != "a:1,b:2" || c.Kafka.Topics.Input != "jobs" || c.Batch.Size != 64 ||
		time.Duration(c.Batch.MaxWait) != 250*time.Millisecond || c.Segments.S3PathStyle {
		t.Fatalf("overrides not applied: %+v", c)
	}
	if string(c.Redis.Password) != "hunter2" {
		t.Fatal("password not read from CAPPER_REDIS_PASSWORD")
	}
	if s := strings.Join([]string{c.Redis.Password.String(), (&c.Redis).Password.GoString()}, " "); strings.Contains(s, "hunter2") {
		t.Fatal("a secret is printable")
	}
}

// TestGroupTimeouts: the rebalance timeout is half the session timeout, and
// the heartbeat interval a tenth of it, at most 100ms, unless set.
func TestGroupTimeouts(t *testing.T) {
	base, _ := os.ReadFile("../../config.example.yaml")
	without := strings.Replace(strings.Replace(string(base), "  rebalance_timeout: 15s", "", 1), "  heartbeat_interval: 100ms", "", 1)
	if len(without) != len(base)-len("  rebalance_timeout: 15s")-len("  heartbeat_interval: 100ms") {
		t.Fatal("config.example.yaml no longer sets rebalance_timeout: 15s and heartbeat_interval: 100ms: the defaults below would be the file's")
	}
	for _, tt := range []struct {
		name                 string
		yaml                 string
		env                  map[string]string
		rebalance, heartbeat time.Duration
	}{
		{"the example's", string(base), nil, 15 * time.Second, 100 * time.Millisecond},
		{"defaults", without, nil, 15 * time.Second, 100 * time.Millisecond},
		{"defaults of a short session timeout", without, map[string]string{"CAPPER_KAFKA_SESSION_TIMEOUT": "900ms"}, 450 * time.Millisecond, 90 * time.Millisecond},
		{"set", without, map[string]string{"CAPPER_KAFKA_REBALANCE_TIMEOUT": "20s", "CAPPER_KAFKA_HEARTBEAT_INTERVAL": "2s"}, 20 * time.Second, 2 * time.Second},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c, err := config.Parse([]byte(tt.yaml), env(tt.env))
			if err != nil {
				t.Fatal(err)
			}
			if r, hb := time.Duration(c.Kafka.RebalanceTimeout), time.Duration(c.Kafka.HeartbeatInterval); r != tt.rebalance || hb != tt.heartbeat {
				t.Errorf("rebalance timeout %v and heartbeat interval %v, want %v and %v", r, hb, tt.rebalance, tt.heartbeat)
			}
		})
	}
}

func TestValidationNamesTheField(t *testing.T) {
	base, _ := os.ReadFile("../../config.example.yaml")
	tests := []struct {
		name string
		env  map[string]string
		yaml string
		want string
	}{
		{"no brokers", map[string]string{"CAPPER_KAFKA_BROKERS": ""}, "", "kafka.brokers (CAPPER_KAFKA_BROKERS)"},
		{"batch size", map[string]string{"CAPPER_BATCH_SIZE": "0x"}, "", "CAPPER_BATCH_SIZE"},
		{"batch wait", map[string]string{"CAPPER_BATCH_MAX_WAIT": "5s"}, "", "batch.max_wait"},
		{"tier wait", map[string]string{"CAPPER_HOLD_MAX_WAIT": "2s"}, "", "hold.max_wait"},
		{"input is an output", map[string]string{"CAPPER_KAFKA_TOPICS_INPUT": "sends.dlq"}, "", "kafka.topics.input"},
		{"sasl without password", map[string]string{"CAPPER_KAFKA_SASL_MECHANISM": "plain", "CAPPER_KAFKA_SASL_USERNAME": "u"}, "", "kafka.sasl_username"},
		{"unknown field", nil, "kafka: {brokerz: [x]}\n", "brokerz"},
		{"cap without limit", nil, "kafka: {brokers: [x]}\nredis: {addrs: [y]}\nsegments: {source: /tmp}\nrules: {default_caps: [{window: 24h}]}\n", "rules.default_caps[0]: limit is required"},
		{"zero window", nil, "kafka: {brokers: [x]}\nredis: {addrs: [y]}\nsegments: {source: /tmp}\nrules: {default_caps: [{window: 0s, limit: 1}]}\n", "window"},
		{"no default caps", nil, "kafka: {brokers: [x]}\nredis: {addrs: [y]}\nsegments: {source: /tmp}\n", "default_caps"},
		{"bad tier", map[string]string{"CAPPER_HOLD_TIERS": "1s,soon"}, "", "hold.tiers"},
		{"tier too short", map[string]string{"CAPPER_HOLD_TIERS": "10ms"}, "", "hold.tiers"},
		{"holding rules without tiers", map[string]string{"CAPPER_HOLD_TIERS": ""}, "", "CAPPER_HOLD_TIERS"},
		{"delay topic is the input", map[string]string{"CAPPER_KAFKA_TOPICS_INPUT": "sends.delay.1s"}, "", "kafka.topics.delay_prefix"},
		{"negative shutdown timeout", nil, "kafka: {brokers: [x]}\nredis: {addrs: [y]}\nsegments: {source: /tmp}\nshutdown_timeout: -5s\nrules: {default_caps: [{window: 24h, limit: 1}]}\n", "shutdown_timeout (CAPPER_SHUTDOWN_TIMEOUT): -5s is negative"},
		{"metrics address without a port", map[string]string{"CAPPER_METRICS_ADDR": "localhost"}, "", "metrics_addr (CAPPER_METRICS_ADDR): \"localhost\" is not host:port"},
		{"rebalance faster than a member can rejoin", map[string]string{"CAPPER_KAFKA_REBALANCE_TIMEOUT": "5s", "CAPPER_KAFKA_HEARTBEAT_INTERVAL": "3s"}, "", "kafka.rebalance_timeout (CAPPER_KAFKA_REBALANCE_TIMEOUT): 5s is under two heartbeats (6s"},
		{"heartbeats too rare to keep a session", map[string]string{"CAPPER_KAFKA_HEARTBEAT_INTERVAL": "11s"}, "", "kafka.heartbeat_interval (CAPPER_KAFKA_HEARTBEAT_INTERVAL): 11s is over a third of kafka.session_timeout (30s)"},
		{"metrics address with a bad port", map[string]string{"CAPPER_METRICS_ADDR": "localhost:http9"}, "", "the port \"http9\" is not a number"},
		// A value the YAML cannot hold: its field and its line, as every other error.
		{"duration without a unit", nil, "kafka:\n  brokers: [x]\n  session_timeout: 30\n", "kafka.session_timeout (CAPPER_KAFKA_SESSION_TIMEOUT), line 3: invalid duration \"30\""},
		{"duration with a space", nil, "kafka: {brokers: [x]}\nrules:\n  default_caps:\n    - {name: d, limit: 1, window: 100 ms}\n", "rules.default_caps[0].window, line 4: invalid duration \"100 ms\""},
		{"an unclosed list", nil, "log_level: info\nkafka: {brokers: [127.0.0.1:9092}\n", "the [ on line 2 is not closed on its line"},
		{"duration in words", nil, "max_clock_skew: 1day\n", "max_clock_skew (CAPPER_MAX_CLOCK_SKEW), line 1: invalid duration \"1day\": a number and a unit"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			data := base
			if tt.yaml != "" {
				data = []byte(tt.yaml)
			}
			_, err := config.Parse(data, env(tt.env))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want one naming %q", err, tt.want)
			}
		})
	}
}

func TestHoldTiers(t *testing.T) {
	base, _ := os.ReadFile("../../config.example.yaml")
	c, err := config.Parse(base, env(nil))
	if err != nil {
		t.Fatal(err)
	}
	w, err := c.Wheel()
	if err != nil || w == nil || len(w.Tiers()) != 7 || w.Tiers()[0].Topic != "sends.delay.100ms" || w.Tiers()[6].Topic != "sends.delay.6h" {
		t.Fatalf("the example's wheel: %v, %v", w, err)
	}
	noHold := strings.Replace(strings.Replace(string(base), "on_capped: {policy: hold, max_hold: 48h}", "", 1), ", arbitration: 2m}", "}", 1)
	c, err = config.Parse([]byte(noHold), env(map[string]string{"CAPPER_HOLD_TIERS": ""}))
	if err != nil {
		t.Fatal(err)
	}
	if w, err := c.Wheel(); w != nil || err != nil {
		t.Errorf("CAPPER_HOLD_TIERS= gives wheel %v, %v; want holding disabled", w, err)
	}
}

func TestMaxClockSkew(t *testing.T) {
	base, _ := os.ReadFile("../../config.example.yaml")
	without := strings.Replace(string(base), "max_clock_skew: 1s\n", "", 1)
	for _, tc := range []struct {
		name, file string
		env        map[string]string
		want       time.Duration
		err        string
	}{
		{"default", without, nil, time.Second, ""},
		{"0 disables", strings.Replace(string(base), "max_clock_skew: 1s", "max_clock_skew: 0s", 1), nil, 0, ""},
		{"environment", string(base), map[string]string{"CAPPER_MAX_CLOCK_SKEW": "250ms"}, 250 * time.Millisecond, ""},
		{"negative", string(base), map[string]string{"CAPPER_MAX_CLOCK_SKEW": "-1s"}, 0, "max_clock_skew (CAPPER_MAX_CLOCK_SKEW)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := config.Parse([]byte(tc.file), env(tc.env))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("error %v, want one naming %s", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if time.Duration(c.MaxClockSkew) != tc.want || c.Limiter().ClockMargin != tc.want {
				t.Errorf("max_clock_skew %v, clock margin %v; want %v", time.Duration(c.MaxClockSkew), c.Limiter().ClockMargin, tc.want)
			}
		})
	}
}

// TestUnknownVariables: a CAPPER_* variable no setting reads is warned about,
// with the nearest one that does; the settings' own, the secrets' and the
// local stack's tools' are not.
func TestUnknownVariables(t *testing.T) {
	got := config.UnknownVariables([]string{"CAPPER_REDIS_ADDR=127.0.0.1:7000", "CAPPER_KAFKA_BROKERS=x", "CAPPER_REDIS_PASSWORD=p",
		"CAPPER_TEST_REDIS_ADDRS=y", "CAPPER_KAFKA_PORT=9092", "CAPPER_SEGMENTS_S3_ENDPOINT=z", "CAPPER_WHATEVER_ELSE_ENTIRELY=1", "HOME=/root"})
	if len(got) != 2 || !strings.Contains(got[0], "CAPPER_REDIS_ADDR is not a setting capper reads") || !strings.Contains(got[0], "did you mean CAPPER_REDIS_ADDRS?") ||
		!strings.Contains(got[1], "CAPPER_WHATEVER_ELSE_ENTIRELY") || strings.Contains(got[1], "did you mean") {
		t.Fatalf("warnings %q", got)
	}
	for _, v := range config.Variables() {
		if w := config.UnknownVariables([]string{v + "=1"}); len(w) != 0 {
			t.Errorf("%s, a setting's own variable, is warned about: %q", v, w)
		}
	}
}
