package capping

import (
	"strings"
	"testing"
)

// TestFunctionLibrary checks decide.lua's library form: named after the
// script's SHA1, the same chunk with its last line replaced by the
// registration, which carries the script's flag; and a script not shaped so
// is refused at start-up rather than loaded half-made.
func TestFunctionLibrary(t *testing.T) {
	sha := decideScript.Hash()
	if decideFunction != "capper_decide_"+sha[:16] || decideLibraryName != "capper_"+sha[:16] {
		t.Fatalf("function %s, library %s: want both named after the script's SHA1 %s", decideFunction, decideLibraryName, sha)
	}
	first, rest, _ := strings.Cut(decideLibrary, "\n")
	if first != "#!lua name="+decideLibraryName {
		t.Fatalf("first line %q", first)
	}
	reg := "redis.register_function{function_name = '" + decideFunction + "', callback = run, flags = {'allow-cross-slot-keys'}}\n"
	body, ok := strings.CutSuffix(rest, reg)
	if !ok {
		t.Fatalf("the library does not end with %q", reg)
	}
	if want := strings.TrimSuffix(strings.TrimPrefix(decideSource, "#!lua flags=allow-cross-slot-keys\n"), "return run(KEYS, ARGV)\n"); body != want {
		t.Fatal("the library's chunk is not decide.lua's")
	}
	if strings.Count(decideLibrary, "\n") != strings.Count(decideSource, "\n") {
		t.Fatal("the library's lines are not the script's: an error's line number would not point into decide.lua")
	}
	for _, src := range []string{"return run(KEYS, ARGV)\n", "#!lua flags=allow-cross-slot-keys\nreturn 1\n"} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("a script %q made a library", src)
				}
			}()
			functionLibrary(src, sha)
		}()
	}
}
