package daemon

// Start-up checks of the backends. A backend that is down is waited for
// (with backoff, up to a bound); a configuration that cannot work (a wrong
// password, an untrusted or expired certificate, a missing grant) fails at
// once with one error naming the backend, the cause and the settings to
// check, so that a rollout stops with the reason instead of a crash loop of
// timeouts.

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/internal/backoff"
	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/fault"
)

// backendStartup bounds how long start-up waits for a backend that does not answer.
const backendStartup = 30 * time.Second

// permanent wraps err, when fault names a cause, as the start-up error of backend.
func permanent(backend string, where any, err error) error {
	cause := fault.Cause(err)
	if cause == "" {
		return nil
	}
	return fmt.Errorf("%s %v: %s: %s: %w", backend, where, cause, fault.Hint(backend, cause), err)
}

func connectRedis(ctx context.Context, rdb capping.Client, addrs []string, lc capping.Config, log *slog.Logger) (*capping.Limiter, error) {
	ctx, cancel := context.WithTimeout(ctx, backendStartup)
	defer cancel()
	retry := backoff.New(250*time.Millisecond, 5*time.Second)
	for {
		lim, err := capping.New(ctx, rdb, lc)
		if err == nil {
			// SCRIPT LOAD may be granted where EVALSHA or the user's keys
			// are not: one read-only decision finds out now.
			_, err = lim.Peek(ctx, capping.Request{JobID: "capper-startup-check", Channel: "check", Retention: time.Second})
			if err == nil {
				return lim, nil
			}
		}
		if perr := permanent("redis", addrs, err); perr != nil {
			return nil, perr
		}
		d := retry.Next()
		if retry.Attempt() == 1 || retry.Attempt()%5 == 0 { // one line when it starts, then every few attempts
			log.Warn("redis not ready; retrying", "err", err, "attempt", retry.Attempt(), "in", d,
				"check", "redis.addrs ("+envOf("redis.addrs")+") and that the cluster runs", "gives_up_after", backendStartup.String())
		}
		if !backoff.Sleep(ctx, d) {
			if ctx.Err() != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return nil, fmt.Errorf("redis %v: no answer within %v: check redis.addrs (%s) and that the cluster runs: %w", addrs, backendStartup, envOf("redis.addrs"), err)
			}
			return nil, fmt.Errorf("redis %v: %w", addrs, err)
		}
	}
}

// checkKafka connects to the brokers and checks that the input and output
// topics (the held and delay topics too when holding, w != nil) exist, that
// the worker may describe them and its consumer group, and that it may read
// the topics and groups it consumes (probeRead). Write grants cannot be
// checked without writing: a missing one shows at the first batch (the
// worker retries, not ready, and logs the cause).
func checkKafka(ctx context.Context, c config.Kafka, w *hold.Wheel, log *slog.Logger) error {
	dialer, transport, err := KafkaClients(c)
	if err != nil {
		return err
	}
	client := &kafka.Client{Addr: kafka.TCP(c.Brokers...), Transport: transport, Timeout: 10 * time.Second}
	defer transport.CloseIdleConnections()
	want := []string{c.Topics.Input, c.Topics.Allowed, c.Topics.Capped, c.Topics.DLQ}
	if w != nil {
		want = append(want, c.Topics.Held)
		for _, t := range w.Tiers() {
			want = append(want, t.Topic)
		}
	}
	for _, t := range []string{c.Topics.External, c.Topics.Feedback, c.Topics.Preferences} {
		if t != "" {
			want = append(want, t)
		}
	}
	ctx, cancel := context.WithTimeout(ctx, backendStartup)
	defer cancel()
	retry := backoff.New(250*time.Millisecond, 5*time.Second)
	for {
		err := connect(ctx, dialer, c.Brokers)
		if err == nil {
			err = describe(ctx, client, c.GroupID, want, w, consumed(c, w))
		}
		if err == nil {
			return nil
		}
		var missing missingTopics
		if errors.As(err, &missing) {
			if derr := undescribable(ctx, client, c.Brokers, c.GroupID, missing.topics); derr != nil {
				return derr
			}
			return err
		}
		if perr := permanent("kafka", c.Brokers, err); perr != nil {
			return perr
		}
		if merr := mismatch(ctx, c, err); merr != nil {
			return merr
		}
		d := retry.Next()
		var unserved unservedPartitions
		switch {
		case errors.As(err, &unserved) && retry.Attempt() < 5: // a leader settles within a second or so
			log.Info("waiting for the leaders of new partitions", "partitions", len(unserved), "err", err, "attempt", retry.Attempt(), "in", d)
		case retry.Attempt() == 1 || retry.Attempt()%5 == 0: // one line when it starts, then every few attempts
			log.Warn("kafka not ready; retrying", "err", err, "attempt", retry.Attempt(), "in", d,
				"check", "kafka.brokers ("+envOf("kafka.brokers")+") and that the brokers run", "gives_up_after", backendStartup.String())
		}
		if !backoff.Sleep(ctx, d) {
			if ctx.Err() != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return fmt.Errorf("kafka %v: no answer within %v: check kafka.brokers (%s) and that the brokers run: %w", c.Brokers, backendStartup, envOf("kafka.brokers"), err)
			}
			return fmt.Errorf("kafka %v: %w", c.Brokers, err)
		}
	}
}

