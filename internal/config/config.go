// Package config loads capper's YAML configuration, applies CAPPER_*
// environment overrides and validates it. See config.example.yaml at the
// repository root for every field with its default.
package config

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/rules"
)

// Config is the whole configuration.
type Config struct {
	Kafka    Kafka        `yaml:"kafka"`
	Redis    Redis        `yaml:"redis"`
	Segments Segments     `yaml:"segments"`
	Batch    Batch        `yaml:"batch"`
	Hold     Hold         `yaml:"hold"`
	Rules    rules.Config `yaml:"rules"`
	// Workspaces make one deployment cap several brands or apps, each with
	// its own rules file, segments and users (a job's workspace field names
	// its own); the rules section then holds only the budgets they share.
	// Empty: one set of rules, and jobs' workspace field is ignored.
	Workspaces []Workspace `yaml:"workspaces"`
	// DefaultWorkspace is the workspace of jobs and events that name none;
	// empty: they are dead-lettered.
	DefaultWorkspace string `yaml:"default_workspace"`
	// MetricsAddr serves /metrics, /healthz and /readyz. Defaults to ":9090"; "off" disables.
	MetricsAddr string `yaml:"metrics_addr"`
	// ShutdownTimeout bounds finishing the in-flight batch on SIGTERM. Defaults to 30s.
	ShutdownTimeout Duration `yaml:"shutdown_timeout"`
	// LogLevel is debug, info, warn or error. Defaults to info.
	LogLevel string `yaml:"log_level"`
	// DebugPprof serves Go's profiler under /debug/pprof/ on metrics_addr. Defaults to false.
	DebugPprof bool `yaml:"debug_pprof"`
	// MaxClockSkew is the largest difference between this worker's clock and
	// TIME on the Redis masters at which it still decides; beyond it the
	// worker stops deciding (not ready, retried like a Redis outage, nothing
	// committed) until the clock is back within it. Log entries are also kept
	// this much longer than the longest window. Defaults to 1s; 0 disables.
	MaxClockSkew Duration `yaml:"max_clock_skew"`
	// ClockCheckInterval is how often the skew is measured. Defaults to 30s.
	ClockCheckInterval Duration `yaml:"clock_check_interval"`

	dir     string // the file's directory: workspaces' rules files are relative to it
	noFiles bool   // Validate does not read the workspaces' rules files (Reload)
}

// DefaultMaxHeartbeat is the longest kafka.heartbeat_interval when the file
// does not set it: a rebalance stops the members that learned of it first for
// up to a heartbeat, and a replica that rejoins makes a rebalance of each of
// its groups, one after another. A budget's window of a second should lose
// little to them: at 500 ms, 3 of 12 runs of a burst with a SIGKILL and a
// restart had a window of 72-90% of the limit after the kill's grace; at 100
// ms none below 94%, for a hundredth of a core per replica in heartbeats (see
// docs/operations.md, Rebalances).
const DefaultMaxHeartbeat = 100 * time.Millisecond

// DefaultMaxClockSkew is max_clock_skew when the file does not set it.
const DefaultMaxClockSkew = time.Second

