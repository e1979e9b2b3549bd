package daemon

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/capping"
)

// holdInterval is how often a replica asks whether the events it holds
// copies for have been applied (their group committed past them).
const holdInterval = 500 * time.Millisecond

// copyHolds keeps the near cache from keeping a copy of the log of a user
// whose feedback (a slot given back) or preference event this replica read
// on its cache reader, until the replica that owns the event's partition has
// applied it to Redis and committed past it. Dropping the copy when the
// event is read is not enough: the owner applies it later (its batch, its
// retries), and a decision in between reads the log and preferences from
// before, and would install a copy that answers "capped" after the change,
// until the copy expires (up to a day: a VIP user capped).
type copyHolds struct {
	lim          *capping.Limiter
	client       *kafka.Client
	group, topic string // the group that applies the events, and their topic
	log          *slog.Logger

	mu      sync.Mutex
	pending []heldEvent
}

type heldEvent struct {
	partition int
	offset    int64
	space     capping.Space
	user      uint32
}

// hold drops the user's copy and keeps none until the event at offset of
// partition is committed by its group.
func (h *copyHolds) hold(partition int, offset int64, space capping.Space, user uint32) {
	h.lim.HoldCopies(space, user)
	h.mu.Lock()
	h.pending = append(h.pending, heldEvent{partition, offset, space, user})
	h.mu.Unlock()
}

// releaseApplied asks the group's committed offsets of the partitions of the
// held events, releases the users of those below them, and returns how many
// are still held.
func (h *copyHolds) releaseApplied(ctx context.Context) (int, error) {
	h.mu.Lock()
	var parts []int
	for _, e := range h.pending {
		if !slices.Contains(parts, e.partition) {
			parts = append(parts, e.partition)
		}
	}
	h.mu.Unlock()
	if len(parts) == 0 {
		return 0, nil
	}
	resp, err := h.client.OffsetFetch(ctx, &kafka.OffsetFetchRequest{GroupID: h.group, Topics: map[string][]int{h.topic: parts}})
	if err == nil {
		err = resp.Error
	}
	if err != nil {
		h.mu.Lock()
		defer h.mu.Unlock()
		return len(h.pending), err
	}
	committed := map[int]int64{}
	for _, p := range resp.Topics[h.topic] {
		if p.Error == nil {
			committed[p.Partition] = p.CommittedOffset // -1: nothing committed yet
		}
	}
	done := map[capping.Space][]uint32{}
	h.mu.Lock()
	keep := h.pending[:0]
	for _, e := range h.pending {
		if c, ok := committed[e.partition]; ok && e.offset < c {
			done[e.space] = append(done[e.space], e.user)
		} else {
			keep = append(keep, e)
		}
	}
	h.pending = keep
	n := len(keep)
	h.mu.Unlock()
	for s, users := range done {
		h.lim.ReleaseCopies(s, users)
	}
	return n, nil
}

// run releases the users of applied events every interval until ctx ends.
// While the group's offsets cannot be read, the users stay held: their
// decisions go to Redis, which is always right.
func (h *copyHolds) run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := h.releaseApplied(ctx)
		if err != nil && !failing && ctx.Err() == nil {
			h.log.Warn("reading the committed offsets of held events failed; their users' copies stay off", "group", h.group, "held_events", n, "err", err)
		}
		failing = err != nil
	}
}
