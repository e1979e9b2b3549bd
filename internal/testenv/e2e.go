package testenv

// End-to-end helpers: one test's slice of the local stack (its own topics,
// consumer group, key prefix and segment objects), producing jobs, reading
// what reached the output topics, and the accounting every end-to-end test
// asserts. Used by the tests of the capper binary and of the daemon.

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/RoaringBitmap/roaring/v2"
	"github.com/redis/go-redis/v9"
	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/kafkaadmin"
	"github.com/capper-dev/capper/output"
	"github.com/capper-dev/capper/segments/segtool"
)

// stack is one test's slice of the local stack: its own topics, group, key
// prefix and segment prefix.
type Stack struct {
	T       *testing.T
	Brokers []string
	Redis   []string
	Topics  [4]string // input, allowed, capped, dlq
	Held    string    // audit records of held jobs (with EnableHold)
	// External, Feedback and Preferences are the event topics (with EnableEvents).
	External, Feedback, Preferences string
	Prefix                          string // of Redis keys, S3 segment objects, topics and the group
	Config                          string // path of the worker's config file
	// DefaultCap is the daily cap of users in no segment that
	// CheckAccounting holds them to; 0: TestRules' 2.
	DefaultCap int

	// The secured stack's admin clients (NewSecureStack); zero: plain.
	dialer    *kafka.Dialer
	transport *kafka.Transport
	redisOpts redis.ClusterOptions
	rdb       *redis.ClusterClient // RedisClient's, made at the first call
}

// backend is where a Stack's slice lives and how the worker reaches it.
type backend struct {
	brokers, redis []string
	workerBrokers  []string // the worker's bootstrap addresses when not brokers (the mTLS listener)
	s3             string
	keyPrefix      func(name string) string
	kafkaConfig    string // extra lines of the worker's kafka section (TLS, SASL)
	redisConfig    string // extra lines of its redis section
}

const TestRules = `
rules:
  segments:
    - name: new
      caps: [{name: daily, window: 24h, limit: 2}]
    - name: active
      caps:
        - {name: daily, window: 24h, limit: 3}
        - {name: push-daily, window: 24h, limit: 1, channel: push}
    - name: dormant
      caps: [{name: daily, window: 24h, limit: 1}]
  default_caps: [{name: daily, window: 24h, limit: 2}]
  exempt_categories: [transactional]
`

// NewStack uploads segments new={1,2}, active={3,4}, dormant={5} plus the
// extra ids given, creates topics and writes a config file.
func NewStack(t *testing.T, partitions int, extra map[string][]uint32) *Stack {
	t.Helper()
	endpoint, _ := S3(t)
	s := &Stack{T: t}
	s.create(partitions, extra, backend{brokers: KafkaBrokers(t), redis: RedisAddrs(t), s3: endpoint,
		keyPrefix: func(name string) string { return name }})
	return s
}

