package budget

import (
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
)

// Hooks for the external tests.

func Calls(b *Budgets, name string) float64 {
	return testutil.ToFloat64(b.m.calls.WithLabelValues(name))
}

func Lapsed(b *Budgets, name string) float64 {
	return testutil.ToFloat64(b.m.tokens.WithLabelValues(name, "lapsed"))
}

func LeaseSize(b *Budgets, key string) int { return b.keys[key].size }

func SetScripter(b *Budgets, s redis.Scripter) { b.cfg.Client = s }

func Scripter(b *Budgets) redis.Scripter { return b.cfg.Client }

func KeyPrefix(b *Budgets) string { return b.cfg.KeyPrefix }

func PromiseLapse(s *Spec) time.Duration { return promiseLapse(s) }
