package config_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/capper-dev/capper/internal/config"
)

// TestWorkspacesExampleLoads: examples/workspaces (two brands, a shared
// budget) loads, and each workspace's rules are its file's with the shared
// budget, its own budgets named after it unless it keeps the deployment's keys.
func TestWorkspacesExampleLoads(t *testing.T) {
	c, err := config.Load("../../examples/workspaces/capper.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if !c.HasWorkspaces() || len(c.Workspaces) != 2 || c.DefaultWorkspace != "acme" {
		t.Fatalf("workspaces %+v, default %q", c.Workspaces, c.DefaultWorkspace)
	}
	budgets := map[string][]string{}
	for _, w := range c.Workspaces {
		rs, _, err := c.CompileWorkspace(w, 1)
		if err != nil {
			t.Fatalf("%s: %v", w.Name, err)
		}
		for _, name := range []string{"sms-provider", "push-speed", "acme/push-speed", "globex/push-speed"} {
			if _, _, ok := rs.BudgetNamed(name); ok {
				budgets[w.Name] = append(budgets[w.Name], name)
			}
		}
	}
	// acme keeps the deployment's key prefix (it had the users before): its own budget keeps its name.
	if strings.Join(budgets["acme"], ",") != "sms-provider,push-speed" || strings.Join(budgets["globex"], ",") != "sms-provider" {
		t.Errorf("budgets by workspace %v", budgets)
	}
	if p := c.WorkspaceKeyPrefix(c.Workspaces[1]); p != "fc:w:globex" {
		t.Errorf("globex's key prefix %q", p)
	}
	if s := c.WorkspaceSegments(c.Workspaces[0]).Source; s != "s3://capper-segments/segments" {
		t.Errorf("acme's segments %q: segments . is the source itself", s)
	}
	if s := c.WorkspaceSegments(c.Workspaces[1]).Source; s != "s3://capper-segments/segments/globex" {
		t.Errorf("globex's segments %q", s)
	}
}

// TestWorkspaceValidation: each mistake is refused with what it is about.
func TestWorkspaceValidation(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("a.yaml", "default_caps: [{name: daily, window: 24h, limit: 1}]\n")
	write("bad.yaml", "default_caps: [{name: daily, window: 24h}]\n")
	write("reload.yaml", "default_caps: [{name: daily, window: 24h, limit: 1}]\nreload_interval: 5s\n")
	write("shared.yaml", "default_caps: [{name: daily, window: 24h, limit: 1}]\nbudgets: [{name: x, limit: 1, window: 1s, workspaces: [a]}]\n")
	base := "kafka: {brokers: [127.0.0.1:9092]}\nredis: {addrs: [127.0.0.1:7000]}\nsegments: {source: /tmp}\n"
	tests := []struct{ name, yaml, want string }{
		{"bad name", "workspaces: [{name: Acme, rules_file: a.yaml}]\n", `workspaces[0]: name "Acme" is not 1..32 of a-z`},
		{"twice", "workspaces: [{name: a, rules_file: a.yaml}, {name: a, rules_file: a.yaml}]\n", `workspaces[1]: workspace "a" is listed twice`},
		{"no rules file", "workspaces: [{name: a}]\n", "workspaces[0] (a): rules_file is required"},
		{"missing file", "workspaces: [{name: a, rules_file: none.yaml}]\n", "workspace a: rules_file: open"},
		{"bad rules", "workspaces: [{name: a, rules_file: bad.yaml}]\n", "workspace a: " + filepath.Join(dir, "bad.yaml") + ": rules.default_caps[0]: limit is required"},
		{"reload interval in a workspace", "workspaces: [{name: a, rules_file: reload.yaml}]\n", "reload_interval is the deployment's"},
		{"shared budget in a workspace's file", "workspaces: [{name: a, rules_file: shared.yaml}]\n", "workspaces is set only on the deployment's shared budgets"},
		{"unknown default", "workspaces: [{name: a, rules_file: a.yaml}]\ndefault_workspace: b\n", `default_workspace (CAPPER_DEFAULT_WORKSPACE): "b" is not one of the workspaces`},
		{"default without workspaces", "default_workspace: b\nrules: {default_caps: [{window: 24h, limit: 1}]}\n", "no workspaces are configured"},
		{"caps beside workspaces", "workspaces: [{name: a, rules_file: a.yaml}]\nrules: {default_caps: [{window: 24h, limit: 1}]}\n", "rules.default_caps: with workspaces, each workspace's rules_file sets it"},
		{"shared budget without workspaces", "rules: {default_caps: [{window: 24h, limit: 1}], budgets: [{name: x, limit: 1, window: 1s, workspaces: [z]}]}\n", "rules.budgets[0].workspaces: set, but no workspaces are configured"},
		{"shared budget of an unknown workspace", "workspaces: [{name: a, rules_file: a.yaml}]\nrules: {budgets: [{name: x, limit: 1, window: 1s, workspaces: [z]}]}\n", `rules.budgets[0].workspaces: "z" is not one of the workspaces`},
		{"one key prefix for two", "workspaces: [{name: a, rules_file: a.yaml, key_prefix: k}, {name: b, rules_file: a.yaml, key_prefix: k}]\n", `key_prefix "k" is also workspace a's`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(dir, "capper.yaml")
			write("capper.yaml", base+tt.yaml)
			_, err := config.Load(path)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want one naming %q", err, tt.want)
			}
		})
	}
	// A reload reads no workspace's file: a bad one is that workspace's to reject.
	data := []byte(base + "workspaces: [{name: a, rules_file: bad.yaml}]\n")
	if _, err := config.Reload(data, filepath.Join(dir, "capper.yaml")); err != nil {
		t.Errorf("Reload with a bad workspace file: %v, want the deployment's settings alone checked", err)
	}
}
