// Package daemon is capper's worker process as a library: it connects the
// backends (Redis, the segment store), builds the Kafka reader and writer and
// the consumer.Worker, serves /metrics, /healthz and /readyz, reloads the
// rules, and shuts everything down in order. cmd/capper only parses flags,
// turns signals into calls (SIGTERM ends Run's context, SIGHUP calls
// ReloadRules) and reports errors; tests run the same daemon in process.
package daemon

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/budget"
	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/collapse"
	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/events"
	"github.com/capper-dev/capper/hold"
	"github.com/capper-dev/capper/internal/backoff"
	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/version"
	"github.com/capper-dev/capper/rules"
	"github.com/capper-dev/capper/skew"
)

// Options are what the process gives the daemon besides its configuration.
type Options struct {
	// ConfigPath is the file the rules are reloaded from: by ReloadRules, and by
	// Run when the file changes. (Required for reloads)
	ConfigPath string
	// Stderr receives the JSON log. Defaults to os.Stderr.
	Stderr io.Writer
	// Registry receives every metric. Defaults to a new registry with the Go
	// and process collectors.
	Registry *prometheus.Registry
	// Decider replaces the Redis limiter's decisions. For the pass-through
	// benchmark baseline (cmd/capper-passthrough) only; never in production.
	Decider consumer.Decider
	// Clock is the time decisions, budgets and holds are taken at. Defaults
	// to time.Now; tests set an offset to play a skewed clock.
	Clock func() time.Time
	// NoSegments connects without loading any segments (Workspace.Store is
	// nil): for a command that only reads Redis (capper keys).
	NoSegments bool

	probeKafka bool // New: say at once when the brokers do not answer, while Redis is awaited
}

// Backends are the worker's connections: the Redis limiter, and each
// workspace's segment store and rules at start (Workspace). capper check
// uses them alone.
type Backends struct {
	Config   *config.Config
	Log      *slog.Logger
	Registry *prometheus.Registry
	Limiter  *capping.Limiter
	Budgets  *budget.Budgets
	Collapse *collapse.Registry
	Skew     *skew.Monitor // this clock against Redis's

	spaces atomic.Pointer[[]*Workspace] // every workspace opened, in order

	trips  *roundTrips
	closes []func() // in reverse order of opening
}

// Connect opens the backends: it waits (with backoff, up to 30 s) for Redis
// to load the script on every node, and for the first complete segment
// snapshot (segments.startup_timeout). A wrong password, certificate or
// grant fails at once (see preflight.go).
func Connect(ctx context.Context, cfg *config.Config, opts Options) (*Backends, error) {
	b := &Backends{Config: cfg, Registry: opts.Registry, trips: &roundTrips{}}
	clock := opts.Clock
	if clock == nil {
		clock = time.Now
	}
	b.Log = NewLogger(cfg.LogLevel, cmp.Or[io.Writer](opts.Stderr, os.Stderr))
	if b.Registry == nil {
		b.Registry = newRegistry()
	}
	rdb, err := newRedis(cfg.Redis, b.trips)
	if err != nil {
		return nil, err
	}
	if opts.probeKafka {
		go probeKafka(ctx, cfg.Kafka, b.Log) // while Redis is awaited: both backends named at once
	}
	b.closes = append(b.closes, func() { _ = rdb.Close() })
	lc := cfg.Limiter()
	lc.Clock = clock
	if b.Limiter, err = connectRedis(ctx, rdb, cfg.Redis.Addrs, lc, b.Log); err != nil {
		b.Close()
		return nil, err
	}
	if b.Skew, err = skew.New(skew.Config{Client: rdb, Clock: clock, MaxSkew: time.Duration(cfg.MaxClockSkew),
		Interval: time.Duration(cfg.ClockCheckInterval), Logger: b.Log, Registerer: b.Registry}); err != nil {
		b.Close()
		return nil, err
	}
	if err := b.Skew.Check(ctx); err != nil { // Run measures again; decisions wait for a measurement within bounds
		b.Log.Warn("measuring clock skew failed", "err", err)
	}
	if err := registerLimiter(b.Registry, b.Limiter); err != nil {
		b.Close()
		return nil, err
	}
	if b.Budgets, err = budget.New(budget.Config{Client: rdb, KeyPrefix: cfg.Redis.KeyPrefix, Registerer: b.Registry, Clock: clock,
		Grace: 2 * time.Duration(cfg.MaxClockSkew)}); err != nil {
		b.Close()
		return nil, err
	}
	if b.Collapse, err = collapse.New(collapse.Config{Client: rdb, Timeout: lc.Timeout, MinReplicasAcked: lc.MinReplicasAcked, ReplicaTimeout: lc.ReplicaTimeout}); err != nil {
		b.Close()
		return nil, err
	}
	if err := b.openWorkspaces(ctx, cfg, opts.NoSegments); err != nil {
		b.Close()
		return nil, err
	}
	return b, nil
}