type Kafka struct {
	Brokers []string `yaml:"brokers"`  // (Required)
	GroupID string   `yaml:"group_id"` // Defaults to "capper".
	Topics  Topics   `yaml:"topics"`
	// SessionTimeout: a member silent this long leaves the group and its partitions move. Defaults to 30s.
	SessionTimeout Duration `yaml:"session_timeout"`
	// RebalanceTimeout: how long a rebalance waits for the members to rejoin;
	// one that has not by then (killed, and not yet expired by SessionTimeout)
	// is dropped, and the others go on. Every member of the group stops reading
	// while a rebalance lasts. Defaults to half of SessionTimeout; at least two
	// heartbeats (HeartbeatInterval).
	RebalanceTimeout Duration `yaml:"rebalance_timeout"`
	// HeartbeatInterval: how often a member tells its group it is alive, and so
	// how soon it learns that a rebalance has begun (kafka-go learns it from a
	// heartbeat's answer alone). The members that learn first stop reading until
	// the last has rejoined, so a rebalance among live members stops reading for
	// up to this long. Defaults to a tenth of SessionTimeout, at most 100ms; at
	// most a third of SessionTimeout.
	HeartbeatInterval Duration `yaml:"heartbeat_interval"`
	// MaxBatchBytes bounds a record batch the worker produces, and so its largest
	// output; it must stay below the broker's message.max.bytes (Kafka's default
	// is 1048588). 0 = consumer.DefaultMaxOutputBytes.
	MaxBatchBytes int `yaml:"max_batch_bytes"`
	// SASL: mechanism plain, scram-sha-256 or scram-sha-512; empty disables.
	SASLMechanism string `yaml:"sasl_mechanism"`
	SASLUsername  string `yaml:"sasl_username"`
	// SASLPassword: set CAPPER_KAFKA_SASL_PASSWORD or sasl_password_file, never the file itself.
	SASLPassword     Secret `yaml:"-"`
	SASLPasswordFile string `yaml:"sasl_password_file"`
	TLS              TLS    `yaml:"tls"`
}

type Topics struct {
	Input   string `yaml:"input"`   // Defaults to "sends".
	Allowed string `yaml:"allowed"` // Defaults to "sends.allowed".
	Capped  string `yaml:"capped"`  // Defaults to "sends.capped".
	DLQ     string `yaml:"dlq"`     // Defaults to "sends.dlq".
	Held    string `yaml:"held"`    // audit records of held jobs. Defaults to "sends.held".
	// DelayPrefix names the delay tiers' topics: prefix + tier ("sends.delay.10s"). Defaults to "sends.delay.".
	DelayPrefix string `yaml:"delay_prefix"`
	// External, when set, is a topic of sends made elsewhere (events.Send),
	// counted toward the caps from their sent_at; read by the group
	// GROUP.external. Optional, no default.
	External string `yaml:"external"`
	// Feedback, when set, is a topic of delivery feedback (events.Feedback):
	// a failed or bounced send gives its slot back. Read by the group
	// GROUP.feedback, and by each process's GROUP.feedback-cache.* to keep its
	// near cache exact. Optional, no default.
	Feedback string `yaml:"feedback"`
	// Preferences, when set, is a topic of the users' own preferences
	// (events.Preference), applied by the group GROUP.preferences; every
	// decision then reads the user's preferences in the same script call.
	// Optional, no default.
	Preferences string `yaml:"preferences"`
}

// Hold configures the delay topics that held jobs wait on.
type Hold struct {
	// Tiers are the delays of the delay topics, e.g. [100ms, 1s, 10s, 1m, 10m, 1h, 6h]
	// (the default); [] disables holding (rules that hold are then refused).
	// The shortest bounds how late a held job is released.
	Tiers []string `yaml:"tiers"`
	// MaxWait is how long a delay tier's batch, after its first job, takes
	// the jobs its reader holds that come due within it (a job due at 3 ms
	// joins the batch; with none due within it, the batch goes at once).
	// At most 1s. Defaults to 10ms (0: the default).
	MaxWait Duration `yaml:"max_wait"`
}

// DefaultTierWait is hold.max_wait's default.
const DefaultTierWait = 10 * time.Millisecond

// BatchWait returns the tiers' batch wait.
func (h Hold) BatchWait() time.Duration {
	if h.MaxWait == 0 {
		return DefaultTierWait
	}
	return time.Duration(h.MaxWait)
}

// Delays returns the tiers' delays (nil when holding is disabled).
func (h Hold) Delays() ([]time.Duration, error) {
	if h.Tiers == nil {
		return hold.DefaultDelays, nil
	}
	var ds []time.Duration
	for _, t := range h.Tiers {
		d, err := rules.ParseDuration(strings.TrimSpace(t))
		if err != nil {
			return nil, err
		}
		ds = append(ds, d)
	}
	return ds, nil
}

