package output

import (
	"cmp"
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"
)

// ReadConfig says what Read reads.
type ReadConfig struct {
	Brokers []string      // (Required)
	Dialer  *kafka.Dialer // TLS and SASL; nil for plain connections
	Topics  []string      // (Required)
	// Group starts the names of the consumer groups Read reads in, one per
	// topic (Group + "." + topic), from the first offset; nothing is
	// committed. Defaults to "capper-output-reader-" and the time.
	Group string
	// MaxWait is how long a fetch waits for messages. Defaults to 250ms.
	MaxWait time.Duration
	// MaxBytes bounds one fetch, QueueCapacity the messages read ahead per
	// topic. Default to 16 MiB and 10,000, for reading millions of outputs.
	MaxBytes, QueueCapacity int
}

// Message is one message Read read, and what capper says on it.
type Message struct {
	kafka.Message
	Output Output
	// Err is why the message's headers do not parse as capper's (see Parse);
	// Output holds what was read before it.
	Err error
}

// Read reads every topic of c from its first offset, one reader per topic,
// concurrently, and calls handle with each message, until ctx ends (it then
// returns nil), handle returns an error, or a topic cannot be read (it then
// returns that error). handle is called from one goroutine per topic at once,
// in each topic's partition order.
func Read(ctx context.Context, c ReadConfig, handle func(*Message) error) error {
	if len(c.Brokers) == 0 || len(c.Topics) == 0 {
		return fmt.Errorf("output: read: brokers and topics are required")
	}
	group := c.Group
	if group == "" {
		group = fmt.Sprintf("capper-output-reader-%d", time.Now().UnixNano())
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, len(c.Topics))
	for _, topic := range c.Topics {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := readTopic(ctx, c, group+"."+topic, topic, handle); err != nil {
				errs <- err
				cancel()
			}
		}()
	}
	wg.Wait()
	select {
	case err := <-errs:
		return err
	default:
		return nil
	}
}

func readTopic(ctx context.Context, c ReadConfig, group, topic string, handle func(*Message) error) error {
	rd := kafka.NewReader(kafka.ReaderConfig{Brokers: c.Brokers, Dialer: c.Dialer, GroupID: group, Topic: topic,
		MaxWait: cmp.Or(c.MaxWait, 250*time.Millisecond), StartOffset: kafka.FirstOffset,
		MaxBytes: cmp.Or(c.MaxBytes, 16<<20), QueueCapacity: cmp.Or(c.QueueCapacity, 10000)})
	defer rd.Close()
	for {
		m, err := rd.FetchMessage(ctx) // no commits: the group is this read's own, used once
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("output: read %s: %w", topic, err)
		}
		msg := Message{Message: m}
		msg.Output, msg.Err = Parse(m.Headers)
		if err := handle(&msg); err != nil {
			return err
		}
	}
}
