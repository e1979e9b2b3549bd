package daemon

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestCopiesHeldUntilTheEventIsCommitted: a preference event read by a
// replica holds the user's near-cache copy off (no answer from it, none
// kept) until the group that applies the events has committed past it on the
// real broker; a commit of another partition, or up to the event but not
// past it, leaves it held. Then copies are kept and answer again.
func TestCopiesHeldUntilTheEventIsCommitted(t *testing.T) {
	ctx := context.Background()
	brokers := testenv.KafkaBrokers(t)
	topic, group := testenv.Unique("prefs"), testenv.Unique("prefs-apply")
	testenv.CreateTopics(t, brokers, 2, topic)
	lim, err := capping.New(ctx, testenv.ClusterClient(t), capping.Config{KeyPrefix: testenv.Unique("held"), NearCache: 1000})
	if err != nil {
		t.Fatal(err)
	}
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Timeout: 10 * time.Second}
	h := &copyHolds{lim: lim, client: client, group: group, topic: topic, log: slog.New(slog.NewTextHandler(io.Discard, nil))}
	caps := []capping.Cap{{Name: "daily", Window: capping.Daily, Limit: 1}}
	jobs := 0
	// decide sends one job of user 7 and reports whether it was allowed and
	// whether the near cache answered it.
	decide := func() (allowed, cached bool) {
		t.Helper()
		jobs++
		before := lim.Stats().CacheHits
		ds, err := lim.Decide(ctx, []capping.Request{{UserID: 7, JobID: "j" + string(rune('a'+jobs)), Channel: "email", Caps: caps}})
		if err != nil {
			t.Fatal(err)
		}
		return ds[0].Allowed, lim.Stats().CacheHits > before
	}
	commit := func(partition int, offset int64) {
		t.Helper()
		resp, err := client.OffsetCommit(ctx, &kafka.OffsetCommitRequest{GroupID: group, GenerationID: -1,
			Topics: map[string][]kafka.OffsetCommit{topic: {{Partition: partition, Offset: offset}}}})
		if err == nil {
			for _, p := range resp.Topics[topic] {
				err = p.Error
			}
		}
		if err != nil {
			t.Fatalf("commit %d of partition %d for group %s: %v", offset, partition, group, err)
		}
	}
	held := func(want int) {
		t.Helper()
		n, err := h.releaseApplied(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if n != want || lim.Stats().CacheHeld != want {
			t.Fatalf("%d events held, %d users, want %d", n, lim.Stats().CacheHeld, want)
		}
	}

	if allowed, _ := decide(); !allowed {
		t.Fatal("the first send was capped")
	}
	if allowed, _ := decide(); allowed {
		t.Fatal("the second send was allowed over the limit of 1")
	}
	if allowed, cached := decide(); allowed || !cached {
		t.Fatalf("before the event: allowed %v, from the copy %v; want capped from the copy", allowed, cached)
	}

	h.hold(1, 4, 0, 7) // the user's preference event, at offset 4 of partition 1
	held(1)            // nothing committed yet
	for range 2 {      // the first from Redis would have installed a copy for the second
		if allowed, cached := decide(); allowed || cached {
			t.Fatalf("while held: allowed %v, from the copy %v; want capped by Redis", allowed, cached)
		}
	}
	commit(0, 10) // another partition
	commit(1, 4)  // up to the event: it is the next to apply
	held(1)
	commit(1, 5) // past it: applied
	held(0)
	if allowed, cached := decide(); allowed || cached {
		t.Fatalf("after the release: allowed %v, from the copy %v; want capped by Redis, which keeps a copy again", allowed, cached)
	}
	if allowed, cached := decide(); allowed || !cached {
		t.Fatalf("after the release: allowed %v, from the copy %v; want capped from the new copy", allowed, cached)
	}
}