// Close closes what Connect opened, last opened first.
func (b *Backends) Close() {
	for i := len(b.closes) - 1; i >= 0; i-- {
		b.closes[i]()
	}
	b.closes = nil
}

// newRegistry is a registry with the Go runtime's and the process's collectors.
func newRegistry() *prometheus.Registry {
	r := prometheus.NewRegistry()
	r.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return r
}

// Daemon is one capper worker process. Make it with New, run it once with
// Run, and Close it.
type Daemon struct {
	*Backends
	opts    Options
	readers []*kafka.Reader // the input topic's, then each delay tier's
	writer  *kafka.Writer
	workers []*consumer.Worker      // in the order of readers
	events  []*consumer.EventWorker // external sends and feedback, after the workers' readers
	// cacheReaders read the feedback and preferences topics in groups of this
	// process's own (from their end, never committed) to hold off the near
	// cache's copies of the logs of users another replica changes (see
	// copyHolds).
	cacheReaders []cacheReader
	watched      []watchedReader // every reader that consumes for a worker, for the stall watch
	tiers        []ownedTier     // each delay tier's partitions this replica holds its sends on
	wheel        *hold.Wheel     // nil when holding is disabled
	metrics      *consumer.Metrics
	srv          *http.Server
	addr         string
	built        atomic.Bool // New has finished: until then /readyz answers 503

	readersClosed sync.Once

	storesCtx atomic.Pointer[context.Context] // the segment stores' refreshes run until it ends (Run)

	reload     sync.Mutex // serialises rules reloads; guards the fields below
	lastConfig []byte
	version    int64
}

