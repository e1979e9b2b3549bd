package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/daemon"
)

// runCheck prints a read-only view of one user's caps.
func runCheck(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("capper check", flag.ContinueOnError)
	path := configFlag(fs)
	user := fs.Uint64("user", 1<<63, "user id (Required)")
	channel := fs.String("channel", "email", "channel of the hypothetical send")
	if err := parseFlags(fs, "capper check --config FILE --user ID [--channel C]", args, stdout, stderr); err != nil {
		return err
	}
	if *user > 1<<32-1 {
		fmt.Fprintln(stderr, "capper check: --user ID (0..4294967295) is required")
		return errUsage
	}
	cfg, err := loadConfig(*path)
	if err != nil {
		return err
	}
	b, err := daemon.Connect(ctx, cfg, daemon.Options{Stderr: os.Stderr})
	if err != nil {
		return err
	}
	defer b.Close()
	uid := uint32(*user)
	segment, ok := b.Store.Snapshot().Lookup(uid)
	caps := b.Rules.CapsFor(segment, ok)
	if !ok {
		segment = "default (in no segment)"
	}
	d, err := b.Limiter.Peek(ctx, capping.Request{UserID: uid, JobID: "capper-check", Channel: *channel, Caps: caps})
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "user %d  segment %s  key %s\n", uid, segment, b.Limiter.Key(uid))
	for i, c := range caps {
		scope := "all channels"
		if c.Channel != "" {
			scope = c.Channel + " only"
		}
		fmt.Fprintf(stdout, "  cap %-12s %3d of %3d sent in the last %-8v (%s)\n", c.Name, d.Counts[i], c.Limit, c.Window, scope)
	}
	if d.Allowed {
		fmt.Fprintf(stdout, "a %s send now: allowed\n", *channel)
		return nil
	}
	retry := "never (a limit of 0)"
	if !d.RetryAt.IsZero() {
		retry = fmt.Sprintf("%s (in %v)", d.RetryAt.UTC().Format(time.RFC3339), d.RetryAt.Sub(d.At).Round(time.Second))
	}
	fmt.Fprintf(stdout, "a %s send now: capped by %s; retry after %s\n", *channel, d.Cap, retry)
	return nil
}
