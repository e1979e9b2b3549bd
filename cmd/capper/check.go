package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/capper-dev/capper/budget"
	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/daemon"
	"github.com/capper-dev/capper/rules"
)

// runCheck prints a read-only view of one user's caps for one job shape.
func runCheck(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("capper check", flag.ContinueOnError)
	path := configFlag(fs)
	var user optUint
	fs.Var(&user, "user", "user `ID`, 0..4294967295 (Required unless --budget)")
	budgetName := fs.String("budget", "", "show this budget's current use instead (with --campaign for a per-campaign budget)")
	channel := fs.String("channel", "email", "channel of the hypothetical send")
	category := fs.String("category", "marketing", "category of the hypothetical send")
	tags := fs.String("tags", "", "comma-separated tags of the hypothetical send")
	campaign := fs.String("campaign", "capper-check", "campaign of the hypothetical send (for per-campaign caps)")
	timezone := fs.String("timezone", "", "the user's IANA time zone (default: the rules' default_timezone)")
	collapseKey := fs.String("collapse-key", "", "collapse_key of the hypothetical send (default: the one the rules derive, if any)")
	timeout := timeoutFlag(fs)
	workspace := workspaceFlag(fs)
	var prio optInt
	fs.Var(&prio, "priority", "`priority` of the hypothetical send, 0..100 (default: the rules' default for it)")
	if err := parseFlags(fs, "capper check --config FILE [--workspace W] (--user ID [--channel C --category C --tags T1,T2 --campaign ID --timezone Z --priority P --collapse-key K] | --budget NAME [--campaign ID])", args, stdout, stderr); err != nil {
		return err
	}
	if *budgetName != "" {
		return checkBudget(ctx, *path, *workspace, *budgetName, *campaign, *timeout, stdout)
	}
	if !user.set || user.v > 1<<32-1 {
		fmt.Fprintln(stderr, "capper check: --user ID (0..4294967295) is required")
		return errUsage
	}
	priority := &prio.v
	if !prio.set {
		*priority = -1 // the rules' default
	}
	zone, err := rules.Location(*timezone)
	if err != nil {
		return fmt.Errorf("--timezone: %w", err)
	}
	cfg, err := loadConfig(*path)
	if err != nil {
		return err
	}
	b, ws, err := connectWorkspace(ctx, cfg, *timeout, false, *workspace)
	if err != nil {
		return err
	}
	defer b.Close()
	if *timezone == "" {
		zone = ws.Rules.DefaultZone()
	}
	uid := uint32(user.v)
	segment, ok := ws.Segmenter().Lookup(uid)
	now := time.Now()
	allTags := []string{*category}
	for _, t := range strings.Split(*tags, ",") {
		if t = strings.TrimSpace(t); t != "" {
			allTags = append(allTags, t)
		}
	}
	inSegment := ok
	if !ok {
		segment = "default"
	}
	// The same plan the worker makes of such a send.
	if *priority > rules.MaxPriority {
		return fmt.Errorf("--priority %d is not in 0..%d", *priority, rules.MaxPriority)
	}
	plan := ws.Rules.Plan(rules.Job{Channel: *channel, Category: *category, Tags: allTags, Campaign: *campaign, Zone: zone,
		Segment: segment, InSegment: inSegment, Priority: max(0, *priority), HasPriority: *priority >= 0, CollapseKey: *collapseKey}, now, nil)
	caps := plan.Caps
	shown := segment
	if !inSegment {
		shown = "default (in no segment)"
	}
	if ws.Name != "" {
		fmt.Fprintf(stdout, "workspace %s  ", ws.Name)
	}
	fmt.Fprintf(stdout, "user %d  segment %s  key %s  time zone %s  priority %d\n", uid, shown, b.Limiter.Key(ws.Space, uid), zone, plan.Priority)
	switch {
	case plan.Exempt:
		fmt.Fprintf(stdout, "category %s is exempt: such a send is neither counted nor capped\n", *category)
		return nil
	case plan.CountOnly:
		fmt.Fprintf(stdout, "category %s is count-only: such a send is counted but never capped\n", *category)
	}
	d, err := b.Limiter.Peek(ctx, capping.Request{UserID: uid, Space: ws.Space, JobID: "capper-check", Channel: *channel, Campaign: *campaign,
		Tags: allTags, Caps: caps, Retention: plan.Retention, Arbitration: plan.Arbitration, Priority: plan.Priority,
		Preferences: b.Config.Kafka.Topics.Preferences != ""})
	if err != nil {
		return err
	}
	printCaps(stdout, caps, &d, &plan, zone)
	if b.Config.Kafka.Topics.Preferences != "" {
		ps, err := b.Limiter.Preferences(ctx, ws.Space, uid)
		if err != nil {
			return err
		}
		for _, p := range ps {
			fmt.Fprintf(stdout, "  the user's %s\n", p)
		}
	}
	if err := printCollapse(ctx, stdout, b, b.Limiter.Key(ws.Space, uid), &plan); err != nil {
		return err
	}
	printVerdict(stdout, *channel, &d, &plan, zone)
	return nil
}

