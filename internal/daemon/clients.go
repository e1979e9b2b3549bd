package daemon

// The clients of capper's backends, built from the configuration: shared by
// the daemon and by the tools (loadgen, report, check).

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/sasl"
	"github.com/segmentio/kafka-go/sasl/plain"
	"github.com/segmentio/kafka-go/sasl/scram"

	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/segments"
)

// NewLogger returns the JSON logger every line of the process goes through,
// go-redis's own lines included (component "redis", level warn: they report
// connection trouble the worker also retries and counts).
func NewLogger(level string, w io.Writer) *slog.Logger {
	var l slog.Level
	_ = l.UnmarshalText([]byte(level))
	log := slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: l}))
	redis.SetLogger(&redisLogger{l: log.With("component", "redis"), seen: map[string]time.Time{}})
	if w == io.Writer(os.Stderr) { // the process's own stream (not a test's buffer): the AWS SDK's lines
		// (segments) and any library's that logs through slog join it, one stream of JSON lines
		slog.SetDefault(log)
	}
	return log
}

// redisLogger is go-redis's internal logger, in slog: a line at warn once
// per redisLogEvery, its repeats at debug (a node that refuses connections
// makes go-redis say so on every dial).
type redisLogger struct {
	l    *slog.Logger
	mu   sync.Mutex
	seen map[string]time.Time // line -> when it was last logged at warn
}

const redisLogEvery = 30 * time.Second

func (r *redisLogger) Printf(ctx context.Context, format string, v ...any) {
	msg := strings.TrimPrefix(fmt.Sprintf(format, v...), "redis: ")
	now := time.Now()
	r.mu.Lock()
	repeat := now.Sub(r.seen[msg]) < redisLogEvery
	if !repeat {
		if len(r.seen) > 1000 {
			clear(r.seen)
		}
		r.seen[msg] = now
	}
	r.mu.Unlock()
	if repeat {
		r.l.DebugContext(ctx, msg)
		return
	}
	r.l.WarnContext(ctx, msg)
}

// kafkaLogger is a kafka-go logger writing at level with component "kafka":
// kafka-go's errors at warn (the worker retries them), its chatter at debug.
func kafkaLogger(l *slog.Logger, level slog.Level) kafka.LoggerFunc {
	l = l.With("component", "kafka")
	return func(msg string, args ...any) {
		if ctx := context.Background(); l.Enabled(ctx, level) {
			l.Log(ctx, level, fmt.Sprintf(msg, args...))
		}
	}
}