// New connects the backends and builds the worker; nothing is consumed
// before Run. The HTTP endpoints are served before anything else, so that
// /metrics and /readyz (503) answer while start-up waits for a backend.
func New(ctx context.Context, cfg *config.Config, opts Options) (*Daemon, error) {
	if opts.Registry == nil {
		opts.Registry = newRegistry()
	}
	d := &Daemon{opts: opts}
	// capper_ready (0 until start-up ends) and capper_build_info from the
	// first moment, so that sum(capper_ready) == 0 fires for replicas that
	// never finish starting.
	if err := d.registerProcess(opts.Registry); err != nil {
		return nil, err
	}
	if cfg.MetricsAddr != "off" {
		if err := d.serveHTTP(cfg.MetricsAddr, opts.Registry, cfg.DebugPprof); err != nil {
			return nil, err
		}
	}
	opts.probeKafka = true
	b, err := Connect(ctx, cfg, opts)
	if err != nil {
		if d.srv != nil {
			_ = d.srv.Close()
		}
		return nil, err
	}
	d.Backends, d.version = b, 1
	if opts.ConfigPath != "" {
		d.lastConfig, _ = os.ReadFile(opts.ConfigPath)
	}
	batchSize := cmp.Or(cfg.Batch.Size, consumer.DefaultBatchSize)
	wheel, err := cfg.Wheel()
	if err != nil {
		d.Close()
		return nil, err
	}
	// Before any reader joins the group: a reader retries a refused
	// connection forever, in the background.
	if err := checkKafka(ctx, cfg.Kafka, wheel, d.Log); err != nil {
		d.Close()
		return nil, err
	}
	var input *kafka.Reader
	inputFaults := &consumer.ReaderFaults{What: fmt.Sprintf("topic %s, group %s", cfg.Kafka.Topics.Input, cfg.Kafka.GroupID), Logger: d.Log}
	inputMember := newMember()
	if input, d.writer, err = newKafka(cfg.Kafka, batchSize, inputMember, inputFaults, d.Log); err != nil {
		d.Close()
		return nil, err
	}
	d.readers = append(d.readers, input)
	d.watched = append(d.watched, watchedReader{inputFaults, cfg.Kafka.Topics.Input, cfg.Kafka.GroupID, inputMember, nil})
	var decider consumer.Decider = skewGuard{d.Limiter, d.Skew}
	if opts.Decider != nil {
		d.Log.Warn("the decider is replaced: capping is skipped (a benchmark baseline, never production)")
		decider = opts.Decider
	}
	d.wheel = wheel
	metrics, err := consumer.NewMetrics(d.Registry)
	if err != nil {
		d.Close()
		return nil, err
	}
	d.metrics = metrics
	spaces, err := d.workspaces(*d.spaces.Load(), cfg.DefaultWorkspace, nil)
	if err != nil {
		d.Close()
		return nil, err
	}
	if spaces.Named() {
		metrics.AddWorkspaces(spaces.Names())
	}
	wc := consumer.Config{
		Reader: input, Writer: d.writer, Decider: decider, Budgets: skewBudgets{d.Budgets, d.Skew}, TokenGrace: time.Duration(cfg.MaxClockSkew), Clock: opts.Clock,
		Workspaces: spaces, Collapse: d.Collapse, UserKey: d.Limiter.Key,
		Topics: consumer.Topics{Allowed: cfg.Kafka.Topics.Allowed, Capped: cfg.Kafka.Topics.Capped, DLQ: cfg.Kafka.Topics.DLQ,
			Held: cfg.Kafka.Topics.Held},
		BatchSize: cfg.Batch.Size, BatchWait: time.Duration(cfg.Batch.MaxWait), MaxOutputBytes: cfg.Kafka.MaxBatchBytes,
		Wheel: wheel, RoundTrips: d.trips.n.Load, Logger: d.Log, Metrics: metrics, Faults: inputFaults,
		Preferences: cfg.Kafka.Topics.Preferences != "",
	}
	if err := d.addWorker(wc); err != nil {
		return nil, err
	}
	if wheel != nil {
		owned := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "capper_hold_owned_partitions",
			Help: "Partitions of each delay tier that this replica's reader owns, which it holds its sends on (0: not known yet, or none: they go by key)."}, []string{"tier"})
		if err := d.Registry.Register(owned); err != nil {
			d.Close()
			return nil, err
		}
		onOwn := &heldOnOwn{owned: map[string]*ownedPartitions{}}
		early := hold.NewEarly() // a budget's tokens that no send would take go to its held sends early
		for _, t := range wheel.Tiers() {
			log := d.Log.With("tier", t.Name)
			faults := &consumer.ReaderFaults{What: fmt.Sprintf("topic %s, group %s", t.Topic, TierGroup(cfg.Kafka.GroupID, t.Name)), Logger: log}
			member := newMember()
			r, err := newTierReader(cfg.Kafka, t, member, faults, d.Log)
			if err != nil {
				d.Close()
				return nil, err
			}
			d.readers = append(d.readers, r.Reader)
			o := &ownedPartitions{gauge: owned.WithLabelValues(t.Name)}
			onOwn.owned[t.Topic] = o
			d.tiers = append(d.tiers, ownedTier{o, TierGroup(cfg.Kafka.GroupID, t.Name), t.Topic, member, r.joins.Load})
			hr := hold.NewReader(r, nil, hold.Ahead)
			hr.UseEarly(early)
			d.watched = append(d.watched, watchedReader{faults, t.Topic, TierGroup(cfg.Kafka.GroupID, t.Name), member, hr.Waiting})
			tc := wc
			tc.Reader, tc.Tier, tc.Logger, tc.Faults, tc.Early = hr, t.Name, log, faults, early
			tc.BatchWait = cfg.Hold.BatchWait() // released jobs come due one by one: a short wait
			tc.RoundTrips = nil                 // the input worker reports round trips per batch
			if err := d.addWorker(tc); err != nil {
				return nil, err
			}
		}
		d.writer.Balancer = onOwn // before anything is written
	}
	if err := d.addEventWorkers(cfg, wc); err != nil {
		d.Close()
		return nil, err
	}
	d.built.Store(true)
	return d, nil
}

