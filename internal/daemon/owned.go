package daemon

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/config"
)

// ownCheck is how often a replica asks which partitions of each delay tier
// its reader owns when its group has not rejoined (a join is noticed within
// ownPoll).
const (
	ownCheck = 5 * time.Second
	ownPoll  = 250 * time.Millisecond
)

// heldOnOwn is the writer's balancer: it sends a held job to a partition of
// its tier that this replica's reader of that tier owns, chosen by the
// message's key among them, and every other message by its key among all the
// topic's partitions (as kafka.Murmur2Balancer does). A replica that dies
// keeps its partitions until its group expires it (kafka.session_timeout):
// by key, the sends the live replicas held meanwhile would wait there for
// nobody, a share of every tier, and so would the budget tokens promised to
// them. On its own partitions a send is read back by the replica that held
// it. Until a tier's partitions are known (the reader's first join, a
// rebalance), its sends go by key: a partition that has changed hands is read
// by its new owner, so a stale answer costs time, never a send.
type heldOnOwn struct {
	key   kafka.Murmur2Balancer
	owned map[string]*ownedPartitions // by tier topic; complete before the writer writes
}

// ownedPartitions are the partitions of a tier's topic its reader owns, in
// order (nil: not known, or none).
type ownedPartitions struct {
	parts atomic.Pointer[[]int]
	gauge prometheus.Gauge
}

func (b *heldOnOwn) Balance(msg kafka.Message, partitions ...int) int {
	if o := b.owned[msg.Topic]; o != nil {
		// The writer passes the topic's partitions 0..n-1: the owned ones
		// are among them unless the topic grew since they were asked.
		if own := o.parts.Load(); own != nil && len(*own) > 0 && (*own)[len(*own)-1] < len(partitions) {
			return b.key.Balance(msg, *own...)
		}
	}
	return b.key.Balance(msg, partitions...)
}

// set records the partitions the group answered (nil: none known).
func (o *ownedPartitions) set(parts []int) {
	if len(parts) == 0 {
		parts = nil
	}
	o.parts.Store(&parts)
	o.gauge.Set(float64(len(parts)))
}

// watch keeps o current until ctx ends: after each join of its reader's
// group (joins counts them) it asks the group's coordinator for member's
// partitions of topic every ownPoll, for a second and until the group
// answers from a stable generation (a join counted just before the
// coordinator saw it is answered from the last one), and every ownCheck in
// between.
func (o *ownedPartitions) watch(ctx context.Context, client *kafka.Client, group, topic string, member []byte, joins func() int64) {
	t := time.NewTicker(ownPoll)
	defer t.Stop()
	var seen int64 = -1
	var noticed, asked time.Time
	settled := false
	for {
		now := time.Now()
		if j := joins(); j != seen {
			seen, noticed, settled = j, now, false
		}
		if !settled || now.Sub(asked) >= ownCheck {
			actx, cancel := context.WithTimeout(ctx, 5*time.Second)
			parts, stable, err := groupMember(actx, client, group, topic, member)
			cancel()
			asked = now
			if err == nil && stable {
				o.set(parts)
				settled = now.Sub(noticed) >= time.Second
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// ownedTier is a delay tier whose partitions a replica holds its sends on:
// its reader's group, topic, member token and joins.
type ownedTier struct {
	owned        *ownedPartitions
	group, topic string
	member       []byte
	joins        func() int64
}

// watchTiers keeps every tier's owned partitions current until ctx ends.
func (d *Daemon) watchTiers(ctx context.Context, c config.Kafka) {
	if len(d.tiers) == 0 {
		return
	}
	_, transport, err := KafkaClients(c)
	if err != nil {
		return // New already built the same clients: the sends go by key
	}
	client := &kafka.Client{Addr: kafka.TCP(c.Brokers...), Transport: transport, Timeout: 5 * time.Second}
	for _, t := range d.tiers {
		go t.owned.watch(ctx, client, t.group, t.topic, t.member, t.joins)
	}
}
