package main

import (
	"context"
	"flag"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/capper-dev/capper/internal/daemon"
)

func configFlag(fs *flag.FlagSet) *string {
	return fs.String("config", os.Getenv("CAPPER_CONFIG"), "config file (or CAPPER_CONFIG)")
}

// runWorker is capper run: the daemon until SIGINT or SIGTERM (ctx), with
// SIGHUP reloading the rules. Its fatal error is logged as JSON, like every
// other line it prints.
func runWorker(ctx context.Context, args []string, stderr io.Writer) error {
	fs := flag.NewFlagSet("capper run", flag.ContinueOnError)
	path := configFlag(fs)
	if err := parseFlags(fs, "capper run --config FILE", args, os.Stdout, stderr); err != nil {
		return err
	}
	if err := work(ctx, *path, stderr); err != nil {
		log := slog.New(slog.NewJSONHandler(stderr, nil))
		if ctx.Err() != nil { // SIGINT or SIGTERM while starting: a clean stop
			log.Info("capper run stopped by a signal before it was started", "during", err.Error())
			return nil
		}
		log.Error("capper run failed", "err", err.Error())
		return errLogged
	}
	return nil
}

func work(ctx context.Context, path string, stderr io.Writer) error {
	cfg, err := loadConfig(path)
	if err != nil {
		return err
	}
	d, err := daemon.New(ctx, cfg, daemon.Options{ConfigPath: path, Stderr: stderr})
	if err != nil {
		return err
	}
	defer d.Close()
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	go func() {
		for range hup {
			_ = d.ReloadRules(ctx) // a rejected file is logged; the rules in force stay
		}
	}()
	return d.Run(ctx)
}