func (s *Stack) create(partitions int, extra map[string][]uint32, b backend) {
	t := s.T
	t.Helper()
	s.Brokers, s.Redis = b.brokers, b.redis
	s.redisOpts.Addrs = b.redis
	_, bucket := S3(t)
	name := Unique("e2e")
	for i, suffix := range []string{"", ".allowed", ".capped", ".dlq"} {
		s.Topics[i] = name + suffix
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := kafkaadmin.CreateTopics(ctx, s.dialer, s.Brokers, partitions, s.Topics[:]...); err != nil {
		t.Fatal(err)
	}
	s.Prefix = b.keyPrefix(name)
	up := &segtool.Uploader{Client: S3Client(b.s3), Bucket: bucket, Prefix: name}
	segs := map[string][]uint32{"new": {1, 2}, "active": {3, 4}, "dormant": {5}}
	for k, v := range extra {
		segs[k] = append(segs[k], v...)
	}
	for seg, ids := range segs {
		data, err := segtool.Encode(roaring.BitmapOf(ids...))
		if err != nil {
			t.Fatal(err)
		}
		if err := up.Put(context.Background(), seg, data); err != nil {
			t.Fatal(err)
		}
	}
	workerBrokers := b.workerBrokers
	if workerBrokers == nil {
		workerBrokers = s.Brokers
	}
	cfg := fmt.Sprintf(`
kafka:
  brokers: [%s]
  group_id: %s
  topics: {input: %s, allowed: %s, capped: %s, dlq: %s}
  session_timeout: 6s
%sredis:
  addrs: [%s]
  key_prefix: %s
  read_timeout: 500ms
  write_timeout: 500ms
  decide_timeout: 1s
%ssegments:
  source: s3://%s/%s
  s3_endpoint: %s
  s3_path_style: true
batch: {size: 200, max_wait: 50ms}
hold:
  tiers: []
metrics_addr: "off"
shutdown_timeout: 10s
log_level: warn
%s`, strings.Join(workerBrokers, ", "), name, s.Topics[0], s.Topics[1], s.Topics[2], s.Topics[3], b.kafkaConfig,
		strings.Join(s.Redis, ", "), s.Prefix, b.redisConfig, bucket, name, b.s3, TestRules)
	s.Config = filepath.Join(t.TempDir(), "capper.yaml")
	if err := os.WriteFile(s.Config, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
}

// roundTripper is the admin's transport; nil (kafka-go's default) on the plain stack.
func (s *Stack) roundTripper() kafka.RoundTripper {
	if s.transport == nil {
		return nil
	}
	return s.transport
}

// RedisClient returns a client of the stack's Redis Cluster (the admin's on
// the secured stack), closed when the test ends.
func (s *Stack) RedisClient() *redis.ClusterClient {
	if s.rdb == nil {
		opts := s.redisOpts
		c := redis.NewClusterClient(&opts)
		s.T.Cleanup(func() { _ = c.Close() })
		s.rdb = c
	}
	return s.rdb
}

// EnableHold creates the held topic and a delay topic per tier (e.g. "1s",
// "5s") and configures the worker to hold jobs on them.
func (s *Stack) EnableHold(partitions int, tiers ...string) {
	s.T.Helper()
	name := s.Topics[0]
	s.Held = name + ".held"
	topics := []string{s.Held}
	for _, t := range tiers {
		topics = append(topics, name+".delay."+t)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := kafkaadmin.CreateTopics(ctx, s.dialer, s.Brokers, partitions, topics...); err != nil {
		s.T.Fatal(err)
	}
	s.EditConfig("dlq: "+s.Topics[3]+"}", fmt.Sprintf("dlq: %s, held: %s, delay_prefix: %s.delay.}", s.Topics[3], s.Held, name))
	s.EditConfig("  tiers: []", "  tiers: ["+strings.Join(tiers, ", ")+"]")
}

// EnableEvents creates the external sends', the feedback's and the
// preferences' topics and configures the worker to read them
// (Stack.External, Stack.Feedback, Stack.Preferences).
func (s *Stack) EnableEvents(partitions int) {
	s.T.Helper()
	s.External, s.Feedback, s.Preferences = s.Topics[0]+".external", s.Topics[0]+".feedback", s.Topics[0]+".preferences"
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := kafkaadmin.CreateTopics(ctx, s.dialer, s.Brokers, partitions, s.External, s.Feedback, s.Preferences); err != nil {
		s.T.Fatal(err)
	}
	s.EditConfig("dlq: "+s.Topics[3], fmt.Sprintf("external: %s, feedback: %s, preferences: %s, dlq: %s", s.External, s.Feedback, s.Preferences, s.Topics[3]))
}

// Workspace is one workspace of a stack with workspaces: its rules file's
// content (the fields of the rules section) and its segments' users.
type Workspace struct {
	Name     string
	Rules    string
	Segments map[string][]uint32
}

// EnableWorkspaces replaces the stack's rules by workspaces, each with its
// rules file next to the config file and its segments under its own
// prefix; def is default_workspace, shared the rules section's content (the
// shared budgets; "" for none).
func (s *Stack) EnableWorkspaces(def, shared string, ws ...Workspace) {
	s.T.Helper()
	var list strings.Builder
	list.WriteString("workspaces:\n")
	for _, w := range ws {
		s.WriteWorkspace(w)
		fmt.Fprintf(&list, "  - {name: %s, rules_file: %s.yaml}\n", w.Name, w.Name)
	}
	fmt.Fprintf(&list, "default_workspace: %q\n", def)
	if shared != "" {
		list.WriteString("rules:\n" + shared + "\n")
	}
	s.EditConfig(TestRules, "\n"+list.String())
}

// WriteWorkspace writes w's rules file and uploads its segments.
func (s *Stack) WriteWorkspace(w Workspace) {
	s.T.Helper()
	if err := os.WriteFile(filepath.Join(filepath.Dir(s.Config), w.Name+".yaml"), []byte(w.Rules), 0o644); err != nil {
		s.T.Fatal(err)
	}
	endpoint, bucket := S3(s.T)
	up := &segtool.Uploader{Client: S3Client(endpoint), Bucket: bucket, Prefix: s.Topics[0] + "/" + w.Name}
	for seg, ids := range w.Segments {
		data, err := segtool.Encode(roaring.BitmapOf(ids...))
		if err != nil {
			s.T.Fatal(err)
		}
		if err := up.Put(context.Background(), seg, data); err != nil {
			s.T.Fatal(err)
		}
	}
}

// ProduceEvents writes JSON events to topic, keyed by their user_id.
func (s *Stack) ProduceEvents(topic string, events ...map[string]any) {
	s.T.Helper()
	msgs := make([]kafka.Message, 0, len(events))
	for _, e := range events {
		b, err := json.Marshal(e)
		if err != nil {
			s.T.Fatal(err)
		}
		msgs = append(msgs, kafka.Message{Key: []byte(fmt.Sprint(e["user_id"])), Value: b})
	}
	s.produceTo(topic, msgs)
}

// JobSpec is one job to produce; Campaign defaults to "c1".
type JobSpec struct {
	ID, Channel, Category string
	User                  uint32
	Campaign, Timezone    string
	Tags                  []string
	ExpiresAt             time.Time
	Priority              *int   // nil: the job has none
	Workspace             string // "": the job names none
	CampaignEndsAt        time.Time
	CollapseKey           string
}

func (s *Stack) Produce(jobs []JobSpec, raw ...kafka.Message) {
	s.T.Helper()
	msgs := make([]kafka.Message, 0, len(jobs)+len(raw))
	for _, j := range jobs {
		campaign := j.Campaign
		if campaign == "" {
			campaign = "c1"
		}
		v := map[string]any{"job_id": j.ID, "user_id": j.User, "campaign_id": campaign, "channel": j.Channel, "payload": map[string]any{"subject": "hi"}}
		if j.Category != "" {
			v["category"] = j.Category
		}
		if j.Timezone != "" {
			v["timezone"] = j.Timezone
		}
		if len(j.Tags) > 0 {
			v["tags"] = j.Tags
		}
		if j.CollapseKey != "" {
			v["collapse_key"] = j.CollapseKey
		}
		if !j.ExpiresAt.IsZero() {
			v["expires_at"] = j.ExpiresAt.UTC().Format(time.RFC3339Nano)
		}
		if j.Priority != nil {
			v["priority"] = *j.Priority
		}
		if j.Workspace != "" {
			v["workspace"] = j.Workspace
		}
		if !j.CampaignEndsAt.IsZero() {
			v["campaign_ends_at"] = j.CampaignEndsAt.UTC().Format(time.RFC3339Nano)
		}
		b, _ := json.Marshal(v)
		msgs = append(msgs, kafka.Message{Key: []byte(strconv.Itoa(int(j.User))), Value: b})
	}
	msgs = append(msgs, raw...)
	s.produceTo(s.Topics[0], msgs)
}

// produceTo writes msgs to topic, retrying while the topic is new.
func (s *Stack) produceTo(topic string, msgs []kafka.Message) {
	s.T.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var err error
	// kafka-go caches topic metadata in the writer's transport, so a retry after
	// "Unknown Topic Or Partition" (a topic just created, whose partitions a busy
	// broker may take seconds to lead) needs a new writer. Only the messages that
	// failed are written again: a partial write is not repeated.
	for attempt := 1; ; attempt++ {
		w := &kafka.Writer{Addr: kafka.TCP(s.Brokers...), Topic: topic, Balancer: &kafka.Murmur2Balancer{}, RequiredAcks: kafka.RequireAll, BatchTimeout: 2 * time.Millisecond, BatchSize: 1000, Transport: s.roundTripper()}
		err = w.WriteMessages(ctx, msgs...)
		w.Close()
		if err == nil {
			return
		}
		var failed kafka.WriteErrors
		if errors.As(err, &failed) && len(failed) == len(msgs) {
			left := msgs[:0:0]
			for i, e := range failed {
				if e != nil {
					left = append(left, msgs[i])
				}
			}
			msgs = left
		}
		select {
		case <-ctx.Done():
			s.T.Errorf("produce to %s: %v (%d attempts in 60 s)", topic, err, attempt)
			return
		case <-time.After(300 * time.Millisecond):
		}
	}
}

// Output is one message on an output topic: what capper says of it
// (output.Parse), its topic, and its job's id and user.
type Output struct {
	output.Output
	Topic, JobID string
	User         uint32
}

// Collect reads the three output topics until want messages arrived or the
// timeout passes.
func (s *Stack) Collect(want int, timeout time.Duration) []Output {
	s.T.Helper()
	return s.CollectFrom(s.Topics[1:], want, timeout)
}

// CollectFrom reads topics until want messages arrived or the timeout passes.
func (s *Stack) CollectFrom(topics []string, want int, timeout time.Duration) []Output {
	s.T.Helper()
	return s.collect(topics, func(outs []Output) bool { return len(outs) >= want }, timeout)
}

// CollectAll reads every message topic holds now: the sum over its
// partitions of the end offset less the first, looked up once, then read.
func (s *Stack) CollectAll(topic string, timeout time.Duration) []Output {
	s.T.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	c := s.adminClient()
	md, err := c.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil || len(md.Topics) != 1 || md.Topics[0].Error != nil {
		s.T.Fatalf("metadata of %s: %v %+v", topic, err, md)
	}
	var reqs []kafka.OffsetRequest
	for _, p := range md.Topics[0].Partitions {
		reqs = append(reqs, kafka.FirstOffsetOf(p.ID), kafka.LastOffsetOf(p.ID))
	}
	offs, err := c.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: reqs}})
	if err != nil {
		s.T.Fatalf("offsets of %s: %v", topic, err)
	}
	total := 0
	for _, p := range offs.Topics[topic] {
		if p.Error != nil {
			s.T.Fatalf("offsets of %s partition %d: %v", topic, p.Partition, p.Error)
		}
		total += int(p.LastOffset - p.FirstOffset)
	}
	if total == 0 {
		return nil
	}
	outs := s.CollectFrom([]string{topic}, total, timeout)
	if len(outs) < total {
		s.T.Errorf("%s: read %d of its %d messages in %v", topic, len(outs), total, timeout)
	}
	return outs
}

