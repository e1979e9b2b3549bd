package consumer

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	jobs         *prometheus.CounterVec
	errors       *prometheus.CounterVec
	batchSize    prometheus.Histogram
	batchSeconds prometheus.Histogram
	roundTrips   prometheus.Histogram
	lag          prometheus.Gauge
	rulesVersion prometheus.Gauge
	redisOutage  prometheus.Histogram
	shadowCapped *prometheus.CounterVec
}

func (m *metrics) register(reg prometheus.Registerer) error {
	m.jobs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_jobs_total", Help: "Jobs handled, by decision (allowed, duplicate, exempt, unchecked, capped, dlq).",
	}, []string{"decision"})
	m.errors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_errors_total", Help: "Backend failures by kind (redis, kafka_fetch, kafka_write, kafka_commit); each is retried.",
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
	m.lag = prometheus.NewGauge(prometheus.GaugeOpts{Name: "capper_consumer_lag", Help: "Messages behind the end of the partitions, as the reader last saw it."})
	m.redisOutage = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "capper_redis_outage_seconds", Help: "How long decisions kept failing before the next successful attempt (a node crash: about the failover time).",
		Buckets: []float64{0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300},
	})
	m.shadowCapped = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_shadow_capped_total", Help: "Sends forwarded that a shadow cap would have capped, by cap name.",
	}, []string{"cap"})
	m.rulesVersion = prometheus.NewGauge(prometheus.GaugeOpts{Name: "capper_rules_version", Help: "Version of the rules in force."})
	for _, s := range []string{"allowed", "duplicate", "exempt", "unchecked", "capped", "dlq"} {
		m.jobs.WithLabelValues(s)
	}
	if reg == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{m.jobs, m.errors, m.batchSize, m.batchSeconds, m.roundTrips, m.lag, m.rulesVersion, m.redisOutage, m.shadowCapped} {
		if err := reg.Register(c); err != nil {
			return fmt.Errorf("consumer: register metrics: %w", err)
		}
	}
	return nil
}
