package kafkaadmin

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/segmentio/kafka-go"
)

// CreateTopics creates the topics that do not exist yet, with the given
// partition count, and waits until their partitions are in the metadata.
func CreateTopics(ctx context.Context, dialer *kafka.Dialer, brokers []string, partitions int, topics ...string) error {
	if dialer == nil {
		dialer = &kafka.Dialer{Timeout: 10 * time.Second}
	}
	conn, err := dialer.DialContext(ctx, "tcp", brokers[0])
	if err != nil {
		return fmt.Errorf("dial kafka %s: %w", brokers[0], err)
	}
	defer conn.Close()
	ctrl, err := conn.Controller()
	if err != nil {
		return fmt.Errorf("find kafka controller: %w", err)
	}
	cc, err := dialer.DialContext(ctx, "tcp", net.JoinHostPort(ctrl.Host, strconv.Itoa(ctrl.Port)))
	if err != nil {
		return fmt.Errorf("dial kafka controller: %w", err)
	}
	defer cc.Close()
	cfgs := make([]kafka.TopicConfig, len(topics))
	for i, tp := range topics {
		cfgs[i] = kafka.TopicConfig{Topic: tp, NumPartitions: partitions, ReplicationFactor: 1}
	}
	if err := cc.CreateTopics(cfgs...); err != nil && !errors.Is(err, kafka.TopicAlreadyExists) {
		return fmt.Errorf("create topics %v: %w", topics, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		parts, err := conn.ReadPartitions(topics...)
		seen := map[string]bool{}
		for _, p := range parts {
			seen[p.Topic] = true
		}
		if err == nil && len(seen) == len(topics) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("topics %v not visible 10s after creation (err %v)", topics, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
