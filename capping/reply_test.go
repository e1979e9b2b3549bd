package capping

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// These tests need no Redis: they check how a Request becomes the script's
// arguments and how the script's reply becomes a Decision.

var now = time.UnixMilli(1_763_800_000_000)

func TestScriptArgs(t *testing.T) {
	day := time.Date(2026, 11, 22, 0, 0, 0, 0, time.UTC)
	r := Request{UserID: 7, JobID: "j1", Channel: "push", Campaign: "c9", Tags: []string{"promotional"}, Caps: []Cap{
		{Name: "daily", Window: 24 * time.Hour, Limit: 3},
		{Name: "promo-push-today", Since: day, Until: day.AddDate(0, 0, 1), Limit: 1,
			Scope: NewScope([]string{"push", "sms"}, []string{"promotional"}).Campaign("c9"), Shadow: true},
	}, Retention: 48 * time.Hour}
	member := Member(r.JobID, r.Channel, r.Campaign, r.Tags)
	a := &newArgs([]Request{r}, now, 0)[0]
	args := call(&r, a, true, 64)[argsStart:]
	ms := int64(time.Hour / time.Millisecond)
	want := []any{now.UnixMilli(), member, 1, 48 * ms, 64, int64(0), 0, 0,
		now.UnixMilli() - 24*ms + 1, 3, 24 * ms, "",
		day.UnixMilli(), 1, -day.AddDate(0, 0, 1).UnixMilli(),
		"\x01\x02" + digest2("push") + digest2("sms") + "\x01" + digest2("promotional") + digest4("c9")}
	if len(args) != len(want) {
		t.Fatalf("%d args, want %d: %v", len(args), len(want), args)
	}
	for i := range want {
		if args[i] != want[i] {
			t.Errorf("ARGV[%d] = %#v, want %#v", i+1, args[i], want[i])
		}
	}
	arb := r
	arb.Arbitration, arb.Priority, arb.Caps = 2*time.Minute, 7, []Cap{{Name: "daily", Window: 24 * time.Hour, Limit: 3, Arbitrated: true}}
	if got := call(&arb, &newArgs([]Request{arb}, now, 0)[0], true, 0); got[2] != 2 || got[3] != "fc:{7}" || got[4] != "fc:{7}:arb" ||
		got[10] != int64(120000) || got[11] != 7 || got[16] != "\x02\x00\x00" {
		t.Errorf("arbitrated request: %q, want 2 keys (the log, its candidates), ARGV[6] 120000, ARGV[7] 7, the cap's flags 2", got)
	}
	if got := call(&r, a, false, 0)[argsStart+2]; got != 0 {
		t.Errorf("look-only ARGV[3] = %v, want 0", got)
	}
	marked := arb
	marked.Preferences, marked.Refused, marked.Caps = true, "budget", nil
	if got := call(&marked, &newArgs([]Request{marked}, now, 0)[0], true, 0); got[2] != 3 || got[5] != "fc:{7}:prefs" ||
		got[argsStart+2+2] != 3 || got[argsStart+2+7] != 1 || got[len(got)-1] != "budget" {
		t.Errorf("refused request with preferences: %q, want 3 keys (log, candidates, preferences), ARGV[3] 3, ARGV[8] 1, ARGV[9] the refusal", got)
	}
	r.Retention = 0
	if got := call(&r, &newArgs([]Request{r}, now, 0)[0], true, 0)[argsStart+3]; got != 24*ms {
		t.Errorf("retention without Request.Retention = %v, want the longest window (24h)", got)
	}
}

// call is scriptCmd's call of r for user 7, with the values it points at
// (what go-redis writes) in their place.
func call(r *Request, a *reqArgs, record bool, maxLog int) []any {
	a.key = "fc:{7}"
	n := scriptLen(r)
	args := scriptCmd(make([]any, n), false, r, a, record, maxLog)
	if len(args) != n {
		panic(fmt.Sprintf("scriptCmd made %d values, scriptLen says %d", len(args), n))
	}
	for i, v := range args {
		switch p := v.(type) {
		case *int64:
			args[i] = *p
		case *int:
			args[i] = *p
		case *string:
			args[i] = *p
		}
	}
	return args
}

