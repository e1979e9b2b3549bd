package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"os"
	"runtime/debug"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/internal/kafkaadmin"
	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/internal/daemon"
	"github.com/capper-dev/capper/internal/loadtest"
	"github.com/capper-dev/capper/rules"
	"github.com/capper-dev/capper/segments"
)

// runLoadgen produces a synthetic blast to the configured input topic and
// writes its manifest.
func runLoadgen(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("capper loadgen", flag.ContinueOnError)
	o := loadgenFlags(fs)
	if err := parseFlags(fs, "capper loadgen --config FILE --manifest FILE [flags]", args, stdout, stderr); err != nil {
		return err
	}
	if o.manifest == "" {
		fmt.Fprintln(stderr, "capper loadgen: --config and --manifest are required")
		return errUsage
	}
	if o.rate < 0 {
		fmt.Fprintln(stderr, "capper loadgen: --rate must be 0 or more")
		return errUsage
	}
	for _, c := range strings.Split(o.channels, ",") {
		if c = strings.TrimSpace(c); c != "" {
			o.g.Channels = append(o.g.Channels, c)
		}
	}
	if o.g.Seed == 0 {
		o.g.Seed = uint64(time.Now().UnixNano())
		fmt.Fprintf(stdout, "loadgen: seed %d (--seed %d repeats this blast)\n", o.g.Seed, o.g.Seed)
	}
	cfg, err := loadConfig(*o.path)
	if err != nil {
		return err
	}
	dialer, transport, err := daemon.KafkaClients(cfg.Kafka)
	if err != nil {
		return err
	}
	ts := cfg.Kafka.Topics
	if o.partitions > 0 {
		topics, err := createConfigTopics(ctx, cfg, dialer, o.partitions)
		if err != nil {
			return err
		}
		if o.g.Jobs == 0 {
			fmt.Fprintf(stdout, "loadgen: topics %s ready\n", strings.Join(topics, ", "))
			return nil
		}
	}
	if len(o.workspaces()) > 1 && (o.prefsShare > 0 || o.vipMidway > 0) {
		return errors.New("loadgen: --prefs-share and --vip-midway-share take one --workspace")
	}
	if (o.externalShare > 0 && ts.External == "") || (o.feedbackShare > 0 && ts.Feedback == "") || ((o.prefsShare > 0 || o.vipMidway > 0) && ts.Preferences == "") {
		return errors.New("loadgen: --external-share, --feedback-share, --prefs-share and --vip-midway-share need kafka.topics.external, .feedback and .preferences")
	}
	var prefEvs []loadtest.Event
	if o.prefsShare > 0 {
		msgs, evs := loadtest.GeneratePreferences(o.g.Users, o.prefsShare, o.g.Seed, time.Now())
		loadtest.InWorkspace(msgs, o.workspaces(), o.g.Users)
		if err = applyPreferences(ctx, cfg, transport, o.workspace, msgs, evs, stderr); err != nil {
			return err
		}
		prefEvs = evs
	}
	msgs, sent, err := loadtest.Generate(o.g)
	if err != nil {
		return err
	}
	ext, fb, evs := loadtest.GenerateEvents(sent, o.externalShare, o.feedbackShare, o.g.Seed, time.Now())
	for _, ms := range [][]kafka.Message{msgs, ext, fb} {
		loadtest.InWorkspace(ms, o.workspaces(), o.g.Users)
	}
	if err := reachable(ctx, cfg, transport, ts.Input); err != nil {
		return err
	}
	start := time.Now()
	vevs, acked, err := produceBlast(ctx, cfg, transport, o, msgs, sent, prefEvs, stderr)
	// Written once the broker acknowledged the messages: a manifest lists only
	// jobs that were sent (those of a chunk the broker failed on may or may
	// not have reached it; none is listed).
	if werr := writeFile(o.manifest, func(f io.Writer) error { return loadtest.WriteManifest(f, sent[:acked]) }); werr != nil {
		return werr
	}
	if err != nil {
		return fmt.Errorf("loadgen: %w (the broker acknowledged %d of %d messages: the manifest %s lists those)", err, acked, len(msgs), o.manifest)
	}
	if len(vevs) > 0 {
		prefEvs = append(prefEvs, vevs...)
		fmt.Fprintf(stdout, "loadgen: %d VIP exemptions sent halfway through the blast, applied by %s\n", len(vevs), vevs[0].ProducedAt.Format(time.RFC3339Nano))
	}
	fmt.Fprintf(stdout, "loadgen: produced %d messages for %d users to %s in %v; manifest %s\n", len(msgs), o.g.Users, ts.Input, time.Since(start).Round(time.Millisecond), o.manifest)
	if len(evs)+len(prefEvs) == 0 {
		return nil
	}
	if err := produceEvents(ctx, cfg, transport, ext, fb, evs); err != nil {
		return err
	}
	if err := writeFile(o.manifest+".events", func(f io.Writer) error { return loadtest.WriteEvents(f, append(evs, prefEvs...)) }); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "loadgen: produced %d external sends, %d feedback events and %d preferences; manifest %s.events\n", len(ext), len(fb), len(prefEvs), o.manifest)
	return nil
}