func tlsConfig(c config.TLS, field string) (*tls.Config, error) {
	if !c.Enabled {
		return nil, nil
	}
	tc := &tls.Config{ServerName: c.ServerName, MinVersion: tls.VersionTLS12}
	if c.CAFile != "" {
		pem, err := os.ReadFile(c.CAFile)
		if err != nil {
			return nil, fmt.Errorf("%s.ca_file: %w", field, err)
		}
		tc.RootCAs = x509.NewCertPool()
		if !tc.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("%s.ca_file: no PEM certificate in %s", field, c.CAFile)
		}
	}
	if c.CertFile != "" || c.KeyFile != "" {
		cert, err := tls.LoadX509KeyPair(c.CertFile, c.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("%s.cert_file/key_file: %w", field, err)
		}
		// A client certificate out of its validity fails every handshake
		// with a bare alert from the server: say so here.
		if now := time.Now(); cert.Leaf != nil && (now.After(cert.Leaf.NotAfter) || now.Before(cert.Leaf.NotBefore)) {
			when := "expired at " + cert.Leaf.NotAfter.Format(time.RFC3339)
			if now.Before(cert.Leaf.NotBefore) {
				when = "is not valid before " + cert.Leaf.NotBefore.Format(time.RFC3339)
			}
			return nil, fmt.Errorf("%s.cert_file %s: the client certificate (%s) %s", field, c.CertFile, cert.Leaf.Subject, when)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// roundTrips counts pipelines and commands sent to Redis nodes.
type roundTrips struct{ n atomic.Uint64 }

func (r *roundTrips) DialHook(next redis.DialHook) redis.DialHook { return next }
func (r *roundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { r.n.Add(1); return next(ctx, cmd) }
}
func (r *roundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error { r.n.Add(1); return next(ctx, cmds) }
}

// redisProtocol is RESP2: capper uses no feature of RESP3 (client-side
// caching, maintenance notifications), its replies read alike in both, and
// on a RESP3 connection (go-redis's default) the client looks at every reply
// for a push notification first: about a sixth of a pipeline's CPU in
// BenchmarkBacklog's profile.
const redisProtocol = 2

// newRedis returns a cluster client for several addresses, a plain client for one.
func newRedis(c config.Redis, trips *roundTrips) (redis.UniversalClient, error) {
	tc, err := tlsConfig(c.TLS, "redis.tls")
	if err != nil {
		return nil, err
	}
	if len(c.Addrs) == 1 {
		cl := redis.NewClient(&redis.Options{
			Addr: c.Addrs[0], Username: c.Username, Password: string(c.Password), TLSConfig: tc,
			DisableIdentity: true, Protocol: redisProtocol,
			DialTimeout: time.Duration(c.DialTimeout), ReadTimeout: time.Duration(c.ReadTimeout), WriteTimeout: time.Duration(c.WriteTimeout),
		})
		cl.AddHook(trips)
		return cl, nil
	}
	cl := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs: c.Addrs, Username: c.Username, Password: string(c.Password), TLSConfig: tc,
		DisableIdentity: true, // no CLIENT SETINFO: not in capper's ACL
		Protocol:        redisProtocol,
		DialTimeout:     time.Duration(c.DialTimeout), ReadTimeout: time.Duration(c.ReadTimeout), WriteTimeout: time.Duration(c.WriteTimeout),
		// The limiter reloads the slot map itself when a node fails or
		// redirects; the periodic reload (go-redis: 60s) is only a safety net.
		ClusterStateReloadInterval: 10 * time.Second,
		// A dead node refuses at once; the worker's own backoff retries, so
		// go-redis need not redial it five times per attempt.
		DialerRetries: 1,
	})
	cl.OnNewNode(func(n *redis.Client) { n.AddHook(trips) })
	return cl, nil
}

func kafkaSASL(c config.Kafka) (sasl.Mechanism, error) {
	switch c.SASLMechanism {
	case "":
		return nil, nil
	case "plain":
		return plain.Mechanism{Username: c.SASLUsername, Password: string(c.SASLPassword)}, nil
	case "scram-sha-256":
		return scram.Mechanism(scram.SHA256, c.SASLUsername, string(c.SASLPassword))
	default:
		return scram.Mechanism(scram.SHA512, c.SASLUsername, string(c.SASLPassword))
	}
}

// KafkaClients returns the dialer (readers, admin) and transport (writers)
// that carry the configured TLS and SASL.
func KafkaClients(c config.Kafka) (*kafka.Dialer, *kafka.Transport, error) {
	tc, err := tlsConfig(c.TLS, "kafka.tls")
	if err != nil {
		return nil, nil, err
	}
	mech, err := kafkaSASL(c)
	if err != nil {
		return nil, nil, fmt.Errorf("kafka.sasl_mechanism: %w", err)
	}
	dialer := &kafka.Dialer{Timeout: 10 * time.Second, DialFunc: dialWithReadGrace, TLS: tc, SASLMechanism: mech}
	transport := &kafka.Transport{TLS: tc, SASL: mech, Dial: (&net.Dialer{Timeout: 10 * time.Second}).DialContext}
	return dialer, transport, nil
}

// fetchReplyGrace is how late past the read deadline kafka-go sets a broker's
// reply may come on a connection of KafkaClients' dialer. kafka-go's reader
// gives a fetch the deadline of its MaxWait and asks the broker to wait three
// quarters of it, so a broker that answers an idle fetch a quarter of MaxWait
// late (25 ms on the 100 ms tiers; a broker busy with a drain does) ends the
// connection: the reader logs an i/o timeout, dials again and reads the
// partition's offsets before it fetches, and a held send due then comes back
// that much later. Java's consumer gives the same reply request.timeout.ms
// (30 s). The grace also delays by as much kafka-go's finding of a broker that
// stopped answering (one that closed the connection is found at once).
const fetchReplyGrace = time.Second

