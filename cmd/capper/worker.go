package main

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/segments"
)

func configFlag(fs *flag.FlagSet) *string {
	return fs.String("config", os.Getenv("CAPPER_CONFIG"), "config file (or CAPPER_CONFIG)")
}

// app holds what run and check share.
type app struct {
	cfg     *config.Config
	log     *slog.Logger
	reg     *prometheus.Registry
	limiter *capping.Limiter
	store   *segments.Store
	rules   *consumer.Rules
	trips   *roundTrips
	close   func()
}

func start(ctx context.Context, path string, logOut io.Writer) (*app, error) {
	cfg, err := loadConfig(path)
	if err != nil {
		return nil, err
	}
	a := &app{cfg: cfg, log: newLogger(cfg.LogLevel, logOut), reg: prometheus.NewRegistry(), trips: &roundTrips{}}
	a.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if a.rules, err = cfg.Rules.Build(1); err != nil {
		return nil, err
	}
	rdb, err := newRedis(cfg.Redis, a.trips)
	if err != nil {
		return nil, err
	}
	a.close = func() { _ = rdb.Close() }
	lctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for backoff := 250 * time.Millisecond; ; backoff = min(2*backoff, 5*time.Second) {
		a.limiter, err = capping.New(lctx, rdb, cfg.Redis.Limiter())
		if err == nil {
			break
		}
		a.log.Warn("redis not ready; retrying", "err", err, "in", backoff)
		select {
		case <-lctx.Done():
			a.close()
			return nil, fmt.Errorf("redis %v: %w", cfg.Redis.Addrs, err)
		case <-time.After(backoff):
		}
	}
	src, err := newSegmentSource(ctx, cfg.Segments)
	if err != nil {
		a.close()
		return nil, err
	}
	a.store, err = segments.New(segments.Config{
		Segments: a.rules.SegmentNames(), Source: src, Logger: a.log, Registerer: a.reg,
		RefreshInterval: time.Duration(cfg.Segments.RefreshInterval), StartupTimeout: time.Duration(cfg.Segments.StartupTimeout),
		CacheDir: cfg.Segments.CacheDir,
	})
	if err != nil {
		a.close()
		return nil, err
	}
	closeRedis := a.close
	a.close = func() { closeRedis(); _ = a.store.Close() }
	if err := a.store.Start(ctx); err != nil {
		a.close()
		return nil, err
	}
	return a, nil
}

func runWorker(ctx context.Context, args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("capper run", flag.ContinueOnError)
	path := configFlag(fs)
	passthrough := fs.Bool("passthrough", false, "benchmark baseline only: skip capping and forward every job as allowed (never in production)")
	if err := parseFlags(fs, "capper run --config FILE", args, os.Stdout, stderr); err != nil {
		return err
	}
	if err := work(ctx, *path, *passthrough, stderr); err != nil {
		// The worker's last line is JSON like every other.
		slog.New(slog.NewJSONHandler(stderr, nil)).Error("capper run failed", "err", err.Error())
		return errLogged
	}
	return nil
}