// loadgenOpts are capper loadgen's flags.
type loadgenOpts struct {
	path                                                *string
	g                                                   loadtest.GenConfig
	externalShare, prefsShare, vipMidway, feedbackShare float64
	channels, manifest, workspace                       string
	rate, partitions                                    int
}

// workspaces returns the --workspace list (nil without).
func (o *loadgenOpts) workspaces() []string {
	var ws []string
	for _, w := range strings.Split(o.workspace, ",") {
		if w = strings.TrimSpace(w); w != "" {
			ws = append(ws, w)
		}
	}
	return ws
}

func loadgenFlags(fs *flag.FlagSet) *loadgenOpts {
	o := &loadgenOpts{path: configFlag(fs)}
	g := &o.g
	fs.IntVar(&g.Jobs, "jobs", 200000, "messages to produce (duplicates and malformed included); 0 with --create-topics only creates the topics")
	fs.IntVar(&g.Users, "users", 50000, "users 1..N receive the jobs")
	fs.Float64Var(&g.RepeatShare, "repeat", 0.3, "share of jobs sent to a hot tenth of the users, so caps bite")
	fs.Float64Var(&g.DuplicateShare, "duplicates", 0.02, "share of messages that resend an earlier job id (redelivery)")
	fs.Float64Var(&g.ExemptShare, "exempt", 0.02, "share of transactional (exempt) jobs")
	fs.Float64Var(&g.MalformedShare, "malformed", 0.005, "share of malformed messages")
	fs.Float64Var(&g.ExpireShare, "expire-share", 0, "share of jobs with an expires_at")
	fs.Float64Var(&g.PriorityShare, "priority-share", 0, "share of jobs with a priority field of their own (0..9 at random)")
	fs.Float64Var(&g.CollapseShare, "collapse-share", 0, "share of jobs with a collapse_key (k0, k1 or k2 at random)")
	g.ExpiresIn = 10 * time.Minute
	fs.Var((*durationFlag)(&g.ExpiresIn), "expires-in", "their expires_at: this long after the blast is generated")
	fs.Float64Var(&o.externalShare, "external-share", 0, "for this share of jobs, also an external send to the same user (kafka.topics.external)")
	fs.Float64Var(&o.prefsShare, "prefs-share", 0, "give this share of the users a preference (at most one email a day, no promotions, or VIP for a day) before the blast, and wait until the workers applied them (kafka.topics.preferences)")
	fs.Float64Var(&o.vipMidway, "vip-midway-share", 0, "halfway through the blast, give this share of the users without a preference (and without a job sent twice) a VIP exemption for a day, while the rest of the blast is produced (with --rate, sends of theirs follow); the report exempts a send from the rules' caps from when the exemption was produced, and holds it to the exemption from when it was seen applied (kafka.topics.preferences)")
	fs.Float64Var(&o.feedbackShare, "feedback-share", 0, "for this share of jobs, a failed or bounced feedback after the blast (kafka.topics.feedback)")
	fs.Uint64Var(&g.Seed, "seed", 0, "random seed, to repeat a blast (0: a new one each run, printed)")
	fs.StringVar(&o.channels, "channels", "email,push,sms", "channels to spread the jobs over, comma-separated")
	fs.IntVar(&o.rate, "rate", 0, "produce this many messages per second, in tenths of a second (0: as fast as the broker takes them)")
	fs.StringVar(&o.manifest, "manifest", "", "file to record what was sent, for capper report (Required)")
	fs.StringVar(&o.workspace, "workspace", "", "with workspaces: the workspace every job and event names (the report judges it with --workspace); a comma-separated list gives users 1..--users to them in contiguous blocks, in order")
	fs.IntVar(&o.partitions, "create-topics", 0, "create the input, output and configured event topics with this many partitions when missing (0: do not)")
	return o
}

