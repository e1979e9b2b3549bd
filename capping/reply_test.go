package capping

import (
	"strings"
	"testing"
	"time"
)

// These tests need no Redis: they check how a Request becomes the script's
// arguments and how the script's reply becomes a Decision.

var now = time.UnixMilli(1_763_800_000_000)

func TestScriptArgs(t *testing.T) {
	r := Request{UserID: 7, JobID: "j1", Channel: "push", Caps: []Cap{
		{Name: "daily", Window: 24 * time.Hour, Limit: 3},
		{Name: "push-weekly", Window: 7 * 24 * time.Hour, Limit: 5, Channel: "push"},
	}}
	args := scriptArgs(&r, now, true)
	want := []any{now.UnixMilli(), Member("j1", "push"), "push", 1, int64(7 * 24 * 3600 * 1000),
		int64(24 * 3600 * 1000), 3, "", int64(7 * 24 * 3600 * 1000), 5, "push"}
	if len(args) != len(want) {
		t.Fatalf("%d args, want %d: %v", len(args), len(want), args)
	}
	for i := range want {
		if args[i] != want[i] {
			t.Errorf("ARGV[%d] = %#v, want %#v", i+1, args[i], want[i])
		}
	}
	if got := scriptArgs(&r, now, false)[3]; got != 0 {
		t.Errorf("look-only ARGV[4] = %v, want 0", got)
	}
	if m := Member("j1", "push"); len(m) != 8+len("push") || !strings.HasSuffix(m, "push") {
		t.Errorf("member %q: want an 8-byte digest followed by the channel", m)
	}
}

func TestParseReply(t *testing.T) {
	caps := []Cap{{Name: "daily", Window: time.Hour, Limit: 1}, {Window: time.Hour, Limit: 2}}
	tests := []struct {
		name  string
		reply any
		want  Decision
		err   string
	}{
		{"allowed", []any{int64(1), int64(0), int64(0), int64(0), int64(1)}, Decision{Allowed: true, Counts: []int{0, 1}}, ""},
		{"duplicate", []any{int64(2), int64(0), int64(0), int64(1), int64(1)}, Decision{Allowed: true, Duplicate: true, Counts: []int{1, 1}}, ""},
		{"capped by a named cap", []any{int64(0), int64(1), now.UnixMilli() + 5000, int64(1), int64(1)},
			Decision{Cap: "daily", RetryAt: now.Add(5 * time.Second), Counts: []int{1, 1}}, ""},
		{"capped by an unnamed cap, for good", []any{int64(0), int64(2), int64(0), int64(0), int64(2)},
			Decision{Cap: "cap1", Counts: []int{0, 2}}, ""},
		{"not an array", "OK", Decision{}, "want an array of 5 integers"},
		{"too short", []any{int64(1), int64(0), int64(0)}, Decision{}, "want an array of 5 integers"},
		{"not an integer", []any{int64(1), "x", int64(0), int64(0), int64(0)}, Decision{}, "element 1 is string"},
		{"cap index out of range", []any{int64(0), int64(3), int64(0), int64(0), int64(0)}, Decision{}, "cap index 3 out of range"},
		{"cap index zero when capped", []any{int64(0), int64(0), int64(0), int64(0), int64(0)}, Decision{}, "cap index 0 out of range"},
		{"unknown status", []any{int64(7), int64(0), int64(0), int64(0), int64(0)}, Decision{}, "status 7"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseReply(tt.reply, caps, now)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("err = %v, want one containing %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.Allowed != tt.want.Allowed || got.Duplicate != tt.want.Duplicate || got.Cap != tt.want.Cap ||
				!got.RetryAt.Equal(tt.want.RetryAt) || !got.At.Equal(now) || len(got.Counts) != len(tt.want.Counts) {
				t.Fatalf("got %+v, want %+v", got, tt.want)
			}
			for i := range got.Counts {
				if got.Counts[i] != tt.want.Counts[i] {
					t.Fatalf("counts %v, want %v", got.Counts, tt.want.Counts)
				}
			}
		})
	}
}

func TestTopologyChanged(t *testing.T) {
	for _, tt := range []struct {
		err  error
		want bool
	}{
		{errString("dial tcp 127.0.0.1:7000: connect: connection refused"), true},
		{ErrNotReplicated, false},
	} {
		if got := topologyChanged(tt.err); got != tt.want {
			t.Errorf("topologyChanged(%v) = %v, want %v", tt.err, got, tt.want)
		}
	}
}

type errString string

func (e errString) Error() string { return string(e) }