// CollectJobs reads the three output topics until every job has an output
// (redelivered jobs may have more) or the timeout passes.
func (s *Stack) CollectJobs(jobs []JobSpec, timeout time.Duration) []Output {
	s.T.Helper()
	missing := map[string]bool{}
	for _, j := range jobs {
		missing[j.ID] = true
	}
	seen := 0 // outputs already looked at
	return s.collect(s.Topics[1:], func(outs []Output) bool {
		for _, o := range outs[seen:] {
			delete(missing, o.JobID)
		}
		seen = len(outs)
		return len(missing) == 0
	}, timeout)
}

// collect reads topics until done (called with everything read so far,
// under a lock) returns true or the timeout passes.
func (s *Stack) collect(topics []string, done func([]Output) bool, timeout time.Duration) []Output {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var mu sync.Mutex
	var outs []Output
	err := output.Read(ctx, output.ReadConfig{Brokers: s.Brokers, Dialer: s.dialer, Topics: topics, Group: Unique("reader"),
		MaxWait: 200 * time.Millisecond}, func(m *output.Message) error {
		if m.Err != nil {
			s.T.Errorf("%s offset %d: %v", m.Topic, m.Offset, m.Err)
		}
		o := Output{Output: m.Output, Topic: m.Topic}
		var j struct {
			JobID  string `json:"job_id"`
			UserID uint32 `json:"user_id"`
		}
		_ = json.Unmarshal(m.Value, &j)
		o.JobID, o.User = j.JobID, j.UserID
		mu.Lock()
		defer mu.Unlock()
		outs = append(outs, o)
		if done(outs) {
			cancel()
		}
		return nil
	})
	if err != nil {
		s.T.Errorf("collect %v: %v", topics, err)
	}
	return outs
}