// createConfigTopics creates every topic of cfg that is missing (the delay
// tiers and the held topic when it holds) and returns their names.
func createConfigTopics(ctx context.Context, cfg *config.Config, dialer *kafka.Dialer, partitions int) ([]string, error) {
	ts := cfg.Kafka.Topics
	topics := []string{ts.Input, ts.Allowed, ts.Capped, ts.DLQ}
	for _, t := range []string{ts.External, ts.Feedback, ts.Preferences} { // the event topics configured
		if t != "" {
			topics = append(topics, t)
		}
	}
	wheel, err := cfg.Wheel()
	if err != nil {
		return nil, err
	}
	if wheel != nil {
		topics = append(topics, ts.Held)
		for _, t := range wheel.Tiers() {
			topics = append(topics, t.Topic)
		}
	}
	return topics, kafkaadmin.CreateTopics(ctx, dialer, cfg.Kafka.Brokers, partitions, topics...)
}

// writeFile creates path and writes it with write.
func writeFile(path string, write func(io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Close()
}

// produceBlast produces msgs to the input topic, paced by o.rate, with a
// progress line; with o.vipMidway, a wave of VIP exemptions goes out halfway
// and is waited for until applied while the second half is produced. It
// returns those exemptions, their ProducedAt set once applied.
func produceBlast(ctx context.Context, cfg *config.Config, transport *kafka.Transport, o *loadgenOpts, msgs []kafka.Message, sent []loadtest.Sent, prefEvs []loadtest.Event, stderr io.Writer) (vevs []loadtest.Event, acked int, err error) {
	w := daemon.NewWriter(cfg.Kafka, transport, cfg.Kafka.Topics.Input, 5000, daemon.NewLogger("warn", os.Stderr))
	defer w.Close()
	start, last := time.Now(), time.Now()
	progress := func(done int) {
		acked = max(acked, done) // the messages before done are acknowledged, in order
		if time.Since(last) >= time.Second || done == len(msgs) {
			last = time.Now()
			fmt.Fprintf(stderr, "loadgen: %d/%d messages (%.0f%%), %.0f/s\n", done, len(msgs), 100*float64(done)/float64(len(msgs)), float64(done)/time.Since(start).Seconds())
		}
	}
	produce := func(from, to int) error {
		if o.rate == 0 {
			return loadtest.Produce(ctx, w, msgs[from:to], 5000, func(done int) { progress(from + done) })
		}
		return producePaced(ctx, w, msgs[from:to], o.rate, start.Add(time.Duration(from)*time.Second/time.Duration(o.rate)), func(done int) { progress(from + done) })
	}
	half := len(msgs)
	if o.vipMidway > 0 {
		half = len(msgs) / 2
	}
	if err := produce(0, half); err != nil {
		return nil, acked, err
	}
	// The midway wave: produced, and waited for until applied, while the
	// second half of the blast goes out.
	midway := make(chan error, 1)
	if o.vipMidway > 0 {
		var vmsgs []kafka.Message
		vmsgs, vevs = loadtest.GenerateVIP(o.g.Users, o.vipMidway, o.g.Seed, time.Now(), prefEvs, sent)
		loadtest.InWorkspace(vmsgs, o.workspaces(), o.g.Users)
		go func() { midway <- applyPreferences(ctx, cfg, transport, o.workspace, vmsgs, vevs, stderr) }()
	} else {
		midway <- nil
	}
	err = produce(half, len(msgs))
	if merr := <-midway; err == nil {
		err = merr
	}
	return vevs, acked, err
}

// produceEvents produces the events after the blast: external sends, then
// the feedback of sends the worker has decided (or will: feedback for a job
// not yet recorded is counted and ignored). Each event's time is taken
// before its chunk is written, so no worker can have applied it earlier: it
// is set in evs (external sends first, then feedback, in order).
func produceEvents(ctx context.Context, cfg *config.Config, transport *kafka.Transport, ext, fb []kafka.Message, evs []loadtest.Event) error {
	k := 0
	ts := cfg.Kafka.Topics
	for _, e := range []struct {
		topic string
		msgs  []kafka.Message
	}{{ts.External, ext}, {ts.Feedback, fb}} {
		ew := daemon.NewWriter(cfg.Kafka, transport, e.topic, 5000, daemon.NewLogger("warn", os.Stderr))
		err := loadtest.Produce(ctx, ew, e.msgs, 5000, nil)
		ew.Close()
		if err != nil {
			return err
		}
		for _, m := range e.msgs {
			evs[k].ProducedAt = loadtest.ProducedAt(m)
			k++
		}
	}
	return nil
}

// applyPreferences sends the preference events msgs and waits until Redis
// holds every one of them (a running capper applies them): the report holds
// each, evs[i], from the moment it was seen applied (its ProducedAt, set
// here), so that every send decided later is judged with it.
func applyPreferences(ctx context.Context, cfg *config.Config, transport *kafka.Transport, workspace string, msgs []kafka.Message, evs []loadtest.Event, stderr io.Writer) error {
	w := daemon.NewWriter(cfg.Kafka, transport, cfg.Kafka.Topics.Preferences, 5000, daemon.NewLogger("warn", os.Stderr))
	err := loadtest.Produce(ctx, w, msgs, 5000, nil)
	w.Close()
	if err != nil {
		return err
	}
	for i := range evs {
		evs[i].SentAt = loadtest.ProducedAt(msgs[i])
	}
	b, err := daemon.Connect(ctx, cfg, daemon.Options{Stderr: os.Stderr, NoSegments: true})
	if err != nil {
		return err
	}
	defer b.Close()
	ws, err := b.Workspace(workspace)
	if err != nil {
		return err
	}
	pending := map[uint32]bool{}
	for _, e := range evs {
		pending[e.UserID] = true
	}
	deadline := time.Now().Add(2 * time.Minute)
	for len(pending) > 0 {
		for u := range pending {
			if ps, err := b.Limiter.Preferences(ctx, ws.Space, u); err == nil && len(ps) > 0 {
				delete(pending, u)
			}
		}
		if len(pending) == 0 {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("loadgen: %d of %d preferences not applied within 2 minutes: is capper run running with kafka.topics.preferences?", len(pending), len(evs))
		}
		fmt.Fprintf(stderr, "loadgen: waiting for the workers to apply %d of %d preferences\n", len(pending), len(evs))
		time.Sleep(500 * time.Millisecond)
	}
	applied := time.Now()
	for i := range evs {
		evs[i].ProducedAt = applied
	}
	return nil
}

// runReport reads the output topics and checks them against the manifest and
// the caps. Its last line is one JSON object; it fails when a job is
// unaccounted for or a cap was exceeded.
func runReport(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("capper report", flag.ContinueOnError)
	path := configFlag(fs)
	manifest := fs.String("manifest", "", "manifest written by capper loadgen (Required)")
	workspace := workspaceFlag(fs)
	waitD, idleD, holdWaitD := durationFlag(5*time.Minute), durationFlag(30*time.Second), durationFlag(time.Minute)
	fs.Var(&waitD, "wait", "give up waiting for outputs after this long")
	fs.Var(&idleD, "idle", "stop waiting when no new output arrived for this long")
	fs.Var(&holdWaitD, "hold-wait", "wait for the release of held jobs due within this (e.g. 1d); later ones are reported pending")
	wait, idle, holdWait := (*time.Duration)(&waitD), (*time.Duration)(&idleD), (*time.Duration)(&holdWaitD)
	if err := parseFlags(fs, "capper report --config FILE --manifest FILE [--workspace W] [--wait D --idle D --hold-wait D]", args, stdout, stderr); err != nil {
		return err
	}
	if *manifest == "" {
		fmt.Fprintln(stderr, "capper report: --config and --manifest are required")
		return errUsage
	}
	limitHeap()
	cfg, err := loadConfig(*path)
	if err != nil {
		return err
	}
	mf, err := os.Open(*manifest)
	if err != nil {
		return err
	}
	sent, err := loadtest.ReadManifest(mf)
	mf.Close()
	if err != nil {
		return fmt.Errorf("%s: %w", *manifest, err)
	}
	dialer, transport, err := daemon.KafkaClients(cfg.Kafka)
	if err != nil {
		return err
	}
	ts := cfg.Kafka.Topics
	topics := map[string]string{loadtest.RoleAllowed: ts.Allowed, loadtest.RoleCapped: ts.Capped, loadtest.RoleDLQ: ts.DLQ}
	if wheel, err := cfg.Wheel(); err == nil && wheel != nil {
		topics[loadtest.RoleHeld] = ts.Held
	}
	if err := reachable(ctx, cfg, transport, slices.Collect(maps.Values(topics))...); err != nil {
		return err
	}
	rc, segCfg, err := judgedRules(cfg, *workspace)
	if err != nil {
		return err
	}
	rs, err := rules.Compile(rc, 0)
	if err != nil {
		return err
	}
	lookup := func(uint32) (string, bool) { return "", false } // a workspace whose users all get its default caps
	if len(rs.SegmentNames()) > 0 {
		src, err := daemon.NewSegmentSource(ctx, segCfg)
		if err != nil {
			return err
		}
		store, err := segments.New(segments.Config{Segments: rs.SegmentNames(), Source: src, Logger: daemon.NewLogger("warn", os.Stderr),
			StartupTimeout: time.Duration(segCfg.StartupTimeout)})
		if err != nil {
			return err
		}
		defer store.Close()
		if err := store.Start(ctx); err != nil {
			return err
		}
		lookup = store.Snapshot().Lookup
	}
	givenBack := map[string]time.Time{}
	var prefs map[uint32][]loadtest.Pref
	externals, feedbacks := 0, 0
	if ef, err := os.Open(*manifest + ".events"); err == nil {
		evs, err := loadtest.ReadEvents(ef)
		ef.Close()
		if err != nil {
			return err
		}
		for _, e := range evs {
			switch e.Kind {
			case loadtest.EventExternal:
				externals++
			case loadtest.EventFeedback:
				feedbacks++
				if at, ok := givenBack[e.ID]; !ok || e.ProducedAt.Before(at) {
					givenBack[e.ID] = e.ProducedAt
				}
			}
		}
		prefs = loadtest.Prefs(evs)
		fmt.Fprintf(stdout, "capper report: %d external sends (not counted by the report's cap check) and %d failed or bounced feedback events produced with the blast\n", externals, feedbacks)
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	// Each output is judged as it is read and then dropped: the report's memory is a few bytes per job.
	checker := loadtest.NewChecker(sent, loadtest.Policy{Rules: rc, Segment: lookup, GivenBack: givenBack, Preferences: prefs})
	rctx, cancel := context.WithTimeout(ctx, *wait)
	defer cancel()
	read, err := loadtest.ReadOutputs(rctx, loadtest.ReadConfig{
		Dialer: dialer, Brokers: cfg.Kafka.Brokers, Want: sent, Each: checker.Add, Idle: *idle, HoldWait: *holdWait, Topics: topics,
		Progress: func(n int) { fmt.Fprintf(stderr, "report: %d outputs read\n", n) },
	})
	if err != nil {
		return err
	}
	r := checker.Result(time.Now())
	printReport(stdout, &r, read)
	if kib, ok := procKiB("/proc/self/status", "VmHWM:"); ok {
		fmt.Fprintf(stdout, "  memory      the report's peak resident set %.0f MiB\n", float64(kib)/1024)
	}
	line, _ := json.Marshal(r)
	fmt.Fprintln(stdout, string(line))
	if !r.OK() {
		return errors.New("report: jobs unaccounted for or caps exceeded")
	}
	return nil
}

// reachable fails, naming the setting to check, when the brokers do not
// answer within brokerTimeout or one of topics does not exist: a load test
// or a report against a broker that is not there says so at once instead of
// blaming the worker.
func reachable(ctx context.Context, cfg *config.Config, transport *kafka.Transport, topics ...string) error {
	ctx, cancel := context.WithTimeout(ctx, brokerTimeout)
	defer cancel()
	client := &kafka.Client{Addr: kafka.TCP(cfg.Kafka.Brokers...), Transport: transport, Timeout: brokerTimeout}
	md, err := client.Metadata(ctx, &kafka.MetadataRequest{Topics: topics})
	if err != nil {
		return fmt.Errorf("the Kafka brokers %v do not answer within %v: check kafka.brokers (CAPPER_KAFKA_BROKERS) and that the broker runs: %w",
			cfg.Kafka.Brokers, brokerTimeout, err)
	}
	for _, t := range md.Topics {
		if t.Error != nil {
			return fmt.Errorf("the topic %s on %v: %w: create it (capper loadgen --create-topics P) or check kafka.topics", t.Name, cfg.Kafka.Brokers, t.Error)
		}
	}
	return nil
}

// brokerTimeout bounds how long a one-shot command waits for the brokers.
const brokerTimeout = 10 * time.Second

// producePaced produces msgs at rate per second, a tenth of a second's share
// at a time, each share when its time has come (a demand's pace, for the
// budget bench: make bench-budget).
func producePaced(ctx context.Context, w *kafka.Writer, msgs []kafka.Message, rate int, start time.Time, progress func(done int)) error {
	per := max(1, rate/10)
	for i := 0; i < len(msgs); i += per {
		at := start.Add(time.Duration(i) * time.Second / time.Duration(rate))
		if d := time.Until(at); d > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(d):
			}
		}
		end := min(i+per, len(msgs))
		if err := loadtest.Produce(ctx, w, msgs[i:end], per, nil); err != nil {
			return err
		}
		progress(end)
	}
	return nil
}

