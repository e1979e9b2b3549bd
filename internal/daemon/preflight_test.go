package daemon

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/kafkaadmin"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestStartupWaitsForNewPartitions: a worker started right after its topics
// were created (a deployment that creates them and starts capper together,
// as demo.sh does) finds partitions whose leader does not serve them yet:
// its readers' first requests were refused ("Not Leader For Partition", a
// warning per partition, 14 at the end of `make demo`). The start-up check
// returns once every partition of the worker's topics answers its leader,
// without a warning.
func TestStartupWaitsForNewPartitions(t *testing.T) {
	brokers := testenv.KafkaBrokers(t)
	c := config.Kafka{Brokers: brokers, GroupID: testenv.Unique("new-topics")}
	c.Topics.Input, c.Topics.Allowed = testenv.Unique("new-in"), testenv.Unique("new-allowed")
	c.Topics.Capped, c.Topics.DLQ = testenv.Unique("new-capped"), testenv.Unique("new-dlq")
	topics := []string{c.Topics.Input, c.Topics.Allowed, c.Topics.Capped, c.Topics.DLQ}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := kafkaadmin.CreateTopics(ctx, nil, brokers, 6, topics...); err != nil {
		t.Fatal(err)
	}
	var logs testenv.LogBuffer
	if err := checkKafka(ctx, c, nil, slog.New(slog.NewTextHandler(&logs, nil))); err != nil {
		t.Fatal(err)
	}
	req := &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{}}
	for _, tp := range topics {
		for p := range 6 {
			req.Topics[tp] = append(req.Topics[tp], kafka.FirstOffsetOf(p))
		}
	}
	_, transport, err := KafkaClients(c)
	if err != nil {
		t.Fatal(err)
	}
	res, err := (&kafka.Client{Addr: kafka.TCP(brokers...), Transport: transport}).ListOffsets(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	for tp, ps := range res.Topics {
		for _, p := range ps {
			if p.Error != nil {
				t.Errorf("after the start-up check, partition %d of %s: %v", p.Partition, tp, p.Error)
			}
		}
	}
	if strings.Contains(logs.String(), "level=WARN") {
		t.Errorf("the start-up check warned:\n%s", logs.String())
	}
}