// blast makes n jobs for users 1..users (ids 1-5 are in segments, the rest
// default), channels mixed.
func Blast(prefix string, n, users int) []JobSpec {
	jobs := make([]JobSpec, n)
	chans := []string{"email", "push", "sms"}
	for i := range jobs {
		jobs[i] = JobSpec{ID: fmt.Sprintf("%s-%d", prefix, i), User: uint32(1 + i%users), Channel: chans[i%3]}
	}
	return jobs
}

// checkAccounting asserts that every job reached an output topic, that no
// user's allowed sends (unique job ids) exceed its daily cap, and that Redis
// logged each allowed job exactly once. With exactLog false (a master crashed
// without min_replicas_acked, so recorded sends may be lost with it) Redis
// must log no more than the allowed jobs: none counted twice.
func (s *Stack) CheckAccounting(jobs []JobSpec, outs []Output, exactLog bool) {
	s.T.Helper()
	seen := map[string]bool{}
	allowed := map[uint32]map[string]bool{}
	for _, o := range outs {
		seen[o.JobID] = true
		if o.Decision == "allowed" || o.Decision == "duplicate" {
			if allowed[o.User] == nil {
				allowed[o.User] = map[string]bool{}
			}
			allowed[o.User][o.JobID] = true
		}
	}
	missing := 0
	for _, j := range jobs {
		if !seen[j.ID] {
			missing++
		}
	}
	if missing > 0 {
		s.T.Errorf("%d of %d jobs reached no output topic", missing, len(jobs))
	}
	limit := map[uint32]int{1: 2, 2: 2, 3: 3, 4: 3, 5: 1}
	rdb := s.RedisClient()
	users := map[uint32]bool{}
	for _, j := range jobs {
		users[j.User] = true
	}
	for u := range users {
		l, ok := limit[u]
		if !ok {
			l = cmp.Or(s.DefaultCap, 2)
		}
		if n := len(allowed[u]); n > l {
			s.T.Errorf("user %d: %d unique jobs allowed, cap %d", u, n, l)
		}
		logged := SentLen(s.T, rdb, fmt.Sprintf("%s:{%d}", s.Prefix, u))
		if int(logged) > len(allowed[u]) || exactLog && int(logged) != len(allowed[u]) {
			s.T.Errorf("user %d: %d sends logged in Redis, %d unique jobs allowed (a job counted twice or lost)", u, logged, len(allowed[u]))
		}
	}
}

