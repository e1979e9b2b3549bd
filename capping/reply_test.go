package capping

import (
	"encoding/binary"
	"fmt"
	"slices"
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
	a := &newArgs([]Request{r}, now, 0, nil, nil)[0]
	c := callOf(&r, a, true, 64)
	ms := int64(time.Hour / time.Millisecond)
	want := packedCall{now: now.UnixMilli(), mode: 1, retention: 48 * ms, maxLog: 64, caps: []unpackedCap{
		{now.UnixMilli() - 24*ms + 1, 3, 24 * ms, 0, "", "", ""},
		{day.UnixMilli(), 1, -day.AddDate(0, 0, 1).UnixMilli(), 1, digest2("push") + digest2("sms"), digest2("promotional"), digest4("c9")}}}
	if len(c.args) != 8 || c.args[2] != 1 || c.args[3] != "fc:{7}" || c.args[5] != member || c.args[6] != "" || c.args[7] != "fc:{7}" || !c.packed.equal(want) {
		t.Errorf("call %q packed %+v, want the log declared, then %+v, the member, no refusal and the log", c.args, c.packed, want)
	}
	arb := r
	arb.Arbitration, arb.Priority, arb.Caps = 2*time.Minute, 7, []Cap{{Name: "daily", Window: 24 * time.Hour, Limit: 3, Arbitrated: true}}
	if c := callOf(&arb, &newArgs([]Request{arb}, now, 0, nil, nil)[0], true, 0); len(c.args) != 9 || c.args[7] != "fc:{7}" || c.args[8] != "fc:{7}:arb" ||
		c.packed.window != 120000 || c.packed.priority != 7 || len(c.packed.caps) != 1 || c.packed.caps[0].flags != 2 {
		t.Errorf("arbitrated request: %q %+v, want 2 keys last (the log, its candidates), window 120000, priority 7, the cap's flags 2", c.args, c.packed)
	}
	if c := callOf(&r, a, false, 0); c.packed.mode != 0 {
		t.Errorf("look-only mode %d, want 0", c.packed.mode)
	}
	// A send a whole copy allowed: mode 4, the copy where a refusal's name goes.
	if v, err := CopyCall([]string{"fc:{7}"}, []Request{r}, []string{"the log"}, now); err != nil || len(v) != 8 || v[6] != "the log" {
		t.Errorf("CopyCall: %q, %v, want the copy as the request's third value", v, err)
	} else if p, err := unpack(v[4].(string)); err != nil || p.mode != 4 {
		t.Errorf("CopyCall's packed values %+v, %v, want mode 4", p, err)
	}
	marked := arb
	marked.Preferences, marked.Refused, marked.Caps = true, "budget", nil
	if c := callOf(&marked, &newArgs([]Request{marked}, now, 0, nil, nil)[0], true, 0); len(c.args) != 10 || c.args[9] != "fc:{7}:prefs" ||
		c.packed.mode != 3 || c.packed.prefs != 1 || len(c.packed.caps) != 0 || c.args[6] != "budget" {
		t.Errorf("refused request with preferences: %q %+v, want 3 keys last (log, candidates, preferences), mode 3, prefs 1, the refusal after the member", c.args, c.packed)
	}
	r.Retention = 0
	if c := callOf(&r, &newArgs([]Request{r}, now, 0, nil, nil)[0], true, 0); c.packed.retention != 24*ms {
		t.Errorf("retention without Request.Retention = %v, want the longest window (24h)", c.packed.retention)
	}
	// Decide sends only the caps that apply: an email leaves out a push cap, and keeps its window in the
	// retention.
	email := Request{UserID: 7, JobID: "j2", Channel: "email", Campaign: "c9", Caps: []Cap{
		{Name: "push-weekly", Window: 7 * 24 * time.Hour, Limit: 1, Scope: NewScope([]string{"push"}, nil)},
		{Window: 24 * time.Hour, Limit: 3}}}
	var slab []Cap
	ea := &newArgs([]Request{email}, now, 0, &slab, nil)[0]
	if c := callOf(&email, ea, true, 0); len(c.packed.caps) != 1 || c.packed.caps[0].limit != 3 || c.packed.retention != 7*24*ms ||
		ea.caps[0].Name != "cap1" || !slices.Equal(ea.orig, []int{1}) || c.packed.caps[0].flags != 4 {
		t.Errorf("an email with a push cap and an unnamed one: %+v, caps %v, want the unnamed cap alone (named cap1, flagged as applying) and a week's retention", c.packed, ea.caps)
	} // Several requests in one call: every key first, in order, then three values per request.
	two := []Request{arb, marked}
	ta := newArgs(two, now, 0, nil, nil)
	ta[0].key, ta[1].key = "fc:{7}", "fc:{8}"
	for i := range two {
		pack(make([]byte, 0, packedLen(&ta[i])), &two[i], &ta[i], true, 0, "")
	}
	got := callArgs(false, two, ta, []int{0, 1})
	str := func(v any) string { return *v.(*string) }
	if len(got) != 4+5+6 || got[2] != 1 || str(got[3]) != "fc:{7}" {
		t.Fatalf("two requests: %d values, %v keys declared, want 15 and the first's log declared alone", len(got), got[2])
	}
	want2 := []string{ta[0].packed, ta[0].member, "", "fc:{7}", "fc:{7}:arb", ta[1].packed, ta[1].member, "budget", "fc:{8}", "fc:{8}:arb", "fc:{8}:prefs"}
	for i, w := range want2 {
		if str(got[4+i]) != w {
			t.Errorf("two requests, value %d: %q, want %q (packed values, member, refusal and keys of each in order)", i+1, str(got[4+i]), w)
		}
	}
}

