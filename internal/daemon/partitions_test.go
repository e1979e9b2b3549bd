package daemon

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
	"github.com/segmentio/kafka-go/protocol/metadata"

	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/testenv"
)

// countingTripper counts the metadata requests of one topic that reach the
// transport below it.
type countingTripper struct {
	kafka.RoundTripper
	asks atomic.Int64
}

func (c *countingTripper) RoundTrip(ctx context.Context, addr net.Addr, req kafka.Request) (kafka.Response, error) {
	if m, ok := req.(*metadata.Request); ok && len(m.TopicNames) == 1 {
		c.asks.Add(1)
	}
	return c.RoundTripper.RoundTrip(ctx, addr, req)
}

// TestWriterAsksForPartitionsOncePerTTL: a writer from NewWriter asks the
// transport for its topic's partitions about once per partitionCountTTL,
// not once per message, and still puts each message in the partition the
// balancer picks from the topic's real partition count. A topic the broker
// does not know is asked for each time.
func TestWriterAsksForPartitionsOncePerTTL(t *testing.T) {
	brokers := testenv.KafkaBrokers(t)
	topic := testenv.Unique("partitions")
	testenv.CreateTopics(t, brokers, 3, topic)
	w := NewWriter(config.Kafka{Brokers: brokers}, &kafka.Transport{}, topic, 100, slog.New(slog.NewTextHandler(io.Discard, nil)))
	defer w.Close()
	pc, ok := w.Transport.(*partitionCounts)
	if !ok {
		t.Fatalf("NewWriter's transport is a %T, want *partitionCounts", w.Transport)
	}
	below := &countingTripper{RoundTripper: pc.RoundTripper}
	pc.RoundTripper = below

	const calls, per = 20, 100
	start := time.Now()
	for c := range calls {
		msgs := make([]kafka.Message, per)
		for i := range msgs {
			k := fmt.Sprintf("user-%d", c*per+i)
			msgs[i] = kafka.Message{Key: []byte(k), Value: []byte(k)}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := w.WriteMessages(ctx, msgs...)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
	}
	elapsed := time.Since(start)
	if most := 2 + int64(elapsed/partitionCountTTL); below.asks.Load() > most {
		t.Errorf("%d messages in %v asked the transport for the topic's metadata %d times, want at most %d",
			calls*per, elapsed, below.asks.Load(), most)
	}

	// Each message is in the partition the balancer picks among the topic's 3.
	got := 0
	for p := range 3 {
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, Topic: topic, Partition: p, MaxWait: 500 * time.Millisecond})
		end, err := r.ReadLag(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		for range end {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			m, err := r.ReadMessage(ctx)
			cancel()
			if err != nil {
				t.Fatalf("partition %d: %v", p, err)
			}
			if want := (&kafka.Murmur2Balancer{}).Balance(kafka.Message{Key: m.Key}, 0, 1, 2); want != p {
				t.Errorf("message %s is in partition %d, want %d", m.Key, p, want)
			}
			got++
		}
		r.Close()
	}
	if got != calls*per {
		t.Errorf("the topic holds %d messages, want %d", got, calls*per)
	}

	// An unknown topic's answer is not kept.
	before := below.asks.Load()
	unknown := &metadata.Request{TopicNames: []string{testenv.Unique("missing")}}
	for range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, _ = pc.RoundTrip(ctx, kafka.TCP(brokers...), unknown)
		cancel()
	}
	if asks := below.asks.Load() - before; asks != 2 {
		t.Errorf("two requests of an unknown topic reached the transport %d times, want 2", asks)
	}
}
