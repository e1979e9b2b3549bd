package testenv_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/redis/go-redis/v9"
	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/testenv"
)

// TestRedisClusterEveryMaster writes and reads a key owned by each master.
func TestRedisClusterEveryMaster(t *testing.T) {
	c := testenv.ClusterClient(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var mu sync.Mutex // ForEachMaster calls its function concurrently
	masters := map[string]bool{}
	if err := c.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
		mu.Lock()
		masters[m.Options().Addr] = false
		mu.Unlock()
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(masters) != 3 {
		t.Fatalf("cluster has %d masters, want 3", len(masters))
	}
	prefix := testenv.Unique("stacktest:")
	// Try keys until every master has owned one; a key's owner is the master
	// that answers it directly.
	for i := 0; i < 1000 && countTrue(masters) < len(masters); i++ {
		key := fmt.Sprintf("%s%d", prefix, i)
		want := fmt.Sprintf("v%d", i)
		if err := c.Set(ctx, key, want, time.Minute).Err(); err != nil {
			t.Fatalf("set %s: %v", key, err)
		}
		got, err := c.Get(ctx, key).Result()
		if err != nil || got != want {
			t.Fatalf("get %s = %q, %v; want %q", key, got, err, want)
		}
		if err := c.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
			n, err := m.Exists(ctx, key).Result()
			if err == nil && n == 1 {
				mu.Lock()
				masters[m.Options().Addr] = true
				mu.Unlock()
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		c.Del(ctx, key)
	}
	for addr, seen := range masters {
		if !seen {
			t.Errorf("no key landed on master %s", addr)
		}
	}
}

func countTrue(m map[string]bool) int {
	n := 0
	for _, v := range m {
		if v {
			n++
		}
	}
	return n
}

// TestKafkaConsumerGroup produces to a fresh topic, consumes it as a consumer
// group, commits, and checks that a second reader of the group resumes after
// the committed offsets.
func TestKafkaConsumerGroup(t *testing.T) {
	brokers := testenv.KafkaBrokers(t)
	topic := testenv.Unique("stacktest-")
	group := testenv.Unique("stacktest-group-")
	testenv.CreateTopics(t, brokers, 3, topic)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	w := &kafka.Writer{Addr: kafka.TCP(brokers...), Topic: topic, RequiredAcks: kafka.RequireAll, Balancer: &kafka.Hash{}, BatchTimeout: 5 * time.Millisecond}
	defer w.Close()
	var msgs []kafka.Message
	for i := 0; i < 30; i++ {
		msgs = append(msgs, kafka.Message{Key: []byte(fmt.Sprintf("k%d", i)), Value: []byte(fmt.Sprintf("v%d", i))})
	}
	if err := w.WriteMessages(ctx, msgs[:20]...); err != nil {
		t.Fatalf("produce: %v", err)
	}

	read := func(n int) []string {
		t.Helper()
		r := kafka.NewReader(kafka.ReaderConfig{Brokers: brokers, GroupID: group, Topic: topic, MaxWait: 200 * time.Millisecond, StartOffset: kafka.FirstOffset})
		defer r.Close()
		var got []string
		for len(got) < n {
			m, err := r.FetchMessage(ctx)
			if err != nil {
				t.Fatalf("fetch after %d messages: %v", len(got), err)
			}
			got = append(got, string(m.Value))
			cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
			err = r.CommitMessages(cctx, m)
			ccancel()
			if err != nil {
				t.Fatalf("commit: %v", err)
			}
		}
		return got
	}
	first := read(20)
	if err := w.WriteMessages(ctx, msgs[20:]...); err != nil {
		t.Fatalf("produce: %v", err)
	}
	second := read(10)
	all := append(first, second...)
	sort.Strings(all)
	want := make([]string, 0, 30)
	for _, m := range msgs {
		want = append(want, string(m.Value))
	}
	sort.Strings(want)
	if fmt.Sprint(all) != fmt.Sprint(want) {
		t.Fatalf("consumed %v\nwant %v (the second reader must resume after the committed offsets)", all, want)
	}
}

// TestS3PutGet puts and gets an object on the S3 endpoint with the AWS SDK.
func TestS3PutGet(t *testing.T) {
	endpoint, bucket := testenv.S3(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cl := testenv.S3Client(endpoint)
	key := testenv.Unique("stacktest/") + ".bin"
	body := bytes.Repeat([]byte("capper"), 1000)
	if _, err := cl.PutObject(ctx, &s3.PutObjectInput{Bucket: &bucket, Key: &key, Body: bytes.NewReader(body)}); err != nil {
		t.Fatalf("put: %v", err)
	}
	out, err := cl.GetObject(ctx, &s3.GetObjectInput{Bucket: &bucket, Key: &key})
	if err != nil {
		t.Fatalf("get: %v", err)
	}
	got, err := io.ReadAll(out.Body)
	out.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, body) {
		t.Fatalf("got %d bytes, want the %d bytes put", len(got), len(body))
	}
}
