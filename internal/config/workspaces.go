package config

// Workspaces: one deployment capping several brands or apps, each with its
// own rules file, segments and users' keys.

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"

	"gopkg.in/yaml.v3"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/rules"
)

// Workspace is one brand or app of a deployment with workspaces.
type Workspace struct {
	// Name is what a job's workspace field says: 1..32 of a-z, 0-9, _ and -. (Required)
	Name string `yaml:"name"`
	// RulesFile holds the workspace's rules: the fields of the rules section
	// (segments, default_caps, budgets, ...), reloaded when it changes.
	// Relative to the configuration file's directory. (Required)
	RulesFile string `yaml:"rules_file"`
	// Segments is the workspace's place under segments.source: its bitmaps are
	// SOURCE/SEGMENTS/<segment>.roaring. Defaults to its name; "." is
	// segments.source itself (the workspace that takes over a deployment's
	// bitmaps where they are).
	Segments string `yaml:"segments"`
	// KeyPrefix starts its users' keys: PREFIX:{USER_ID}. Defaults to
	// redis.key_prefix + ":w:" + its name. The workspace that takes over a
	// deployment's users from before it had workspaces sets redis.key_prefix
	// itself, and keeps their history.
	KeyPrefix string `yaml:"key_prefix"`
}

var workspaceName = regexp.MustCompile(`^[a-z0-9_-]{1,32}$`)

// HasWorkspaces reports whether jobs name their workspaces.
func (c *Config) HasWorkspaces() bool { return len(c.Workspaces) > 0 }

// Path returns the path of a workspace's file (its rules file), relative to
// the configuration file's directory.
func (c *Config) Path(file string) string {
	if filepath.IsAbs(file) || c.dir == "" {
		return file
	}
	return filepath.Join(c.dir, file)
}

// WorkspaceKeyPrefix returns the key prefix of w's users.
func (c *Config) WorkspaceKeyPrefix(w Workspace) string {
	if w.KeyPrefix != "" {
		return w.KeyPrefix
	}
	return c.keyPrefix() + ":w:" + w.Name
}

func (c *Config) keyPrefix() string {
	if c.Redis.KeyPrefix == "" {
		return capping.DefaultKeyPrefix
	}
	return c.Redis.KeyPrefix
}

// OwnBudgetNames reports whether w's own budgets are named "NAME/BUDGET"
// (rules.Config.InWorkspace): unless w keeps the deployment's key prefix,
// and with it its budgets' names and state from before workspaces.
func (c *Config) OwnBudgetNames(w Workspace) bool { return c.WorkspaceKeyPrefix(w) != c.keyPrefix() }

// WorkspaceSegments returns the segments settings of w: its objects under
// segments.source, and its own cache directory.
func (c *Config) WorkspaceSegments(w Workspace) Segments {
	s := c.Segments
	if w.Segments != "." {
		s.Source = strings.TrimSuffix(s.Source, "/") + "/" + strings.Trim(cmp.Or(w.Segments, w.Name), "/")
	}
	if s.CacheDir != "" {
		s.CacheDir = filepath.Join(s.CacheDir, w.Name)
	}
	return s
}

// WorkspaceRules reads the rules file of w and returns its rules, with the
// deployment's shared budgets that list w (rules.Config.InWorkspace).
// data is the file's content, for a reload to compare.
func (c *Config) WorkspaceRules(w Workspace) (rc rules.Config, data []byte, err error) {
	path := c.Path(w.RulesFile)
	if data, err = os.ReadFile(path); err != nil {
		return rc, nil, fmt.Errorf("config: workspace %s: rules_file: %w", w.Name, err)
	}
	dec := yaml.NewDecoder(strings.NewReader(string(data)))
	dec.KnownFields(true)
	if err := dec.Decode(&rc); err != nil && !errors.Is(err, io.EOF) {
		return rc, data, fmt.Errorf("config: workspace %s: %s: %w", w.Name, path, err)
	}
	if rc.ReloadInterval != 0 {
		return rc, data, fmt.Errorf("config: workspace %s: %s: reload_interval is the deployment's (rules.reload_interval), not a workspace's", w.Name, path)
	}
	for i, b := range rc.Budgets {
		if len(b.Workspaces) > 0 {
			return rc, data, fmt.Errorf("config: workspace %s: %s: budgets[%d] (%s): workspaces is set only on the deployment's shared budgets (rules.budgets)", w.Name, path, i, b.Name)
		}
	}
	var shared []rules.Budget
	for _, b := range c.Rules.Budgets {
		if len(b.Workspaces) == 0 || slices.Contains(b.Workspaces, w.Name) {
			shared = append(shared, b)
		}
	}
	return rc.InWorkspace(w.Name, c.OwnBudgetNames(w), shared), data, nil
}

