// Package testenv finds the local stack (Redis Cluster, Kafka-protocol broker,
// S3-compatible endpoint) that integration tests run against.
//
// The stack is located through environment variables that `scripts/stack.sh env`
// prints and `scripts/test.sh` exports. When a variable is missing the test is
// skipped, except under CI=true, where a missing backend fails the test.
package testenv

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/capper-dev/capper/internal/kafkaadmin"
	"github.com/redis/go-redis/v9"
)

// Environment variables naming the stack.
const (
	EnvRedisAddrs   = "CAPPER_TEST_REDIS_ADDRS"
	EnvKafkaBrokers = "CAPPER_TEST_KAFKA_BROKERS"
	EnvS3Endpoint   = "CAPPER_TEST_S3_ENDPOINT"
	EnvS3Bucket     = "CAPPER_TEST_S3_BUCKET"
)

func require(t testing.TB, name string) string {
	t.Helper()
	v := strings.TrimSpace(os.Getenv(name))
	if v != "" {
		return v
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s is not set: under CI=true a missing backend is a failure (run scripts/test.sh)", name)
	}
	t.Skipf("%s is not set: start the stack with scripts/stack.sh up and eval \"$(scripts/stack.sh env)\"", name)
	return ""
}

// RedisAddrs returns the Redis Cluster node addresses.
func RedisAddrs(t testing.TB) []string {
	t.Helper()
	return strings.Split(require(t, EnvRedisAddrs), ",")
}

// KafkaBrokers returns the Kafka bootstrap addresses.
func KafkaBrokers(t testing.TB) []string {
	t.Helper()
	return strings.Split(require(t, EnvKafkaBrokers), ",")
}

// S3 returns the S3 endpoint URL and the bucket created by the stack.
func S3(t testing.TB) (endpoint, bucket string) {
	t.Helper()
	endpoint = require(t, EnvS3Endpoint)
	bucket = os.Getenv(EnvS3Bucket)
	if bucket == "" {
		bucket = "capper-segments"
	}
	return endpoint, bucket
}

// StackDir returns the local stack's state directory (PID files and logs),
// for tests that stop or freeze a stack process.
func StackDir(t testing.TB) string {
	t.Helper()
	return require(t, "CAPPER_STACK_DIR")
}

// ClusterClient returns a client of the Redis Cluster, closed when the test ends.
func ClusterClient(t testing.TB) *redis.ClusterClient {
	t.Helper()
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: RedisAddrs(t)})
	t.Cleanup(func() { _ = c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("ping redis cluster: %v", err)
	}
	return c
}

// Unique returns prefix followed by a random suffix: each test uses its own key
// prefixes and topic names on the shared stack.
func Unique(prefix string) string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// CreateTopics creates topics with the given partition count on the broker
// and waits until they are visible.
func CreateTopics(t testing.TB, brokers []string, partitions int, topics ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := kafkaadmin.CreateTopics(ctx, nil, brokers, partitions, topics...); err != nil {
		t.Fatal(err)
	}
}