func TestMemberAndScopes(t *testing.T) {
	m := Member("j1", "push", "c9", []string{"promotional", "newsletter"})
	if len(m) != 14+2*2 {
		t.Fatalf("member of %d bytes, want 18: 8 job + 2 channel + 4 campaign + 2 per tag", len(m))
	}
	if Member("j1", "push", "c9", []string{"promotional", "newsletter"}) != m {
		t.Fatal("the same send gives another member: a redelivery would not be recognised")
	}
	for _, tt := range []struct {
		name  string
		scope Scope
		want  bool
	}{
		{"any send", Scope{}, true},
		{"its channel among others", NewScope([]string{"email", "push"}, nil), true},
		{"another channel", NewScope([]string{"email"}, nil), false},
		{"one of its tags", NewScope(nil, []string{"newsletter"}), true},
		{"another tag", NewScope(nil, []string{"transactional"}), false},
		{"channel and tag", NewScope([]string{"push"}, []string{"promotional"}), true},
		{"channel but not tag", NewScope([]string{"push"}, []string{"alerts"}), false},
		{"its campaign", Scope{}.Campaign("c9"), true},
		{"another campaign", Scope{}.Campaign("c10"), false},
		{"an old-format entry", NewScope([]string{"push"}, nil), false},
	} {
		member := m
		if tt.name == "an old-format entry" {
			member = m[:8] + "push" // before scopes: digest + raw channel
		}
		if got := tt.scope.Matches(member); got != tt.want {
			t.Errorf("%s: matches = %v, want %v", tt.name, got, tt.want)
		}
	}
}

func TestParseReply(t *testing.T) {
	caps := []Cap{{Name: "daily", Window: time.Hour, Limit: 1}, {Window: time.Hour, Limit: 2}}
	member := Member("j", "email", "c", nil)
	tests := []struct {
		name  string
		reply any
		want  Decision
		err   string
	}{
		{"allowed", []any{int64(1), int64(0), int64(0), int64(0), int64(1)}, Decision{Allowed: true, Counts: []int{0, 1}}, ""},
		{"allowed, recorded later", []any{int64(1), int64(0), int64(1_795_000_000_200), int64(0), int64(1)}, Decision{Allowed: true, Counts: []int{0, 1}, Recorded: time.UnixMilli(1_795_000_000_200)}, ""},
		{"duplicate", []any{int64(2), int64(0), int64(1_795_000_000_123), int64(1), int64(1)}, Decision{Allowed: true, Duplicate: true, Counts: []int{1, 1}, Recorded: time.UnixMilli(1_795_000_000_123)}, ""},
		{"capped by a named cap", []any{int64(0), int64(1), now.UnixMilli() + 5000, int64(1), int64(1)},
			Decision{Cap: "daily", RetryAt: now.Add(5 * time.Second), Counts: []int{1, 1}}, ""},
		{"capped by an unnamed cap, for good", []any{int64(0), int64(2), int64(0), int64(0), int64(2)},
			Decision{Cap: "cap1", Counts: []int{0, 2}}, ""},
		{"allowed, with the log for the cache", []any{int64(1), int64(0), int64(0), int64(0), int64(1), member, now.UnixMilli()}, Decision{Allowed: true, Counts: []int{0, 1}}, ""},
		{"not an array", "OK", Decision{}, "want an array of 5 integers"},
		{"too short", []any{int64(1), int64(0), int64(0)}, Decision{}, "want an array of 5 integers"},
		{"a log of odd length", []any{int64(1), int64(0), int64(0), int64(0), int64(1), member}, Decision{}, "want an array of 5 integers"},
		{"not an integer", []any{int64(1), "x", int64(0), int64(0), int64(0)}, Decision{}, "element 1 is string"},
		{"cap index out of range", []any{int64(0), int64(3), int64(0), int64(0), int64(0)}, Decision{}, "cap index 3 out of range"},
		{"cap index zero when capped", []any{int64(0), int64(0), int64(0), int64(0), int64(0)}, Decision{}, "cap index 0 out of range"},
		{"unknown status", []any{int64(7), int64(0), int64(0), int64(0), int64(0)}, Decision{}, "status 7"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, _, err := parseReply(tt.reply, caps, member, now, nil)
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
				!got.RetryAt.Equal(tt.want.RetryAt) || !got.Recorded.Equal(tt.want.Recorded) || !got.At.Equal(now) || len(got.Counts) != len(tt.want.Counts) {
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

func TestShadowCapsAreReported(t *testing.T) {
	caps := []Cap{
		{Name: "daily", Window: time.Hour, Limit: 5},
		{Name: "new-daily", Window: time.Hour, Limit: 2, Shadow: true},
		{Name: "push-shadow", Window: time.Hour, Limit: 1, Shadow: true, Scope: NewScope([]string{"push"}, nil)},
	}
	// Allowed with 2 sends counted by both shadow caps: new-daily would have
	// capped; push-shadow does not apply to an email send.
	d, _, err := parseReply([]any{int64(1), int64(0), int64(0), int64(2), int64(2), int64(3)}, caps, Member("j", "email", "c", nil), now, make([]int, len(caps)))
	if err != nil {
		t.Fatal(err)
	}
	if !d.Allowed || len(d.Shadow) != 1 || d.Shadow[0] != "new-daily" {
		t.Fatalf("decision %+v, want allowed with shadow [new-daily]", d)
	}
}

type errString string

func (e errString) Error() string { return string(e) }
