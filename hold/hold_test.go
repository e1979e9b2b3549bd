package hold_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/output"
)

var t0 = time.Date(2026, 11, 22, 12, 0, 0, 0, time.UTC)

func wheel(t *testing.T, delays ...time.Duration) *hold.Wheel {
	t.Helper()
	w, err := hold.NewWheel("sends.delay.", delays)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func TestRoute(t *testing.T) {
	w := wheel(t, time.Hour, 5*time.Second, time.Minute, 10*time.Minute) // any order
	for _, c := range []struct {
		name  string
		left  time.Duration
		topic string
		wake  time.Duration
	}{
		{"exactly a tier", time.Minute, "sends.delay.1m", time.Minute},
		{"between tiers: the shorter", 59 * time.Second, "sends.delay.5s", 5 * time.Second},
		{"just over a tier", 10*time.Minute + time.Millisecond, "sends.delay.10m", 10 * time.Minute},
		{"beyond the longest", 30 * time.Hour, "sends.delay.1h", time.Hour},
		{"shorter than the shortest: wakes at due", 2 * time.Second, "sends.delay.5s", 2 * time.Second},
		{"already due", -time.Second, "sends.delay.5s", -time.Second},
	} {
		t.Run(c.name, func(t *testing.T) {
			tier, wake := w.Route(t0, t0.Add(c.left))
			if tier.Topic != c.topic || !wake.Equal(t0.Add(c.wake)) {
				t.Errorf("Route(+%v) = %s waking at +%v, want %s at +%v", c.left, tier.Topic, wake.Sub(t0), c.topic, c.wake)
			}
		})
	}
}

// TestRouteHopsEndAtDue follows a job through the wheel: each hop wakes no
// later than due, and the last one exactly at due.
func TestRouteHopsEndAtDue(t *testing.T) {
	w := wheel(t, hold.DefaultDelays...)
	now, due := t0, t0.Add(25*time.Hour+17*time.Minute+3*time.Second+400*time.Millisecond)
	hops := 0
	for now.Before(due) {
		_, wake := w.Route(now, due)
		if wake.After(due) || !wake.After(now) {
			t.Fatalf("hop %d at %v wakes at %v (due %v)", hops, now, wake, due)
		}
		now = wake
		hops++
	}
	if !now.Equal(due) || hops > 30 {
		t.Errorf("%d hops ending at %v, want due %v in at most 30", hops, now, due)
	}
}

func TestNewWheelRejects(t *testing.T) {
	for _, ds := range [][]time.Duration{nil, {time.Second, time.Second}, {10 * time.Millisecond}, {time.Second + time.Microsecond}} {
		if _, err := hold.NewWheel("p.", ds); err == nil {
			t.Errorf("NewWheel(%v) accepted", ds)
		}
	}
	if got := hold.Name(36 * time.Hour); got != "36h" {
		t.Errorf("Name(36h) = %q", got)
	}
	if got := hold.Name(48 * time.Hour); got != "2d" {
		t.Errorf("Name(48h) = %q", got)
	}
	if got := hold.Name(1500 * time.Millisecond); got != "1500ms" {
		t.Errorf("Name(1.5s) = %q", got)
	}
}

func TestStateHeaders(t *testing.T) {
	s := hold.State{Since: t0, Due: t0.Add(time.Minute + 250*time.Millisecond), Wake: t0.Add(time.Minute), Count: 3, Reason: "daily"}
	got, ok, err := hold.ParseState(s.AppendHeaders([]kafka.Header{{Key: "other", Value: []byte("x")}}))
	if err != nil || !ok || !got.Since.Equal(s.Since) || !got.Due.Equal(s.Due) || !got.Wake.Equal(s.Wake) || got.Count != 3 || got.Reason != "daily" {
		t.Errorf("round trip: %+v %v %v, want %+v", got, ok, err, s)
	}
	if _, ok, err := hold.ParseState([]kafka.Header{{Key: "other"}}); ok || err != nil {
		t.Errorf("no hold headers: ok %v err %v", ok, err)
	}
	bad := []kafka.Header{{Key: output.HeaderHoldCount, Value: []byte("2")}, {Key: output.HeaderDueAt, Value: []byte("tomorrow")}}
	if _, _, err := hold.ParseState(bad); err == nil {
		t.Error("a bad due time was accepted")
	}
	if _, _, err := hold.ParseState(bad[:1]); err == nil {
		t.Error("hold headers without a due time were accepted")
	}
}

// source hands out its messages in order and records what is committed.
type source struct {
	msgs      []kafka.Message
	committed []kafka.Message
}

func (s *source) FetchMessage(ctx context.Context) (kafka.Message, error) {
	if len(s.msgs) == 0 {
		<-ctx.Done()
		return kafka.Message{}, ctx.Err()
	}
	m := s.msgs[0]
	s.msgs = s.msgs[1:]
	return m, nil
}
func (s *source) CommitMessages(_ context.Context, msgs ...kafka.Message) error {
	s.committed = append(s.committed, msgs...)
	return nil
}

// rebalancing is a source whose group rebalances when the test says.
type rebalancing struct {
	source
	joined, assigned int64
}

func (s *rebalancing) Generations() (int64, int64) { return s.joined, s.assigned }

// rebalance: the group is joined and a generation begins before the next fetch.
func (s *rebalancing) rebalance() { s.joined, s.assigned = s.joined+1, s.assigned+1 }

// held is a tier message of partition p at offset off waking at wake.
func held(p int, off int64, wake time.Time) kafka.Message {
	s := hold.State{Since: wake.Add(-time.Hour), Due: wake.Add(time.Hour), Wake: wake, Count: 1}
	return kafka.Message{Topic: "sends.delay.100ms", Partition: p, Offset: off, Headers: s.AppendHeaders(nil)}
}

// TestReaderReturnsTheEarliestWake: a message due sooner is not kept behind
// one queued before it with a later wake time (in the shortest tier, a job
// with a few milliseconds left queued behind one with the whole delay left);
// none is returned before its wake time; a wait cut short keeps them all.
func TestReaderReturnsTheEarliestWake(t *testing.T) {
	start := time.Now().Truncate(time.Millisecond) // headers keep milliseconds
	late, soon := start.Add(300*time.Millisecond), start.Add(100*time.Millisecond)
	bare := kafka.Message{Topic: "sends.delay.100ms", Partition: 0, Offset: 8} // no hold headers: at once (dead-lettered)
	r := hold.NewReader(&source{msgs: []kafka.Message{held(0, 7, late), bare, held(0, 9, soon)}}, nil, hold.Ahead)
	if r.Waiting() {
		t.Error("waiting before it holds a message")
	}
	if m, err := r.FetchMessage(context.Background()); err != nil || m.Offset != 8 {
		t.Fatalf("first fetch: offset %d, %v; want 8 (no hold headers) at once", m.Offset, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := r.FetchMessage(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("fetch before any wake time: %v, want the context's deadline", err)
	}
	if !r.Waiting() {
		t.Error("not waiting while it holds messages before their wake time (the stall watch would call the tier stalled)")
	}
	for _, want := range []struct {
		offset int64
		wake   time.Time
	}{{9, soon}, {7, late}} {
		m, err := r.FetchMessage(context.Background())
		if err != nil || m.Offset != want.offset {
			t.Fatalf("fetch: offset %d, %v; want %d", m.Offset, err, want.offset)
		}
		if now := time.Now(); now.Before(want.wake) {
			t.Errorf("offset %d returned %v before its wake time", m.Offset, want.wake.Sub(now))
		}
	}
	if r.Waiting() {
		t.Error("still waiting after every message was returned")
	}
}

// TestReaderDoesNotWaitPastTheDeadline: a batch collecting more after its
// first is not kept waiting for a message that wakes after it stops
// collecting (every release was that wait late).
func TestReaderDoesNotWaitPastTheDeadline(t *testing.T) {
	wake := time.Now().Add(10 * time.Second)
	r := hold.NewReader(&source{msgs: []kafka.Message{held(0, 1, wake)}}, nil, hold.Ahead)
	ctx, cancel := context.WithDeadline(context.Background(), wake.Add(-time.Millisecond))
	defer cancel()
	if _, err := r.FetchMessage(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("fetch: %v, want the deadline", err)
	}
	if ctx.Err() != nil {
		t.Error("waited until the deadline for a message that wakes after it")
	}
	if !r.Waiting() {
		t.Error("the message was not kept")
	}
	// Nothing held and nothing fetched: a message produced now wakes later.
	empty := hold.NewReader(&source{}, nil, hold.Ahead)
	if _, err := empty.FetchMessage(ctx); !errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil {
		t.Errorf("fetch from an empty tier: %v (the deadline's own: %v), want the deadline at once", err, ctx.Err())
	}
}

// TestReaderSendsAReleaseAtOnce: a batch that holds a job due to be decided
// does not wait for jobs that only hop to another tier; one of hops alone
// takes those due within its wait.
func TestReaderSendsAReleaseAtOnce(t *testing.T) {
	now := time.Now()
	release := held(0, 1, now.Add(-time.Millisecond))
	s, _, _ := hold.ParseState(release.Headers)
	s.Due = s.Wake
	release.Headers = s.AppendHeaders(nil)
	hop := held(0, 2, now.Add(20*time.Millisecond))
	r := hold.NewReader(&source{msgs: []kafka.Message{release, hop}}, nil, hold.Ahead)
	if m, err := r.FetchMessage(context.Background()); err != nil || m.Offset != 1 {
		t.Fatalf("first: offset %d, %v; want the release", m.Offset, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if m, err := r.FetchMessage(ctx); !errors.Is(err, context.DeadlineExceeded) || ctx.Err() != nil {
		t.Fatalf("collecting after a release: offset %d, %v; want the deadline at once", m.Offset, err)
	}
	// A new batch: the hop first; then a batch of hops takes the next hop due within its wait.
	r = hold.NewReader(&source{msgs: []kafka.Message{held(0, 3, now), held(0, 4, now.Add(20*time.Millisecond))}}, nil, hold.Ahead)
	if m, err := r.FetchMessage(context.Background()); err != nil || m.Offset != 3 {
		t.Fatalf("first hop: offset %d, %v", m.Offset, err)
	}
	if m, err := r.FetchMessage(ctx); err != nil || m.Offset != 4 {
		t.Fatalf("collecting after a hop: offset %d, %v; want the hop due within the wait", m.Offset, err)
	}
}

// TestReaderDropsARedelivery: a message fetched again while it is held or
// passed on and not committed (a rebalance reset the group's offset) is not
// returned twice, and a reader that does not read ahead returns its
// messages in order.
func TestReaderDropsARedelivery(t *testing.T) {
	past := time.Now().Add(-time.Second)
	a, b := held(0, 1, past), held(0, 2, past)
	src := &source{msgs: []kafka.Message{a, b, a, b, held(0, 3, past)}}
	r := hold.NewReader(src, nil, 1)
	if m, err := r.FetchMessage(context.Background()); err != nil || m.Offset != 1 {
		t.Fatalf("first: offset %d, %v", m.Offset, err)
	}
	if m, err := r.FetchMessage(context.Background()); err != nil || m.Offset != 2 {
		t.Fatalf("second: offset %d, %v", m.Offset, err)
	}
	if m, err := r.FetchMessage(context.Background()); err != nil || m.Offset != 3 {
		t.Fatalf("after the copies of 1 and 2: offset %d, %v; want 3", m.Offset, err)
	}
	later := time.Now().Add(time.Hour)
	r = hold.NewReader(&source{msgs: []kafka.Message{held(0, 4, later), held(0, 5, past)}}, nil, 1)
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	if m, err := r.FetchMessage(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("a reader that does not read ahead returned offset %d (%v) before the head's wake time", m.Offset, err)
	}
}

// TestReaderCommitsOnlyWhatIsDone: a commit never covers a message fetched
// and not yet done, in its partition; other partitions commit on their own.
func TestReaderCommitsOnlyWhatIsDone(t *testing.T) {
	past := time.Now().Add(-time.Second)
	src := &source{}
	r := hold.NewReader(src, nil, hold.Ahead)
	ms := []kafka.Message{held(0, 10, past), held(0, 11, past), held(0, 12, past), held(1, 5, past)}
	src.msgs = ms
	for range ms {
		if _, err := r.FetchMessage(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	commit := func(m kafka.Message, want ...string) {
		t.Helper()
		commits(t, r, &src.committed, []kafka.Message{m}, want...)
	}
	commit(ms[2])         // 10 and 11 are not done: nothing
	commit(ms[3], "1:5")  // another partition
	commit(ms[0], "0:10") // 10 done, 11 not
	commit(ms[1], "0:12") // all done
	commit(ms[1])         // again (a failed commit retried): nothing new
}

// commits marks ms done on r and checks what r committed to its source
// (committed: the source's record), as "partition:offset".
func commits(t *testing.T, r *hold.Reader, committed *[]kafka.Message, ms []kafka.Message, want ...string) {
	t.Helper()
	*committed = nil
	if err := r.CommitMessages(context.Background(), ms...); err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, c := range *committed {
		got = append(got, fmt.Sprintf("%d:%d", c.Partition, c.Offset))
	}
	if !slices.Equal(got, want) {
		t.Errorf("commit of %v committed %v, want %v", offsetsOf(ms), got, want)
	}
}

func offsetsOf(ms []kafka.Message) []string {
	var out []string
	for _, m := range ms {
		out = append(out, fmt.Sprintf("%d:%d", m.Partition, m.Offset))
	}
	return out
}

// TestReaderDropsWhatARebalanceTookBack: a rebalance drops the messages a
// reader held, of every tier: those of its own partitions come again (each
// returned once), those of another replica's now are that replica's alone.
// A commit never passes a dropped offset before it is fetched again, and
// one the group's offset passed (another replica's work) holds nothing back.
func TestReaderDropsWhatARebalanceTookBack(t *testing.T) {
	past, later := time.Now().Add(-time.Second), time.Now().Add(time.Hour)
	src := &rebalancing{}
	r := hold.NewReader(src, nil, hold.Ahead)
	// returns gives r the source's next messages ms and checks the offsets it
	// returns, then that it returns nothing more before the wake times of
	// those it holds (an hour away).
	returns := func(ms []kafka.Message, want ...int64) {
		t.Helper()
		src.msgs = ms
		for _, w := range want {
			ctx, cancel := context.WithCancel(context.Background()) // no deadline: a deadline is a batch collecting more
			stop := time.AfterFunc(10*time.Second, cancel)          // a message wrongly kept wakes in an hour
			m, err := r.FetchMessage(ctx)
			stop.Stop()
			cancel()
			if err != nil || m.Offset != w {
				t.Fatalf("offset %d:%d, %v; want offset %d", m.Partition, m.Offset, err, w)
			}
		}
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(50*time.Millisecond, cancel)
		if m, err := r.FetchMessage(ctx); err == nil {
			t.Fatalf("offset %d:%d returned; want none before its wake time", m.Partition, m.Offset)
		}
	}
	commit := func(ms []kafka.Message, want ...string) { t.Helper(); commits(t, r, &src.committed, ms, want...) }

	returns([]kafka.Message{held(0, 10, later), held(0, 11, later), held(1, 7, later), held(0, 12, past)}, 12)
	// The group rebalances: partition 0 stays, partition 1 goes to another
	// replica (its offset 7 is never returned). Partition 0 is read again
	// from its committed offset: 10 and 11 once each, 12 (passed on) not again.
	src.rebalance()
	returns([]kafka.Message{held(0, 10, past)}, 10)
	commit([]kafka.Message{held(0, 12, past), held(0, 10, past)}, "0:10") // not past 11, dropped and not fetched again
	returns([]kafka.Message{held(0, 11, past), held(0, 12, past), held(0, 13, past)}, 11, 13)
	if r.Waiting() {
		t.Error("partition 1's offset 7, held before the rebalance, is still held: it is another replica's now")
	}

	// A dropped offset the group's offset passed (another replica's work)
	// holds no commit back.
	returns([]kafka.Message{held(2, 1, later)})
	src.rebalance()
	returns([]kafka.Message{held(2, 5, past), held(2, 6, past)}, 5, 6)
	commit([]kafka.Message{held(2, 5, past), held(2, 6, past)}, "2:6")
	returns([]kafka.Message{held(6, 50, later), held(6, 51, later)}) // so with one sent again after it
	src.rebalance()
	returns([]kafka.Message{held(6, 51, past)}, 51)
	commit([]kafka.Message{held(6, 51, past)}, "6:51")

	// The fetch that sees a generation begin may return a message read
	// before it: it does not pass the dropped offsets.
	returns([]kafka.Message{held(3, 20, later), held(3, 21, later)})
	src.rebalance()
	returns([]kafka.Message{held(3, 22, past)}, 22)
	commit([]kafka.Message{held(3, 22, past)})

	// Joined, and no generation yet: what is fetched is of the one that
	// ended (left in the consumer's queue), dropped, and sent again.
	returns([]kafka.Message{held(4, 30, later)})
	src.joined++
	returns([]kafka.Message{held(4, 31, past)})
	src.assigned++
	returns([]kafka.Message{held(4, 30, past), held(4, 31, past)}, 30, 31)
	commit([]kafka.Message{held(4, 30, past), held(4, 31, past)}, "4:31")

	// A partition's leader changed (counted as an assignment, no join): the
	// consumer reads on from where it was, and nothing held is dropped.
	returns([]kafka.Message{held(5, 40, later)})
	src.assigned++
	returns([]kafka.Message{held(5, 41, past)}, 41)
	if !r.Waiting() {
		t.Error("offset 40 was dropped on a change of leader: no one would send it again")
	}
}

// heldBy is held(p, off, wake) held by reason (a budget's name).
func heldBy(p int, off int64, wake time.Time, reason string) kafka.Message {
	s := hold.State{Since: wake.Add(-time.Hour), Due: wake, Wake: wake, Count: 1, Reason: reason}
	return kafka.Message{Topic: "sends.delay.1h", Partition: p, Offset: off, Headers: s.AppendHeaders(nil)}
}

// TestReaderReleasesEarly: an early request returns, at its time, the held
// message of its reason that wakes first, before its wake time, from a
// Reader waiting for a wake time or for a fetch; a request of a reason the
// Reader holds none of is not served, and is dropped a tenth of a second
// after its time; the other messages keep their wake times.
func TestReaderReleasesEarly(t *testing.T) {
	now := time.Now()
	src := &source{msgs: []kafka.Message{heldBy(0, 1, now.Add(2*time.Hour), "sms"), heldBy(0, 2, now.Add(30*time.Minute), "push"),
		heldBy(0, 3, now.Add(time.Hour), "sms"), heldBy(0, 4, now.Add(3*time.Hour), "sms")}}
	// Without the request, each fetch below would wait an hour or more: soon
	// ends it first (a cancel, not a deadline: a fetch with a deadline is a
	// batch collecting more, which does not wait).
	soon, stop := context.WithCancel(context.Background())
	defer time.AfterFunc(time.Minute, stop).Stop()
	for _, ahead := range []int{4, hold.Ahead} { // waiting on a timer (all read ahead), and in a fetch
		src := &source{msgs: slices.Clone(src.msgs)}
		r := hold.NewReader(src, nil, ahead)
		early := hold.NewEarly()
		r.UseEarly(early)
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		if _, err := r.FetchMessage(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("ahead %d: fetch before any request: %v, want the deadline", ahead, err)
		}
		cancel()
		early.Release("email", time.Now()) // held by no budget this reader holds
		go func() {                        // while the reader waits
			time.Sleep(20 * time.Millisecond)
			early.Release("sms", time.Now())
		}()
		m, err := r.FetchMessage(soon)
		if err != nil || m.Offset != 3 {
			t.Fatalf("ahead %d: fetch after an early request of sms: offset %d, %v; want 3, sms's soonest", ahead, m.Offset, err)
		}
		at := time.Now().Add(50 * time.Millisecond) // a promise given up, at its time
		early.Release("sms", at)
		if m, err := r.FetchMessage(soon); err != nil || m.Offset != 1 {
			t.Fatalf("ahead %d: fetch after a request for later: offset %d, %v; want 1", ahead, m.Offset, err)
		}
		if time.Now().Before(at) {
			t.Errorf("ahead %d: a request for %v returned its message before then", ahead, at)
		}
		if n := early.Pending(); n != 1 {
			t.Errorf("ahead %d: %d requests pending, want the one no reader can serve (email)", ahead, n)
		}
		time.Sleep(150 * time.Millisecond) // past its lapse: dropped at the next look
		early.Release("push", time.Now())
		if m, err := r.FetchMessage(soon); err != nil || m.Offset != 2 {
			t.Fatalf("ahead %d: fetch after a request of push: offset %d, %v; want 2", ahead, m.Offset, err)
		}
		if n := early.Pending(); n != 0 {
			t.Errorf("ahead %d: %d requests pending, want none (email's lapsed)", ahead, n)
		}
		ctx, cancel = context.WithTimeout(context.Background(), 100*time.Millisecond)
		if m, err := r.FetchMessage(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("ahead %d: offset %d returned (%v) with no request and no wake due", ahead, m.Offset, err)
		}
		cancel()
		if !r.Waiting() {
			t.Errorf("ahead %d: the last message (offset 4) was not kept", ahead)
		}
	}
}
