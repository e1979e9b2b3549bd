// Command capper-devstack is the local stack's helper (scripts/stack.sh): it
// serves the S3-compatible endpoint (gofakes3) and sets up the stack's Apache
// Kafka broker. It is a development tool: the capper binary never links it.
//
//	capper-devstack s3 -addr 127.0.0.1:9000 -buckets capper-segments
//	capper-devstack kafka-setup -brokers 127.0.0.1:9092 -topics sends,... [secured flags]
//	capper-devstack calls -sha SHA [-args decide|seed|batch|copy -setup -at MS -n N -users U -clients C -pipeline P]
//	capper-devstack drop-keys -addrs A -prefix P
//	capper-devstack drop-topics -brokers B -prefix P
//	capper-devstack wait-groups -brokers B -config FILE -members N
//
// The S3 endpoint listens on 127.0.0.1 only and keeps its objects in memory;
// it runs until SIGINT or SIGTERM. kafka-setup creates the topics a broker
// does not have yet and, on the secured broker (-sasl-user, -ca), grants the
// user of -grant exactly capper's ACLs (internal/kafkaadmin) on them. calls
// drives a Lua script on the Redis Cluster with capper's own arguments, the
// load whose cost scripts/bench-calls.sh measures (see calls.go). drop-keys
// removes a run's keys (keys.go), drop-topics its topics (topics.go);
// wait-groups waits until the consumer groups of a run's workers have settled (groups.go).
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
)

func main() {
	var err error
	switch cmd := first(os.Args[1:]); cmd {
	case "s3":
		err = serveS3(os.Args[2:])
	case "kafka-setup":
		err = kafkaSetup(os.Args[2:])
	case "calls":
		err = calls(os.Args[2:])
	case "drop-keys":
		err = dropKeys(os.Args[2:])
	case "drop-topics":
		err = dropTopics(os.Args[2:])
	case "wait-groups":
		err = waitGroups(os.Args[2:])
	case "-h", "-help", "--help", "help":
		fmt.Fprint(os.Stdout, devstackUsage)
		return
	default:
		fmt.Fprint(os.Stderr, devstackUsage)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "capper-devstack:", err)
		os.Exit(1)
	}
}

const devstackUsage = `usage: capper-devstack s3|kafka-setup|calls|drop-keys|drop-topics|wait-groups [flags]

the local stack's development tool (capper itself does not link it):
  s3           the S3-compatible endpoint of the local stack
  kafka-setup  creates the stack's topics and grants capper's ACLs
  calls        drives decide.lua's calls for the benchmarks
  drop-keys    deletes a run's Redis keys by prefix
  drop-topics  deletes a run's topics by prefix
  wait-groups  waits until a run's consumer groups are stable with N members

capper-devstack COMMAND -h lists a command's flags.

examples:
  capper-devstack drop-keys -addrs 127.0.0.1:7000 -prefix demo-1:
  capper-devstack calls -addrs 127.0.0.1:7000 -args decide -n 10000
`

func first(args []string) string {
	if len(args) == 0 {
		return ""
	}
	return args[0]
}

func serveS3(args []string) error {
	fs := flag.NewFlagSet("s3", flag.ExitOnError)
	addr := fs.String("addr", "127.0.0.1:9000", "listen address of the S3-compatible endpoint (127.0.0.1 only)")
	buckets := fs.String("buckets", "capper-segments", "comma-separated buckets to create")
	_ = fs.Parse(args)
	if host, _, err := net.SplitHostPort(*addr); err != nil || host != "127.0.0.1" {
		return fmt.Errorf("-addr %q must be 127.0.0.1:PORT", *addr)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	backend := s3mem.New()
	names := splitList(*buckets)
	for _, b := range names {
		if err := backend.CreateBucket(b); err != nil {
			return fmt.Errorf("create bucket %q: %w", b, err)
		}
	}
	faker := gofakes3.New(backend, gofakes3.WithAutoBucket(true))
	ln, err := net.Listen("tcp", *addr)
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
	log.Info("s3 endpoint ready", "addr", *addr, "buckets", names)
	<-ctx.Done()
	log.Info("shutting down")
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return srv.Shutdown(shutdownCtx)
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
