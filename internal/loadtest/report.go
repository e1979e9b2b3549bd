package loadtest

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/output"
	"github.com/capper-dev/capper/rules"
)

// Output roles: which output topic a message was read from.
const (
	RoleAllowed = "allowed"
	RoleCapped  = "capped"
	RoleDLQ     = "dlq"
	RoleHeld    = "held" // audit records of holds: not a final topic
)

// ReleaseGrace is how late after its due time a held job may be released
// before the report counts it as lost; a job due later than the report's
// end plus this is pending, not lost.
const ReleaseGrace = 30 * time.Second

// Output is one message read from an output topic: what capper says of it
// (output.Parse), its topic's role, loadgen's id and when it was
// produced and written.
type Output struct {
	output.Output
	Role       string // RoleAllowed, RoleCapped, RoleDLQ or RoleHeld
	ID         string // HeaderID
	Time       time.Time
	ProducedAt time.Time
}

// at is when o was decided: capper-decided-at, else its write time.
func (o *Output) at() time.Time {
	if !o.DecidedAt.IsZero() {
		return o.DecidedAt
	}
	return o.Time
}

// Result is the report's verdict. The JSON field names are the report's last line.
type Result struct {
	Jobs       int `json:"jobs"`
	Allowed    int `json:"allowed"`
	Capped     int `json:"capped"`
	DLQ        int `json:"dlq"`
	Duplicates int `json:"duplicates"`
	Exempt     int `json:"exempt"`
	Unchecked  int `json:"unchecked"` // forwarded without a check under a fail-open rule
	Held       int `json:"held"`      // hold records (a job held twice counts twice)
	Released   int `json:"released"`  // final outputs of jobs that were held
	// EarlyReleases counts the released jobs decided before the due time
	// of their last held record: a budget's hold released early, when a
	// token came free (any other hold so ended is a violation).
	EarlyReleases int `json:"early_releases"`
	Pending       int `json:"pending"` // jobs still held, due after the report
	// Arbitrations of a cap's last slot: final outputs of candidates that won and lost it.
	ArbitrationsWon  int `json:"arbitrations_won"`
	ArbitrationsLost int `json:"arbitrations_lost"`
	// Keyed counts the jobs with a collapse key, Collapsed those of them
	// capped as collapsed (a newer send of their key replaced them).
	Keyed     int `json:"keyed"`
	Collapsed int `json:"collapsed"`
	// VIPJudged counts the final outputs (allowed or capped) of jobs decided
	// while their user was VIP: each is a violation if the rules' caps capped it.
	VIPJudged int `json:"vip_judged"`
	// Foreign counts the outputs of jobs the manifest does not list (another
	// blast's, another workspace's): neither counted above nor judged.
	Foreign     int     `json:"foreign"`
	Unaccounted int     `json:"unaccounted"`
	Violations  int     `json:"violations"`
	JobsPerSec  float64 `json:"jobs_per_sec"`
	P50ms       float64 `json:"p50_ms"`
	P99ms       float64 `json:"p99_ms"`
	// Release lag: from a held job's due time to its release decision.
	ReleaseP50ms float64 `json:"release_p50_ms"`
	ReleaseP99ms float64 `json:"release_p99_ms"`

	// Budgets: what each budget (per campaign: each key) forwarded per window.
	Budgets []BudgetDelivery `json:"budgets,omitempty"`

	ByCap     map[string]int            `json:"-"`
	BySegment map[string]map[string]int `json:"-"` // segment -> decision -> outputs
	Problems  []string                  `json:"-"` // the first few, for people
}

// BudgetDelivery is what a budget forwarded: its allowed sends (by decision
// time) per window of its length, from its first allowed send. Whole counts
// the windows after the first (partial: the demand begins) that end by the
// last produce stamp or, when held jobs waited past it (a burst), before the
// window of the last of them the budget sent (the demand has ended then;
// without stamps, all but the last, partial one): under demand above the
// limit, each of those is the share of the limit the budget delivers.
// Demand is, for each of them, what it could get: the limit, or fewer when
// fewer of the budget's sends were still to come at its start (a burst's
// last windows, whose sends waiting are spread over them and the next).
type BudgetDelivery struct {
	Budget string        `json:"budget"`
	Limit  int           `json:"limit"`
	Window time.Duration `json:"window_ns"`
	Whole  []int         `json:"whole_windows"`
	Demand []int         `json:"whole_demand"`
	// HeldCapped is, for each whole window, the sends of its scope that were
	// held and capped when they came back, in it by decision time: one its
	// user's cap refused after it claimed its token left that token counted and
	// unsent; one capped beyond its max_hold found its token taken by a late
	// claim. A window short of the limit with such sends lost them there.
	HeldCapped []int `json:"whole_held_capped"`
	// HeldCappedBy counts those of HeldCapped by what capped them: the
	// reason (beyond max_hold, refused before, ...), else the cap.
	HeldCappedBy map[string]int `json:"whole_held_capped_by,omitempty"`
	// First is when its first allowed send was decided (Unix ns): window i
	// of Whole starts (i+1) windows after it.
	First int64 `json:"first_ns"`
	// MaxAny is the most allowed sends in any window of its length (sliding).
	MaxAny int `json:"max_any"`
}

// OK reports whether nothing was lost or over-sent.
func (r *Result) OK() bool { return r.Unaccounted == 0 && r.Violations == 0 }

const maxProblems = 20

func (r *Result) problem(format string, args ...any) {
	if len(r.Problems) < maxProblems {
		r.Problems = append(r.Problems, fmt.Sprintf(format, args...))
	}
}

