package output_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/testenv"
	"github.com/capper-dev/capper/output"
)

// TestReadOnTheBroker writes capper outputs and one foreign message to two
// topics of the real broker and reads them back with Read: every message
// once, each with its parsed output or its parse error, and Read returns
// nil when its context ends.
func TestReadOnTheBroker(t *testing.T) {
	brokers := testenv.KafkaBrokers(t)
	allowed, capped := testenv.Unique("out-allowed"), testenv.Unique("out-capped")
	testenv.CreateTopics(t, brokers, 2, allowed, capped)
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), RequiredAcks: kafka.RequireAll, AllowAutoTopicCreation: false}
	defer w.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	write(ctx, t, w,
		kafka.Message{Topic: allowed, Key: []byte("1"), Value: []byte("a"), Headers: headers(output.HeaderDecision, "allowed", output.HeaderSegment, "new")},
		kafka.Message{Topic: allowed, Key: []byte("2"), Value: []byte("b"), Headers: headers(output.HeaderDecision, "duplicate")},
		kafka.Message{Topic: capped, Key: []byte("3"), Value: []byte("c"), Headers: headers(output.HeaderDecision, "capped", output.HeaderCap, "daily", output.HeaderRetryAt, "")},
		kafka.Message{Topic: capped, Key: []byte("4"), Value: []byte("d"), Headers: headers("trace-id", "not capper's")},
	)
	var mu sync.Mutex
	got := map[string]*output.Message{}
	err := output.Read(ctx, output.ReadConfig{Brokers: brokers, Topics: []string{allowed, capped}, MaxWait: 100 * time.Millisecond},
		func(m *output.Message) error {
			mu.Lock()
			defer mu.Unlock()
			if got[string(m.Value)] != nil {
				t.Errorf("%s read twice", m.Value)
			}
			got[string(m.Value)] = m
			if len(got) == 4 {
				cancel()
			}
			return nil
		})
	if err != nil {
		t.Fatalf("Read: %v", err)
	}
	if len(got) != 4 {
		t.Fatalf("read %d of 4 messages", len(got))
	}
	for v, want := range map[string]string{"a": "allowed", "b": "duplicate", "c": "capped"} {
		if m := got[v]; m.Err != nil || m.Output.Decision != want {
			t.Errorf("%s: decision %q, error %v; want %s", v, m.Output.Decision, m.Err, want)
		}
	}
	if got["a"].Topic != allowed || got["c"].Topic != capped || got["c"].Output.Cap != "daily" || !got["c"].Output.RetryAt.IsZero() {
		t.Errorf("topics or headers lost: %+v %+v", got["a"], got["c"])
	}
	if got["d"].Err == nil {
		t.Error("a message without capper's headers read without an error")
	}
}

// TestReadStopsOnHandlerError: an error from the handler ends the read and
// is returned.
func TestReadStopsOnHandlerError(t *testing.T) {
	brokers := testenv.KafkaBrokers(t)
	topic := testenv.Unique("out-err")
	testenv.CreateTopics(t, brokers, 1, topic)
	w := &kafka.Writer{Addr: kafka.TCP(brokers...), RequiredAcks: kafka.RequireAll}
	defer w.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	write(ctx, t, w, kafka.Message{Topic: topic, Value: []byte("x"), Headers: headers(output.HeaderDecision, "allowed")})
	stop := context.Canceled // any error value the handler returns
	err := output.Read(ctx, output.ReadConfig{Brokers: brokers, Topics: []string{topic}}, func(*output.Message) error { return stop })
	if err != stop {
		t.Fatalf("Read returned %v, want the handler's error", err)
	}
	if ctx.Err() != nil {
		t.Fatal("Read returned only when the test's context ended")
	}
}

// write writes msgs, again while the broker does not know a new topic yet
// (its metadata follows the creation), until ctx ends.
func write(ctx context.Context, t *testing.T, w *kafka.Writer, msgs ...kafka.Message) {
	t.Helper()
	for {
		err := w.WriteMessages(ctx, msgs...)
		if err == nil {
			return
		}
		if !errors.Is(err, kafka.UnknownTopicOrPartition) && !errors.Is(err, kafka.LeaderNotAvailable) || ctx.Err() != nil {
			t.Fatalf("write: %v", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}
