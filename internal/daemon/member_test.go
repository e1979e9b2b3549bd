package daemon

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestMemberPartitions: two readers from newReader in one group on a topic
// of 4 partitions; the group's own answer, found by each reader's member
// token, gives each the partitions it fetches from, together all of them and
// none twice. A token no member carries has none.
func TestMemberPartitions(t *testing.T) {
	brokers := testenv.KafkaBrokers(t)
	topic, group := testenv.Unique("member"), testenv.Unique("member-group")
	testenv.CreateTopics(t, brokers, 4, topic)
	c := config.Kafka{Brokers: brokers, SessionTimeout: config.Duration(6 * time.Second)}
	dialer, transport, err := KafkaClients(c)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	var msgs []kafka.Message
	for i := range 400 {
		msgs = append(msgs, kafka.Message{Key: fmt.Appendf(nil, "k%d", i), Value: []byte("v")})
	}
	produce(ctx, t, c, transport, topic, msgs...)
	client := &kafka.Client{Addr: kafka.TCP(brokers...), Transport: transport, Timeout: 5 * time.Second}
	members := [][]byte{newMember(), newMember()}
	fetchedFrom := []map[int]bool{{}, {}}
	readers := make([]*kafka.Reader, 2)
	for i := range readers {
		readers[i] = newReader(c, dialer, group, topic, 1<<20, 100, readerMaxWait, memberBalancer{member: members[i]}, &consumer.ReaderFaults{}, log)
		defer readers[i].Close()
	}
	// Both members joined and the group settled: every partition fetched
	// from, and each member's answer is the partitions it fetched from since
	// its answer last changed (a member that joined first held them all).
	last := [][]int{nil, nil}
	for {
		for i, r := range readers {
			fctx, fcancel := context.WithTimeout(ctx, 500*time.Millisecond)
			if m, err := r.FetchMessage(fctx); err == nil {
				fetchedFrom[i][m.Partition] = true
			}
			fcancel()
		}
		a, errA := memberPartitions(ctx, client, group, topic, members[0])
		b, errB := memberPartitions(ctx, client, group, topic, members[1])
		if errA != nil || errB != nil {
			t.Fatalf("memberPartitions: %v, %v", errA, errB)
		}
		for i, parts := range [][]int{a, b} {
			if !slices.Equal(parts, last[i]) {
				last[i], fetchedFrom[i] = parts, map[int]bool{}
			}
		}
		all := slices.Sorted(slices.Values(append(slices.Clone(a), b...)))
		if len(a) > 0 && len(b) > 0 && slices.Equal(all, []int{0, 1, 2, 3}) && covers(a, fetchedFrom[0]) && covers(b, fetchedFrom[1]) {
			t.Logf("member 0: %v (fetched from %v), member 1: %v (fetched from %v)", a, fetchedFrom[0], b, fetchedFrom[1])
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("the group's answer never settled: %v and %v, fetched from %v and %v", a, b, fetchedFrom[0], fetchedFrom[1])
		}
	}
	if parts, err := memberPartitions(ctx, client, group, topic, newMember()); err != nil || len(parts) != 0 {
		t.Errorf("a token no member carries: %v, %v; want no partitions", parts, err)
	}
}

// covers reports whether every partition fetched from is in parts, and
// every one of parts was fetched from.
func covers(parts []int, fetched map[int]bool) bool {
	if len(parts) != len(fetched) {
		return false
	}
	for _, p := range parts {
		if !fetched[p] {
			return false
		}
	}
	return true
}

// TestTierSourceTellsGenerations: a tier's reader counts its group's joins
// and the generations it was assigned, which hold.Reader drops what it held
// by: one of each when it first reads, and a join then a generation more
// when a second reader joins the group.
func TestTierSourceTellsGenerations(t *testing.T) {
	brokers := testenv.KafkaBrokers(t)
	topic, group := testenv.Unique("tier"), testenv.Unique("tier-group")
	testenv.CreateTopics(t, brokers, 2, topic)
	c := config.Kafka{Brokers: brokers, GroupID: group, SessionTimeout: config.Duration(6 * time.Second), RebalanceTimeout: config.Duration(3 * time.Second)}
	_, transport, err := KafkaClients(c)
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	produce(ctx, t, c, transport, topic, kafka.Message{Value: []byte("a")}, kafka.Message{Value: []byte("b")})
	tier := hold.Tier{Name: "1s", Topic: topic}
	first, err := newTierReader(c, tier, newMember(), &consumer.ReaderFaults{}, log)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	if _, err := first.FetchMessage(ctx); err != nil {
		t.Fatal(err)
	}
	joined, assigned := first.Generations()
	if joined != 1 || assigned != 1 {
		t.Fatalf("after the first fetch: joined %d, assigned %d; want 1 and 1", joined, assigned)
	}
	second, err := newTierReader(c, tier, newMember(), &consumer.ReaderFaults{}, log)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Close()
	go func() { // the second joins while it fetches
		for ctx.Err() == nil {
			if _, err := second.FetchMessage(ctx); err != nil {
				return
			}
		}
	}()
	for {
		fctx, fcancel := context.WithTimeout(ctx, 200*time.Millisecond)
		_, _ = first.FetchMessage(fctx) // the first rejoins in the background; nothing more to read
		fcancel()
		j, a := first.Generations()
		if j > joined && a > assigned {
			t.Logf("joined %d, assigned %d after the second reader joined", j, a)
			return
		}
		if ctx.Err() != nil {
			t.Fatalf("the first reader never rejoined: joined %d, assigned %d", j, a)
		}
	}
}

