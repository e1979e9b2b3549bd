// Command capper is the frequency-capping worker and its tools.
//
//	capper run --config FILE           consume, cap and forward send jobs
//	capper check --config FILE --user ID [--channel C]
//	capper segments build|inspect|upload ...
//	capper prefs get|set ...             a user's own preferences
//	capper loadgen / capper report       synthetic blasts and their verification
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/capper-dev/capper/internal/version"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil {
		if !errors.Is(err, errUsage) && !errors.Is(err, errLogged) {
			fmt.Fprintln(os.Stderr, "capper:", err)
		}
		os.Exit(1)
	}
}

var errUsage = errors.New("usage")

// errLogged ends a command whose error was already logged.
var errLogged = errors.New("logged")

// errHelp ends a command that printed its help to stdout (exit 0).
var errHelp = errors.New("help")

// parseFlags parses a command's flags. On -h or --help it prints the
// command's synopsis and flags to stdout and returns errHelp; on a bad flag it
// prints the error and the flags to stderr and returns errUsage.
func parseFlags(fs *flag.FlagSet, synopsis string, args []string, stdout, stderr io.Writer) error {
	fs.SetOutput(io.Discard)
	err := fs.Parse(args)
	switch {
	case errors.Is(err, flag.ErrHelp):
		fmt.Fprintf(stdout, "usage: %s\n\nflags:\n", synopsis)
		fs.SetOutput(stdout)
		fs.PrintDefaults()
		if ex := examples[fs.Name()]; ex != "" {
			fmt.Fprintf(stdout, "\nexamples:\n%s", ex)
		}
		return errHelp
	case err != nil:
		fmt.Fprintf(stderr, "%s: %v\nusage: %s\n", fs.Name(), err, synopsis)
		fs.SetOutput(stderr)
		fs.PrintDefaults()
		return errUsage
	}
	return nil
}

// examples are each command's real invocations, printed after its flags by
// --help, keyed by the flag set's name.
var examples = map[string]string{
	"capper run": "  capper run --config /etc/capper/capper.yaml\n" +
		"  CAPPER_LOG_LEVEL=debug capper run --config capper.yaml\n",
	"capper check": "  capper check --config capper.yaml --user 42\n" +
		"  capper check --config capper.yaml --user 42 --channel push --tags promotional --priority 7\n" +
		"  capper check --config capper.yaml --budget sms-provider\n",
	"capper validate": "  capper validate --config capper.yaml\n" +
		"  CAPPER_KAFKA_BROKERS=b-1:9092 capper validate --config capper.yaml\n",
	"capper segments build": "  capper segments build --name vip --out vip.roaring --from vip-ids.txt\n" +
		"  cut -d, -f1 users.csv | capper segments build --name new --out new.roaring\n",
	"capper prefs get": "  capper prefs get --config capper.yaml --user 42\n",
	"capper prefs set": "  capper prefs set --config capper.yaml --user 42 --channel email --limit 1 --window 7d\n" +
		"  capper prefs set --config capper.yaml --user 42 --tag promotional --opt-out\n" +
		"  capper prefs set --config capper.yaml --user 42 --vip-until 2026-12-31T00:00:00Z\n",
	"capper loadgen": "  capper loadgen --config capper.yaml --manifest blast.csv --jobs 200000 --users 50000\n" +
		"  capper loadgen --config capper.yaml --manifest sms.csv --channels sms --rate 150 --create-topics 6\n",
	"capper keys": "  capper keys --config capper.yaml --workspace globex\n" +
		"  capper keys --config capper.yaml --workspace globex --delete\n",
	"capper report": "  capper report --config capper.yaml --manifest blast.csv\n" +
		"  capper report --config capper.yaml --manifest blast.csv --hold-wait 2m --idle 1m\n",
}

// isHelp reports whether args ask for help (for commands without flags).
func isHelp(args []string) bool {
	return len(args) > 0 && (args[0] == "-h" || args[0] == "--help" || args[0] == "-help" || args[0] == "help")
}

const usage = `capper — per-user frequency capping for campaign messages

Usage:
  capper run --config FILE                     run the worker (consume, cap, forward, commit)
  capper validate --config FILE                check a configuration offline: every error with its field
                                               (and line); contacts nothing; exit 0 or 1
  capper check --config FILE --user ID [--channel C]
                                               show a user's segment, counted sends and whether a send
                                               now would be allowed; records nothing
  capper segments build --name NAME --out FILE [--from FILE|-]
                                               build a segment bitmap from user ids, one per line
  capper segments inspect FILE|s3://bucket/key  cardinality, size, containers, min/max id
  capper segments upload DIR s3://bucket/prefix  upload DIR/*.roaring (S3 settings from CAPPER_SEGMENTS_S3_* or AWS_*)
  capper prefs get --config FILE --user ID     a user's own preferences (limits, opt-outs, VIP)
  capper prefs set --config FILE --user ID ... send one to the preferences topic (--help for its flags)
  capper loadgen --config FILE --manifest FILE [--jobs N --users U ...]
                                               produce a synthetic blast to the input topic, record it
  capper report --config FILE --manifest FILE  check the output topics against the blast and the caps;
                                               the last line is JSON; exits 1 on loss or over-send
  capper keys --config FILE --workspace W [--delete]
                                               count (or delete) one workspace's keys in Redis
  capper version                               the version, VCS revision and Go version of this build

Examples:
  capper validate --config capper.yaml
  capper run --config capper.yaml
  capper check --config capper.yaml --user 42 --channel push
  capper segments build --name vip --out vip.roaring --from vip-ids.txt
  capper <command> --help                     a command's flags and examples

Every config field can be overridden by an environment variable: kafka.topics.input is
CAPPER_KAFKA_TOPICS_INPUT. Secrets come from CAPPER_REDIS_PASSWORD and CAPPER_KAFKA_SASL_PASSWORD
(or the *_file fields). See config.example.yaml.
`

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if err := command(ctx, args, stdout, stderr); !errors.Is(err, errHelp) {
		return err
	}
	return nil
}

func command(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return errUsage
	}
	switch args[0] {
	case "run":
		return runWorker(ctx, args[1:], stderr)
	case "check":
		return runCheck(ctx, args[1:], stdout, stderr)
	case "validate":
		return runValidate(args[1:], stdout, stderr)
	case "segments":
		return runSegments(ctx, args[1:], stdout, stderr)
	case "loadgen":
		return runLoadgen(ctx, args[1:], stdout, stderr)
	case "prefs":
		return runPrefs(ctx, args[1:], stdout, stderr)
	case "report":
		return runReport(ctx, args[1:], stdout, stderr)
	case "keys":
		return runKeys(ctx, args[1:], stdout, stderr)
	case "version", "--version":
		if isHelp(args[1:]) {
			fmt.Fprint(stdout, "usage: capper version\n\nprints the version, VCS revision and Go version of this build\n\nexamples:\n  capper version\n")
			return nil
		}
		fmt.Fprintln(stdout, version.Get())
		return nil
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return nil
	default:
		fmt.Fprintf(stderr, "capper: unknown command %q\n\n%s", args[0], usage)
		return errUsage
	}
}
