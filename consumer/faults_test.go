package consumer

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"
)

func TestReaderFaults(t *testing.T) {
	now := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	var logs bytes.Buffer
	f := &ReaderFaults{What: "topic sends, group capper", Logger: slog.New(slog.NewTextHandler(&logs, nil)), Clock: func() time.Time { return now }}
	errorLines := func() int { return strings.Count(logs.String(), "level=ERROR") }

	if f.Report("fetch failed", errors.New("connection reset by peer")) || f.Failing() {
		t.Fatal("a transient error made the reader failing")
	}
	if !f.Report("fetch failed", fmt.Errorf("fetch: %w", kafka.TopicAuthorizationFailed)) || !f.Failing() {
		t.Fatal("a refused fetch did not make the reader failing")
	}
	// kafka-go only logs a refused join: the error among the log line's arguments counts.
	now = now.Add(5 * time.Second)
	var passed []string
	next := kafka.LoggerFunc(func(msg string, args ...any) { passed = append(passed, fmt.Sprintf(msg, args...)) })
	f.ErrorLogger(next)("Failed to join group %s: %v", "capper", kafka.GroupAuthorizationFailed)
	if len(passed) != 1 || !strings.Contains(passed[0], "Failed to join group capper") {
		t.Errorf("the line was not passed on: %q", passed)
	}
	if errorLines() != 1 {
		t.Errorf("%d error lines for one cause within %v, want 1:\n%s", errorLines(), FaultLogEvery, logs.String())
	}
	// It stays failing for FaultHold after the last refusal, then recovers by itself.
	now = now.Add(FaultHold - time.Millisecond)
	if !f.Failing() {
		t.Error("not failing within FaultHold of the last refusal")
	}
	now = now.Add(time.Millisecond)
	if f.Failing() {
		t.Error("still failing FaultHold after the last refusal")
	}
	// Logged again once FaultLogEvery has passed; a fetched message clears it at once.
	now = now.Add(FaultLogEvery)
	f.Report("commit failed", kafka.GroupAuthorizationFailed)
	if errorLines() != 2 || !strings.Contains(logs.String(), "during=\"commit failed\"") || !strings.Contains(logs.String(), "reader=\"topic sends, group capper\"") {
		t.Errorf("want a second error line naming the reader and the step:\n%s", logs.String())
	}
	f.Fetched()
	if f.Failing() {
		t.Error("still failing after a message was fetched")
	}
	var none *ReaderFaults
	if none.Report("fetch failed", kafka.TopicAuthorizationFailed) || none.Failing() {
		t.Error("a nil ReaderFaults reported something")
	}
}