// WaitClusterOK waits until every node of the cluster reports cluster_state:ok,
// for tests that fail over or stop a node.
func WaitClusterOK(t testing.TB, rdb *redis.ClusterClient) {
	t.Helper()
	for i := 0; i < 150; i++ {
		var bad atomic.Bool // ForEachShard calls its function concurrently
		_ = rdb.ForEachShard(context.Background(), func(ctx context.Context, c *redis.Client) error {
			if info, err := c.ClusterInfo(ctx).Result(); err != nil || !strings.Contains(info, "cluster_state:ok") {
				bad.Store(true)
			}
			return nil
		})
		if !bad.Load() {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Error("the cluster did not return to cluster_state:ok in 15s")
}

// S3Client returns an AWS SDK client of the local S3 endpoint.
func S3Client(endpoint string) *s3.Client {
	return s3.New(s3.Options{
		Region: "us-east-1", BaseEndpoint: aws.String(endpoint), UsePathStyle: true,
		Credentials: credentials.NewStaticCredentialsProvider("test", "test", ""),
	})
}

// RedisPID returns the process id of the stack's Redis node at addr.
func RedisPID(t testing.TB, addr string) int {
	t.Helper()
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(StackDir(t), "redis", port+".pid"))
	if err != nil {
		t.Fatalf("pid of redis %s: %v", addr, err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("pid file of redis %s: %v", addr, err)
	}
	return pid
}

// KillRedis crashes the stack's Redis node at addr with SIGKILL (no shutdown,
// no final replication) and returns the function that starts it again and
// waits until the cluster has its three linked replicas back. It may be called
// from another goroutine; it also runs (or is waited for) when the test ends,
// so later tests find a whole cluster.
func KillRedis(t testing.TB, addr string) (restart func()) {
	t.Helper()
	pid := RedisPID(t, addr)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 redis %s: %v", addr, err)
	}
	for i := 0; i < 200 && syscall.Kill(pid, 0) == nil; i++ {
		time.Sleep(10 * time.Millisecond)
	}
	_, port, _ := net.SplitHostPort(addr)
	script := require(t, "CAPPER_STACK_SCRIPT")
	var once sync.Once // a second caller (the cleanup) waits for a restart in progress
	restart = func() {
		once.Do(func() {
			out, err := exec.Command(script, "restart-node", port).CombinedOutput()
			if err != nil {
				t.Errorf("restart redis %s: %v\n%s", addr, err, out)
			}
		})
	}
	t.Cleanup(restart)
	return restart
}

// StopKafka stops the stack's broker with sig (SIGKILL: a crash; SIGTERM: a
// controlled shutdown), waits until the process is gone and returns the
// function that starts it again on its data directory and waits until it
// serves. The restart also runs (or is waited for) when the test ends, so
// later tests find a broker.
func StopKafka(t testing.TB, sig syscall.Signal) (restart func()) {
	t.Helper()
	pid := kafkaPID(t)
	if err := syscall.Kill(pid, sig); err != nil {
		t.Fatalf("kill -%d the broker: %v", sig, err)
	}
	for i := 0; syscall.Kill(pid, 0) == nil; i++ {
		if i == 3000 {
			t.Fatalf("the broker did not exit within 60 s of signal %d", sig)
		}
		time.Sleep(20 * time.Millisecond)
	}
	script := require(t, "CAPPER_STACK_SCRIPT")
	var once sync.Once
	restart = func() {
		once.Do(func() {
			out, err := exec.Command(script, "restart-kafka").CombinedOutput()
			if err != nil {
				t.Errorf("restart the broker: %v\n%s", err, out)
			}
		})
	}
	t.Cleanup(restart)
	return restart
}

// PauseKafka freezes the stack's broker (SIGSTOP) for d, as a long
// collection pause or a starved machine does, and thaws it (SIGCONT).
func PauseKafka(t testing.TB, d time.Duration) {
	t.Helper()
	pid := kafkaPID(t)
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatalf("kill -STOP the broker: %v", err)
	}
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGCONT) }) // should the test end in the pause
	time.Sleep(d)
	if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
		t.Fatalf("kill -CONT the broker: %v", err)
	}
}

func kafkaPID(t testing.TB) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(StackDir(t), "kafka", "kafka.pid"))
	if err != nil {
		t.Fatalf("pid of the broker: %v", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("pid file of the broker: %v", err)
	}
	return pid
}

// ReplicaOf returns the address of a replica of the master at addr.
func ReplicaOf(t testing.TB, addr string) string {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	info, err := c.Info(context.Background(), "replication").Result()
	if err != nil {
		t.Fatalf("info replication of %s: %v", addr, err)
	}
	for _, line := range strings.Split(info, "\n") {
		if !strings.HasPrefix(line, "slave0:") {
			continue
		}
		var ip, port string
		for _, kv := range strings.Split(strings.TrimSpace(strings.TrimPrefix(line, "slave0:")), ",") {
			k, v, _ := strings.Cut(kv, "=")
			switch k {
			case "ip":
				ip = v
			case "port":
				port = v
			}
		}
		return net.JoinHostPort(ip, port)
	}
	t.Fatalf("master %s has no replica:\n%s", addr, info)
	return ""
}

// WaitMaster polls the node at addr until it reports the master role and
// returns when it did, or fails the test after timeout.
func WaitMaster(t testing.TB, addr string, timeout time.Duration) time.Time {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: 200 * time.Millisecond, ReadTimeout: 200 * time.Millisecond})
	defer c.Close()
	end := time.Now().Add(timeout)
	for time.Now().Before(end) {
		if role, err := c.Do(context.Background(), "ROLE").Slice(); err == nil && len(role) > 0 && role[0] == "master" {
			return time.Now()
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%s was not promoted to master within %v", addr, timeout)
	return time.Time{}
}

// LogBuffer is a log sink safe for concurrent writers (a worker's goroutines),
// read back whole by String.
type LogBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *LogBuffer) String() string { l.mu.Lock(); defer l.mu.Unlock(); return l.b.String() }
