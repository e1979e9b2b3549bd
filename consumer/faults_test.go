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
	f := &ReaderFaults{What: "topic sends, group capper", Logger: slog.New(slog.NewTextHandler(&logs, nil)), Now: func() time.Time { return now }}
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