// scriptCall is a call callArgs made: its values, with what they point at in
// their place (what go-redis writes), and its packed values read back.
type scriptCall struct {
	args   []any
	packed packedCall
}

// callOf is the call of r alone for user 7.
func callOf(r *Request, a *reqArgs, record bool, maxLog int) scriptCall {
	a.key = "fc:{7}"
	pack(make([]byte, 0, packedLen(a)), r, a, record, maxLog, "")
	args := callArgs(false, []Request{*r}, []reqArgs{*a}, []int{0})
	if len(args) != 4+3+keyCount(r) {
		panic(fmt.Sprintf("callArgs made %d values, want %d", len(args), 4+3+keyCount(r)))
	}
	for i, v := range args {
		if p, ok := v.(*string); ok {
			args[i] = *p
		}
	}
	if len(a.packed) != packedLen(a) {
		panic(fmt.Sprintf("pack made %d bytes, packedLen says %d", len(a.packed), packedLen(a)))
	}
	p, err := unpack(a.packed)
	if err != nil {
		panic(fmt.Sprintf("packed values %q: %v", a.packed, err))
	}
	return scriptCall{args, p}
}

// packedCall and unpackedCap are decide.lua's ARGV[2] read back as its header
// documents it.
type packedCall struct {
	now, retention, window int64
	mode, priority, prefs  byte
	maxLog                 int
	caps                   []unpackedCap
}

type unpackedCap struct {
	since, limit, reset      int64
	flags                    byte
	channels, tags, campaign string
}

func (p packedCall) equal(q packedCall) bool {
	return p.now == q.now && p.retention == q.retention && p.window == q.window && p.mode == q.mode &&
		p.priority == q.priority && p.prefs == q.prefs && p.maxLog == q.maxLog && slices.Equal(p.caps, q.caps)
}

