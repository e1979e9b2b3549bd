package consumer

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the workers' metrics. The workers of one process (the input
// topic's and each delay tier's) share one Metrics.
type Metrics struct {
	jobs         *prometheus.CounterVec
	wsJobs       *prometheus.CounterVec // by workspace and decision: only with workspaces
	errors       *prometheus.CounterVec
	batchSize    prometheus.Histogram
	batchSeconds prometheus.Histogram
	roundTrips   prometheus.Histogram
	lag          prometheus.Gauge
	rulesVersion prometheus.Gauge
	redisOutage  prometheus.Histogram
	shadowCapped *prometheus.CounterVec
	cappedBy     *prometheus.CounterVec
	held         *prometheus.CounterVec
	notHeld      *prometheus.CounterVec
	heldNow      *prometheus.GaugeVec
	moves        *prometheus.CounterVec
	releaseLag   prometheus.Histogram
	arbitrations *prometheus.CounterVec
	collapsed    *prometheus.CounterVec
}

// NewMetrics makes the workers' metrics and registers them with reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	m := &Metrics{}
	m.jobs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_jobs_total", Help: "Jobs handled, by decision (allowed, duplicate, exempt, unchecked, capped, dlq, and held: a held job is counted again when it is released and decided).",
	}, []string{"decision"})
	m.wsJobs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_workspace_jobs_total", Help: "With workspaces: jobs handled, by workspace (one of the configured ones; a job naming another is dead-lettered and counted only in capper_jobs_total) and decision, as capper_jobs_total.",
	}, []string{"workspace", "decision"})
	m.errors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_errors_total", Help: "Backend failures by kind (redis, redis_budget, redis_collapse, kafka_fetch, kafka_write, kafka_commit); each is retried.",
	}, []string{"kind"})
	m.batchSize = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "capper_batch_size", Help: "Jobs per batch.", Buckets: prometheus.ExponentialBuckets(1, 2, 12),
	})
	m.batchSeconds = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "capper_batch_duration_seconds", Help: "Time from a batch's fetch to its commit.", Buckets: prometheus.ExponentialBuckets(0.001, 2, 14),
	})
	m.roundTrips = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "capper_redis_round_trips_per_batch", Help: "Redis round trips (pipelines sent to a node) per batch.", Buckets: []float64{0, 1, 2, 3, 4, 6, 8, 12, 16, 32},
	})
	m.lag = prometheus.NewGauge(prometheus.GaugeOpts{Name: "capper_consumer_lag", Help: "Messages of the input topic the consumer group has not committed, over all its partitions (every replica reports the group's figure)."})
	m.redisOutage = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "capper_redis_outage_seconds", Help: "How long decisions kept failing before the next successful attempt (a node crash: about the failover time).",
		Buckets: []float64{0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300},
	})
	m.shadowCapped = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_shadow_capped_total", Help: "Sends forwarded that a shadow cap would have capped, by cap name.",
	}, []string{"cap"})
	m.cappedBy = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_capped_total", Help: "Jobs sent to the capped topic, by the cap that refused them (\"expired\": past expires_at).",
	}, []string{"cap"})
	m.rulesVersion = prometheus.NewGauge(prometheus.GaugeOpts{Name: "capper_rules_version", Help: "Version of the rules in force."})
	m.held = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_held_total", Help: "Jobs held, by reason: cap (a cap refused them; they wait for its retry-at), quiet_hours, budget (a budget had no token), arbitration (a candidate for a cap's last slot, waiting for its window to end).",
	}, []string{"reason"})
	m.notHeld = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_not_held_total", Help: "Capped jobs that were not held, by reason: never (a limit of 0), expired (on arrival, or its slot comes after expires_at), beyond_max_hold, quiet_hours (quiet hours under the drop policy), collapsed (a newer send of its collapse key replaced it).",
	}, []string{"reason"})
	m.heldNow = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "capper_held_jobs", Help: "Held jobs waiting on a delay tier: messages its consumer group has not committed, over all partitions (every replica reports the group's figure), by tier.",
	}, []string{"tier"})
	m.moves = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_hold_moves_total", Help: "Held jobs moved to a shorter delay tier (not due yet when their tier returned them), by the tier they moved to.",
	}, []string{"tier"})
	m.releaseLag = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "capper_release_lag_seconds", Help: "From a held job's due time to its release (decided again).",
		Buckets: []float64{0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 300},
	})
	m.arbitrations = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_arbitrations_total", Help: "Sends in an arbitration of a cap's last slot, by result: candidate (held until its window ends), won (allowed at its end), lost (capped, then held or dropped by its policy).",
	}, []string{"result"})
	m.collapsed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_collapsed_total", Help: "Sends their collapse key refused, by why: newer (a newer send of the key was seen), window (a send of the key was forwarded within collapse.window). Each ends capped as collapsed, unless it is a redelivery of a send forwarded before.",
	}, []string{"why"})
	for _, s := range []string{"newer", "window"} {
		m.collapsed.WithLabelValues(s)
	}
	for _, s := range []string{"candidate", "won", "lost"} {
		m.arbitrations.WithLabelValues(s)
	}
	for _, s := range []string{"allowed", "duplicate", "exempt", "unchecked", "capped", "dlq", "held"} {
		m.jobs.WithLabelValues(s)
	}
	for _, s := range []string{"redis", "redis_budget", "redis_collapse", "kafka_fetch", "kafka_write", "kafka_commit"} {
		m.errors.WithLabelValues(s) // 0 from the start, so that rate() and alerts see them
	}
	for _, s := range []string{"cap", "quiet_hours", "budget", "arbitration"} {
		m.held.WithLabelValues(s)
	}
	for _, s := range []string{"never", "expired", "beyond_max_hold", "quiet_hours", "collapsed"} {
		m.notHeld.WithLabelValues(s)
	}
	if reg == nil {
		return m, nil
	}
	for _, c := range []prometheus.Collector{m.jobs, m.wsJobs, m.errors, m.batchSize, m.batchSeconds, m.roundTrips, m.lag, m.rulesVersion, m.redisOutage, m.shadowCapped, m.cappedBy,
		m.held, m.notHeld, m.heldNow, m.moves, m.releaseLag, m.arbitrations, m.collapsed} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("consumer: register metrics: %w", err)
		}
	}
	return m, nil
}

// SetConsumerLag sets the input group's lag (measured by the process).
func (m *Metrics) SetConsumerLag(n int64) { m.lag.Set(float64(n)) }

// SetHeld sets how many held jobs wait on tier (its group's lag).
// AddWorkspaces makes the decisions of each workspace of names count from 0,
// so that rate() sees a workspace from its first job.
func (m *Metrics) AddWorkspaces(names []string) {
	for _, n := range names {
		for _, d := range []string{"allowed", "duplicate", "exempt", "unchecked", "capped", "dlq", "held"} {
			m.wsJobs.WithLabelValues(n, d)
		}
	}
}

func (m *Metrics) SetHeld(tier string, n int64) { m.heldNow.WithLabelValues(tier).Set(float64(n)) }
