package config

import (
	"fmt"
	"reflect"
	"strings"
)

// toolVariables are CAPPER_* variables that something other than the
// configuration reads: the local stack's scripts, the tests, capper
// segments upload. They are not warned about.
var toolVariables = []string{"CAPPER_CONFIG", "CAPPER_SEGMENTS_S3_ENDPOINT", "CAPPER_SEGMENTS_S3_PATH_STYLE",
	"CAPPER_SEGMENTS_S3_REGION"}

var toolPrefixes = []string{"CAPPER_TEST_", "CAPPER_STACK_", "CAPPER_SECURE_", "CAPPER_S3_", "CAPPER_BENCH_",
	"CAPPER_KAFKA_PORT", "CAPPER_KAFKA_CACHE", "CAPPER_KAFKA_HEAP", "CAPPER_KAFKA_READY_TIMEOUT", "CAPPER_REDIS_PORT",
	"CAPPER_PARTITIONS", "CAPPER_ACL"}

// Variables are the environment variables the configuration reads: one per
// scalar or string-list field (CAPPER_ and its path), and the secrets.
func Variables() []string {
	var out []string
	var walk func(t reflect.Type, prefix string)
	walk = func(t reflect.Type, prefix string) {
		for i := range t.NumField() {
			f := t.Field(i)
			tag := strings.Split(f.Tag.Get("yaml"), ",")[0]
			if tag == "" || tag == "-" || !f.IsExported() {
				continue
			}
			name := prefix + "_" + strings.ToUpper(tag)
			switch {
			case f.Type.Kind() == reflect.Struct:
				walk(f.Type, name)
			case f.Type.Kind() == reflect.Slice && f.Type.Elem().Kind() != reflect.String: // lists of structs: the file's alone
			default:
				out = append(out, name)
			}
		}
	}
	walk(reflect.TypeFor[Config](), "CAPPER")
	return append(out, "CAPPER_REDIS_PASSWORD", "CAPPER_KAFKA_SASL_PASSWORD")
}

// UnknownVariables returns a warning for each CAPPER_* variable of environ
// ("NAME=value" entries) that no setting reads, with the nearest one that
// does: a typo (CAPPER_REDIS_ADDR) is otherwise ignored without a word.
func UnknownVariables(environ []string) []string {
	known := map[string]bool{}
	vars := Variables()
	for _, v := range append(vars, toolVariables...) {
		known[v] = true
	}
	var warnings []string
	for _, kv := range environ {
		name, _, _ := strings.Cut(kv, "=")
		if !strings.HasPrefix(name, "CAPPER_") || known[name] || hasPrefix(name, toolPrefixes) {
			continue
		}
		best, bestD := "", 1<<30
		for _, v := range vars {
			if d := distance(name, v); d < bestD {
				best, bestD = v, d
			}
		}
		w := fmt.Sprintf("the environment variable %s is not a setting capper reads: it is ignored", name)
		if bestD <= max(3, len(name)/4) {
			w += fmt.Sprintf(" (did you mean %s?)", best)
		}
		warnings = append(warnings, w)
	}
	return warnings
}

func hasPrefix(s string, prefixes []string) bool {
	for _, p := range prefixes {
		if strings.HasPrefix(s, p) {
			return true
		}
	}
	return false
}

// distance is the Levenshtein distance of a and b.
func distance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}
