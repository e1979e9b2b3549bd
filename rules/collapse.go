package rules

// Collapse keys: sends of one series ("the price drop of product 42") that
// replace each other. Of the sends of a user with one key, only the newest
// (by submission time) may go; an older one, held or late, is capped as
// collapsed. A key is the job's own collapse_key, or derived by a rule of
// the collapse section.

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// Collapse is the collapse section of the rules.
type Collapse struct {
	// Keys derive a collapse key for the jobs they select that carry no
	// collapse_key of their own: the first key that selects a job gives it.
	Keys []CollapseKey `yaml:"keys"`
	// Window, when set, also collapses a send whose key reached its user
	// within it (a newer send of a key is not sent again within the
	// window); 0: only older sends collapse.
	Window Duration `yaml:"window"`
	// Retain is how long a user's newest send of a key is remembered after
	// the user's last keyed send: a send held longer than this is not
	// collapsed by a newer one. At least the window; defaults to 30d, the
	// longest max_hold.
	Retain Duration `yaml:"retain"`
}

// CollapseKey derives the collapse key of the jobs it selects.
type CollapseKey struct {
	// Name starts every key it derives ("name", "name/CAMPAIGN",
	// "name/CAMPAIGN/TAG"). (Required)
	Name string `yaml:"name"`
	// Scope selects the jobs (channels, tags); per_campaign puts the job's
	// campaign in the key (one series per campaign).
	Scope `yaml:",inline"`
	// TagPrefix puts the job's first tag with this prefix in the key (one
	// series per product: "product:"); a job without such a tag gets no key
	// from this rule.
	TagPrefix string `yaml:"tag_prefix"`
}

// DefaultCollapseRetain is Collapse.Retain unless it says.
const DefaultCollapseRetain = maxHoldLimit

// CollapsePlan is what the rules say of a send's collapse key (Plan.Collapse).
type CollapsePlan struct {
	Key    string        // "": the send has none
	Window time.Duration // see Collapse.Window
	Retain time.Duration // see Collapse.Retain
}

type compiledCollapse struct {
	keys           []compiledKey
	window, retain time.Duration
}

type compiledKey struct {
	name        string
	channels    []string // empty: every channel
	tags        []string // empty: any
	perCampaign bool
	tagPrefix   string
}

func (r *Rules) compileCollapse(c *Collapse) error {
	r.collapse = compiledCollapse{retain: DefaultCollapseRetain}
	if c == nil {
		return nil
	}
	switch {
	case c.Window < 0 || c.Retain < 0:
		return fmt.Errorf("rules.collapse: window and retain must not be negative")
	case c.Retain != 0 && c.Retain < c.Window:
		return fmt.Errorf("rules.collapse: retain %v must be at least the window %v", time.Duration(c.Retain), time.Duration(c.Window))
	case c.Window > 0 && c.Window%Duration(time.Millisecond) != 0:
		return fmt.Errorf("rules.collapse: window %v must be whole milliseconds", time.Duration(c.Window))
	}
	r.collapse.window = time.Duration(c.Window)
	if c.Retain > 0 {
		r.collapse.retain = time.Duration(c.Retain)
	}
	names := map[string]bool{}
	for i, k := range c.Keys {
		f := fmt.Sprintf("rules.collapse.keys[%d]", i)
		switch {
		case k.Name == "" || strings.Contains(k.Name, "/"):
			return fmt.Errorf("%s: name is required, without a /", f)
		case names[k.Name]:
			return fmt.Errorf("%s: a second key named %q", f, k.Name)
		}
		names[k.Name] = true
		channels, err := k.Scope.compile(f)
		if err != nil {
			return err
		}
		r.collapse.keys = append(r.collapse.keys, compiledKey{name: k.Name, channels: channels, tags: slices.Clone(k.Tags),
			perCampaign: k.PerCampaign, tagPrefix: k.TagPrefix})
	}
	return nil
}

// collapseOf is the collapse plan of job: its own key, else the first
// derived one.
func (r *Rules) collapseOf(job *Job) CollapsePlan {
	p := CollapsePlan{Key: job.CollapseKey, Window: r.collapse.window, Retain: r.collapse.retain}
	if p.Key != "" {
		return p
	}
	for i := range r.collapse.keys {
		k := &r.collapse.keys[i]
		if len(k.channels) > 0 && !slices.Contains(k.channels, job.Channel) ||
			len(k.tags) > 0 && !slices.ContainsFunc(job.Tags, func(t string) bool { return slices.Contains(k.tags, t) }) {
			continue
		}
		key := k.name
		if k.perCampaign {
			key += "/" + job.Campaign
		}
		if k.tagPrefix != "" {
			tag := ""
			for _, t := range job.Tags {
				if strings.HasPrefix(t, k.tagPrefix) {
					tag = t
					break
				}
			}
			if tag == "" {
				continue
			}
			key += "/" + tag
		}
		p.Key = key
		return p
	}
	return p
}
