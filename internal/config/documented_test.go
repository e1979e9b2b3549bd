package config

import (
	"os"
	"reflect"
	"regexp"
	"strings"
	"testing"
)

// yamlPaths returns the YAML path of every field of t, following nested
// structs, slices and maps of structs, and inlined fields.
func yamlPaths(t reflect.Type, prefix string, seen map[reflect.Type]bool) []string {
	for t.Kind() == reflect.Pointer || t.Kind() == reflect.Slice || t.Kind() == reflect.Map {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct || seen[t] || t.PkgPath() == "time" {
		return nil
	}
	seen[t] = true
	defer delete(seen, t)
	var paths []string
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("yaml")
		name, opts, _ := strings.Cut(tag, ",")
		if !f.IsExported() || name == "-" {
			continue
		}
		if strings.Contains(opts, "inline") {
			paths = append(paths, yamlPaths(f.Type, prefix, seen)...)
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name)
		}
		p := prefix + name
		paths = append(paths, p)
		paths = append(paths, yamlPaths(f.Type, p+".", seen)...)
	}
	return paths
}

// TestEveryFieldIsDocumented requires every field of the configuration, at
// every depth (rules, caps, budgets, tiers included), to be written in
// config.example.yaml, the file that documents each field with its default:
// a field added without its line there fails here.
func TestEveryFieldIsDocumented(t *testing.T) {
	example, err := os.ReadFile("../../config.example.yaml")
	if err != nil {
		t.Fatal(err)
	}
	paths := yamlPaths(reflect.TypeFor[Config](), "", map[reflect.Type]bool{})
	if len(paths) < 60 {
		t.Fatalf("found only %d fields: %v", len(paths), paths)
	}
	for _, p := range paths {
		key := p[strings.LastIndex(p, ".")+1:]
		if !regexp.MustCompile(`(^|[\s{,#])` + regexp.QuoteMeta(key) + `:`).Match(example) {
			t.Errorf("config field %s is not documented in config.example.yaml", p)
		}
	}
}