// addEventWorkers adds a worker per configured event topic (external sends,
// feedback), and the feedback's cache reader.
func (d *Daemon) addEventWorkers(cfg *config.Config, wc consumer.Config) error {
	em, err := consumer.NewEventMetrics(d.Registry)
	if err != nil {
		return err
	}
	dialer, transport, err := KafkaClients(cfg.Kafka)
	if err != nil {
		return err
	}
	for _, e := range []struct {
		kind  consumer.EventKind
		topic string
	}{{consumer.ExternalSends, cfg.Kafka.Topics.External}, {consumer.Feedback, cfg.Kafka.Topics.Feedback}, {consumer.Preferences, cfg.Kafka.Topics.Preferences}} {
		if e.topic == "" {
			continue
		}
		group := EventGroup(cfg.Kafka.GroupID, e.kind)
		log := d.Log.With("events", e.kind.String())
		faults := &consumer.ReaderFaults{What: fmt.Sprintf("topic %s, group %s", e.topic, group), Logger: log}
		member := newMember()
		r := newReader(cfg.Kafka, dialer, group, e.topic, 4<<20, 1000, readerMaxWait, memberBalancer{member: member}, faults, d.Log)
		d.readers = append(d.readers, r)
		d.watched = append(d.watched, watchedReader{faults, e.topic, group, member, nil})
		w, err := consumer.NewEventWorker(consumer.EventConfig{Kind: e.kind, Reader: r, Writer: d.writer, DLQ: cfg.Kafka.Topics.DLQ,
			Recorder: d.Limiter, Workspaces: d.workers[0].Workspaces, MaxFuture: time.Duration(cfg.MaxClockSkew),
			BatchSize: cfg.Batch.Size, BatchWait: time.Duration(cfg.Batch.MaxWait), Clock: wc.Clock, Logger: log, Faults: faults,
			Metrics: d.metrics, EventMetrics: em})
		if err != nil {
			return err
		}
		d.events = append(d.events, w)
		if e.kind != consumer.ExternalSends && cfg.Redis.NearCacheSize > 0 {
			c := newCacheReader(cfg.Kafka, dialer, group, e.topic, d.Log)
			client := &kafka.Client{Addr: kafka.TCP(cfg.Kafka.Brokers...), Transport: transport, Timeout: 5 * time.Second}
			d.cacheReaders = append(d.cacheReaders, cacheReader{c, e.kind, &copyHolds{lim: d.Limiter, client: client, group: group, topic: e.topic, log: log}})
			d.readers = append(d.readers, c)
		}
	}
	return nil
}

type cacheReader struct {
	r     *kafka.Reader
	kind  consumer.EventKind
	holds *copyHolds
}

