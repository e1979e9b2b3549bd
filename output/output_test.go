package output_test

import (
	"strings"
	"testing"
	"time"

	"github.com/segmentio/kafka-go"

	"github.com/capper-dev/capper/output"
)

func headers(kv ...string) []kafka.Header {
	var hs []kafka.Header
	for i := 0; i < len(kv); i += 2 {
		hs = append(hs, kafka.Header{Key: kv[i], Value: []byte(kv[i+1])})
	}
	return hs
}

func TestParse(t *testing.T) {
	at := time.Date(2026, 11, 27, 9, 0, 0, 123e6, time.UTC)
	tests := []struct {
		name    string
		hs      []kafka.Header
		want    output.Output
		wantErr string
	}{
		{"allowed, with shadow caps and another service's header",
			headers("trace-id", "x", output.HeaderDecision, "allowed", output.HeaderSegment, "new",
				output.HeaderShadow, "today,promo", output.HeaderDecidedAt, output.FormatTime(at), output.HeaderPriority, "3"),
			output.Output{Decision: "allowed", Segment: "new", Shadow: []string{"today", "promo"}, DecidedAt: at, Priority: 3}, ""},
		{"capped for good: retry-at present and empty",
			headers(output.HeaderDecision, "capped", output.HeaderCap, "daily", output.HeaderRetryAt, "", output.HeaderReason, "never",
				output.HeaderReservedFor, "7"),
			output.Output{Decision: "capped", Cap: "daily", Reason: "never", ReservedFor: 7}, ""},
		{"collapsed by a newer send of its key",
			headers(output.HeaderDecision, "capped", output.HeaderCap, "collapsed", output.HeaderReason, "collapsed",
				output.HeaderCollapseKey, "price/c1/product:42", output.HeaderCollapsedBy, "job-9"),
			output.Output{Decision: "capped", Cap: "collapsed", Reason: "collapsed", CollapseKey: "price/c1/product:42", CollapsedBy: "job-9"}, ""},
		{"released after a hold",
			headers(output.HeaderDecision, "allowed", output.HeaderHoldCount, "2", output.HeaderHeldSince, output.FormatTime(at),
				output.HeaderDueAt, output.FormatTime(at.Add(time.Hour)), output.HeaderHeldFor, "3600.050"),
			output.Output{Decision: "allowed", HoldCount: 2, HeldSince: at, DueAt: at.Add(time.Hour), HeldFor: 3600.05}, ""},
		{"not capper's", headers("trace-id", "x"), output.Output{}, "no capper-decision header"},
		{"a bad time", headers(output.HeaderDecision, "capped", output.HeaderRetryAt, "tomorrow"), output.Output{}, "header capper-retry-at"},
		{"a bad count", headers(output.HeaderDecision, "held", output.HeaderHoldCount, "two"), output.Output{}, "header capper-hold-count"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := output.Parse(tt.hs)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want one with %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.Decision != tt.want.Decision || got.Segment != tt.want.Segment || got.Cap != tt.want.Cap ||
				got.Reason != tt.want.Reason || !got.RetryAt.Equal(tt.want.RetryAt) || !got.DecidedAt.Equal(tt.want.DecidedAt) ||
				got.HoldCount != tt.want.HoldCount || !got.HeldSince.Equal(tt.want.HeldSince) || !got.DueAt.Equal(tt.want.DueAt) ||
				got.HeldFor != tt.want.HeldFor || got.Priority != tt.want.Priority || got.ReservedFor != tt.want.ReservedFor ||
				strings.Join(got.Shadow, ",") != strings.Join(tt.want.Shadow, ",") ||
				got.CollapseKey != tt.want.CollapseKey || got.CollapsedBy != tt.want.CollapsedBy {
				t.Errorf("got %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

// TestHoldHeaders: the hold headers are the five a delay tier's message
// carries, and no other header of capper's is one.
func TestHoldHeaders(t *testing.T) {
	for _, k := range []string{output.HeaderHoldCount, output.HeaderHeldSince, output.HeaderDueAt, output.HeaderWakeAt, output.HeaderHoldReason} {
		if !output.IsHoldHeader(k) {
			t.Errorf("%s is not a hold header", k)
		}
	}
	for _, k := range []string{output.HeaderDecision, output.HeaderHeldFor, output.HeaderCap, "trace-id"} {
		if output.IsHoldHeader(k) {
			t.Errorf("%s is a hold header", k)
		}
	}
}