// TestReaderStall: a reader with partitions (the group's answer) that has
// not fetched for the bound while they hold messages is stalled (not ready,
// one error line) until it fetches again; an idle reader with nothing
// waiting, one without partitions and a delay tier waiting for its head's due
// time are not. A new assignment starts the idle time again; when the group
// cannot be asked, the last assignment counts.
func TestReaderStall(t *testing.T) {
	now := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	var logs bytes.Buffer
	f := &ReaderFaults{What: "topic sends, group capper", Logger: slog.New(slog.NewJSONHandler(&logs, nil)), Clock: func() time.Time { return now }}
	const bound = 30 * time.Second
	waiting := int64(0)
	var assigned []int // the group's answer
	var groupErr error
	described := 0
	assignment := func() ([]int, error) { described++; return assigned, groupErr }
	var asked [][]int
	lag := func(parts []int) (int64, error) { asked = append(asked, parts); return waiting, nil }
	check := func(tier bool) {
		t.Helper()
		if err := f.CheckStall(bound, tier, assignment, lag); err != nil {
			t.Fatal(err)
		}
	}

	// Within the bound of the first look the group is not even asked.
	check(false)
	now = now.Add(bound - time.Millisecond)
	check(false)
	if described != 0 || len(asked) != 0 {
		t.Fatalf("within the bound: the group asked %d times, lag %v", described, asked)
	}
	// No partitions: never stalled, lag not asked.
	assigned = []int{}
	now = now.Add(time.Hour)
	check(false)
	if f.Failing() || len(asked) != 0 {
		t.Fatalf("a reader without partitions: failing %v, lag asked %v", f.Failing(), asked)
	}
	// A new assignment: the idle time starts again.
	assigned, waiting = []int{0, 3}, 7
	check(false)
	if f.Failing() || len(asked) != 0 {
		t.Fatalf("at a new assignment: failing %v, lag asked %v", f.Failing(), asked)
	}
	now = now.Add(bound - time.Millisecond)
	check(false)
	if f.Failing() || len(asked) != 0 {
		t.Fatalf("within the bound of its assignment: failing %v, lag asked %v", f.Failing(), asked)
	}
	// A delay tier waiting for its head's due time is not stalled.
	now = now.Add(time.Millisecond)
	check(true)
	if f.Failing() || len(asked) != 0 {
		t.Fatalf("a tier waiting for a due time: failing %v, lag asked %v", f.Failing(), asked)
	}
	// Idle for the bound, and messages seen waiting: not stalled yet (they
	// may have just arrived); still waiting a bound later: stalled, one
	// error line.
	check(false)
	if f.Failing() {
		t.Fatal("stalled the moment messages were first seen waiting on an idle reader")
	}
	now = now.Add(bound)
	check(false)
	if !f.Failing() {
		t.Fatal("7 messages waiting for the bound, and not failing")
	}
	if len(asked) != 2 || fmt.Sprint(asked[0]) != "[0 3]" {
		t.Errorf("lag asked for %v, want the assigned partitions [0 3] twice", asked)
	}
	if n := strings.Count(logs.String(), `"level":"ERROR"`); n != 1 || !strings.Contains(logs.String(), `"waiting":7`) ||
		!strings.Contains(logs.String(), `"reader":"topic sends, group capper"`) || !strings.Contains(logs.String(), `"idle":"1m0s"`) {
		t.Errorf("want one error line naming the reader, the 7 waiting and the 1m idle:\n%s", logs.String())
	}
	// A fetch ends it at once.
	f.Fetched()
	if f.Failing() {
		t.Error("still stalled after a fetch")
	}
	// Long idle (an hour with nothing to read), then messages arrive: the
	// reader fetches them within its wait; it is not stalled for having been
	// idle before they came, and is if it does not fetch them for the bound.
	waiting = 0
	now = now.Add(time.Hour)
	check(false)
	waiting = 24
	now = now.Add(time.Second)
	check(false)
	if f.Failing() {
		t.Fatal("a reader idle for an hour is stalled a second after 24 messages arrived")
	}
	f.Fetched()
	now = now.Add(bound + time.Second) // idle again, the next messages arrive
	check(false)
	now = now.Add(bound / 2)
	check(false)
	if f.Failing() {
		t.Fatal("stalled before messages had waited the bound")
	}
	now = now.Add(bound / 2)
	check(false)
	if !f.Failing() {
		t.Fatal("24 messages waited the bound unfetched, and not failing")
	}
	f.Fetched()
	// Idle again with nothing waiting: ready (an idle topic).
	waiting = 0
	now = now.Add(2 * bound)
	check(false)
	if f.Failing() {
		t.Error("stalled on partitions with nothing waiting")
	}
	// Idle for the bound, the group and the lag cannot be told (the broker
	// does not answer): the last assignment counts, stalled.
	groupErr = errors.New("broker away")
	asked = nil
	if err := f.CheckStall(bound, false, assignment, func(parts []int) (int64, error) {
		asked = append(asked, parts)
		return 0, errors.New("broker away")
	}); err == nil || !f.Failing() {
		t.Errorf("a failed lag query: err %v, failing %v; want the error and stalled", err, f.Failing())
	}
	if fmt.Sprint(asked) != "[[0 3]]" {
		t.Errorf("lag asked for %v while the group did not answer, want the last assignment [0 3]", asked)
	}
	if !strings.Contains(logs.String(), `"waiting":"unknown: broker away"`) {
		t.Errorf("the second stall's line does not say the lag is unknown:\n%s", logs.String())
	}
	// A new assignment with no partitions (a replica beyond the partition count) is never stalled.
	f.Fetched()
	groupErr, assigned = nil, []int{}
	now = now.Add(2 * bound)
	check(false)
	now = now.Add(2 * bound)
	check(false)
	if f.Failing() {
		t.Error("a reader assigned no partitions is stalled")
	}
	// A reader whose group never answered cannot tell its partitions: stalled, the error said.
	g := &ReaderFaults{What: "topic sends, group other", Logger: slog.New(slog.NewJSONHandler(&logs, nil)), Clock: func() time.Time { return now }}
	g.CheckStall(bound, false, assignment, lag)
	now = now.Add(bound)
	groupErr = errors.New("coordinator away")
	if err := g.CheckStall(bound, false, assignment, lag); err == nil || !g.Failing() || !strings.Contains(logs.String(), "its assignment: coordinator away") {
		t.Errorf("no assignment ever read and the group away: err %v, failing %v\n%s", err, g.Failing(), logs.String())
	}
	var none *ReaderFaults
	if none.CheckStall(bound, false, assignment, lag) != nil || none.Failing() {
		t.Error("a nil ReaderFaults stalled")
	}
}
