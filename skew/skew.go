// Package skew measures how far a worker's clock is from Redis's and says
// whether it may decide.
//
// Decisions use the worker's clock (capping.Config.Clock). Two replicas whose
// clocks differ by d can let a user receive more than a cap allows, by the
// sends in a slice of width d at a window's edge (see the capping package
// doc). Redis is the reference every replica shares: a Monitor reads TIME on
// every master, takes half the round trip as the error bound, and reports the
// largest absolute difference. Beyond Config.MaxSkew the worker must stop
// deciding (Within is false) until the clock is back within the bound; the
// daemon treats that like a Redis outage (retried, not ready, nothing
// committed).
package skew

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

// Client is what a Monitor needs of Redis: TIME on every master (a
// *redis.ClusterClient), or on the one node (a *redis.Client).
type Client interface {
	Time(ctx context.Context) *redis.TimeCmd
}

// Config configures a Monitor.
type Config struct {
	Client Client // (Required)
	// Clock is the clock decisions use. Defaults to time.Now.
	Clock func() time.Time
	// MaxSkew is the largest difference from Redis at which the worker still
	// decides. 0 disables the bound (the skew is still measured). Defaults to 0.
	MaxSkew time.Duration
	// Interval between measurements in Run. Defaults to 30s.
	Interval time.Duration
	// Timeout bounds one measurement. Defaults to 5s.
	Timeout time.Duration
	// Logger gets a warning beyond half of MaxSkew and an error beyond it.
	// Defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives capper_clock_skew_seconds (nil: unregistered).
	Registerer prometheus.Registerer
}

// Monitor measures the clock's skew; safe for concurrent use.
type Monitor struct {
	cfg     Config
	gauge   prometheus.Gauge
	skew    atomic.Int64 // ns, signed: positive when this clock is ahead
	within  atomic.Bool
	mu      sync.Mutex // serialises measurements and the log state below
	warned  bool
	refused bool
}

// New returns a Monitor; it has not measured yet (Within is true).
func New(cfg Config) (*Monitor, error) {
	if cfg.Client == nil {
		return nil, errors.New("skew: a Redis client is required")
	}
	if cfg.MaxSkew < 0 {
		return nil, fmt.Errorf("skew: max skew %v must not be negative", cfg.MaxSkew)
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	if cfg.Interval <= 0 {
		cfg.Interval = 30 * time.Second
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 5 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	m := &Monitor{cfg: cfg, gauge: prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "capper_clock_skew_seconds",
		Help: "Largest absolute difference between this worker's clock and TIME on a Redis master, at the last measurement (half the round trip is its error bound).",
	})}
	m.within.Store(true)
	if cfg.Registerer != nil {
		if err := cfg.Registerer.Register(m.gauge); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Within reports whether the last measurement was within MaxSkew (always
// true when MaxSkew is 0, and before the first measurement).
func (m *Monitor) Within() bool { return m.within.Load() }

// Skew returns the last measured skew: positive when this clock is ahead of Redis.
func (m *Monitor) Skew() time.Duration { return time.Duration(m.skew.Load()) }

// Err returns why decisions are refused, nil when Within.
func (m *Monitor) Err() error {
	if m.Within() {
		return nil
	}
	return fmt.Errorf("clock skew: this worker's clock is %.1fs %s of Redis, beyond max_clock_skew %v: not deciding until it is back within the bound (check NTP)",
		abs(m.Skew()).Seconds(), direction(m.Skew()), m.cfg.MaxSkew)
}

// Check measures once: TIME on every master, the largest absolute
// difference. A failed measurement leaves the last state as it was (Redis
// failures are the limiter's to report) and returns the error.
func (m *Monitor) Check(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, m.cfg.Timeout)
	defer cancel()
	m.mu.Lock()
	defer m.mu.Unlock()
	var worst, bound time.Duration
	var mu sync.Mutex
	measure := func(ctx context.Context, c Client) error {
		t0 := m.cfg.Clock()
		ts, err := c.Time(ctx).Result()
		t1 := m.cfg.Clock()
		if err != nil {
			return err
		}
		rtt := t1.Sub(t0)
		d := t0.Add(rtt / 2).Sub(ts) // this clock at the moment Redis read its own, minus Redis's
		mu.Lock()
		if abs(d) > abs(worst) {
			worst, bound = d, rtt/2
		}
		mu.Unlock()
		return nil
	}
	var err error
	if cl, ok := m.cfg.Client.(*redis.ClusterClient); ok {
		err = cl.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return measure(ctx, c) })
	} else {
		err = measure(ctx, m.cfg.Client)
	}
	if err != nil {
		return fmt.Errorf("skew: redis TIME: %w", err)
	}
	m.skew.Store(int64(worst))
	m.gauge.Set(abs(worst).Seconds())
	limit := m.cfg.MaxSkew
	// Refuse only when the skew is beyond the bound even after its error bound.
	within := limit == 0 || abs(worst)-bound <= limit
	m.within.Store(within)
	log := m.cfg.Logger
	switch {
	case !within:
		if !m.refused {
			log.Error("clock skew beyond max_clock_skew: not deciding until the clock is back within the bound",
				"skew_seconds", worst.Seconds(), "error_bound_seconds", bound.Seconds(), "max_clock_skew", limit.String())
		}
		m.refused, m.warned = true, true
	case limit > 0 && abs(worst) > limit/2:
		if !m.warned || m.refused {
			log.Warn("clock skew above half of max_clock_skew (check NTP)",
				"skew_seconds", worst.Seconds(), "error_bound_seconds", bound.Seconds(), "max_clock_skew", limit.String())
		}
		m.refused, m.warned = false, true
	default:
		if m.refused || m.warned {
			log.Info("clock skew back within bounds", "skew_seconds", worst.Seconds(), "max_clock_skew", limit.String())
		}
		m.refused, m.warned = false, false
	}
	return nil
}

// Run measures every Interval until ctx ends (the first measurement at once).
func (m *Monitor) Run(ctx context.Context) {
	t := time.NewTicker(m.cfg.Interval)
	defer t.Stop()
	for {
		if err := m.Check(ctx); err != nil && ctx.Err() == nil {
			m.cfg.Logger.Debug("measuring clock skew failed", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func abs(d time.Duration) time.Duration {
	if d < 0 {
		return -d
	}
	return d
}

func direction(d time.Duration) string {
	if d < 0 {
		return "behind"
	}
	return "ahead"
}