// Wheel returns the delay topics of these settings, nil when holding is disabled.
func (c *Config) Wheel() (*hold.Wheel, error) {
	ds, err := c.Hold.Delays()
	if err != nil || len(ds) == 0 {
		return nil, err
	}
	return hold.NewWheel(c.Kafka.Topics.DelayPrefix, ds)
}

type Redis struct {
	// Addrs: one address = a standalone Redis, several = a cluster. (Required)
	Addrs    []string `yaml:"addrs"`
	Username string   `yaml:"username"`
	// Password: set CAPPER_REDIS_PASSWORD or password_file.
	Password     Secret   `yaml:"-"`
	PasswordFile string   `yaml:"password_file"`
	TLS          TLS      `yaml:"tls"`
	KeyPrefix    string   `yaml:"key_prefix"`    // capping.Config.KeyPrefix (empty: its default).
	DialTimeout  Duration `yaml:"dial_timeout"`  // Defaults to 1s.
	ReadTimeout  Duration `yaml:"read_timeout"`  // Defaults to 1s.
	WriteTimeout Duration `yaml:"write_timeout"` // Defaults to 1s.
	// DecideTimeout: capping.Config.Timeout, one attempt at a batch's decisions
	// (failed decisions are retried). 0 = its default.
	DecideTimeout Duration `yaml:"decide_timeout"`
	// Pipelines: capping.Config.Pipelines. 0 = its default.
	Pipelines int `yaml:"pipelines"`
	// MinReplicasAcked: see capping.Config.MinReplicasAcked. Defaults to 0 (off).
	MinReplicasAcked int `yaml:"min_replicas_acked"`
	// ReplicaTimeout: see capping.Config.ReplicaTimeout (0 = its default).
	ReplicaTimeout Duration `yaml:"replica_timeout"`
	// NearCacheSize: capping.Config.NearCache, the users whose logs the near
	// cache keeps while a cap blocks them. Defaults to DefaultNearCacheSize; 0 turns it off.
	NearCacheSize int `yaml:"near_cache_size"`
	// ScriptOnly: capping.Config.ScriptOnly, every decision by the script
	// (a first send to a user with no log is otherwise one SET NX). Defaults to false.
	ScriptOnly bool `yaml:"script_only"`
}

// DefaultNearCacheSize is redis.near_cache_size when the file does not set it:
// 140 to 400 MB at the measured bytes per copy.
const DefaultNearCacheSize = 1_000_000

type TLS struct {
	Enabled    bool   `yaml:"enabled"`
	CAFile     string `yaml:"ca_file"`
	CertFile   string `yaml:"cert_file"`
	KeyFile    string `yaml:"key_file"`
	ServerName string `yaml:"server_name"`
}

type Segments struct {
	// Source: s3://bucket/prefix or a local directory. (Required)
	Source          string   `yaml:"source"`
	S3Endpoint      string   `yaml:"s3_endpoint"`      // S3-compatible endpoint; defaults to AWS.
	S3Region        string   `yaml:"s3_region"`        // Defaults to AWS_REGION, then us-east-1.
	S3PathStyle     bool     `yaml:"s3_path_style"`    // Defaults to false.
	RefreshInterval Duration `yaml:"refresh_interval"` // segments.Config.RefreshInterval (0 = its default).
	StartupTimeout  Duration `yaml:"startup_timeout"`  // segments.Config.StartupTimeout (0 = its default).
	// CacheDir keeps the downloaded objects; defaults to a temporary directory removed at exit.
	// One process at a time (segments.Config.CacheDir).
	CacheDir string `yaml:"cache_dir"`
}

type Batch struct {
	Size    int      `yaml:"size"`     // consumer.Config.BatchSize, at most 100000 (0 = its default).
	MaxWait Duration `yaml:"max_wait"` // consumer.Config.BatchWait, at most 1s (0 = its default).
}

// Duration reads "24h", "7d", "500ms" (see rules.ParseDuration).
type Duration = rules.Duration

// Secret is a string never printed.
type Secret string

func (Secret) String() string   { return "[redacted]" }
func (Secret) GoString() string { return "[redacted]" }