// holdCached holds off the near cache's copy of every user a feedback event
// gives a slot back to, or whose preferences change, from when it reads the
// event until the replica applying it has committed past it (see
// copyHolds), until ctx ends.
func (d *Daemon) holdCached(ctx context.Context, c cacheReader) {
	go c.holds.run(ctx, holdInterval)
	for {
		m, err := c.r.FetchMessage(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if !backoff.Sleep(ctx, time.Second) {
				return
			}
			continue
		}
		spaces := d.workers[0].Workspaces()
		if c.kind == consumer.Feedback {
			if f, err := events.DecodeFeedback(m.Value); err == nil && f.GivesBack() {
				if ws, err := spaces.Lookup(f.Workspace); err == nil { // else the event is dead-lettered
					c.holds.hold(m.Partition, m.Offset, ws.Space, f.UserID)
				}
			}
		} else if p, err := events.DecodePreference(m.Value); err == nil {
			if ws, err := spaces.Lookup(p.Workspace); err == nil {
				c.holds.hold(m.Partition, m.Offset, ws.Space, p.UserID)
			}
		}
	}
}

// EventGroup is the consumer group that reads an event topic.
func EventGroup(group string, kind consumer.EventKind) string {
	switch kind {
	case consumer.ExternalSends:
		return group + ".external"
	case consumer.Feedback:
		return group + ".feedback"
	}
	return group + ".preferences"
}

// skewGuard refuses every decision while the clock is beyond max_clock_skew
// of Redis's: the worker retries them as in a Redis outage (not ready,
// nothing committed) until the clock is back.
type skewGuard struct {
	consumer.Decider
	skew *skew.Monitor
}

func (g skewGuard) Decide(ctx context.Context, reqs []capping.Request) ([]capping.Decision, error) {
	if err := g.skew.Err(); err != nil {
		errs := make(capping.RequestErrors, len(reqs))
		for i := range errs {
			errs[i] = err
		}
		return make([]capping.Decision, len(reqs)), errs
	}
	return g.Decider.Decide(ctx, reqs)
}

// skewBudgets refuses budget tokens likewise: a budget's buckets are on the worker's clock too.
type skewBudgets struct {
	*budget.Budgets
	skew *skew.Monitor
}

func (b skewBudgets) Take(ctx context.Context, wants []budget.Want) ([]budget.Grant, error) {
	if err := b.skew.Err(); err != nil {
		return nil, err
	}
	return b.Budgets.Take(ctx, wants)
}

// registerLimiter exports the limiter's script calls and its near cache.
func registerLimiter(reg prometheus.Registerer, l *capping.Limiter) error {
	counter := func(name, help string, f func(capping.Stats) uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return float64(f(l.Stats())) })
	}
	gauge := func(name, help string, f func(capping.Stats) int) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help}, func() float64 { return float64(f(l.Stats())) })
	}
	for _, c := range []prometheus.Collector{
		counter("capper_decide_script_calls_total", "Calls of the decision script sent to Redis (retries included); a call carries up to 32 decisions for one node.",
			func(s capping.Stats) uint64 { return s.ScriptCalls }),
		counter("capper_decide_redis_requests_total", "Decisions sent to Redis (once each, however often tried): in the decision script's calls, or as new logs.",
			func(s capping.Stats) uint64 { return s.Requests }),
		counter("capper_decide_new_logs_total", "Sends recorded as their user's new log with one SET NX, without a script call, or (sends that read preferences) by the script's mode 5 (redis.script_only off).",
			func(s capping.Stats) uint64 { return s.NewLogs }),
		counter("capper_decide_new_log_misses_total", "New logs that found the user had a log (or, in mode 5, preferences): the script decided them (a high share: see redis.script_only).",
			func(s capping.Stats) uint64 { return s.NewLogMisses }),
		counter("capper_near_cache_appends_total", "Sends the near cache decided allowed from its copy of the whole log, recorded by one APPEND (or a patch) to that very log.",
			func(s capping.Stats) uint64 { return s.CopyAppends }),
		counter("capper_near_cache_stale_total", "Sends decided allowed from a copy whose log had changed (another replica's write): decided in full by the script, in the same call.",
			func(s capping.Stats) uint64 { return s.CopyMisses }),
		counter("capper_decide_function_loads_total", "Loads of the decision script's function library on a Redis node that had lost it (restarted without persistence, FUNCTION FLUSH).",
			func(s capping.Stats) uint64 { return s.FunctionLoads }),
		counter("capper_near_cache_hits_total", "Decisions answered capped by the near cache, without a script call.",
			func(s capping.Stats) uint64 { return s.CacheHits }),
		counter("capper_near_cache_misses_total", "Decisions the near cache looked up and sent to Redis.",
			func(s capping.Stats) uint64 { return s.CacheMisses }),
		counter("capper_near_cache_evictions_total", "Copies of logs the near cache dropped to make room (redis.near_cache_size).",
			func(s capping.Stats) uint64 { return s.CacheEvictions }),
		gauge("capper_near_cache_entries", "Copies of blocked users' logs the near cache keeps.",
			func(s capping.Stats) int { return s.CacheEntries }),
		counter("capper_near_cache_holds_total", "Holds of a user's near-cache copies: a feedback or preference event read, which another replica may not have applied yet (see capper_near_cache_held_users).",
			func(s capping.Stats) uint64 { return s.CacheHolds }),
		gauge("capper_near_cache_held_users", "Users the near cache keeps no copy for while an event that changes their log or preferences (feedback, preferences) is on its way to Redis: read, not yet committed by the replica applying it.",
			func(s capping.Stats) int { return s.CacheHeld }),
		gauge("capper_near_cache_bytes", "Memory of the near cache: its copies' logs in the shards' arenas (room to grow included) and their slots.",
			func(s capping.Stats) int { return s.CacheBytes }),
	} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

