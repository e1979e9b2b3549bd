package capping

import (
	"go/ast"
	"go/parser"
	"go/token"
	"maps"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// seamPrefixes name the constants of the seam between protocol.go and
// decide.lua: the modes of a request, the statuses of a reply, a cap's flags,
// the reply of a written request and the most tally items a log holds.
var seamPrefixes = []string{"mode", "status", "flag", "reply", "spill"}

func isSeamName(name string) bool {
	for _, p := range seamPrefixes {
		if rest, ok := strings.CutPrefix(name, p); ok && rest != "" && rest[0] >= 'A' && rest[0] <= 'Z' {
			return true
		}
	}
	return false
}

// TestSeamNamesAgree reads protocol.go's constants and decide.lua's locals of
// the seam and requires the same names with the same values on both sides: a
// mode or status added, renamed or renumbered on one side only fails here,
// not in production.
func TestSeamNamesAgree(t *testing.T) {
	goSide := map[string]string{}
	f, err := parser.ParseFile(token.NewFileSet(), "protocol.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range f.Decls {
		g, ok := d.(*ast.GenDecl)
		if !ok || g.Tok != token.CONST || g.Specs[0].(*ast.ValueSpec).Names[0].Name != "modeLook" {
			continue // the seam is the block that starts with modeLook
		}
		for _, s := range g.Specs {
			vs := s.(*ast.ValueSpec)
			for k, name := range vs.Names {
				if !isSeamName(name.Name) {
					continue
				}
				lit, ok := vs.Values[k].(*ast.BasicLit)
				if !ok {
					t.Fatalf("protocol.go: %s is not a literal", name.Name)
				}
				goSide[name.Name] = lit.Value
			}
		}
	}
	luaSide := map[string]string{}
	local := regexp.MustCompile(`^local (\w+) = (\d+|'[^']*')$`)
	for _, line := range strings.Split(decideSource, "\n") {
		if m := local.FindStringSubmatch(line); m != nil && isSeamName(m[1]) {
			v := m[2]
			if strings.HasPrefix(v, "'") {
				v = strconv.Quote(strings.Trim(v, "'"))
			}
			luaSide[m[1]] = v
		}
	}
	if len(goSide) < 17 {
		t.Fatalf("protocol.go declares %d seam constants: %v", len(goSide), slices.Sorted(maps.Keys(goSide)))
	}
	for name, v := range goSide {
		if lv, ok := luaSide[name]; !ok {
			t.Errorf("%s = %s in protocol.go has no local in decide.lua", name, v)
		} else if lv != v {
			t.Errorf("%s is %s in protocol.go but %s in decide.lua", name, v, lv)
		}
	}
	for name, v := range luaSide {
		if _, ok := goSide[name]; !ok {
			t.Errorf("decide.lua's local %s = %s has no constant in protocol.go", name, v)
		}
	}
	// The values the Go side packs are the ones the test read.
	if modeAppend != 4 || statusWhole != 128 || flagApplies != 4 || replyWritten != "=" {
		t.Fatal("protocol.go was not parsed as compiled")
	}
}

// TestSeamHasNoBareNumbers checks that decide.lua compares modes and statuses
// by name: a bare number beside "mode" or "status" is a seam value nobody can
// find from the Go side.
func TestSeamHasNoBareNumbers(t *testing.T) {
	bare := regexp.MustCompile(`\b(mode|status)\s*[=~]=\s*\d`)
	for i, line := range strings.Split(decideSource, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "--") {
			continue
		}
		if bare.MatchString(line) {
			t.Errorf("decide.lua:%d compares a mode or status with a number: %s", i+1, strings.TrimSpace(line))
		}
	}
}