// Load reads path, applies CAPPER_* environment overrides, fills defaults and validates.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return parse(data, os.LookupEnv, filepath.Dir(path), false)
}

// Reload is Load on the bytes of the file at path, read again by a running
// worker: the workspaces' rules files are not read (the worker reloads each
// on its own, so that a bad one keeps only its workspace on its old rules).
func Reload(data []byte, path string) (*Config, error) {
	return parse(data, os.LookupEnv, filepath.Dir(path), true)
}

// Parse is Load on bytes, with env looking up environment variables;
// workspaces' files are relative to the working directory.
func Parse(data []byte, env func(string) (string, bool)) (*Config, error) {
	return parse(data, env, "", false)
}

func parse(data []byte, env func(string) (string, bool), dir string, noFiles bool) (*Config, error) {
	c := Config{Redis: Redis{NearCacheSize: DefaultNearCacheSize}, MaxClockSkew: Duration(DefaultMaxClockSkew), dir: dir, noFiles: noFiles} // defaults that 0 may override
	dec := yaml.NewDecoder(strings.NewReader(string(data)))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("config: %w", located(data, err))
	}
	if err := applyEnv(reflect.ValueOf(&c).Elem(), "CAPPER", env); err != nil {
		return nil, err
	}
	if err := c.readSecrets(env); err != nil {
		return nil, err
	}
	c.defaults()
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &c, nil
}

// located names the field of a value error that says only its line ("line
// 12: invalid duration ..."): "kafka.session_timeout (CAPPER_...), line 12:
// invalid duration ...". Other errors (the YAML's syntax, unknown fields)
// say where they are already.
func located(data []byte, err error) error {
	m := lineError.FindStringSubmatch(err.Error())
	if m == nil {
		return unclosed(data, err)
	}
	line, _ := strconv.Atoi(m[1])
	col, _ := strconv.Atoi(m[2])
	var root yaml.Node
	if yaml.Unmarshal(data, &root) != nil {
		return err
	}
	path := pathAt(&root, line, col, "")
	switch {
	case path == "":
		return err
	case strings.Contains(path, "["): // in a list: the file alone sets it
		return fmt.Errorf("%s, line %d: %s", path, line, m[3])
	}
	return fmt.Errorf("%s (%s), line %d: %s", path, envName(path), line, m[3])
}

// unclosed points at the line of an unclosed flow list or map, which
// YAML's parser reports at the line its enclosing block starts on ("yaml:
// line 1: did not find expected ',' or ']'" for a [ left open on line 2).
func unclosed(data []byte, err error) error {
	open, close := byte(0), byte(0)
	switch msg := err.Error(); {
	case strings.Contains(msg, "did not find expected ',' or ']'"):
		open, close = '[', ']'
	case strings.Contains(msg, "did not find expected ',' or '}'"):
		open, close = '{', '}'
	default:
		return err
	}
	for i, line := range strings.Split(string(data), "\n") {
		if code, _, _ := strings.Cut(line, "#"); strings.Count(code, string(open)) > strings.Count(code, string(close)) {
			return fmt.Errorf("%w (the %c on line %d is not closed on its line)", err, open, i+1)
		}
	}
	return err
}

var lineError = regexp.MustCompile(`^line (\d+), column (\d+): (.*)$`)

// pathAt returns the field path of the scalar value at line and col under n
// ("rules.segments[0].caps[1].window"), or "".
func pathAt(n *yaml.Node, line, col int, prefix string) string {
	switch n.Kind {
	case yaml.DocumentNode:
		for _, c := range n.Content {
			if p := pathAt(c, line, col, prefix); p != "" {
				return p
			}
		}
	case yaml.MappingNode:
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			path := k.Value
			if prefix != "" {
				path = prefix + "." + k.Value
			}
			if v.Kind == yaml.ScalarNode && v.Line == line && v.Column == col {
				return path
			}
			if p := pathAt(v, line, col, path); p != "" {
				return p
			}
		}
	case yaml.SequenceNode:
		for i, c := range n.Content {
			if p := pathAt(c, line, col, fmt.Sprintf("%s[%d]", prefix, i)); p != "" {
				return p
			}
		}
	}
	return ""
}