// freezeMaster stops (SIGSTOP) the Redis master that owns user's key and
// returns the function that resumes it and waits for the cluster to be ok.
func (s *Stack) FreezeMaster(t *testing.T, user uint32) (resume func()) {
	t.Helper()
	rdb := s.RedisClient()
	master, err := rdb.MasterForKey(context.Background(), fmt.Sprintf("%s:{%d}", s.Prefix, user))
	if err != nil {
		t.Fatal(err)
	}
	pid := RedisPID(t, master.Options().Addr)
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	done := false
	resume = func() {
		if done {
			return
		}
		done = true
		_ = syscall.Kill(pid, syscall.SIGCONT)
		WaitClusterOK(t, rdb)
	}
	t.Cleanup(resume)
	return resume
}

func CountDecision(outs []Output, decision string) int {
	n := 0
	for _, o := range outs {
		if o.Decision == decision {
			n++
		}
	}
	return n
}

// editConfig replaces old by new in the test's config file.
func (s *Stack) EditConfig(old, new string) {
	s.T.Helper()
	b, err := os.ReadFile(s.Config)
	if err != nil {
		s.T.Fatal(err)
	}
	edited := strings.Replace(string(b), old, new, 1)
	if edited == string(b) {
		s.T.Fatalf("config has no %q to replace", old)
	}
	if err := os.WriteFile(s.Config, []byte(edited), 0o644); err != nil {
		s.T.Fatal(err)
	}
}

