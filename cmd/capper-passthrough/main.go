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

const usage = `usage: capper-passthrough --config FILE

the benchmark baseline of capper run: the same daemon (consume, produce,
commit) with capping skipped, every job forwarded as allowed

flags:
`

func run(ctx context.Context) error {
	flag.Usage = func() {
		fmt.Fprint(flag.CommandLine.Output(), usage)
		flag.PrintDefaults()
		fmt.Fprint(flag.CommandLine.Output(), "\nexamples:\n  capper-passthrough --config config.example.yaml\n")
	}
	path := flag.String("config", os.Getenv("CAPPER_CONFIG"), "config `FILE` (or CAPPER_CONFIG)")
	flag.Parse()
	if *path == "" {
		flag.CommandLine.SetOutput(os.Stderr)
		flag.Usage()
		os.Exit(2)
	}
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
