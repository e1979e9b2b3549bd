package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/capper-dev/capper/capping"
)

// runKeys counts (or, with --delete, deletes) one workspace's keys in Redis:
// its users' logs, preferences and arbitration candidates, and its own
// budgets' state. The other workspaces' keys and the shared budgets' are
// not touched. It needs an ACL user with +scan and +unlink (the worker's has
// neither: docs/security.md).
func runKeys(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("capper keys", flag.ContinueOnError)
	path := configFlag(fs)
	workspace := workspaceFlag(fs)
	del := fs.Bool("delete", false, "delete the keys (their users start afresh: every cap, preference and budget state of the workspace is gone)")
	timeout := timeoutFlag(fs)
	if err := parseFlags(fs, "capper keys --config FILE [--workspace W] [--delete]", args, stdout, stderr); err != nil {
		return err
	}
	cfg, err := loadConfig(*path)
	if err != nil {
		return err
	}
	b, ws, err := connectWorkspace(ctx, cfg, *timeout, true, *workspace) // Redis alone
	if err != nil {
		return err
	}
	defer b.Close()
	patterns := []string{b.Limiter.SpacePattern(ws.Space)}
	if ws.Name != "" && b.Config.OwnBudgetNames(ws.Config()) { // (one that kept the deployment's keys names its budgets as before)
		patterns = append(patterns, capping.EscapeGlob(strings.TrimSuffix(b.Budgets.RedisKey(ws.Name+"/"), "}"))+"*")
	}
	verb := "found"
	if *del {
		verb = "deleted"
	}
	name := ws.Name
	if name == "" {
		name = "(no workspaces: the deployment's)"
	}
	for _, p := range patterns {
		n, err := b.Limiter.ScanKeys(ctx, p, *del)
		if err != nil {
			return fmt.Errorf("capper keys: %s after %d keys: %w", p, n, err)
		}
		fmt.Fprintf(stdout, "workspace %s: %d keys %s matching %s\n", name, n, verb, p)
	}
	return nil
}