// dialWithReadGrace dials as kafka-go's dialer does and gives the connection's
// read deadlines fetchReplyGrace more; its write deadlines are kept.
func dialWithReadGrace(ctx context.Context, network, address string) (net.Conn, error) {
	c, err := (&net.Dialer{}).DialContext(ctx, network, address)
	if err != nil {
		return nil, err
	}
	return graceConn{c}, nil
}

type graceConn struct{ net.Conn }

func (c graceConn) SetReadDeadline(t time.Time) error { return c.Conn.SetReadDeadline(withGrace(t)) }

func (c graceConn) SetDeadline(t time.Time) error {
	return errors.Join(c.Conn.SetReadDeadline(withGrace(t)), c.Conn.SetWriteDeadline(t))
}

func withGrace(t time.Time) time.Time {
	if t.IsZero() {
		return t
	}
	return t.Add(fetchReplyGrace)
}

// NewWriter returns a synchronous writer that waits for all in-sync replicas
// and partitions by key like the Java client. With topic empty, each message
// names its topic.
func NewWriter(c config.Kafka, transport *kafka.Transport, topic string, batchSize int, logger *slog.Logger) *kafka.Writer {
	return &kafka.Writer{
		Addr:         kafka.TCP(c.Brokers...),
		Topic:        topic,
		Balancer:     &kafka.Murmur2Balancer{},
		RequiredAcks: kafka.RequireAll,
		// Messages per partition per produce request. kafka-go allocates the
		// whole capacity for every partition batch, so it stays near what one
		// partition gets from one output batch rather than the whole batch.
		BatchSize:    min(max(100, batchSize), 512),
		BatchBytes:   int64(cmp.Or(c.MaxBatchBytes, consumer.DefaultMaxOutputBytes)),
		BatchTimeout: 2 * time.Millisecond,
		MaxAttempts:  3,
		WriteTimeout: 10 * time.Second,
		Transport:    newPartitionCounts(transport),
		Logger:       kafkaLogger(logger, slog.LevelDebug),
		ErrorLogger:  kafkaLogger(logger, slog.LevelWarn),
	}
}

func newKafka(c config.Kafka, batchSize int, member []byte, faults *consumer.ReaderFaults, logger *slog.Logger) (*kafka.Reader, *kafka.Writer, error) {
	dialer, transport, err := KafkaClients(c)
	if err != nil {
		return nil, nil, err
	}
	r := newReader(c, dialer, c.GroupID, c.Topics.Input, 16<<20, max(100, 2*batchSize), readerMaxWait, memberBalancer{member: member}, faults, logger)
	return r, NewWriter(c, transport, "", batchSize, logger), nil
}

// newTierReader reads one delay tier in its own consumer group
// (group_id.delay.TIER), so that each tier is consumed in order and waits on
// its own head.
func newTierReader(c config.Kafka, t hold.Tier, member []byte, faults *consumer.ReaderFaults, logger *slog.Logger) (*tierSource, error) {
	dialer, _, err := KafkaClients(c)
	if err != nil {
		return nil, err
	}
	s := &tierSource{}
	// A small queue: messages wait there for their head.
	s.Reader = newReader(c, dialer, TierGroup(c.GroupID, t.Name), t.Topic, 4<<20, 1000, tierMaxWait(t.Delay), memberBalancer{member: member, joins: &s.joins}, faults, logger)
	return s, nil
}

// tierSource is a tier's reader as hold.Reader reads it, telling its
// group's generations (hold.Rebalancer): the joins its balancer was asked
// for, and the assignments from kafka-go's stats (which hand out the counts
// since their last call: nothing else may read them; they count a
// partition's change of leader too).
type tierSource struct {
	*kafka.Reader
	joins    atomic.Int64
	assigned int64
}

func (s *tierSource) Generations() (joined, assigned int64) {
	s.assigned += s.Stats().Rebalances
	return s.joins.Load(), s.assigned
}

// TierGroup is the consumer group that reads the delay tier named tier.
func TierGroup(group, tier string) string { return group + ".delay." + tier }

