package capping

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"
)

// A Preference is one of a user's own wishes, kept in the user's slot beside
// the log and read by the decision script (Request.Preferences):
//   - a limit: at most Limit sends of a channel (or of sends with a tag) in
//     any Window; with OptOut, none at all;
//   - an exemption: until VIPUntil, the rules' caps do not apply to the user
//     (its own limits and opt-outs still do).
//
// Exactly one of Channel, Tag and VIPUntil is set.
type Preference struct {
	Channel, Tag string
	Limit        int           // with Channel or Tag: >= 1, unless OptOut
	Window       time.Duration // with a Limit: whole milliseconds
	OptOut       bool
	VIPUntil     time.Time
}

// field is the preference's hash field: "c:<channel>", "t:<tag>" or "vip".
func (p Preference) field() string {
	switch {
	case p.Channel != "":
		return "c:" + p.Channel
	case p.Tag != "":
		return "t:" + p.Tag
	}
	return "vip"
}

// String names the preference as decisions do (a limit's, an opt-out's)
// and capper check prints it.
func (p Preference) String() string {
	switch {
	case p.OptOut:
		return PreferenceCap(p.field()) + " opted out"
	case p.Channel != "" || p.Tag != "":
		return fmt.Sprintf("%s at most %d per %v", PreferenceCap(p.field()), p.Limit, p.Window)
	}
	return "vip until " + p.VIPUntil.UTC().Format(time.RFC3339)
}

// PreferenceCap is the cap name of a decision a preference field refused:
// "preference:channel:sms", "preference:tag:promotional".
func PreferenceCap(field string) string {
	switch {
	case strings.HasPrefix(field, "c:"):
		return "preference:channel:" + field[2:]
	case strings.HasPrefix(field, "t:"):
		return "preference:tag:" + field[2:]
	}
	return "preference:" + field
}

// Validate reports whether the preference is usable.
func (p Preference) Validate() error {
	n := 0
	for _, set := range []bool{p.Channel != "", p.Tag != "", !p.VIPUntil.IsZero()} {
		if set {
			n++
		}
	}
	switch {
	case n != 1:
		return fmt.Errorf("capping: a preference sets exactly one of channel, tag and vip_until")
	case !p.VIPUntil.IsZero():
		return nil
	case p.OptOut:
		return nil
	case p.Limit < 1 || p.Window < time.Millisecond || p.Window%time.Millisecond != 0:
		return fmt.Errorf("capping: preference %s: a limit of at least 1 in a window of whole milliseconds, or opt_out", p.field())
	}
	return nil
}

// value is the preference's hash value (see decide.lua).
func (p Preference) value() string {
	if !p.VIPUntil.IsZero() {
		return strconv.FormatInt(p.VIPUntil.UnixMilli(), 10)
	}
	d := digest2(p.Channel)
	if p.Tag != "" {
		d = digest2(p.Tag)
	}
	if p.OptOut {
		return d + "0:0"
	}
	return fmt.Sprintf("%s%d:%d", d, p.Limit, p.Window.Milliseconds())
}

// PreferencesKey returns the Redis key of a user's preferences.
func (l *Limiter) PreferencesKey(s Space, userID uint32) string { return l.Key(s, userID) + ":prefs" }

// SetPreference sets (or, with clear, removes) one of user's preferences,
// and drops the near cache's copy of the user's log.
func (l *Limiter) SetPreference(ctx context.Context, s Space, userID uint32, p Preference, clear bool) error {
	if err := p.Validate(); err != nil && !clear {
		return err
	}
	pipe := l.client.Pipeline()
	if clear {
		pipe.HDel(ctx, l.PreferencesKey(s, userID), p.field())
	} else {
		pipe.HSet(ctx, l.PreferencesKey(s, userID), p.field(), p.value())
	}
	_, err := pipe.Exec(ctx)
	l.DropCached(s, userID)
	if err != nil {
		return fmt.Errorf("capping: set a preference of user %d: %w", userID, err)
	}
	return nil
}

// Preferences returns user's preferences, sorted by field.
func (l *Limiter) Preferences(ctx context.Context, s Space, userID uint32) ([]Preference, error) {
	pipe := l.client.Pipeline()
	cmd := pipe.HGetAll(ctx, l.PreferencesKey(s, userID))
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, fmt.Errorf("capping: preferences of user %d: %w", userID, err)
	}
	var out []Preference
	fields := cmd.Val()
	keys := make([]string, 0, len(fields))
	for f := range fields {
		keys = append(keys, f)
	}
	sort.Strings(keys)
	for _, f := range keys {
		v := fields[f]
		var p Preference
		switch {
		case f == "vip":
			ms, _ := strconv.ParseInt(v, 10, 64)
			p.VIPUntil = time.UnixMilli(ms)
		case len(v) > 2 && (strings.HasPrefix(f, "c:") || strings.HasPrefix(f, "t:")):
			if f[0] == 'c' {
				p.Channel = f[2:]
			} else {
				p.Tag = f[2:]
			}
			parts := strings.SplitN(v[2:], ":", 2)
			if len(parts) == 2 {
				p.Limit, _ = strconv.Atoi(parts[0])
				ms, _ := strconv.ParseInt(parts[1], 10, 64)
				p.Window = time.Duration(ms) * time.Millisecond
			}
			p.OptOut = p.Limit == 0
		default:
			continue
		}
		out = append(out, p)
	}
	return out, nil
}