// work runs the worker until ctx ends.
func work(ctx context.Context, path string, passthrough bool, stderr io.Writer) error {
	a, err := start(ctx, path, stderr)
	if err != nil {
		return err
	}
	defer a.close()
	cfg := a.cfg
	batchSize := cmp.Or(cfg.Batch.Size, consumer.DefaultBatchSize)
	reader, writer, err := newKafka(cfg.Kafka, batchSize, a.log)
	if err != nil {
		return err
	}
	defer writer.Close()
	var decider consumer.Decider = a.limiter
	if passthrough {
		a.log.Warn("passthrough: capping is skipped and every job is forwarded as allowed; this is a benchmark baseline")
		decider = allowAll{}
	}
	w, err := consumer.New(consumer.Config{
		Reader: reader, Writer: writer, Decider: decider,
		Segments:  func() consumer.Segmenter { return a.store.Snapshot() },
		Rules:     a.rules,
		Topics:    consumer.Topics{Allowed: cfg.Kafka.Topics.Allowed, Capped: cfg.Kafka.Topics.Capped, DLQ: cfg.Kafka.Topics.DLQ},
		BatchSize: cfg.Batch.Size, BatchWait: time.Duration(cfg.Batch.MaxWait), MaxOutputBytes: cfg.Kafka.MaxBatchBytes,
		RoundTrips: a.trips.n.Load, Logger: a.log, Registerer: a.reg,
	})
	if err != nil {
		reader.Close()
		return err
	}
	bg, stopBG := context.WithCancel(context.Background())
	defer stopBG()
	go a.store.Run(bg)
	go watchRules(bg, path, a, w)
	if cfg.MetricsAddr != "off" {
		srv, err := serveHTTP(cfg.MetricsAddr, a, w)
		if err != nil {
			reader.Close()
			return err
		}
		defer srv.Close()
	}
	a.log.Info("capper running", "group_id", cfg.Kafka.GroupID, "input", cfg.Kafka.Topics.Input,
		"segments", a.rules.SegmentNames(), "batch_size", batchSize, "metrics_addr", cfg.MetricsAddr)
	runErr := w.Run(ctx, time.Duration(cfg.ShutdownTimeout))
	// Leave the group; a commit is never left to Close (it can hang).
	closeDone := make(chan error, 1)
	go func() { closeDone <- reader.Close() }()
	select {
	case err := <-closeDone:
		if err != nil {
			a.log.Warn("closing the kafka reader", "err", err)
		}
	case <-time.After(10 * time.Second):
		a.log.Warn("closing the kafka reader timed out")
	}
	if runErr != nil {
		return runErr
	}
	a.log.Info("capper stopped")
	return nil
}

func serveHTTP(addr string, a *app, w *consumer.Worker) (*http.Server, error) {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(a.reg, promhttp.HandlerOpts{}))
	if a.cfg.DebugPprof {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	mux.HandleFunc("/healthz", func(rw http.ResponseWriter, _ *http.Request) { fmt.Fprintln(rw, "ok") })
	mux.HandleFunc("/readyz", func(rw http.ResponseWriter, _ *http.Request) {
		if a.store.Snapshot() == nil || !w.Ready() {
			http.Error(rw, "not ready: waiting for segments or a backend", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(rw, "ready")
	})
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics_addr %s: %w", addr, err)
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	return srv, nil
}

// watchRules reloads the rules when the config file changes or on SIGHUP. A
// bad file is logged and the rules in force stay.
func watchRules(ctx context.Context, path string, a *app, w *consumer.Worker) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	last, _ := os.ReadFile(path)
	version := a.rules.Version
	t := time.NewTicker(time.Duration(a.cfg.Rules.ReloadInterval))
	defer t.Stop()
	for {
		force := false
		select {
		case <-ctx.Done():
			return
		case <-hup:
			force = true
		case <-t.C:
		}
		data, err := os.ReadFile(path)
		if err != nil {
			a.log.Error("rules reload: cannot read the config file; keeping the rules in force", "err", err)
			continue
		}
		if !force && bytes.Equal(data, last) {
			continue
		}
		last = data
		cfg, err := config.Parse(data, os.LookupEnv)
		var rules *consumer.Rules
		if err == nil {
			rules, err = cfg.Rules.Build(version + 1)
		}
		if err == nil && fmt.Sprint(rules.SegmentNames()) != fmt.Sprint(a.rules.SegmentNames()) {
			err = errors.New("the list of segments changed: that needs a restart")
		}
		if err == nil {
			err = w.SetRules(rules)
		}
		if err != nil {
			a.log.Error("rules reload rejected; keeping the rules in force", "err", err, "rules_version", version)
			continue
		}
		version++
		a.log.Info("rules reloaded", "rules_version", version)
	}
}

// allowAll is the pass-through baseline's decider: the consume, produce and
// commit path of capper run with capping skipped.
type allowAll struct{}

func (allowAll) Decide(_ context.Context, reqs []capping.Request) ([]capping.Decision, error) {
	ds := make([]capping.Decision, len(reqs))
	for i := range ds {
		ds[i] = capping.Decision{Allowed: true}
	}
	return ds, nil
}