// printCollapse prints the user's collapse keys (under the user's log key)
// and the send's own.
func printCollapse(ctx context.Context, stdout io.Writer, b *daemon.Backends, user string, plan *rules.Plan) error {
	entries, err := b.Collapse.Keys(ctx, user)
	if err != nil {
		return err
	}
	for _, e := range entries {
		fmt.Fprintf(stdout, "  collapse key %s: %s (kept %v more)\n", e.Key, e, e.ExpiresIn.Round(time.Second))
	}
	if c := plan.Collapse; c.Key != "" {
		fmt.Fprintf(stdout, "  this send's collapse key: %s (an older send of it collapses", c.Key)
		if c.Window > 0 {
			fmt.Fprintf(stdout, "; so does one within %v of a send of it", c.Window)
		}
		fmt.Fprintln(stdout, ")")
	}
	return nil
}

// printCaps prints each cap of the plan with its count in d.
func printCaps(stdout io.Writer, caps []capping.Cap, d *capping.Decision, plan *rules.Plan, zone *time.Location) {
	for i, c := range caps {
		since, window := c.Since, ""
		switch {
		case c.Tally && c.Window == 0:
			window = "lifetime, in the user's tally, kept until " + c.Keep.In(zone).Format("2006-01-02") + " if sent now"
		case c.Tally:
			since, window = d.At.Add(-c.Window), "rolling "+rules.Duration(c.Window).String()+", in the user's tally"
		case c.Window > 0:
			since, window = d.At.Add(-c.Window), "rolling "+rules.Duration(c.Window).String()
		default:
			window = "calendar, until " + c.Until.In(zone).Format("2006-01-02 15:04 MST")
		}
		if c.Tally && plan.CountOnly {
			fmt.Fprintf(stdout, "  cap %-20s %3d so far (counted, never caps a count-only send; %s)\n", c.Name, d.Counts[i], window)
			continue
		}
		state := ""
		if c.Shadow {
			state = "  [shadow: never blocks]"
		}
		if c.Reserved > 0 {
			_, min := plan.Reservation(c.Name)
			state += fmt.Sprintf("  [%d more reserved for priority %d and above]", c.Reserved, min)
		}
		if c.Tally && c.Window == 0 {
			fmt.Fprintf(stdout, "  cap %-20s %3d of %3d ever (%s)%s\n", c.Name, d.Counts[i], c.Limit, window, state)
			continue
		}
		fmt.Fprintf(stdout, "  cap %-20s %3d of %3d since %s (%s)%s\n", c.Name, d.Counts[i], c.Limit, since.In(zone).Format("2006-01-02 15:04 MST"), window, state)
	}
}

// printVerdict prints what a send of channel now would become.
func printVerdict(stdout io.Writer, channel string, d *capping.Decision, plan *rules.Plan, zone *time.Location) {
	for _, s := range d.Shadow {
		fmt.Fprintf(stdout, "shadow cap %s would cap this send\n", s)
	}
	if until := plan.QuietUntil; !until.IsZero() {
		fmt.Fprintf(stdout, "a %s send now: in quiet hours until %s; %s\n", channel, until.In(zone).Format(time.RFC3339),
			policy(plan.OnCapped("")))
		return
	}
	if d.Candidate {
		fmt.Fprintf(stdout, "a %s send now: would take the last slot of %s, which is arbitrated: it would wait until %s, when the highest priority among the sends that asked for it meanwhile gets it\n",
			channel, d.Cap, d.RetryAt.In(zone).Format(time.RFC3339))
		return
	}
	if d.Allowed || plan.CountOnly {
		fmt.Fprintf(stdout, "a %s send now: allowed\n", channel)
		return
	}
	retry := "never (a limit of 0, or a lifetime cap)"
	if !d.RetryAt.IsZero() {
		retry = fmt.Sprintf("%s (in %v)", d.RetryAt.In(zone).Format(time.RFC3339), d.RetryAt.Sub(d.At).Round(time.Second))
	}
	by := d.Cap
	if d.Reserved {
		_, min := plan.Reservation(d.Cap)
		by += fmt.Sprintf(" (the slots left are reserved for priority %d and above)", min)
	}
	fmt.Fprintf(stdout, "a %s send now: capped by %s; retry after %s; %s\n", channel, by, retry, policy(plan.OnCapped(d.Cap)))
}