// envOf is the environment variable of a config field.
func envOf(field string) string {
	return "CAPPER_" + strings.ToUpper(strings.ReplaceAll(field, ".", "_"))
}

// probeKafka tells, in one warning line, that the brokers do not answer,
// while start-up waits for Redis (checkKafka checks them in full after):
// an operator whose both backends are wrong learns it at once, not after
// Redis's wait.
func probeKafka(ctx context.Context, c config.Kafka, log *slog.Logger) {
	dialer, _, err := KafkaClients(c)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := connect(ctx, dialer, c.Brokers); err != nil && ctx.Err() == nil {
		log.Warn("kafka not ready", "err", err, "check", "kafka.brokers ("+envOf("kafka.brokers")+") and that the brokers run")
	}
}

// mismatch recognises a broker that hangs up on the first request because it
// speaks another protocol on that port: a TLS listener given plaintext (with
// or without a SASL handshake), or a plaintext listener given a TLS
// ClientHello. No retry fixes either, so it names the setting at once. It
// probes the first broker once each way and only to classify: nothing is sent
// over the probes but a handshake.
func mismatch(ctx context.Context, c config.Kafka, err error) error {
	if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
		return nil
	}
	addr := c.Brokers[0]
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if !c.TLS.Enabled {
		d := tls.Dialer{Config: &tls.Config{InsecureSkipVerify: true}} // a handshake to see whether it speaks TLS; never used
		if conn, terr := d.DialContext(ctx, "tcp", addr); terr == nil {
			_ = conn.Close()
			return fmt.Errorf("kafka [%s]: the broker expects TLS on this port: set kafka.tls.enabled (CAPPER_KAFKA_TLS_ENABLED) and kafka.tls.ca_file, or use its plaintext listener: %w", addr, err)
		}
		return nil
	}
	plain := &kafka.Dialer{Timeout: 3 * time.Second}
	if conn, perr := plain.DialContext(ctx, "tcp", addr); perr == nil {
		_, verr := conn.ApiVersions()
		_ = conn.Close()
		if verr == nil {
			return fmt.Errorf("kafka [%s]: the broker does not speak TLS on this port (it answers plaintext): set kafka.tls.enabled false (CAPPER_KAFKA_TLS_ENABLED), or use its TLS listener: %w", addr, err)
		}
	}
	return nil
}

// connect opens and closes one connection, to the first broker that takes
// it: the dialer reports a failed SASL authentication as such (a client's
// pooled connection only sees the broker hang up).
func connect(ctx context.Context, dialer *kafka.Dialer, brokers []string) error {
	var err error
	for _, b := range brokers {
		var conn *kafka.Conn
		if conn, err = dialer.DialContext(ctx, "tcp", b); err == nil {
			return conn.Close()
		}
		if fault.Cause(err) != "" {
			return err
		}
	}
	return err
}

