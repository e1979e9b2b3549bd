package collapse_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/capper-dev/capper/collapse"
	"github.com/capper-dev/capper/internal/testenv"
)

func newRegistry(t *testing.T) (*collapse.Registry, *redis.ClusterClient, string) {
	t.Helper()
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(t)})
	t.Cleanup(func() { _ = rdb.Close() })
	r, err := collapse.New(collapse.Config{Client: rdb, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	return r, rdb, testenv.Unique("cl")
}

var t0 = time.Date(2026, 11, 28, 8, 0, 0, 0, time.UTC)

func verdicts(t *testing.T, r *collapse.Registry, now time.Time, sends ...collapse.Send) []collapse.Verdict {
	t.Helper()
	v, err := r.Check(context.Background(), sends, now)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// Held sends of one key come back in any order: only the newest goes,
// the others name it, and asking again answers the same.
func TestOnlyTheNewestOfAKeyGoes(t *testing.T) {
	r, _, prefix := newRegistry(t)
	user := prefix + ":{7}"
	send := func(job string, min int) collapse.Send {
		return collapse.Send{User: user, Key: "price-drop/sku-1", Job: job, Since: t0.Add(time.Duration(min) * time.Minute), Retain: time.Hour}
	}
	// Held overnight, one after the other: each the newest when it was held.
	for i, j := range []string{"a", "b", "c"} {
		if v := verdicts(t, r, t0.Add(time.Duration(i)*time.Minute), send(j, i)); v[0].Collapsed() {
			t.Fatalf("%s, the newest when it was held, collapsed: %+v", j, v[0])
		}
	}
	// Back in the morning, out of order.
	morning := t0.Add(10 * time.Minute)
	for _, tc := range []struct {
		job  string
		min  int
		want string
	}{{"b", 1, "c"}, {"c", 2, ""}, {"a", 0, "c"}, {"c", 2, ""}, {"b", 1, "c"}} {
		v := verdicts(t, r, morning, send(tc.job, tc.min))
		if v[0].By != tc.want || (tc.want != "" && v[0].Why != "newer") {
			t.Errorf("%s back: %+v, want collapsed by %q", tc.job, v[0], tc.want)
		}
	}
	// Another user, or another key of the same user, is another series.
	other := send("z", -5)
	other.User = prefix + ":{8}"
	another := send("y", -5)
	another.Key = "price-drop/sku-2"
	if v := verdicts(t, r, morning, other, another); v[0].Collapsed() || v[1].Collapsed() {
		t.Errorf("sends of another user or key collapsed: %+v", v)
	}
}

// Sends of one key in one call (a batch): only the newest goes, whatever
// their order in it; at the same submission time, the greater job id.
func TestABatchKeepsItsNewest(t *testing.T) {
	r, _, prefix := newRegistry(t)
	user := prefix + ":{9}"
	s := func(job string, sec int) collapse.Send {
		return collapse.Send{User: user, Key: "k", Job: job, Since: t0.Add(time.Duration(sec) * time.Second), Retain: time.Hour}
	}
	v := verdicts(t, r, t0.Add(time.Minute), s("j1", 1), s("j3", 3), s("j2", 2), s("j3b", 3))
	want := []string{"j3b", "j3b", "j3b", ""}
	for i := range v {
		if v[i].By != want[i] {
			t.Errorf("send %d: %+v, want collapsed by %q", i, v[i], want[i])
		}
	}
}

// Copies of one job (a redelivery keeps its timestamp, a resend has a new
// one) are never collapsed by each other, in one call or in two; a resend
// is the key's newest as of its own time, so a send between the two copies
// collapses by it.
func TestCopiesOfAJobDoNotCollapseEachOther(t *testing.T) {
	r, _, prefix := newRegistry(t)
	user := prefix + ":{13}"
	s := func(job string, sec int) collapse.Send {
		return collapse.Send{User: user, Key: "k", Job: job, Since: t0.Add(time.Duration(sec) * time.Second), Retain: time.Hour}
	}
	if v := verdicts(t, r, t0, s("j", 1), s("j", 5), s("j", 1)); v[0].Collapsed() || v[1].Collapsed() || v[2].Collapsed() {
		t.Fatalf("copies of one job in one call: %+v", v)
	}
	if v := verdicts(t, r, t0, s("j", 1)); v[0].Collapsed() {
		t.Errorf("an older copy of the newest job, alone: %+v", v[0])
	}
	if v := verdicts(t, r, t0, s("between", 3)); v[0].By != "j" {
		t.Errorf("a send between the job's copies: %+v, want collapsed by the job's resend", v[0])
	}
}

// With a window, a send of a key forwarded within it collapses the next
// send of the key, however new; past the window, the next goes. A copy of
// the forwarded send (a redelivery) is not collapsed by itself.
func TestAWindowCollapsesSendsAfterOneWent(t *testing.T) {
	r, rdb, prefix := newRegistry(t)
	user := prefix + ":{11}"
	s := func(job string, at time.Time) collapse.Send {
		return collapse.Send{User: user, Key: "news", Job: job, Since: at, Window: time.Hour, Retain: 2 * time.Hour}
	}
	ctx := context.Background()
	first := s("n1", t0)
	if v := verdicts(t, r, t0, first); v[0].Collapsed() {
		t.Fatalf("the first send collapsed: %+v", v[0])
	}
	if err := r.Sent(ctx, []collapse.Send{first}, []time.Time{t0.Add(time.Second)}, t0.Add(time.Second)); err != nil {
		t.Fatal(err)
	}
	at := t0.Add(30 * time.Minute)
	if v := verdicts(t, r, at, s("n2", at)); v[0].By != "n1" || v[0].Why != "window" {
		t.Errorf("a send 30 min after one went: %+v, want collapsed by n1 (window)", v[0])
	}
	if v := verdicts(t, r, at, s("n1", t0)); v[0].By != "n2" {
		t.Errorf("a copy of the send that went, after a newer one: %+v, want collapsed by n2 (its duplicate check then finds it sent)", v[0])
	}
	late := t0.Add(time.Hour + 2*time.Second)
	if v := verdicts(t, r, late, s("n3", late)); v[0].Collapsed() {
		t.Errorf("a send past the window: %+v, want it to go", v[0])
	}
	keys, err := r.Keys(ctx, user)
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != 1 || keys[0].Key != "news" || keys[0].Newest != "n3" || keys[0].Sent != "n1" || !keys[0].SentAt.Equal(t0.Add(time.Second)) {
		t.Errorf("keys: %+v", keys)
	}
	if ttl := rdb.PTTL(ctx, user+":k").Val(); ttl <= time.Hour || ttl > 2*time.Hour {
		t.Errorf("the user's keys expire in %v, want the retain of 2h", ttl)
	}
}

// A user with many keys keeps those of its last retain only.
func TestOldKeysArePruned(t *testing.T) {
	r, _, prefix := newRegistry(t)
	user := prefix + ":{12}"
	var sends []collapse.Send
	for i := range 80 {
		sends = append(sends, collapse.Send{User: user, Key: fmt.Sprint("old-", i), Job: fmt.Sprint("o", i), Since: t0, Retain: time.Hour})
	}
	verdicts(t, r, t0, sends...)
	later := t0.Add(2 * time.Hour)
	verdicts(t, r, later, collapse.Send{User: user, Key: "new", Job: "n", Since: later, Retain: time.Hour})
	keys, err := r.Keys(context.Background(), user)
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != 1 || keys[0].Key != "new" {
		t.Errorf("%d keys left after the old ones' retain, want only the new one", len(keys))
	}
}

// With min_replicas_acked, a call waits for a replica of each node it wrote
// to, and fails when it cannot have it; a node that lost the script (a
// restart, SCRIPT FLUSH) gets it again without an error.
func TestDurableCallsAndALostScript(t *testing.T) {
	plain, rdb, prefix := newRegistry(t)
	ctx := context.Background()
	durable, err := collapse.New(collapse.Config{Client: rdb, Timeout: 5 * time.Second, MinReplicasAcked: 1, ReplicaTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	var sends []collapse.Send
	for u := range 20 { // users of every node
		sends = append(sends, collapse.Send{User: fmt.Sprintf("%s:{%d}", prefix, u), Key: "k", Job: "a", Since: t0, Retain: time.Hour})
	}
	if err := rdb.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return c.ScriptFlush(ctx).Err() }); err != nil {
		t.Fatal(err)
	}
	if v, err := durable.Check(ctx, sends, t0); err != nil || v[0].Collapsed() {
		t.Fatalf("a durable check after SCRIPT FLUSH: %+v, %v", v, err)
	}
	newer := sends[3]
	newer.Job, newer.Since = "b", t0.Add(time.Second)
	if v, err := durable.Check(ctx, []collapse.Send{newer, sends[3]}, t0); err != nil || v[0].Collapsed() || v[1].By != "b" {
		t.Errorf("a durable check of a newer send: %+v, %v", v, err)
	}
	if err := rdb.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return c.ScriptFlush(ctx).Err() }); err != nil {
		t.Fatal(err)
	}
	if v, err := plain.Check(ctx, sends, t0); err != nil || v[3].By != "b" {
		t.Fatalf("a check after SCRIPT FLUSH: %+v, %v", v, err)
	}
	tooMany, err := collapse.New(collapse.Config{Client: rdb, MinReplicasAcked: 2, ReplicaTimeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tooMany.Check(ctx, sends[:1], t0); err == nil || !strings.Contains(err.Error(), "1 of 2 replicas") {
		t.Errorf("a check needing 2 replicas of nodes that have 1: %v, want it refused", err)
	}
}

// A check of many users' sends (several calls per node) answers each send.
func TestManyUsersInOneCheck(t *testing.T) {
	r, _, prefix := newRegistry(t)
	var sends, older []collapse.Send
	for u := range 150 {
		s := collapse.Send{User: fmt.Sprintf("%s:{%d}", prefix, u), Key: "k", Job: fmt.Sprint("new-", u), Since: t0.Add(time.Second), Retain: time.Hour}
		sends = append(sends, s)
		s.Job, s.Since = fmt.Sprint("old-", u), t0
		older = append(older, s)
	}
	for i, v := range verdicts(t, r, t0, sends...) {
		if v.Collapsed() {
			t.Fatalf("send %d of a new series collapsed: %+v", i, v)
		}
	}
	for i, v := range verdicts(t, r, t0, older...) {
		if v.By != fmt.Sprint("new-", i) {
			t.Fatalf("an older send of user %d: %+v, want collapsed by new-%d", i, v, i)
		}
	}
}