// Policy is what Check needs of the worker: its rules as configured (Check
// reads them itself: see judge.go) and each user's segment.
type Policy struct {
	Rules rules.Config
	// Segment returns a user's segment (ok false: in none, the default caps).
	Segment func(user uint32) (segment string, ok bool)
	// GivenBack maps the job id of a send whose delivery failed (feedback
	// failed or bounced) to when that feedback was produced: from then on the
	// send may no longer count (a worker can only apply it later, so it is
	// treated as counted before). Optional.
	GivenBack map[string]time.Time
	// Preferences are users' own limits and opt-outs, each held from its
	// From on (Prefs). Optional.
	Preferences map[uint32][]Pref
}

// percentile is the nearest-rank percentile of sorted values.
func percentile[T int32 | float64](sorted []T, p float64) T {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(math.Ceil(p * float64(len(sorted))))
	return sorted[min(len(sorted), max(rank, 1))-1]
}

// ReadConfig says what ReadOutputs reads and when it stops.
type ReadConfig struct {
	Dialer  *kafka.Dialer     // TLS and SASL; nil for plain connections
	Brokers []string          // (Required)
	Topics  map[string]string // role (RoleAllowed, RoleCapped, RoleDLQ, RoleHeld) -> topic (Required)
	Want    *Manifest         // the messages to wait for (Required)
	// Each is given every output read, one at a time; it must not keep it. (Required)
	Each func(*Output)
	Idle time.Duration // stop when nothing new arrived for this long
	// HoldWait: a held message due within this is waited for (until its due
	// time plus ReleaseGrace); one due later is not. Defaults to 1m.
	HoldWait time.Duration
	// Progress, when set, is called now and then with the count read so far.
	Progress func(read int)
}

// ReadOutputs reads the output topics from their beginning with a fresh
// consumer group, until every message of c.Want has a final output (or is
// held until after c.HoldWait), nothing new arrived for c.Idle while no held
// message is due soon, or ctx ends. It returns how many outputs it read.
func ReadOutputs(ctx context.Context, c ReadConfig) (int, error) {
	holdWait := cmp.Or(c.HoldWait, time.Minute)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var mu sync.Mutex
	read := 0
	final := make([]bool, c.Want.Len()) // by line: the message has a final output
	held := map[int]time.Time{}         // lines held (latest due) without a final output yet
	found := 0                          // lines with a final output
	lastNew := time.Now()
	roles := map[string]string{} // topic -> role
	var names []string
	for role, topic := range c.Topics {
		roles[topic] = role
		names = append(names, topic)
	}
	errs := make(chan error, 1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		in := map[string]interner{} // per topic: its reader's goroutine's own
		for _, t := range names {
			in[t] = interner{}
		}
		err := output.Read(ctx, output.ReadConfig{Brokers: c.Brokers, Dialer: c.Dialer, Topics: names,
			Group: fmt.Sprintf("capper-report-%d", time.Now().UnixNano())}, func(m *output.Message) error {
			role := roles[m.Topic]
			o, err := parseOutput(role, m, in[m.Topic])
			if err != nil {
				return err
			}
			mu.Lock()
			defer mu.Unlock()
			read++
			c.Each(&o)
			i, ok := c.Want.Index(o.ID)
			switch {
			case !ok: // another run's
				lastNew = time.Now()
			case role == RoleHeld:
				lastNew = time.Now()
				if !final[i] && o.DueAt.After(held[i]) {
					held[i] = o.DueAt
				}
			case !final[i]:
				final[i] = true
				lastNew = time.Now()
				delete(held, i)
				found++
			}
			return nil
		})
		if err != nil {
			errs <- err
		}
	}()
	tick := time.NewTicker(200 * time.Millisecond)
	defer tick.Stop()
	lastProgress := time.Now()
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case err := <-errs:
			cancel()
			wg.Wait()
			return read, err
		case <-tick.C:
			mu.Lock()
			now := time.Now()
			done, n, quiet := found, read, now.Sub(lastNew)
			soon := 0 // held messages due within holdWait, or due and not yet past the grace
			for _, due := range held {
				if due.After(now.Add(holdWait)) {
					done++
				} else if due.After(now.Add(-ReleaseGrace)) {
					soon++
				}
			}
			mu.Unlock()
			if c.Progress != nil && time.Since(lastProgress) >= 2*time.Second {
				c.Progress(n)
				lastProgress = time.Now()
			}
			if done == len(final) || (quiet > c.Idle && soon == 0) {
				break loop
			}
		}
	}
	cancel()
	wg.Wait()
	return read, nil
}

// interner keeps one copy of each of the few values a field takes across
// millions of outputs or manifest lines (a decision, segment, cap, reason,
// channel, campaign, time zone). What it returns never points into s's
// buffer (a manifest line).
type interner map[string]string

func (in interner) get(s string) string {
	if v, ok := in[s]; ok {
		return v
	}
	c := strings.Clone(s)
	if len(in) < 10000 { // the values are a handful; never let a surprise grow it without bound
		in[c] = c
	}
	return c
}

func parseOutput(role string, m *output.Message, in interner) (Output, error) {
	o := Output{Role: role, Time: m.Time, Output: m.Output}
	for _, h := range m.Headers {
		switch h.Key {
		case HeaderID:
			o.ID = string(h.Value)
		case HeaderProducedAt:
			if ms, err := strconv.ParseInt(string(h.Value), 10, 64); err == nil {
				o.ProducedAt = time.UnixMilli(ms)
			}
		}
	}
	if m.Err != nil {
		return o, fmt.Errorf("report: %s partition %d offset %d (loadgen id %q): %w", m.Topic, m.Partition, m.Offset, o.ID, m.Err)
	}
	o.Decision, o.Segment, o.Cap, o.Reason, o.Arbitration = in.get(o.Decision), in.get(o.Segment), in.get(o.Cap), in.get(o.Reason), in.get(o.Arbitration)
	return o, nil
}