// probeGroupRead asks group to let a member that does not exist leave: Kafka
// checks Read on the group first, then answers UNKNOWN_MEMBER_ID for the
// member and changes nothing. kafka-go 0.4.51 decodes the group-level answers
// of LeaveGroup and Heartbeat v1+ with the throttle time and the error code
// swapped, so a refusal arrives as no error and a throttle of 30 ms (30 is
// GROUP_AUTHORIZATION_FAILED); both forms are read as a refusal. A group
// coordinator that is loading or moving passes (the reader retries it).
func probeGroupRead(ctx context.Context, client *kafka.Client, group string) error {
	resp, err := client.LeaveGroup(ctx, &kafka.LeaveGroupRequest{GroupID: group,
		Members: []kafka.LeaveGroupRequestMember{{ID: "capper-startup-check"}}})
	if err != nil {
		if errors.Is(err, kafka.GroupAuthorizationFailed) {
			return err
		}
		return nil
	}
	if errors.Is(resp.Error, kafka.GroupAuthorizationFailed) {
		return resp.Error
	}
	for _, m := range resp.Members {
		if errors.Is(m.Error, kafka.GroupAuthorizationFailed) {
			return m.Error
		}
		if m.Error != nil {
			return nil // UNKNOWN_MEMBER_ID: the group let us ask
		}
	}
	if resp.Error == nil && resp.Throttle == time.Duration(kafka.GroupAuthorizationFailed)*time.Millisecond {
		return kafka.GroupAuthorizationFailed
	}
	return nil
}

// undescribable tells a topic the principal may not describe from one that
// does not exist. kafka-go answers metadata from an all-topics request, in
// which Kafka leaves such topics out, and asking for a topic by name through
// a kafka-go Conn would let the broker create it (auto.create.topics.enable).
// An OffsetFetch of the worker's group for partition 0 of the topic creates
// nothing: Kafka answers TOPIC_AUTHORIZATION_FAILED for a topic the principal
// may not describe, and no error or UNKNOWN_TOPIC_OR_PARTITION for a missing
// one. It returns the start-up error naming the first such topic, or nil.
func undescribable(ctx context.Context, client *kafka.Client, brokers []string, group string, topics []string) error {
	for _, t := range topics {
		resp, err := client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{t: {0}}})
		if err != nil || resp.Error != nil {
			return nil // the group's own grant is checked on its own
		}
		for _, p := range resp.Topics[t] {
			if errors.Is(p.Error, kafka.TopicAuthorizationFailed) {
				return fmt.Errorf("kafka %v: permission denied: topic %s: this principal may not describe it (Describe, or the Read or Write that implies it): grant capper's kafka ACLs (docs/security.md): %w", brokers, t, p.Error)
			}
		}
	}
	return nil
}

type missingTopics struct {
	topics []string
	w      *hold.Wheel
}

func (m missingTopics) Error() string {
	msg := fmt.Sprintf("kafka: the topics %s do not exist, or this principal may not describe them: create them, or grant capper's kafka ACLs (docs/security.md)", strings.Join(m.topics, ", "))
	if m.w != nil {
		msg += fmt.Sprintf(" (delay and held topics with a retention above the longest delay tier, %v; or disable holding with hold.tiers: [] (CAPPER_HOLD_TIERS))", m.w.Longest())
	}
	return msg
}

func describe(ctx context.Context, client *kafka.Client, group string, topics []string, w *hold.Wheel, reads []read) error {
	md, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: topics})
	if err != nil {
		return err
	}
	found := map[string]error{}
	for _, t := range md.Topics {
		found[t.Name] = t.Error
	}
	var missing []string
	for _, t := range topics {
		terr, ok := found[t]
		switch {
		case !ok || errors.Is(terr, kafka.UnknownTopicOrPartition):
			missing = append(missing, t)
		case terr != nil:
			return fmt.Errorf("topic %s: %w", t, terr)
		}
	}
	if len(missing) > 0 {
		return missingTopics{missing, w}
	}
	if err := served(ctx, client, md, topics); err != nil {
		return err
	}
	parts := map[string][]int{}
	for _, t := range md.Topics {
		if t.Name == topics[0] {
			for _, p := range t.Partitions {
				parts[t.Name] = append(parts[t.Name], p.ID)
			}
		}
	}
	off, err := client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: parts})
	if err != nil {
		return fmt.Errorf("consumer group %s: %w", group, err)
	}
	// A group that never committed answers with no offsets (-1), not an error.
	if off.Error != nil {
		return fmt.Errorf("consumer group %s: %w", group, off.Error)
	}
	for _, ps := range off.Topics {
		for _, p := range ps {
			if p.Error != nil {
				return fmt.Errorf("consumer group %s, partition %d: %w", group, p.Partition, p.Error)
			}
		}
	}
	return probeRead(ctx, client, reads)
}

