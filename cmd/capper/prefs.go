package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/events"
	"github.com/capper-dev/capper/internal/daemon"
)

// runPrefs reads a user's preferences from Redis (get) or sends one to the
// preferences topic (set), which the workers apply: every replica then drops
// its near cache's copy of the user's log.
func runPrefs(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	const usage = "usage: capper prefs get --config FILE --user ID\n       capper prefs set --config FILE --user ID (--channel C | --tag T) (--limit N --window D | --opt-out | --clear)\n       capper prefs set --config FILE --user ID (--vip-until RFC3339 | --clear)\n\n`capper prefs get --help` and `capper prefs set --help` list their flags.\n"
	if isHelp(args) {
		fmt.Fprint(stdout, usage+"\nexamples:\n"+examples["capper prefs get"]+examples["capper prefs set"])
		return nil
	}
	if len(args) == 0 || (args[0] != "get" && args[0] != "set") {
		fmt.Fprint(stderr, usage)
		return errUsage
	}
	fs := flag.NewFlagSet("capper prefs "+args[0], flag.ContinueOnError)
	path := configFlag(fs)
	var user optUint
	fs.Var(&user, "user", "user `ID`, 0..4294967295 (Required)")
	timeout := timeoutFlag(fs)
	workspace := workspaceFlag(fs)
	var channel, tag, window, vip *string
	var limit *int
	var optOut, clear *bool
	synopsis := "capper prefs get --config FILE [--workspace W] --user ID"
	if args[0] == "set" { // get has no other flags
		channel = fs.String("channel", "", "a limit or opt-out of this channel")
		tag = fs.String("tag", "", "a limit or opt-out of sends with this tag")
		limit = fs.Int("limit", 0, "at most this many such sends ...")
		window = fs.String("window", "", "... in any window this long (e.g. 7d)")
		optOut = fs.Bool("opt-out", false, "none at all")
		vip = fs.String("vip-until", "", "the rules' caps do not apply to the user until this RFC 3339 time")
		clear = fs.Bool("clear", false, "remove the channel's, the tag's or (with neither) the VIP preference")
		synopsis = "capper prefs set --config FILE [--workspace W] --user ID ((--channel C | --tag T) (--limit N --window D | --opt-out | --clear) | --vip-until T | --clear)"
	}
	if err := parseFlags(fs, synopsis, args[1:], stdout, stderr); err != nil {
		return err
	}
	if !user.set || user.v > 1<<32-1 {
		fmt.Fprintln(stderr, "capper prefs: --user ID (0..4294967295) is required")
		return errUsage
	}
	cfg, err := loadConfig(*path)
	if err != nil {
		return err
	}
	if args[0] == "get" {
		b, ws, err := connectWorkspace(ctx, cfg, *timeout, true, *workspace) // preferences are in Redis alone
		if err != nil {
			return err
		}
		defer b.Close()
		ps, err := b.Limiter.Preferences(ctx, ws.Space, uint32(user.v))
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "user %d  key %s  %d preferences\n", user.v, b.Limiter.PreferencesKey(ws.Space, uint32(user.v)), len(ps))
		for _, p := range ps {
			fmt.Fprintf(stdout, "  %s\n", p)
		}
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	topic := cfg.Kafka.Topics.Preferences
	if topic == "" {
		return errors.New("capper prefs set: kafka.topics.preferences is not configured (CAPPER_KAFKA_TOPICS_PREFERENCES): the workers apply preferences from it")
	}
	ev := map[string]any{"user_id": user.v}
	if *workspace != "" {
		if !cfg.HasWorkspaces() {
			return errors.New("capper prefs set: --workspace: no workspaces are configured")
		}
		ev["workspace"] = *workspace
	}
	for k, v := range map[string]string{"channel": *channel, "tag": *tag, "window": *window, "vip_until": *vip} {
		if v != "" {
			ev[k] = v
		}
	}
	if *limit > 0 {
		ev["limit"] = *limit
	}
	if *optOut {
		ev["opt_out"] = true
	}
	if *clear {
		ev["clear"] = true
	}
	value, _ := json.Marshal(ev)
	if _, err := events.DecodePreference(value); err != nil { // say what is wrong here, not in the dead-letter topic
		return err
	}
	_, transport, err := daemon.KafkaClients(cfg.Kafka)
	if err != nil {
		return err
	}
	w := daemon.NewWriter(cfg.Kafka, transport, topic, 1, daemon.NewLogger("warn", os.Stderr))
	defer w.Close()
	if err := w.WriteMessages(ctx, kafka.Message{Key: []byte(strconv.FormatUint(user.v, 10)), Value: value}); err != nil {
		return fmt.Errorf("capper prefs set: write to %s: %w", topic, err)
	}
	fmt.Fprintf(stdout, "capper prefs: %s sent to %s\n", value, topic)
	return nil
}