// masterOf returns the address of the master that owns user's log.
func (s *Stack) MasterOf(user uint32) string {
	s.T.Helper()
	m, err := s.RedisClient().MasterForKey(context.Background(), fmt.Sprintf("%s:{%d}", s.Prefix, user))
	if err != nil {
		s.T.Fatal(err)
	}
	return m.Options().Addr
}

// NullHeaders reads every record of topic with kafka-go's protocol client,
// which, unlike its Reader, tells a null header value from an empty one (as
// Java's Header.value() and librdkafka do), and returns "header@offset" for
// each header whose value is null.
func (s *Stack) NullHeaders(topic string) []string {
	s.T.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := &kafka.Client{Addr: kafka.TCP(s.Brokers...), Transport: s.roundTripper()}
	md, err := c.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil || len(md.Topics) != 1 || md.Topics[0].Error != nil {
		s.T.Fatalf("metadata of %s: %v %+v", topic, err, md)
	}
	var nulls []string
	for _, p := range md.Topics[0].Partitions {
		for offset := int64(0); ; {
			res, err := c.Fetch(ctx, &kafka.FetchRequest{Topic: topic, Partition: p.ID, Offset: offset, MaxBytes: 1 << 20, MaxWait: 100 * time.Millisecond})
			if err != nil || res.Error != nil {
				s.T.Fatalf("fetch %s/%d at %d: %v %v", topic, p.ID, offset, err, res.Error)
			}
			if offset >= res.HighWatermark {
				break
			}
			read := 0
			for {
				r, err := res.Records.ReadRecord()
				if err != nil {
					break
				}
				read++
				for _, h := range r.Headers {
					if h.Value == nil {
						nulls = append(nulls, fmt.Sprintf("%s@%d/%d", h.Key, p.ID, r.Offset))
					}
				}
				offset = r.Offset + 1
			}
			if read == 0 {
				s.T.Fatalf("fetch %s/%d at %d: no records below the high watermark %d", topic, p.ID, offset, res.HighWatermark)
			}
		}
	}
	return nulls
}

// SentLen is how many sends the log at key holds (its marks of refused
// sends apart).
func SentLen(t testing.TB, c redis.Cmdable, key string) int {
	t.Helper()
	l, err := capping.ReadLog(context.Background(), c, key)
	if err != nil {
		t.Errorf("%v", err)
	}
	n := 0
	for _, e := range l {
		if e.At > 0 {
			n++
		}
	}
	return n
}

// LogLen returns how many items (sends and marks) the log at key holds
// (capping.LogLen); t fails on an error reading it.
func LogLen(t testing.TB, c redis.Cmdable, key string) int {
	t.Helper()
	n, err := capping.LogLen(context.Background(), c, key)
	if err != nil {
		t.Errorf("%v", err)
	}
	return n
}