// tierMaxWait is how long a fetch of a tier's partition with nothing new
// waits: a tenth of the tier's delay, from 100 ms to readerMaxWait. A member
// rejoins its rebalancing group only once each of its partition readers'
// fetches has returned (kafka-go does not cut one short), and the group reads
// nothing until its last member has rejoined: an idle partition keeps its
// tier's group stopped up to this long, and the sends due meanwhile come back
// that late and take their budget's tokens late (docs/design.md). The short
// tiers, which return the sends due within a budget's window, wait the least;
// the long ones, mostly idle, fetch less often.
func tierMaxWait(delay time.Duration) time.Duration {
	return min(max(delay/10, 100*time.Millisecond), readerMaxWait)
}

// newReader is a consumer-group reader of topic that commits only when told
// (after the outputs are acknowledged); a fetch waits up to maxWait for new
// messages. kafka-go's errors go through faults, which sees the refusals it
// only logs. member (newMember) is carried in its join metadata, so that the
// group's answer tells which partitions are its (memberPartitions).
func newReader(c config.Kafka, dialer *kafka.Dialer, group, topic string, maxBytes, queue int, maxWait time.Duration, balancer memberBalancer, faults *consumer.ReaderFaults, logger *slog.Logger) *kafka.Reader {
	return kafka.NewReader(kafka.ReaderConfig{
		Brokers:           c.Brokers,
		GroupID:           group,
		Topic:             topic,
		Dialer:            dialer,
		MinBytes:          1,
		MaxBytes:          maxBytes,
		MaxWait:           maxWait,
		CommitInterval:    0, // synchronous commits, after the outputs are acknowledged
		StartOffset:       kafka.FirstOffset,
		SessionTimeout:    time.Duration(c.SessionTimeout),
		RebalanceTimeout:  time.Duration(c.RebalanceTimeout),
		HeartbeatInterval: time.Duration(c.HeartbeatInterval),
		QueueCapacity:     queue,
		GroupBalancers:    []kafka.GroupBalancer{balancer, kafka.RoundRobinGroupBalancer{}},
		Logger:            kafkaLogger(logger, slog.LevelDebug),
		ErrorLogger:       faults.ErrorLogger(kafkaLogger(logger, slog.LevelWarn)),
	})
}

// memberBalancer is kafka-go's range balancer (its default's first) with the
// reader's member token as the user data of its join metadata: the group
// coordinator keeps it and DescribeGroups answers it with the member's
// assignment. The assignment itself is the range balancer's, so members of
// earlier versions, which send no token, share a group with it.
type memberBalancer struct {
	kafka.RangeGroupBalancer
	member []byte
	joins  *atomic.Int64 // counts the joins (each asks for the user data); nil: not counted
}

func (b memberBalancer) UserData() ([]byte, error) {
	if b.joins != nil {
		b.joins.Add(1)
	}
	return b.member, nil
}

var members atomic.Int64

// newMember returns a token no other reader of any process has: the
// process's id, its start and a count.
func newMember() []byte {
	return fmt.Appendf(nil, "capper %d-%d-%d", os.Getpid(), processStart.UnixNano(), members.Add(1))
}

var processStart = time.Now()

// newCacheReader reads topic from its end in a consumer group of this
// process's own that never commits (Kafka deletes it once the process
// leaves): every replica sees every event from its start on.
func newCacheReader(c config.Kafka, dialer *kafka.Dialer, group, topic string, logger *slog.Logger) *kafka.Reader {
	return kafka.NewReader(kafka.ReaderConfig{
		Brokers: c.Brokers, GroupID: fmt.Sprintf("%s-cache.%d-%d", group, os.Getpid(), time.Now().UnixNano()),
		Topic: topic, Dialer: dialer, MinBytes: 1, MaxBytes: 1 << 20, MaxWait: 500 * time.Millisecond,
		StartOffset: kafka.LastOffset, SessionTimeout: time.Duration(c.SessionTimeout), RebalanceTimeout: time.Duration(c.RebalanceTimeout),
		HeartbeatInterval: time.Duration(c.HeartbeatInterval),
		Logger:            kafkaLogger(logger, slog.LevelDebug), ErrorLogger: kafkaLogger(logger, slog.LevelWarn),
	})
}

// NewSegmentSource opens the configured segment source.
func NewSegmentSource(ctx context.Context, c config.Segments) (segments.Source, error) {
	return segments.OpenSource(ctx, c.Source, segments.S3Config{Endpoint: c.S3Endpoint, Region: c.S3Region, PathStyle: c.S3PathStyle})
}