// registerProcess exports the build (capper_build_info) and /readyz's answer (capper_ready).
func (d *Daemon) registerProcess(reg prometheus.Registerer) error {
	v := version.Get()
	info := prometheus.NewGauge(prometheus.GaugeOpts{Name: "capper_build_info", Help: "Always 1; the labels name the build.",
		ConstLabels: prometheus.Labels{"version": v.Version, "revision": v.Revision, "go_version": v.GoVersion}})
	info.Set(1)
	ready := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "capper_ready", Help: "1 when /readyz answers ready: a segment snapshot is loaded and the last batch of every reader went through."},
		func() float64 {
			if d.Ready() {
				return 1
			}
			return 0
		})
	for _, c := range []prometheus.Collector{info, ready} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

func (d *Daemon) addWorker(c consumer.Config) error {
	w, err := consumer.New(c)
	if err != nil {
		d.Close()
		return err
	}
	d.workers = append(d.workers, w)
	return nil
}

// Ready reports whether New has finished, the worker has a segment snapshot, its clock is
// within max_clock_skew of Redis's, and the last batch of each of its readers
// went through without a backend failure (what /readyz answers).
func (d *Daemon) Ready() bool {
	if !d.built.Load() || !d.Skew.Within() {
		return false
	}
	for _, ws := range d.workers[0].Workspaces().Names() {
		if w, err := d.Workspace(ws); err != nil || !w.Ready() {
			return false
		}
	}
	for _, w := range d.workers {
		if !w.Ready() {
			return false
		}
	}
	for _, w := range d.events {
		if !w.Ready() {
			return false
		}
	}
	return true
}

// MetricsAddr returns the address /metrics is served on ("" when off): the
// bound address, so ":0" in the config gives a free port.
func (d *Daemon) MetricsAddr() string { return d.addr }

