// Command capper-devstack runs the development Kafka-protocol broker (kfake)
// and the S3-compatible endpoint (gofakes3) that the local stack, the tests
// and the demo use. It is a development tool: the capper binary never links it.
//
// It listens on 127.0.0.1 only. Kafka state (logs and committed offsets) lives
// in -data-dir and survives a restart; the S3 endpoint keeps its objects in
// memory. A janitor removes consumer-group members that died while joining,
// which kfake never expires (see janitor.go). It runs until SIGINT or SIGTERM.
//
// The secured stack (scripts/stack.sh up --secure) runs it with TLS on the
// broker, SASL users (-sasl-users) with ACLs enforced, and a second broker
// that demands client certificates (-mtls-port): see secure.go.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

type options struct {
	kafkaPort  int
	dataDir    string
	topics     []string
	partitions int
	s3Addr     string
	buckets    []string
	janitor    bool
	secure     secureFlags
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "capper-devstack:", err)
		os.Exit(1)
	}
}

func run() error {
	var cfg options
	var topics, buckets string
	flag.IntVar(&cfg.kafkaPort, "kafka-port", 9092, "port of the Kafka-protocol broker on 127.0.0.1")
	flag.StringVar(&cfg.dataDir, "data-dir", "", "directory for the broker's logs and offsets (Required)")
	flag.StringVar(&topics, "topics", "sends,sends.allowed,sends.capped,sends.dlq,sends.held,sends.delay.1s,sends.delay.10s,sends.delay.1m,sends.delay.10m,sends.delay.1h,sends.delay.6h", "comma-separated topics to create when missing")
	flag.IntVar(&cfg.partitions, "partitions", 6, "partitions of each created topic")
	flag.StringVar(&cfg.s3Addr, "s3-addr", "127.0.0.1:9000", "listen address of the S3-compatible endpoint")
	flag.StringVar(&buckets, "buckets", "capper-segments", "comma-separated buckets to create")
	flag.BoolVar(&cfg.janitor, "janitor", true, "remove group members that died while joining (kfake never expires them)")
	cfg.secure.register(flag.CommandLine)
	flag.Parse()
	cfg.topics = splitList(topics)
	cfg.buckets = splitList(buckets)
	if cfg.dataDir == "" {
		return errors.New("-data-dir is required")
	}
	if cfg.partitions < 1 {
		return fmt.Errorf("-partitions must be at least 1, got %d", cfg.partitions)
	}
	if host, _, err := net.SplitHostPort(cfg.s3Addr); err != nil || host != "127.0.0.1" {
		return fmt.Errorf("-s3-addr %q must be 127.0.0.1:PORT", cfg.s3Addr)
	}

	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	brokers, err := cfg.secure.brokers(cfg.kafkaPort)
	if err != nil {
		return err
	}
	for _, b := range brokers {
		opts := append([]kfake.Opt{
			kfake.Ports(b.port),
			kfake.DefaultNumPartitions(cfg.partitions),
			kfake.SeedTopics(int32(cfg.partitions), cfg.topics...),
		}, b.opts...)
		if cfg.secure.none() {
			opts = append(opts, kfake.DataDir(cfg.dataDir)) // the secured stack starts empty every time
		}
		cluster, err := kfake.NewCluster(opts...)
		if err != nil {
			return fmt.Errorf("start kafka broker %s: %w", b.name, err)
		}
		defer cluster.Close()
		if err := ensureTopics(ctx, cluster.ListenAddrs(), b.admin, cfg.topics, cfg.partitions); err != nil {
			return err
		}
		log.Info("kafka broker ready", "broker", b.name, "addrs", cluster.ListenAddrs(), "topics", cfg.topics, "data_dir", cfg.dataDir)
		if cfg.janitor {
			if err := startJanitor(ctx, cluster, b.admin, log); err != nil {
				return fmt.Errorf("start group janitor: %w", err)
			}
		}
	}

	backend := s3mem.New()
	for _, b := range cfg.buckets {
		if err := backend.CreateBucket(b); err != nil {
			return fmt.Errorf("create bucket %q: %w", b, err)
		}
	}
	faker := gofakes3.New(backend, gofakes3.WithAutoBucket(true))
	ln, err := net.Listen("tcp", cfg.s3Addr)
	if err != nil {
		return fmt.Errorf("listen s3 endpoint: %w", err)
	}
	srv := &http.Server{Handler: faker.Server(), ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("s3 endpoint stopped", "err", err)
			stop()
		}
	}()
	log.Info("s3 endpoint ready", "addr", cfg.s3Addr, "buckets", cfg.buckets)

	<-ctx.Done()
	log.Info("shutting down")
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(shutdownCtx)
	return nil
}

// ensureTopics creates the topics a restarted broker does not have yet: seeded
// topics are only applied to an empty data directory.
func ensureTopics(ctx context.Context, addrs []string, admin []kgo.Opt, topics []string, partitions int) error {
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(addrs...)}, admin...)...)
	if err != nil {
		return fmt.Errorf("admin client: %w", err)
	}
	defer cl.Close()
	req := kmsg.NewPtrCreateTopicsRequest()
	req.TimeoutMillis = 5000
	for _, t := range topics {
		rt := kmsg.NewCreateTopicsRequestTopic()
		rt.Topic = t
		rt.NumPartitions = int32(partitions)
		rt.ReplicationFactor = 1
		req.Topics = append(req.Topics, rt)
	}
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	resp, err := req.RequestWith(cctx, cl)
	if err != nil {
		return fmt.Errorf("create topics: %w", err)
	}
	for _, t := range resp.Topics {
		if t.ErrorCode != 0 && t.ErrorCode != 36 { // 36: TOPIC_ALREADY_EXISTS
			return fmt.Errorf("create topic %q: kafka error code %d", t.Topic, t.ErrorCode)
		}
	}
	return nil
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
