package budget_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	. "github.com/capper-dev/capper/budget"
	"github.com/capper-dev/capper/internal/testenv"
)

// TestCallsAreTimed: each Redis call of a budget (a lease, a refusal, a
// claim) is observed in capper_budget_call_seconds under its budget, as many
// as capper_budget_redis_calls_total counts: what an operator watches when
// held sends come back late.
func TestCallsAreTimed(t *testing.T) {
	rdb := redis.NewClusterClient(&redis.ClusterOptions{Addrs: testenv.RedisAddrs(t)})
	t.Cleanup(func() { rdb.Close() })
	reg := prometheus.NewRegistry()
	b, err := New(Config{Client: rdb, KeyPrefix: testenv.Unique("bm"), Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	spec := &Spec{Name: "timed", Limit: 2, Window: time.Second}
	ctx := context.Background()
	gs, err := b.Take(ctx, wants(spec, "timed", 3)) // two granted, one refused and promised a token
	if err != nil || granted(gs) != 2 || gs[2].RetryAt.IsZero() {
		t.Fatalf("take: %+v %v", gs, err)
	}
	claim := Want{Spec: spec, Key: "timed", Promised: gs[2].RetryAt}
	if _, err := b.Take(ctx, []Want{claim}); err != nil {
		t.Fatal(err)
	}
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var calls float64
	var timed uint64
	var seconds float64
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			if len(m.GetLabel()) == 0 || m.GetLabel()[0].GetValue() != "timed" {
				continue
			}
			switch f.GetName() {
			case "capper_budget_redis_calls_total":
				calls = m.GetCounter().GetValue()
			case "capper_budget_call_seconds":
				timed, seconds = m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()
			}
		}
	}
	if calls < 2 || float64(timed) != calls || seconds <= 0 {
		t.Fatalf("capper_budget_call_seconds: %d calls timed (%v s in all), capper_budget_redis_calls_total %v: want every call (at least 2) timed", timed, seconds, calls)
	}
}