// Run consumes until ctx ends, refreshing the segments and reloading the
// rules when the config file changes (every rules.reload_interval). Then it
// finishes the batches in flight within shutdown_timeout and leaves the
// consumer group. It returns nil after a clean stop.
func (d *Daemon) Run(ctx context.Context) error {
	cfg := d.Config
	bg, stopBG := context.WithCancel(context.Background())
	defer stopBG()
	d.runStores(bg)
	go d.Skew.Run(bg)
	go d.watchRules(bg, time.Duration(cfg.Rules.ReloadInterval))
	go d.watchLag(bg, cfg.Kafka)
	go d.watchStalls(bg, cfg.Kafka)
	if cfg.Redis.NearCacheSize > 0 {
		go d.watchNearCache(bg, cfg.Redis.NearCacheSize, time.Minute)
	}
	d.watchTiers(bg, cfg.Kafka)
	for _, c := range d.cacheReaders {
		go d.holdCached(bg, c)
	}
	d.Log.Info("capper running", "group_id", cfg.Kafka.GroupID, "input", cfg.Kafka.Topics.Input,
		"workspaces", d.workers[0].Workspaces().Names(), "batch_size", cmp.Or(cfg.Batch.Size, consumer.DefaultBatchSize),
		"delay_tiers", len(d.workers)-1, "event_topics", len(d.events), "metrics_addr", d.addr)
	// The input topic and each delay tier have their own worker, so waiting
	// on a tier never blocks the input.
	runners := make([]interface {
		Run(context.Context, time.Duration) error
	}, 0, len(d.workers)+len(d.events))
	for _, w := range d.workers {
		runners = append(runners, w)
	}
	for _, w := range d.events {
		runners = append(runners, w)
	}
	errs := make([]error, len(runners))
	var wg sync.WaitGroup
	for i, w := range runners {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = w.Run(ctx, time.Duration(cfg.ShutdownTimeout))
		}()
	}
	wg.Wait()
	// Unused budget tokens go back, so that they count for the other replicas at once.
	bctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	if err := d.Budgets.Close(bctx); err != nil {
		d.Log.Warn("giving budget tokens back failed; they lapse when their bucket leaves the window", "err", err)
	}
	cancel()
	d.closeReaders() // leave the groups; a commit is never left to Close (it can hang)
	if runErr := errors.Join(errs...); runErr != nil {
		return runErr
	}
	d.Log.Info("capper stopped")
	return nil
}

// closeReaders closes the Kafka readers once, each leaving its group, within 10 s.
func (d *Daemon) closeReaders() {
	d.readersClosed.Do(func() {
		closed := make(chan error, len(d.readers))
		for _, r := range d.readers {
			go func() { closed <- r.Close() }()
		}
		timeout := time.After(10 * time.Second)
		for range d.readers {
			select {
			case err := <-closed:
				if err != nil {
					d.Log.Warn("closing a kafka reader", "err", err)
				}
			case <-timeout:
				d.Log.Warn("closing the kafka readers timed out")
				return
			}
		}
	})
}

// Close stops the HTTP endpoints and closes the readers (when Run did not),
// the writer and the backends. Call it after Run returned (or instead of Run,
// as New's error paths do).
func (d *Daemon) Close() {
	if d.srv != nil {
		_ = d.srv.Close()
	}
	d.closeReaders()
	if d.writer != nil {
		_ = d.writer.Close()
	}
	d.Backends.Close()
}

// ReloadRules reads the config file again and applies its rules from the next
// batch on. A file that does not parse or validate, or whose list of segments
// changed (that needs a restart: the snapshot is built for the listed
// segments), is rejected with an error and logged; the rules in force stay.
func (d *Daemon) ReloadRules(ctx context.Context) error {
	return d.reloadRules(true)
}

