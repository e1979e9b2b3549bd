package rules

// Global send-rate budgets: a name, a scope and a limit per rolling window,
// shared by every replica (package budget enforces them).

import (
	"fmt"
	"slices"
	"time"

	"github.com/capper-dev/capper/budget"
)

// Budget is one budget as configured.
type Budget struct {
	// Name identifies it in metrics, holds and keys. (Required)
	Name string `yaml:"name"`
	// Limit is the most sends of its scope in any Window. (Required, >= 1)
	Limit *int `yaml:"limit"`
	// Window is rolling, whole milliseconds, a multiple of 100 ms (one per bucket). (Required)
	Window Duration `yaml:"window"`
	// Scope, as for caps; per_campaign makes one budget per campaign id. Empty: every send.
	Scope `yaml:",inline"`
	// MaxHold bounds how long after submission a job may wait for a token:
	// one whose token comes back later, or less than a tenth of a second
	// before (budget.Grant.Promised), is capped with reason "beyond
	// max_hold". Defaults to 24h.
	MaxHold Duration `yaml:"max_hold"`
	// Spread spreads the sends over the window (budget.Spec.Spread): under
	// sustained demand they go at the limit's pace and every window gets
	// about the limit (99% of it). Defaults to true; false lets
	// the whole limit go at once at any time (spread, only an idle
	// budget's), which under sustained demand above the limit travels in
	// lumps that drift across windows (a window in 100 can get none).
	Spread *bool `yaml:"spread"`
	// Workspaces, in a deployment with workspaces, lists those that share
	// this budget (one SMS provider account serving two brands); empty: all
	// of them. Only the deployment's rules section sets it; a workspace's
	// own budgets are its alone.
	Workspaces []string `yaml:"workspaces"`

	shared bool // added to a workspace's rules by InWorkspace: keeps its name
}

type compiledBudget struct {
	spec        *budget.Spec
	channels    []string
	tags        []string
	perCampaign bool
	maxHold     time.Duration
}

// BudgetName is the name budget b of c goes by in holds (capper-cap),
// metrics and Redis keys: "NAME/BUDGET" for a workspace's own budget
// (InWorkspace), its own name otherwise.
func (c Config) BudgetName(b Budget) string { return budgetName(c.workspace, b) }

func budgetName(workspace string, b Budget) string {
	if b.shared || workspace == "" || b.Name == "" {
		return b.Name
	}
	return workspace + "/" + b.Name
}

func (r *Rules) compileBudgets(bs []Budget, workspace string) error {
	r.budgetHold = map[string]time.Duration{}
	for i, b := range bs {
		f := fmt.Sprintf("rules.budgets[%d]", i)
		if b.shared {
			f = fmt.Sprintf("the shared budget %q", b.Name)
		}
		b.Name = budgetName(workspace, b)
		switch {
		case b.Name == "":
			return fmt.Errorf("%s: name is required", f)
		case r.budgetHold[b.Name] != 0:
			return fmt.Errorf("%s: budget %q is listed twice", f, b.Name)
		case b.Limit == nil:
			return fmt.Errorf("%s (%s): limit is required", f, b.Name)
		case b.MaxHold < 0 || time.Duration(b.MaxHold) > maxHoldLimit:
			return fmt.Errorf("%s (%s): max_hold %v is not between 0 and 30d", f, b.Name, time.Duration(b.MaxHold))
		}
		spec := &budget.Spec{Name: b.Name, Limit: *b.Limit, Window: time.Duration(b.Window), Spread: b.Spread == nil || *b.Spread}
		if err := spec.Validate(); err != nil {
			return fmt.Errorf("%s: %w", f, err)
		}
		channels, err := b.Scope.compile(fmt.Sprintf("%s (%s)", f, b.Name))
		if err != nil {
			return err
		}
		cb := compiledBudget{spec: spec, channels: channels, tags: slices.Clone(b.Tags), perCampaign: b.PerCampaign, maxHold: time.Duration(b.MaxHold)}
		if cb.maxHold == 0 {
			cb.maxHold = 24 * time.Hour
		}
		r.budgets = append(r.budgets, cb)
		r.budgetHold[b.Name] = cb.maxHold
	}
	return nil
}

// Budgets appends to dst a want of every budget whose scope matches a send
// of channel with tags (its category among them) in campaign.
func (r *Rules) Budgets(dst []budget.Want, channel string, tags []string, campaign string) []budget.Want {
	for i := range r.budgets {
		b := &r.budgets[i]
		if len(b.channels) > 0 && !slices.Contains(b.channels, channel) {
			continue
		}
		if len(b.tags) > 0 && !slices.ContainsFunc(tags, func(t string) bool { return slices.Contains(b.tags, t) }) {
			continue
		}
		key := b.spec.Name
		if b.perCampaign {
			key += ":" + campaign
		}
		dst = append(dst, budget.Want{Spec: b.spec, Key: key})
	}
	return dst
}

// BudgetMaxHold returns how long a job may wait for a token of the budget name.
func (r *Rules) BudgetMaxHold(name string) time.Duration { return r.budgetHold[name] }

// BudgetNamed returns the budget called name, for capper check.
func (r *Rules) BudgetNamed(name string) (spec *budget.Spec, perCampaign bool, ok bool) {
	for _, b := range r.budgets {
		if b.spec.Name == name {
			return b.spec, b.perCampaign, true
		}
	}
	return nil, false, false
}