func (c *Config) readSecrets(env func(string) (string, bool)) error {
	read := func(dst *Secret, envName, file, field string) error {
		if v, ok := env(envName); ok {
			*dst = Secret(v)
			return nil
		}
		if file == "" {
			return nil
		}
		b, err := os.ReadFile(file)
		if err != nil {
			return fmt.Errorf("config: %s: %w", field, err)
		}
		*dst = Secret(strings.TrimRight(string(b), "\r\n"))
		return nil
	}
	if err := read(&c.Redis.Password, "CAPPER_REDIS_PASSWORD", c.Redis.PasswordFile, "redis.password_file"); err != nil {
		return err
	}
	return read(&c.Kafka.SASLPassword, "CAPPER_KAFKA_SASL_PASSWORD", c.Kafka.SASLPasswordFile, "kafka.sasl_password_file")
}

// DefaultTopics are the topics' names the file does not set, and
// DefaultGroupID the consumer group's.
var DefaultTopics = Topics{Input: "sends", Allowed: "sends.allowed", Capped: "sends.capped", DLQ: "sends.dlq",
	Held: "sends.held", DelayPrefix: "sends.delay."}

const DefaultGroupID = "capper"

func (c *Config) defaults() {
	set := func(p *string, v string) {
		if *p == "" {
			*p = v
		}
	}
	setD := func(p *Duration, v time.Duration) {
		if *p == 0 {
			*p = Duration(v)
		}
	}
	set(&c.Kafka.GroupID, DefaultGroupID)
	set(&c.Kafka.Topics.Input, DefaultTopics.Input)
	set(&c.Kafka.Topics.Allowed, DefaultTopics.Allowed)
	set(&c.Kafka.Topics.Capped, DefaultTopics.Capped)
	set(&c.Kafka.Topics.DLQ, DefaultTopics.DLQ)
	set(&c.Kafka.Topics.Held, DefaultTopics.Held)
	set(&c.Kafka.Topics.DelayPrefix, DefaultTopics.DelayPrefix)
	setD(&c.Kafka.SessionTimeout, 30*time.Second)
	setD(&c.Kafka.RebalanceTimeout, time.Duration(c.Kafka.SessionTimeout)/2)
	setD(&c.Kafka.HeartbeatInterval, min(time.Duration(c.Kafka.SessionTimeout)/10, DefaultMaxHeartbeat))
	setD(&c.Redis.DialTimeout, time.Second)
	setD(&c.Redis.ReadTimeout, time.Second)
	setD(&c.Redis.WriteTimeout, time.Second)
	setD(&c.ShutdownTimeout, 30*time.Second)
	setD(&c.ClockCheckInterval, 30*time.Second)
	setD(&c.Rules.ReloadInterval, 10*time.Second)
	set(&c.MetricsAddr, ":9090")
	set(&c.LogLevel, "info")
}