func (d *Daemon) reloadRules(force bool) error {
	d.reload.Lock()
	defer d.reload.Unlock()
	data, err := os.ReadFile(d.opts.ConfigPath)
	if err != nil {
		err = fmt.Errorf("rules reload: %w", err)
		d.Log.Error("rules reload: cannot read the config file; keeping the rules in force", "err", err)
		return err
	}
	changed := !bytes.Equal(data, d.lastConfig)
	if !force && !changed && !d.Config.HasWorkspaces() { // a workspace's own file may have changed
		return nil
	}
	d.lastConfig = data
	cfg, err := config.Reload(data, d.opts.ConfigPath)
	if err == nil && cfg.HasWorkspaces() != d.Config.HasWorkspaces() {
		err = errors.New("workspaces were added to or removed from a deployment without them: that needs a restart")
	}
	if err == nil && !sameTiers(cfg, d.wheel) {
		d.Log.Warn("rules reload: hold.tiers changed in the file; the delay tiers change at the next restart", "rules_version", d.version+1)
	}
	if err == nil && cfg.HasWorkspaces() {
		return d.reloadWorkspaces(context.Background(), cfg, force || changed)
	}
	var next *rules.Rules
	if err == nil {
		next, err = rules.Compile(cfg.Rules, d.version+1)
	}
	if err == nil && !slices.Equal(next.SegmentNames(), d.workers[0].Workspaces().Default().Rules.SegmentNames()) {
		err = errors.New("the list of segments changed: that needs a restart")
	}
	if err == nil {
		err = config.CheckRules(next, d.wheel) // the tiers this worker runs, not the file's
	}
	if err != nil {
		d.Log.Error("rules reload rejected; keeping the rules in force", "err", err, "rules_version", d.version)
		return fmt.Errorf("rules reload rejected: %w", err)
	}
	for _, w := range d.workers {
		w.SetRules(next)
	}
	d.Limiter.InvalidateCache() // a user's caps may have changed
	d.version++
	d.Log.Info("rules reloaded", "rules_version", d.version)
	return nil
}

// sameTiers reports whether cfg's hold.tiers are the running wheel's.
func sameTiers(cfg *config.Config, running *hold.Wheel) bool {
	w, err := cfg.Wheel()
	if err != nil || (w == nil) != (running == nil) {
		return false
	}
	return w == nil || slices.Equal(w.Tiers(), running.Tiers())
}

// watchNearCache looks at the near cache every period (a minute in Run) and
// says whether it dropped copies to make room since the last look
// (sayNearCacheFull). size is redis.near_cache_size.
func (d *Daemon) watchNearCache(ctx context.Context, size int, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	last := d.Limiter.Stats().CacheEvictions
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			last = d.sayNearCacheFull(last, size, every)
		}
	}
}

// sayNearCacheFull warns when the near cache dropped copies of users' logs
// to make room since its count of them was last (within the time since):
// each such user's next send is decided in full by the script, where a copy
// would have answered it capped or made it an append (docs/operations.md,
// Sizing the near cache). It returns the count now.
func (d *Daemon) sayNearCacheFull(last uint64, size int, within time.Duration) uint64 {
	s := d.Limiter.Stats()
	if dropped := s.CacheEvictions - last; dropped > 0 {
		d.Log.Warn("the near cache is full: it dropped copies of users' logs to make room, and each such user's next send is decided in full by the script; "+
			"give redis.near_cache_size the users a replica decides within a blast, and a quarter more (docs/operations.md)",
			"dropped", dropped, "within", within.String(), "near_cache_size", size, "copies", s.CacheEntries)
	}
	return s.CacheEvictions
}

// watchRules reloads the rules when the config file changes.
func (d *Daemon) watchRules(ctx context.Context, every time.Duration) {
	if d.opts.ConfigPath == "" {
		return
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			_ = d.reloadRules(false) // logged
		}
	}
}

func (d *Daemon) serveHTTP(addr string, reg *prometheus.Registry, pprofOn bool) error {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	if pprofOn {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	mux.HandleFunc("/healthz", func(rw http.ResponseWriter, _ *http.Request) { fmt.Fprintln(rw, "ok") })
	mux.HandleFunc("/readyz", func(rw http.ResponseWriter, _ *http.Request) {
		if !d.built.Load() {
			http.Error(rw, "not ready: starting (connecting the backends, loading the segments)", http.StatusServiceUnavailable)
			return
		}
		if !d.Ready() {
			http.Error(rw, "not ready: waiting for segments or a backend", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(rw, "ready")
	})
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("metrics_addr %s: %w", addr, err)
	}
	d.addr = ln.Addr().String()
	d.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = d.srv.Serve(ln) }()
	return nil
}
