package daemon

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/internal/config"
)

// lagInterval is how often the consumer groups' lag is measured.
const lagInterval = 10 * time.Second

// groupLag returns the messages of topic that group has not committed yet:
// over its partitions (those of only, when not nil), the last offset minus
// the committed one (minus the first retained one where nothing is committed).
func groupLag(ctx context.Context, c *kafka.Client, group, topic string, only []int) (int64, error) {
	md, err := c.Metadata(ctx, &kafka.MetadataRequest{Topics: []string{topic}})
	if err != nil {
		return 0, err
	}
	var parts []int
	for _, t := range md.Topics {
		if t.Name != topic {
			continue
		}
		if t.Error != nil {
			return 0, fmt.Errorf("topic %s: %w", topic, t.Error)
		}
		for _, p := range t.Partitions {
			if only == nil || slices.Contains(only, p.ID) {
				parts = append(parts, p.ID)
			}
		}
	}
	reqs := make([]kafka.OffsetRequest, 0, 2*len(parts))
	for _, p := range parts {
		reqs = append(reqs, kafka.FirstOffsetOf(p), kafka.LastOffsetOf(p))
	}
	offs, err := c.ListOffsets(ctx, &kafka.ListOffsetsRequest{Topics: map[string][]kafka.OffsetRequest{topic: reqs}})
	if err != nil {
		return 0, err
	}
	first, last := map[int]int64{}, map[int]int64{}
	for _, po := range offs.Topics[topic] {
		if po.Error != nil {
			return 0, fmt.Errorf("topic %s partition %d: %w", topic, po.Partition, po.Error)
		}
		if po.FirstOffset >= 0 {
			first[po.Partition] = po.FirstOffset
		}
		if po.LastOffset >= 0 {
			last[po.Partition] = po.LastOffset
		}
	}
	committed, err := c.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: parts}})
	if err != nil {
		return 0, err
	}
	if committed.Error != nil {
		return 0, committed.Error
	}
	done := map[int]int64{}
	for _, p := range committed.Topics[topic] {
		if p.CommittedOffset >= 0 {
			done[p.Partition] = p.CommittedOffset
		}
	}
	var lag int64
	for _, p := range parts {
		from, ok := done[p]
		if !ok || from < first[p] {
			from = first[p]
		}
		lag += max(0, last[p]-from)
	}
	return lag, nil
}

// watchLag measures, every lagInterval, the input group's lag and each delay
// tier group's (the jobs held on that tier) for the whole group, not only
// the partitions of this replica: every replica reports the same figures.
func (d *Daemon) watchLag(ctx context.Context, c config.Kafka) {
	_, transport, err := KafkaClients(c)
	if err != nil {
		return // New already built the same clients
	}
	client := &kafka.Client{Addr: kafka.TCP(c.Brokers...), Transport: transport, Timeout: lagInterval / 2}
	t := time.NewTicker(lagInterval)
	defer t.Stop()
	failing := false
	for {
		err := d.measureLag(ctx, client, c)
		if err != nil && !failing && ctx.Err() == nil {
			d.Log.Warn("measuring consumer group lag failed", "err", err)
		}
		failing = err != nil
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (d *Daemon) measureLag(ctx context.Context, client *kafka.Client, c config.Kafka) error {
	ctx, cancel := context.WithTimeout(ctx, lagInterval/2)
	defer cancel()
	n, err := groupLag(ctx, client, c.GroupID, c.Topics.Input, nil)
	if err != nil {
		return fmt.Errorf("input %s: %w", c.Topics.Input, err)
	}
	d.metrics.SetConsumerLag(n)
	if d.wheel == nil {
		return nil
	}
	for _, t := range d.wheel.Tiers() {
		n, err := groupLag(ctx, client, TierGroup(c.GroupID, t.Name), t.Topic, nil)
		if err != nil {
			return fmt.Errorf("delay tier %s: %w", t.Topic, err)
		}
		d.metrics.SetHeld(t.Name, n)
	}
	return nil
}

// A reader stalls when it has partitions, has not fetched for stallBound and
// they hold messages not committed (consumer.ReaderFaults.CheckStall): three
// of the longest fetch waits, a late reply's grace (fetchReplyGrace) and the
// session timeout, so that a rebalance after a replica died, which stops every
// reader for up to the session timeout, is not one. Checked every stallCheck.
const (
	readerMaxWait = 500 * time.Millisecond // kafka.ReaderConfig.MaxWait of a reader (newReader), the longest
	stallCheck    = 2 * time.Second
)

func stallBound(c config.Kafka) time.Duration {
	return 3*readerMaxWait + fetchReplyGrace + time.Duration(c.SessionTimeout)
}

// watchedReader is a reader the stall watch checks: its faults, its topic and
// group, its member token (newMember), and whether it waits for a due time (a
// delay tier's head; nil: never).
type watchedReader struct {
	faults       *consumer.ReaderFaults
	topic, group string
	member       []byte
	waiting      func() bool
}

// memberPartitions returns the partitions of topic that the group's
// coordinator assigned to the member whose join metadata carries member: the
// group's own answer, which kafka-go's reader does not expose. None when no
// member carries it (not joined yet, or between generations).
func memberPartitions(ctx context.Context, client *kafka.Client, group, topic string, member []byte) ([]int, error) {
	parts, _, err := groupMember(ctx, client, group, topic, member)
	return parts, err
}

// groupMember is memberPartitions, and whether the group's generation is
// stable (its assignment is the one its members read by).
func groupMember(ctx context.Context, client *kafka.Client, group, topic string, member []byte) (parts []int, stable bool, err error) {
	resp, err := client.DescribeGroups(ctx, &kafka.DescribeGroupsRequest{GroupIDs: []string{group}})
	if err != nil {
		return nil, false, err
	}
	parts = []int{}
	for _, g := range resp.Groups {
		if g.Error != nil {
			return nil, false, fmt.Errorf("describe group %s: %w", group, g.Error)
		}
		stable = g.GroupState == "Stable"
		for _, m := range g.Members {
			if !bytes.Equal(m.MemberMetadata.UserData, member) {
				continue
			}
			for _, t := range m.MemberAssignments.Topics {
				if t.Topic == topic {
					parts = append(parts, t.Partitions...)
				}
			}
			slices.Sort(parts)
			return parts, stable, nil
		}
	}
	return parts, stable, nil
}

// watchStalls checks every reader for a stall every stallCheck; the lag of a
// reader's partitions is only asked for once it has been idle for the bound.
func (d *Daemon) watchStalls(ctx context.Context, c config.Kafka) {
	_, transport, err := KafkaClients(c)
	if err != nil {
		return // New already built the same clients
	}
	client := &kafka.Client{Addr: kafka.TCP(c.Brokers...), Transport: transport, Timeout: 5 * time.Second}
	bound := stallBound(c)
	t := time.NewTicker(stallCheck)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, w := range d.watched {
			waiting := w.waiting != nil && w.waiting()
			err := w.faults.CheckStall(bound, waiting, func() ([]int, error) {
				actx, cancel := context.WithTimeout(ctx, 5*time.Second)
				defer cancel()
				return memberPartitions(actx, client, w.group, w.topic, w.member)
			}, func(parts []int) (int64, error) {
				lctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				defer cancel()
				return groupLag(lctx, client, w.group, w.topic, parts)
			})
			if err != nil && ctx.Err() == nil {
				d.Log.Debug("measuring an idle reader's lag failed", "topic", w.topic, "group", w.group, "err", err)
			}
		}
	}
}