// produce writes msgs to topic, again while the new topic's metadata spreads.
func produce(ctx context.Context, t *testing.T, c config.Kafka, transport *kafka.Transport, topic string, msgs ...kafka.Message) {
	t.Helper()
	w := NewWriter(c, transport, topic, 100, slog.New(slog.NewTextHandler(io.Discard, nil)))
	defer w.Close()
	for err := w.WriteMessages(ctx, msgs...); err != nil; err = w.WriteMessages(ctx, msgs...) {
		if ctx.Err() != nil {
			t.Fatalf("write: %v", err)
		}
		t.Logf("write: %v", err)
		time.Sleep(100 * time.Millisecond) // the topic's metadata follows its creation
	}
}

// TestTierFetchWaits: a tier's reader fetches with a wait of a tenth of its
// delay, from 100 ms to readerMaxWait, which bounds how long a rebalance of
// its group waits for it (tierMaxWait): the tiers a budget's held sends come
// back through wait least.
func TestTierFetchWaits(t *testing.T) {
	c := config.Kafka{Brokers: testenv.KafkaBrokers(t), GroupID: testenv.Unique("tier-wait"),
		SessionTimeout: config.Duration(6 * time.Second), RebalanceTimeout: config.Duration(3 * time.Second)}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for _, w := range []struct{ delay, want time.Duration }{
		{100 * time.Millisecond, 100 * time.Millisecond},
		{time.Second, 100 * time.Millisecond},
		{2 * time.Second, 200 * time.Millisecond},
		{10 * time.Second, 500 * time.Millisecond},
		{6 * time.Hour, 500 * time.Millisecond},
	} {
		tier := hold.Tier{Name: hold.Name(w.delay), Delay: w.delay, Topic: testenv.Unique("tier-wait")}
		r, err := newTierReader(c, tier, newMember(), &consumer.ReaderFaults{}, log)
		if err != nil {
			t.Fatal(err)
		}
		if got := r.Config().MaxWait; got != w.want {
			t.Errorf("tier of %v: its reader's fetch waits %v, want %v", w.delay, got, w.want)
		}
		r.Close()
	}
}

// TestALateFetchReplyKeepsItsConnection: a broker frozen for 300 ms (a long
// collection pause, a starved machine) answers an idle 100 ms tier's fetch
// late. The reader waits for the reply on its connection (fetchReplyGrace):
// no error, no new dial, and a send produced after the pause is read.
// kafka-go alone ends the connection a quarter of the fetch wait past the
// broker's wait ("i/o timeout"), dials again and reads the offsets first.
func TestALateFetchReplyKeepsItsConnection(t *testing.T) {
	brokers := testenv.KafkaBrokers(t)
	topic := testenv.Unique("late-reply")
	testenv.CreateTopics(t, brokers, 1, topic)
	c := config.Kafka{Brokers: brokers, GroupID: testenv.Unique("late-reply"), SessionTimeout: config.Duration(6 * time.Second), RebalanceTimeout: config.Duration(3 * time.Second)}
	_, transport, err := KafkaClients(c)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	tier := hold.Tier{Name: "100ms", Delay: 100 * time.Millisecond, Topic: topic}
	r, err := newTierReader(c, tier, newMember(), &consumer.ReaderFaults{}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	produce(ctx, t, c, transport, topic, kafka.Message{Value: []byte("before")})
	if m, err := r.FetchMessage(ctx); err != nil || string(m.Value) != "before" {
		t.Fatalf("first fetch: %q, %v", m.Value, err)
	}
	r.Stats() // the counts from here on
	// It fetches idle a few times before the pause.
	for fetches := int64(0); fetches < 3; {
		if ctx.Err() != nil {
			t.Fatal("the reader did not fetch again")
		}
		time.Sleep(50 * time.Millisecond)
		fetches += r.Stats().Fetches
	}
	testenv.PauseKafka(t, 300*time.Millisecond)
	produce(ctx, t, c, transport, topic, kafka.Message{Value: []byte("after")})
	if m, err := r.FetchMessage(ctx); err != nil || string(m.Value) != "after" {
		t.Fatalf("fetch after the pause: %q, %v", m.Value, err)
	}
	if st := r.Stats(); st.Errors != 0 || st.Dials != 0 {
		t.Errorf("over the pause the reader had %d errors and dialed %d times, want none", st.Errors, st.Dials)
	}
}