// limitHeap keeps the report's heap below three quarters of the memory
// available when it starts, unless GOMEMLIMIT is set: the report keeps a few
// dozen bytes per job (ten million in about 650 MiB), and a blast far larger
// than that makes the collector run more often instead of letting the heap
// grow to twice what is live.
func limitHeap() {
	if os.Getenv("GOMEMLIMIT") != "" {
		return
	}
	if kib, ok := procKiB("/proc/meminfo", "MemAvailable:"); ok {
		debug.SetMemoryLimit(kib * 1024 / 4 * 3)
	}
}

// procKiB reads the "FIELD: N kB" line of a /proc file; false where there is
// none (not Linux).
func procKiB(path, field string) (int64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	for _, l := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(l, field); ok {
			n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return n, err == nil
		}
	}
	return 0, false
}

func printReport(w io.Writer, r *loadtest.Result, outputs int) {
	fmt.Fprintf(w, "capper report: %d jobs sent, %d outputs read\n", r.Jobs, outputs-r.Foreign)
	if r.Foreign > 0 {
		fmt.Fprintf(w, "  (and %d outputs of jobs the manifest does not list: another blast's or workspace's, not judged)\n", r.Foreign)
	}
	fmt.Fprintf(w, "  decisions   allowed %d, duplicate %d, exempt %d, unchecked %d, capped %d, dead-letter %d\n", r.Allowed, r.Duplicates, r.Exempt, r.Unchecked, r.Capped, r.DLQ)
	var caps []string
	for c, n := range r.ByCap {
		caps = append(caps, fmt.Sprintf("%s %d", c, n))
	}
	sort.Strings(caps)
	fmt.Fprintf(w, "  capped by   %s\n", strings.Join(caps, ", "))
	var segs []string
	for s := range r.BySegment {
		segs = append(segs, s)
	}
	sort.Strings(segs)
	for _, s := range segs {
		d := r.BySegment[s]
		fmt.Fprintf(w, "  segment %-9s allowed %d, duplicate %d, exempt %d, capped %d\n", s, d["allowed"], d["duplicate"], d["exempt"], d["capped"])
	}
	fmt.Fprintf(w, "  throughput  %.0f jobs/s from first produce to last forward; latency p50 %.0f ms, p99 %.0f ms\n", r.JobsPerSec, r.P50ms, r.P99ms)
	if r.Held > 0 {
		fmt.Fprintf(w, "  holds       %d held records; %d released jobs decided (%d early: a budget's token came free), release lag p50 %.0f ms, p99 %.0f ms; %d still held (due later)\n",
			r.Held, r.Released, r.EarlyReleases, r.ReleaseP50ms, r.ReleaseP99ms, r.Pending)
	}
	if r.Keyed > 0 {
		fmt.Fprintf(w, "  collapse    %d jobs with a collapse key, %d of them collapsed by a newer send of their key\n", r.Keyed, r.Collapsed)
	}
	for _, b := range r.Budgets {
		short := "" // a burst's last windows (Demand only falls): what they could get
		if k := slices.IndexFunc(b.Demand, func(d int) bool { return d < b.Limit }); k >= 0 {
			short = fmt.Sprintf(" (the last %d began with fewer sends to come than the limit: %v)", len(b.Demand)-k, b.Demand[k:])
		}
		fmt.Fprintf(w, "  budget %-8s limit %d per %v; allowed per whole window while the demand lasts (from the second) %v%s; at most %d in any %v\n",
			b.Budget, b.Limit, b.Window, b.Whole, short, b.MaxAny, b.Window)
		if slices.ContainsFunc(b.HeldCapped, func(n int) bool { return n > 0 }) {
			fmt.Fprintf(w, "  budget %-8s held sends capped when they came back, per whole window (each costs its window a send) %v; by what capped them %v\n", b.Budget, b.HeldCapped, b.HeldCappedBy)
		}
	}
	if r.VIPJudged > 0 {
		fmt.Fprintf(w, "  vip         %d sends decided while their user was VIP (the rules' caps may cap none)\n", r.VIPJudged)
	}
	fmt.Fprintf(w, "  checks      %d unaccounted, %d violations (caps, preferences and VIP exemptions, releases before due, sends after expiry, collapse keys)\n", r.Unaccounted, r.Violations)
	for _, p := range r.Problems {
		fmt.Fprintf(w, "  problem: %s\n", p)
	}
}