// policy says what happens to a refused send under p.
func policy(p rules.Policy) string {
	if !p.Hold {
		return "policy drop: it would go to the capped topic"
	}
	return fmt.Sprintf("policy hold: it would wait for its slot, at most %v after it was submitted", p.MaxHold)
}

// checkBudget prints one budget key's current use.
func checkBudget(ctx context.Context, path, workspace, name, campaign string, timeout time.Duration, stdout io.Writer) error {
	cfg, err := loadConfig(path)
	if err != nil {
		return err
	}
	b, ws, err := connectWorkspace(ctx, cfg, timeout, true, workspace) // budgets are in Redis alone
	if err != nil {
		return err
	}
	defer b.Close()
	spec, perCampaign, ok := ws.Rules.BudgetNamed(name)
	if !ok && ws.Name != "" {
		spec, perCampaign, ok = ws.Rules.BudgetNamed(ws.Name + "/" + name) // the workspace's own
	}
	if !ok {
		return fmt.Errorf("no budget %q in the rules", name)
	}
	key := spec.Name
	if perCampaign {
		key += ":" + campaign
	}
	u, err := b.Budgets.Peek(ctx, budget.Want{Spec: spec, Key: key})
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "budget %s  key %s  limit %d per %v (rolling, %d buckets)\n", key, b.Budgets.RedisKey(key), spec.Limit, rules.Duration(spec.Window), budget.Buckets)
	fmt.Fprintf(stdout, "  used %d of %d in the window now (leased tokens count, used or not)\n", u.Used, spec.Limit)
	if !u.Next.IsZero() {
		fmt.Fprintf(stdout, "  the oldest counted bucket leaves the window at %s (in %v)\n", u.Next.UTC().Format(time.RFC3339Nano), time.Until(u.Next).Round(time.Millisecond))
	}
	return nil
}

// connectWorkspace opens the backends of a one-shot command (check, prefs
// get, keys) and returns the workspace called name (the default one for
// ""); noSegments loads none (Redis alone). It gives up after timeout, the
// segments' first snapshot and Redis included, naming --timeout, rather than
// the worker's minutes of patience.
func connectWorkspace(ctx context.Context, cfg *config.Config, timeout time.Duration, noSegments bool, name string) (*daemon.Backends, *daemon.Workspace, error) {
	cfg.Segments.StartupTimeout = config.Duration(min(time.Duration(cfg.Segments.StartupTimeout), timeout))
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start := time.Now()
	b, err := daemon.Connect(ctx, cfg, daemon.Options{Stderr: os.Stderr, NoSegments: noSegments})
	if err != nil && time.Since(start) >= timeout*9/10 {
		return nil, nil, fmt.Errorf("gave up after %v (--timeout D waits longer): %w", timeout, err)
	}
	if err != nil {
		return nil, nil, err
	}
	ws, err := b.Workspace(name)
	if err != nil {
		b.Close()
		return nil, nil, err
	}
	return b, ws, nil
}

// timeoutFlag is a one-shot command's --timeout.
func timeoutFlag(fs *flag.FlagSet) *time.Duration {
	d := durationFlag(10 * time.Second)
	fs.Var(&d, "timeout", "give up on a backend that does not answer after this long")
	return (*time.Duration)(&d)
}

// workspaceFlag is --workspace, in a deployment with workspaces: the
// workspace whose user (or budget) a command is about; empty: the default one.
func workspaceFlag(fs *flag.FlagSet) *string {
	return fs.String("workspace", "", "the `workspace` of the user or budget, with workspaces (default: default_workspace)")
}
