package main_test

import (
	"bytes"
	"debug/buildinfo"
	"debug/elf"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// TestReleaseBuild builds capper the way the Dockerfile and `make build` do
// (scripts/build.sh) twice: the binary is static (no interpreter, no dynamic
// section: it runs on distroless/static), both builds are byte-identical
// (-trimpath, no build id), and `capper version` prints the stamped version
// and revision. Its recorded build settings say cgo off, -trimpath and the
// embedded time zone database.
func TestReleaseBuild(t *testing.T) {
	dir := t.TempDir()
	var bins [][]byte
	for _, name := range []string{"a", "b"} {
		out := filepath.Join(dir, name, "capper")
		cmd := exec.Command("../../scripts/build.sh", out, "v0.0.0-test")
		cmd.Env = append(os.Environ(), "REVISION=0123abc")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("scripts/build.sh: %v\n%s", err, b)
		}
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		bins = append(bins, b)
	}
	if !bytes.Equal(bins[0], bins[1]) {
		t.Error("two release builds of the same tree differ")
	}
	bin := filepath.Join(dir, "a", "capper")
	f, err := elf.Open(bin)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP || p.Type == elf.PT_DYNAMIC {
			t.Errorf("the binary is dynamically linked (program header %v)", p.Type)
		}
	}
	out, err := exec.Command(bin, "version").Output()
	if want := "capper v0.0.0-test (revision 0123abc, " + runtime.Version() + ")\n"; err != nil || string(out) != want {
		t.Errorf("capper version: %q (%v), want %q", out, err, want)
	}
	// The build settings it records: no cgo, trimmed paths, its own time zone database.
	bi, err := buildinfo.ReadFile(bin)
	if err != nil {
		t.Fatal(err)
	}
	settings := map[string]string{}
	for _, s := range bi.Settings {
		settings[s.Key] = s.Value
	}
	for k, want := range map[string]string{"CGO_ENABLED": "0", "-trimpath": "true", "-tags": "timetzdata"} {
		if settings[k] != want {
			t.Errorf("build setting %s = %q, want %q", k, settings[k], want)
		}
	}
}
