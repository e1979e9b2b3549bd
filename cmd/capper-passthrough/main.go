// Command capper-passthrough is the benchmark baseline of capper run: the
// same daemon (consume, produce, commit) with capping skipped, every job
// forwarded as allowed. scripts/bench-e2e.sh compares capper with it. It is a
// separate binary so that no flag of the production binary can skip capping.
//
//	capper-passthrough --config FILE
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/daemon"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "capper-passthrough:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context) error {
	path := flag.String("config", os.Getenv("CAPPER_CONFIG"), "config file (or CAPPER_CONFIG)")
	flag.Parse()
	cfg, err := config.Load(*path)
	if err != nil {
		return err
	}
	d, err := daemon.New(ctx, cfg, daemon.Options{ConfigPath: *path, Decider: allowAll{}})
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Run(ctx)
}

// allowAll allows every request without asking Redis.
type allowAll struct{}

func (allowAll) Decide(_ context.Context, reqs []capping.Request) ([]capping.Decision, error) {
	ds := make([]capping.Decision, len(reqs))
	for i := range ds {
		ds[i] = capping.Decision{Allowed: true}
	}
	return ds, nil
}
