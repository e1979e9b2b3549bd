package rules_test

import (
	"strings"
	"testing"
	"time"

	"github.com/capper-dev/capper/rules"
)

// TestPriorities: a job's own priority wins; else its campaign's, else the
// highest of its tags' (its category among them), else its category's, else 0.
func TestPriorities(t *testing.T) {
	r := compile(t, rules.Config{Priorities: []rules.Priority{
		{Campaign: "cart", Priority: 9}, {Tag: "promotional", Priority: 2}, {Tag: "news", Priority: 4},
		{Category: "marketing", Priority: 3},
	}})
	for _, c := range []struct {
		name     string
		job      rules.Job
		priority int
	}{
		{"its own", rules.Job{Campaign: "cart", Priority: 1, HasPriority: true}, 1},
		{"its own 0", rules.Job{Campaign: "cart", HasPriority: true}, 0},
		{"its campaign's", rules.Job{Campaign: "cart", Category: "marketing", Tags: []string{"marketing", "news"}}, 9},
		{"the highest of its tags'", rules.Job{Campaign: "c", Category: "marketing", Tags: []string{"marketing", "promotional", "news"}}, 4},
		{"its category's", rules.Job{Campaign: "c", Category: "marketing", Tags: []string{"marketing"}}, 3},
		{"none", rules.Job{Campaign: "c", Category: "alerts", Tags: []string{"alerts"}}, 0},
	} {
		j := c.job
		j.Channel = "email"
		if p := r.Plan(j, time.Now(), nil); p.Priority != c.priority {
			t.Errorf("%s: priority %d, want %d", c.name, p.Priority, c.priority)
		}
	}
	for _, bad := range []struct {
		ps   []rules.Priority
		want string
	}{
		{[]rules.Priority{{Campaign: "a", Tag: "b", Priority: 1}}, "exactly one"},
		{[]rules.Priority{{Priority: 1}}, "exactly one"},
		{[]rules.Priority{{Tag: "a", Priority: 101}}, "not in 0..100"},
		{[]rules.Priority{{Tag: "a", Priority: 1}, {Tag: "a", Priority: 2}}, "twice"},
	} {
		_, err := rules.Compile(rules.Config{DefaultCaps: []rules.Cap{{Name: "d", Window: rules.Duration(time.Hour), Limit: limit(1)}}, Priorities: bad.ps}, 1)
		if err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("priorities %+v: %v, want an error with %q", bad.ps, err, bad.want)
		}
	}
}

// TestReservedSlots: a send below a cap's reserve.min_priority sees its
// limit less the reserved slots; one at or above it sees the whole limit;
// shadow and calendar caps reserve alike; bad reserves are refused.
func TestReservedSlots(t *testing.T) {
	r := compile(t, rules.Config{DefaultCaps: []rules.Cap{
		{Name: "daily", Window: rules.Duration(24 * time.Hour), Limit: limit(3), Reserve: &rules.Reserve{Slots: 1, MinPriority: 7}},
		{Name: "today", Calendar: "day", Limit: limit(5), Reserve: &rules.Reserve{Slots: 2, MinPriority: 5}},
		{Name: "shadow", Window: rules.Duration(time.Hour), Limit: limit(2), Shadow: true, Reserve: &rules.Reserve{Slots: 2, MinPriority: 9}},
		{Name: "plain", Window: rules.Duration(time.Hour), Limit: limit(4)},
	}})
	limits := func(priority int) (out []int) {
		p := r.Plan(rules.Job{Channel: "email", Category: "marketing", Tags: []string{"marketing"}, Priority: priority, HasPriority: true}, time.Now(), nil)
		for _, c := range p.Caps {
			out = append(out, c.Limit, c.Reserved)
		}
		return out
	}
	for _, c := range []struct {
		priority int
		want     []int // limit, reserved of each cap
	}{
		{0, []int{2, 1, 3, 2, 0, 2, 4, 0}},
		{5, []int{2, 1, 5, 0, 0, 2, 4, 0}},
		{7, []int{3, 0, 5, 0, 0, 2, 4, 0}},
		{9, []int{3, 0, 5, 0, 2, 0, 4, 0}},
	} {
		if got := limits(c.priority); !equal(got, c.want) {
			t.Errorf("priority %d: limit, reserved %v, want %v", c.priority, got, c.want)
		}
	}
	p := r.Plan(rules.Job{Channel: "email", Category: "marketing", Tags: []string{"marketing"}}, time.Now(), nil)
	if slots, min := p.Reservation("today"); slots != 2 || min != 5 {
		t.Errorf("Reservation(today) = %d, %d, want 2, 5", slots, min)
	}
	for _, res := range []rules.Reserve{{Slots: 0, MinPriority: 5}, {Slots: 4, MinPriority: 5}, {Slots: 1, MinPriority: 0}, {Slots: 1, MinPriority: 101}} {
		_, err := rules.Compile(rules.Config{DefaultCaps: []rules.Cap{{Name: "d", Window: rules.Duration(time.Hour), Limit: limit(3), Reserve: &res}}}, 1)
		if err == nil || !strings.Contains(err.Error(), "reserve.") {
			t.Errorf("reserve %+v on a limit of 3: %v, want refused", res, err)
		}
	}
}

func equal(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
