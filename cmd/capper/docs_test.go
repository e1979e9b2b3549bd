package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// TestEveryCommandIsDocumented requires every command the binary dispatches
// (read from command's switch in main.go) and every subcommand its usage
// lists to be in README's commands table: a command added without its row
// there fails here.
func TestEveryCommandIsDocumented(t *testing.T) {
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, table, ok := strings.Cut(string(readme), "\n## Commands\n")
	if !ok {
		t.Fatal("README has no Commands section")
	}
	table, _, _ = strings.Cut(table, "\n## ")
	f, err := parser.ParseFile(token.NewFileSet(), "main.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var commands []string
	ast.Inspect(f, func(n ast.Node) bool {
		fn, ok := n.(*ast.FuncDecl)
		if !ok || fn.Name.Name != "command" {
			return true
		}
		ast.Inspect(fn.Body, func(n ast.Node) bool {
			if cc, ok := n.(*ast.CaseClause); ok && len(cc.List) > 0 {
				if lit, ok := cc.List[0].(*ast.BasicLit); ok {
					if name, _ := strconv.Unquote(lit.Value); name != "help" {
						commands = append(commands, name)
					}
				}
			}
			return true
		})
		return false
	})
	if len(commands) < 7 {
		t.Fatalf("found only the commands %v in main.go", commands)
	}
	for _, c := range commands {
		if !strings.Contains(table, "`capper "+c) {
			t.Errorf("command %q is not in README's commands table", c)
		}
	}
	for _, m := range regexp.MustCompile(`(?m)^  (capper \w+ \w+)`).FindAllStringSubmatch(usage, -1) {
		if sub := strings.Fields(m[1])[2]; sub != "" && !strings.HasPrefix(sub, "-") && !strings.Contains(table, "`"+m[1]) {
			t.Errorf("%q (in the usage) is not in README's commands table", m[1])
		}
	}
}