// Validate checks every field and names the offending one.
func (c *Config) Validate() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("config: %s (%s): %s", field, envName(field), fmt.Sprintf(format, args...)))
	}
	if len(c.Kafka.Brokers) == 0 {
		bad("kafka.brokers", "at least one broker address is required")
	}
	switch c.Kafka.SASLMechanism {
	case "", "plain", "scram-sha-256", "scram-sha-512":
	default:
		bad("kafka.sasl_mechanism", "%q is not plain, scram-sha-256 or scram-sha-512", c.Kafka.SASLMechanism)
	}
	if c.Kafka.SASLMechanism != "" && (c.Kafka.SASLUsername == "" || c.Kafka.SASLPassword == "") {
		bad("kafka.sasl_username", "SASL needs a username and a password (CAPPER_KAFKA_SASL_PASSWORD or sasl_password_file)")
	}
	ts := c.Kafka.Topics
	if ts.Input == ts.Allowed || ts.Input == ts.Capped || ts.Input == ts.DLQ || ts.Input == ts.Held {
		bad("kafka.topics.input", "the input topic %q must differ from the output topics", ts.Input)
	}
	wheel, err := c.Wheel()
	if err != nil {
		bad("hold.tiers", "%v", err)
	}
	if wheel != nil {
		for _, t := range wheel.Tiers() {
			if t.Topic == ts.Input || t.Topic == ts.Allowed || t.Topic == ts.Capped || t.Topic == ts.DLQ || t.Topic == ts.Held {
				bad("kafka.topics.delay_prefix", "the delay topic %q is also another topic", t.Topic)
			}
		}
	}
	if len(c.Redis.Addrs) == 0 {
		bad("redis.addrs", "at least one address is required")
	}
	for _, f := range []struct {
		field string
		addrs []string
	}{{"kafka.brokers", c.Kafka.Brokers}, {"redis.addrs", c.Redis.Addrs}} {
		field := f.field
		for _, a := range f.addrs {
			host, port, err := net.SplitHostPort(a)
			if n, perr := strconv.Atoi(port); err != nil || perr != nil || n < 1 || n > 65535 || host == "" {
				bad(field, "%q is not host:port with a port in 1..65535", a)
			}
		}
	}
	if err := c.Redis.Limiter().Validate(); err != nil {
		bad("redis", "%v", err)
	}
	if c.Segments.Source == "" {
		bad("segments.source", "an s3://bucket/prefix URI or a directory is required")
	}
	if c.Batch.Size < 0 || c.Batch.Size > 100000 {
		bad("batch.size", "%d is not in 0..100000 (0: the default, %d)", c.Batch.Size, consumer.DefaultBatchSize)
	}
	for _, f := range []struct {
		field string
		d     Duration
	}{{"max_clock_skew", c.MaxClockSkew}, {"shutdown_timeout", c.ShutdownTimeout}, {"clock_check_interval", c.ClockCheckInterval},
		{"kafka.session_timeout", c.Kafka.SessionTimeout}, {"kafka.rebalance_timeout", c.Kafka.RebalanceTimeout},
		{"kafka.heartbeat_interval", c.Kafka.HeartbeatInterval}, {"rules.reload_interval", c.Rules.ReloadInterval},
		{"redis.dial_timeout", c.Redis.DialTimeout}, {"redis.read_timeout", c.Redis.ReadTimeout}, {"redis.write_timeout", c.Redis.WriteTimeout}} {
		if f.d < 0 {
			bad(f.field, "%v is negative", time.Duration(f.d))
		}
	}
	if hb, st := time.Duration(c.Kafka.HeartbeatInterval), time.Duration(c.Kafka.SessionTimeout); hb >= 0 && 3*hb > st {
		bad("kafka.heartbeat_interval", "%v is over a third of kafka.session_timeout (%v): two heartbeats lost would expire a live member", hb, st)
	}
	if r, hb := time.Duration(c.Kafka.RebalanceTimeout), time.Duration(c.Kafka.HeartbeatInterval); r >= 0 && r < 2*hb {
		bad("kafka.rebalance_timeout", "%v is under two heartbeats (%v: kafka.heartbeat_interval each): a live member could not rejoin in time", r, 2*hb)
	}
	if c.MetricsAddr != "off" {
		if _, port, err := net.SplitHostPort(c.MetricsAddr); err != nil {
			bad("metrics_addr", "%q is not host:port, :port or off (%v)", c.MetricsAddr, err)
		} else if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
			bad("metrics_addr", "%q: the port %q is not a number in 0..65535", c.MetricsAddr, port)
		}
	}
	if time.Duration(c.Batch.MaxWait) > time.Second {
		bad("batch.max_wait", "%v is over 1s", time.Duration(c.Batch.MaxWait))
	}
	if c.Hold.MaxWait < 0 || time.Duration(c.Hold.MaxWait) > time.Second {
		bad("hold.max_wait", "%v is not between 0 and 1s", time.Duration(c.Hold.MaxWait))
	}
	switch c.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		bad("log_level", "%q is not debug, info, warn or error", c.LogLevel)
	}
	wsErrs := c.validateWorkspaces(bad) // (bad appends to errs)
	errs = append(errs, wsErrs...)
	if c.HasWorkspaces() {
		return errors.Join(errs...)
	}
	if rs, err := rules.Compile(c.Rules, 0); err != nil {
		errs = append(errs, fmt.Errorf("config: %w", err))
	} else if w, err := c.Wheel(); err == nil {
		if err := CheckRules(rs, w); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// CheckRules reports whether rs can run on the delay tiers of wheel (nil:
// none): rules that hold jobs (a hold policy, quiet hours, a budget) need
// them. A rules reload is checked against the running worker's wheel, not
// the new file's hold.tiers, which only apply after a restart.
func CheckRules(rs *rules.Rules, wheel *hold.Wheel) error {
	if wheel == nil && rs.Holds() {
		return fmt.Errorf("config: rules hold jobs (a hold policy, quiet hours, a budget or an arbitration window) but there are no delay tiers (hold.tiers, %s, empty when the worker started): holding needs the delay topics", envName("hold.tiers"))
	}
	return nil
}

// Limiter returns the capping configuration of the whole configuration: the
// Redis settings, and the clock margin of max_clock_skew.
func (c *Config) Limiter() capping.Config {
	l := c.Redis.Limiter()
	l.ClockMargin = time.Duration(c.MaxClockSkew)
	return l
}

// Limiter returns the capping configuration these settings describe; zero
// fields take capping's defaults.
func (r Redis) Limiter() capping.Config {
	return capping.Config{
		KeyPrefix: r.KeyPrefix, Timeout: time.Duration(r.DecideTimeout), Pipelines: r.Pipelines,
		MinReplicasAcked: r.MinReplicasAcked, ReplicaTimeout: time.Duration(r.ReplicaTimeout),
		NearCache:  r.NearCacheSize,
		ScriptOnly: r.ScriptOnly,
	}
}

// envName is the environment variable of a field path: kafka.topics.input -> CAPPER_KAFKA_TOPICS_INPUT.
func envName(path string) string {
	return "CAPPER_" + strings.ToUpper(strings.NewReplacer(".", "_").Replace(path))
}

// applyEnv sets every scalar or string-list field from PREFIX_FIELD_PATH when set.
// Rules (lists of structs) come only from the file.
func applyEnv(v reflect.Value, prefix string, env func(string) (string, bool)) error {
	t := v.Type()
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		tag := strings.Split(f.Tag.Get("yaml"), ",")[0]
		if tag == "" || tag == "-" || !f.IsExported() {
			continue
		}
		name := prefix + "_" + strings.ToUpper(tag)
		fv := v.Field(i)
		if f.Type.Kind() == reflect.Struct {
			if err := applyEnv(fv, name, env); err != nil {
				return err
			}
			continue
		}
		val, ok := env(name)
		if !ok {
			continue
		}
		switch {
		case f.Type == reflect.TypeOf(Duration(0)):
			d, err := rules.ParseDuration(val)
			if err != nil {
				return fmt.Errorf("config: %s: %w", name, err)
			}
			fv.SetInt(int64(d))
		case f.Type.Kind() == reflect.String:
			fv.SetString(val)
		case f.Type.Kind() == reflect.Int:
			n, err := strconv.Atoi(val)
			if err != nil {
				return fmt.Errorf("config: %s: %q is not an integer", name, val)
			}
			fv.SetInt(int64(n))
		case f.Type.Kind() == reflect.Bool:
			b, err := strconv.ParseBool(val)
			if err != nil {
				return fmt.Errorf("config: %s: %q is not true or false", name, val)
			}
			fv.SetBool(b)
		case f.Type.Kind() == reflect.Slice && f.Type.Elem().Kind() == reflect.String:
			parts := []string{} // an empty variable is an empty list, not the default
			for _, p := range strings.Split(val, ",") {
				if p = strings.TrimSpace(p); p != "" {
					parts = append(parts, p)
				}
			}
			fv.Set(reflect.ValueOf(parts))
		}
	}
	return nil
}
