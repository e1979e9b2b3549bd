package daemon

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestHeldOnOwnPartitions: two readers of a tier's group on 4 partitions
// learn which partitions are theirs; a writer whose balancer is the first
// one's heldOnOwn puts every message for the tier on those partitions and
// the other topic's by key over all of them; when the second reader leaves,
// the first learns it owns every partition, and its sends go to all of them.
func TestHeldOnOwnPartitions(t *testing.T) {
	brokers := testenv.KafkaBrokers(t)
	tier, other, group := testenv.Unique("own-tier"), testenv.Unique("own-other"), testenv.Unique("own-group")
	testenv.CreateTopics(t, brokers, 4, tier, other)
	c := config.Kafka{Brokers: brokers, GroupID: group, SessionTimeout: config.Duration(6 * time.Second), RebalanceTimeout: config.Duration(3 * time.Second)}
	_, transport, err := KafkaClients(c)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	produce(ctx, t, c, transport, tier, kafka.Message{Value: []byte("a")}) // the topic's metadata is known
	produce(ctx, t, c, transport, other, kafka.Message{Value: []byte("a")})
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Transport: transport, Timeout: 5 * time.Second}
	gauge := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "owned"}, []string{"member"})
	owned := make([]*ownedPartitions, 2)
	readers := make([]*tierSource, 2)
	rctx := make([]context.Context, 2)
	stop := make([]context.CancelFunc, 2)
	for i := range readers {
		member := newMember()
		if readers[i], err = newTierReader(c, hold.Tier{Name: "1s", Topic: tier}, member, &consumer.ReaderFaults{}, log); err != nil {
			t.Fatal(err)
		}
		owned[i] = &ownedPartitions{gauge: gauge.WithLabelValues(fmt.Sprint(i))}
		rctx[i], stop[i] = context.WithCancel(ctx)
		go func() { // the reader joins while it fetches
			for rctx[i].Err() == nil {
				if _, err := readers[i].FetchMessage(rctx[i]); err != nil && rctx[i].Err() == nil {
					time.Sleep(50 * time.Millisecond)
				}
			}
		}()
		go owned[i].watch(rctx[i], client, TierGroup(group, "1s"), tier, member, readers[i].joins.Load)
	}
	closed := make([]bool, 2)
	leave := func(i int) {
		stop[i]()
		if !closed[i] {
			closed[i] = true
			readers[i].Close()
		}
	}
	defer leave(0)
	defer leave(1)
	parts := func(i int) []int {
		if p := owned[i].parts.Load(); p != nil {
			return *p
		}
		return nil
	}
	settle := func(want func(a, b []int) bool) {
		t.Helper()
		for !want(parts(0), parts(1)) {
			if ctx.Err() != nil {
				t.Fatalf("the owned partitions never settled: %v and %v", parts(0), parts(1))
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	settle(func(a, b []int) bool {
		return len(a) > 0 && len(b) > 0 && slices.Equal(slices.Sorted(slices.Values(append(slices.Clone(a), b...))), []int{0, 1, 2, 3})
	})
	mine := parts(0)
	t.Logf("member 0 owns %v, member 1 %v", mine, parts(1))

	w := NewWriter(c, transport, "", 100, log)
	defer w.Close()
	w.Balancer = &heldOnOwn{owned: map[string]*ownedPartitions{tier: owned[0]}}
	write := func(topic string) map[int]int64 { // 200 messages of distinct keys -> how many each partition got
		t.Helper()
		before := ends(ctx, t, client, topic)
		var msgs []kafka.Message
		for i := range 200 {
			msgs = append(msgs, kafka.Message{Topic: topic, Key: fmt.Appendf(nil, "user-%d", i), Value: []byte("v")})
		}
		if err := w.WriteMessages(ctx, msgs...); err != nil {
			t.Fatalf("write to %s: %v", topic, err)
		}
		after := ends(ctx, t, client, topic)
		got := map[int]int64{}
		for p := range after {
			if n := after[p] - before[p]; n > 0 {
				got[p] = n
			}
		}
		return got
	}
	spread := func(got map[int]int64) []int { return slices.Sorted(maps.Keys(got)) }
	if got := write(tier); !slices.Equal(spread(got), mine) {
		t.Errorf("the tier's messages went to partitions %v (%v); want every one of member 0's, %v, and no other", spread(got), got, mine)
	}
	if got := write(other); !slices.Equal(spread(got), []int{0, 1, 2, 3}) {
		t.Errorf("another topic's messages went to partitions %v; want all four, by key", spread(got))
	}

	leave(1) // the second member leaves: the first owns every partition
	settle(func(a, _ []int) bool { return slices.Equal(a, []int{0, 1, 2, 3}) })
	if got := write(tier); !slices.Equal(spread(got), []int{0, 1, 2, 3}) {
		t.Errorf("after the rebalance the tier's messages went to partitions %v; want all four", spread(got))
	}
}

// ends returns the end offset of each partition of topic.
func ends(ctx context.Context, t *testing.T, client *kafka.Client, topic string) map[int]int64 {
	t.Helper()
	req := &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: {}}}
	for p := range 4 {
		req.Topics[topic] = append(req.Topics[topic], kafka.LastOffsetOf(p))
	}
	resp, err := client.ListOffsets(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]int64{}
	for _, po := range resp.Topics[topic] {
		if po.Error != nil {
			t.Fatal(po.Error)
		}
		out[po.Partition] = po.LastOffset
	}
	return out
}