// unpack reads ARGV[2] by the script's header (its own reading, not pack's code).
func unpack(s string) (packedCall, error) {
	b := []byte(s)
	i64 := func() int64 { v := int64(binary.BigEndian.Uint64(b)); b = b[8:]; return v }
	if len(b) < 29 {
		return packedCall{}, fmt.Errorf("%d bytes, want 29 at least", len(b))
	}
	var p packedCall
	p.now = i64()
	p.mode, b = b[0], b[1:]
	p.retention = i64()
	p.maxLog, b = int(binary.BigEndian.Uint16(b)), b[2:]
	p.window = i64()
	p.priority, p.prefs, b = b[0], b[1], b[2:]
	// str reads a string after its length of size bytes.
	str := func(size int) (string, error) {
		if len(b) < size {
			return "", fmt.Errorf("a length cut at %d bytes", len(b))
		}
		n := int(b[0])
		if size == 2 {
			n = int(binary.BigEndian.Uint16(b))
		}
		if len(b) < size+n {
			return "", fmt.Errorf("a string of %d bytes in %d", n, len(b)-size)
		}
		v := string(b[size : size+n])
		b = b[size+n:]
		return v, nil
	}
	for len(b) > 0 {
		if len(b) < 21 {
			return p, fmt.Errorf("a cap of %d bytes", len(b))
		}
		var c unpackedCap
		var err error
		c.since = i64()
		c.limit, b = int64(int32(binary.BigEndian.Uint32(b))), b[4:]
		c.reset = i64()
		c.flags, b = b[0], b[1:]
		if c.channels, err = str(2); err == nil {
			if c.tags, err = str(2); err == nil {
				c.campaign, err = str(1)
			}
		}
		if err != nil {
			return p, fmt.Errorf("cap %d: %w", len(p.caps)+1, err)
		}
		p.caps = append(p.caps, c)
	}
	return p, nil
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
	log := logEntry(Member("a", "email", "c", nil), now.UnixMilli()-10) + logEntry(member, now.UnixMilli())
	tests := []struct {
		name  string
		reply any
		want  Decision
		tail  string
		err   string
		whole string
	}{
		{"allowed", reply(1, 0, 0, 0, 1), Decision{Allowed: true, Counts: []int{0, 1}}, "", "", ""},
		{"allowed, recorded later", reply(1, 0, 1_795_000_000_200, 0, 1), Decision{Allowed: true, Counts: []int{0, 1}, Recorded: time.UnixMilli(1_795_000_000_200)}, "", "", ""},
		{"duplicate", reply(2, 0, 1_795_000_000_123, 1, 1), Decision{Allowed: true, Duplicate: true, Counts: []int{1, 1}, Recorded: time.UnixMilli(1_795_000_000_123)}, "", "", ""},
		{"capped by a named cap", reply(0, 1, now.UnixMilli()+5000, 1, 1),
			Decision{Cap: "daily", RetryAt: now.Add(5 * time.Second), Counts: []int{1, 1}}, "", "", ""},
		{"capped by an unnamed cap, for good", reply(0, 2, 0, 0, 2),
			Decision{Cap: "cap1", Counts: []int{0, 2}}, "", "", ""},
		{"allowed, with the log for the cache", reply(1, 0, 0, 0, 1) + log, Decision{Allowed: true, Counts: []int{0, 1}}, log, "", ""},
		{"capped by a preference", reply(4, 0, now.UnixMilli()+5000, 1, 1) + "c:push", Decision{Cap: PreferenceCap("c:push"), RetryAt: now.Add(5 * time.Second), Counts: []int{1, 1}}, "", "", ""},
		{"refused before", reply(5, 0, 0, 0, 0) + "budget", Decision{Cap: "budget", Counts: []int{0, 0}}, "", "", ""},
		{"not a string", []any{int64(1), int64(0), int64(0), int64(0), int64(1)}, Decision{}, "", "want a string of 19 bytes or more", ""},
		{"too short", reply(1, 0, 0, 0), Decision{}, "", "want a string of 19 bytes or more", ""},
		{"a truncated log", reply(1, 0, 0, 0, 1) + log[:len(log)-1], Decision{}, "", "not packed entries", ""},
		{"a log shorter than an entry's head", reply(1, 0, 0, 0, 1) + log[:9], Decision{}, "", "not packed entries", ""},
		{"a preference not named", reply(4, 0, 0, 0, 0), Decision{}, "", "no preference or refusal named", ""},
		{"cap index out of range", reply(0, 3, 0, 0, 0), Decision{}, "", "cap index 3 out of range", ""},
		{"cap index zero when capped", reply(0, 0, 0, 0, 0), Decision{}, "", "cap index 0 out of range", ""},
		{"unknown status", reply(7, 0, 0, 0, 0), Decision{}, "", "status 7", ""},
		{"allowed, with the log whole", reply(129, 0, 0, 0, 1) + "HEADER.." + log, Decision{Allowed: true, Counts: []int{0, 1}}, log, "", "HEADER.." + log},
		{"capped, with the log whole", reply(128, 1, now.UnixMilli()+5000, 1, 1) + "HEADER.." + log,
			Decision{Cap: "daily", RetryAt: now.Add(5 * time.Second), Counts: []int{1, 1}}, log, "", "HEADER.." + log},
		{"allowed, no log whole (none)", reply(129, 0, 0, 0, 1), Decision{Allowed: true, Counts: []int{0, 1}}, "", "", ""},
		{"the log whole without a header", reply(129, 0, 0, 0, 1) + "HEAD", Decision{}, "", "not a header and packed entries", ""},
		{"the log whole, truncated", reply(129, 0, 0, 0, 1) + "HEADER.." + log[:len(log)-1], Decision{}, "", "not a header and packed entries", ""},
		{"a preference with the whole flag", reply(132, 0, 0, 0, 0) + "c:push", Decision{}, "", "not a header and packed entries", ""},
		{"allowed, the log whole in pieces", []any{reply(129, 0, 0, 0, 1), "HEADER..", log[:5], log[5:]},
			Decision{Allowed: true, Counts: []int{0, 1}}, log, "", "HEADER.." + log},
		{"capped, the log whole in one piece", []any{reply(128, 1, now.UnixMilli()+5000, 1, 1), "HEADER.." + log},
			Decision{Cap: "daily", RetryAt: now.Add(5 * time.Second), Counts: []int{1, 1}}, log, "", "HEADER.." + log},
		{"the log whole in pieces, none", []any{reply(129, 0, 0, 0, 1), ""}, Decision{Allowed: true, Counts: []int{0, 1}}, "", "", ""},
		{"the log's pieces truncated", []any{reply(129, 0, 0, 0, 1), "HEADER..", log[:len(log)-1]}, Decision{}, "", "not a header and packed entries", ""},
		{"pieces without the whole flag", []any{reply(1, 0, 0, 0, 1), log}, Decision{}, "", "not of a whole log", ""},
		{"pieces after a log", []any{reply(129, 0, 0, 0, 1) + "HEADER..", log}, Decision{}, "", "not of a whole log", ""},
		{"a piece not a string", []any{reply(129, 0, 0, 0, 1), "HEADER..", int64(3)}, Decision{}, "", "pieces are not strings", ""},
		{"an empty array", []any{}, Decision{}, "", "want a string of 19 bytes or more", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, tail, whole, err := parseReply(tt.reply, caps, member, now, nil, nil)
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
			if tail != tt.tail || whole != tt.whole {
				t.Fatalf("log %q (whole %q), want %q (%q)", tail, whole, tt.tail, tt.whole)
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
	d, _, _, err := parseReply(reply(1, 0, 0, 2, 2, 3), caps, Member("j", "email", "c", nil), now, make([]int, len(caps)), nil)
	if err != nil {
		t.Fatal(err)
	}
	if !d.Allowed || len(d.Shadow) != 1 || d.Shadow[0] != "new-daily" {
		t.Fatalf("decision %+v, want allowed with shadow [new-daily]", d)
	}
}

// reply packs a script reply as decide.lua does: status, cap, retry_at, then
// the counts.
func reply(status byte, hit uint16, retryAt int64, counts ...uint32) string {
	b := binary.BigEndian.AppendUint16([]byte{status}, hit)
	b = binary.BigEndian.AppendUint64(b, uint64(retryAt))
	for _, c := range counts {
		b = binary.BigEndian.AppendUint32(b, c)
	}
	return string(b)
}

type errString string

func (e errString) Error() string { return string(e) }