// CompileWorkspace compiles w's rules as version.
func (c *Config) CompileWorkspace(w Workspace, version int64) (*rules.Rules, []byte, error) {
	rc, data, err := c.WorkspaceRules(w)
	if err != nil {
		return nil, data, err
	}
	rs, err := rules.Compile(rc, version)
	if err != nil {
		return nil, data, fmt.Errorf("config: workspace %s: %s: %w", w.Name, c.Path(w.RulesFile), err)
	}
	return rs, data, nil
}

// validateWorkspaces checks the workspaces, and that the rules section holds
// only what is the deployment's: the shared budgets and reload_interval.
func (c *Config) validateWorkspaces(bad func(field, format string, args ...any)) []error {
	if !c.HasWorkspaces() {
		if c.DefaultWorkspace != "" {
			bad("default_workspace", "%q is set but no workspaces are configured", c.DefaultWorkspace)
		}
		var errs []error
		for i, b := range c.Rules.Budgets {
			if len(b.Workspaces) > 0 {
				errs = append(errs, fmt.Errorf("config: rules.budgets[%d].workspaces: set, but no workspaces are configured", i))
			}
		}
		return errs
	}
	names := map[string]bool{}
	prefixes := map[string]string{}
	var errs []error
	for i, w := range c.Workspaces {
		f := fmt.Sprintf("workspaces[%d]", i)
		switch {
		case !workspaceName.MatchString(w.Name):
			errs = append(errs, fmt.Errorf("config: %s: name %q is not 1..32 of a-z, 0-9, _ and -", f, w.Name))
			continue
		case names[w.Name]:
			errs = append(errs, fmt.Errorf("config: %s: workspace %q is listed twice", f, w.Name))
			continue
		case w.RulesFile == "":
			errs = append(errs, fmt.Errorf("config: %s (%s): rules_file is required", f, w.Name))
			continue
		case strings.ContainsAny(w.KeyPrefix, "{}"):
			errs = append(errs, fmt.Errorf("config: %s (%s): key_prefix %q must not contain { or }", f, w.Name, w.KeyPrefix))
			continue
		}
		names[w.Name] = true
		p := c.WorkspaceKeyPrefix(w)
		if other, dup := prefixes[p]; dup {
			errs = append(errs, fmt.Errorf("config: %s (%s): key_prefix %q is also workspace %s's: their users would be one", f, w.Name, p, other))
		}
		prefixes[p] = w.Name
		if c.noFiles {
			continue
		}
		rs, _, err := c.CompileWorkspace(w, 0)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if wheel, err := c.Wheel(); err == nil {
			if err := CheckRules(rs, wheel); err != nil {
				errs = append(errs, fmt.Errorf("workspace %s: %w", w.Name, err))
			}
		}
	}
	if c.DefaultWorkspace != "" && !names[c.DefaultWorkspace] {
		bad("default_workspace", "%q is not one of the workspaces", c.DefaultWorkspace)
	}
	for i, b := range c.Rules.Budgets {
		for _, n := range b.Workspaces {
			if !names[n] {
				errs = append(errs, fmt.Errorf("config: rules.budgets[%d].workspaces: %q is not one of the workspaces", i, n))
			}
		}
	}
	// The rules section is the deployment's: its shared budgets and how often files are checked.
	v := reflect.ValueOf(c.Rules)
	for i := range v.NumField() {
		f := v.Type().Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
		if !f.IsExported() || name == "budgets" || name == "reload_interval" {
			continue
		}
		if !v.Field(i).IsZero() {
			errs = append(errs, fmt.Errorf("config: rules.%s: with workspaces, each workspace's rules_file sets it; the rules section holds only the shared budgets and reload_interval", name))
		}
	}
	return errs
}