// unservedPartitions are partitions whose leader does not serve them yet: a
// topic just created, or a leader just moved. Start-up waits for them, so
// that the readers and writers start on partitions that answer (each of a
// reader's refused first requests is a warning of kafka-go's).
type unservedPartitions []string

func (u unservedPartitions) Error() string {
	const most = 5
	names := strings.Join(u[:min(len(u), most)], ", ")
	if len(u) > most {
		names += fmt.Sprintf(" and %d more", len(u)-most)
	}
	return "partitions not served by their leader yet (new topics, or a leader moving): " + names
}

// served asks the leader of every partition of topics (md's) for its first
// offset, as a reader does before it fetches: a retriable refusal
// (NOT_LEADER_OR_FOLLOWER, LEADER_NOT_AVAILABLE) is an unservedPartitions,
// any other the error.
func served(ctx context.Context, client *kafka.Client, md *kafka.MetadataResponse, topics []string) error {
	req := &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{}}
	for _, t := range md.Topics {
		if slices.Contains(topics, t.Name) {
			for _, p := range t.Partitions {
				req.Topics[t.Name] = append(req.Topics[t.Name], kafka.FirstOffsetOf(p.ID))
			}
		}
	}
	res, err := client.ListOffsets(ctx, req)
	if err != nil {
		return err
	}
	var waiting unservedPartitions
	for t, ps := range res.Topics {
		for _, p := range ps {
			var kerr kafka.Error
			switch {
			case p.Error == nil:
			case errors.As(p.Error, &kerr) && kerr.Temporary():
				waiting = append(waiting, fmt.Sprintf("%s/%d", t, p.Partition))
			default:
				return fmt.Errorf("topic %s partition %d: %w", t, p.Partition, p.Error)
			}
		}
	}
	if len(waiting) > 0 {
		slices.Sort(waiting)
		return waiting
	}
	return nil
}

// read is a topic the worker consumes and the group it consumes it in.
type read struct{ topic, group string }

// consumed lists what the worker reads: the input, every delay tier, the
// event topics.
func consumed(c config.Kafka, w *hold.Wheel) []read {
	reads := []read{{c.Topics.Input, c.GroupID}}
	if w != nil {
		for _, t := range w.Tiers() {
			reads = append(reads, read{t.Topic, TierGroup(c.GroupID, t.Name)})
		}
	}
	if t := c.Topics.External; t != "" {
		reads = append(reads, read{t, EventGroup(c.GroupID, consumer.ExternalSends)})
	}
	if t := c.Topics.Feedback; t != "" {
		reads = append(reads, read{t, EventGroup(c.GroupID, consumer.Feedback)})
	}
	if t := c.Topics.Preferences; t != "" {
		reads = append(reads, read{t, EventGroup(c.GroupID, consumer.Preferences)})
	}
	return reads
}

// Groups returns the consumer groups a worker of cfg joins: the input's,
// then one per delay tier and one per event topic. Each process's event
// caches read in groups of their own (newCacheReader's), not listed.
func Groups(cfg *config.Config) ([]string, error) {
	w, err := cfg.Wheel()
	if err != nil {
		return nil, err
	}
	var groups []string
	for _, r := range consumed(cfg.Kafka, w) {
		groups = append(groups, r.group)
	}
	return groups, nil
}

// probeRead checks the Read grants the worker needs and metadata does not
// show, on the input, every delay tier and every event topic: a fetch of at most one byte
// from partition 0 of the topic (Kafka checks Read on the topic first), and
// a LeaveGroup of a member that does not exist (probeGroupRead). Any answer
// but an authorization failure passes: the readers handle the rest.
func probeRead(ctx context.Context, client *kafka.Client, reads []read) error {
	for _, r := range reads {
		f, err := client.Fetch(ctx, &kafka.FetchRequest{Topic: r.topic, Partition: 0, Offset: 0, MinBytes: 1, MaxBytes: 1, MaxWait: time.Millisecond})
		if err == nil {
			err = f.Error
		}
		if errors.Is(err, kafka.TopicAuthorizationFailed) {
			return fmt.Errorf("topic %s: Read refused (capper consumes it): %w", r.topic, err)
		}
		if err := probeGroupRead(ctx, client, r.group); err != nil {
			return fmt.Errorf("consumer group %s: Read refused (capper joins it): %w", r.group, err)
		}
	}
	return nil
}
