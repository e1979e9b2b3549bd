package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/rules"
)

// runValidate is capper validate: the configuration checked offline, as
// promtool check config or terraform validate do: the file, the CAPPER_*
// overrides, the rules compiled, the addresses' form. It contacts nothing
// and exits 0 when the configuration would start, 1 with every error
// otherwise.
func runValidate(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("capper validate", flag.ContinueOnError)
	path := configFlag(fs)
	if err := parseFlags(fs, "capper validate --config FILE", args, stdout, stderr); err != nil {
		return err
	}
	if *path == "" {
		fmt.Fprintln(stderr, "capper validate: --config FILE is required")
		return errUsage
	}
	cfg, err := config.Load(*path)
	if err != nil {
		fmt.Fprintf(stdout, "%s: invalid\n%s\n", *path, indent(err.Error()))
		return errLogged
	}
	for _, w := range config.UnknownVariables(os.Environ()) {
		fmt.Fprintf(stdout, "warning: %s\n", w)
	}
	wheel, _ := cfg.Wheel()
	tiers := 0
	if wheel != nil {
		tiers = len(wheel.Tiers())
	}
	if !cfg.HasWorkspaces() {
		rs, _ := rules.Compile(cfg.Rules, 0) // Load compiled them already
		fmt.Fprintf(stdout, "%s: valid: %d segments with caps, %d budgets, %d delay tiers, holding %v\n", *path,
			len(rs.SegmentNames()), len(cfg.Rules.Budgets), tiers, rs.Holds())
		return nil
	}
	fmt.Fprintf(stdout, "%s: valid: %d workspaces (default %q), %d shared budgets, %d delay tiers\n", *path,
		len(cfg.Workspaces), cfg.DefaultWorkspace, len(cfg.Rules.Budgets), tiers)
	for _, w := range cfg.Workspaces {
		rc, _, _ := cfg.WorkspaceRules(w) // Load compiled them already
		rs, _ := rules.Compile(rc, 0)
		fmt.Fprintf(stdout, "  workspace %s: %s: %d segments with caps, %d budgets, users' keys %s:{USER_ID}, segments %s, holding %v\n",
			w.Name, cfg.Path(w.RulesFile), len(rs.SegmentNames()), len(rc.Budgets), cfg.WorkspaceKeyPrefix(w), cfg.WorkspaceSegments(w).Source, rs.Holds())
	}
	return nil
}

func indent(s string) string { return "  " + strings.ReplaceAll(s, "\n", "\n  ") }