func loadConfig(path string) (*config.Config, error) {
	if path == "" {
		return nil, errors.New("--config is required")
	}
	cfg, err := config.Load(path)
	if err == nil {
		log := slog.New(slog.NewJSONHandler(os.Stderr, nil))
		for _, w := range config.UnknownVariables(os.Environ()) {
			log.Warn(w)
		}
	}
	return cfg, err
}

// judgedRules are the rules and segments a report judges a manifest by: the
// rules section's, or with workspaces the named one's (default_workspace
// when empty). A budget shared with other workspaces is judged on this
// workspace's sends alone: the others' sends count toward it too, so the
// check sees a lower bound of its use.
func judgedRules(cfg *config.Config, workspace string) (rules.Config, config.Segments, error) {
	if !cfg.HasWorkspaces() {
		if workspace != "" {
			return rules.Config{}, config.Segments{}, errors.New("--workspace: no workspaces are configured")
		}
		return cfg.Rules, cfg.Segments, nil
	}
	name := cmp.Or(workspace, cfg.DefaultWorkspace)
	for _, w := range cfg.Workspaces {
		if w.Name == name {
			rc, _, err := cfg.WorkspaceRules(w)
			return rc, cfg.WorkspaceSegments(w), err
		}
	}
	return rules.Config{}, config.Segments{}, fmt.Errorf("--workspace %q is not one of the workspaces", name)
}
