package main_test

import (
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestEveryHelp walks every command and subcommand of capper and both tool
// binaries: --help exits 0 on standard output with a usage line, the
// command's own flags and an examples block, and no sentinel default (a
// 9223372036854775808 user or a -1 priority reads as a real value); the tools
// without arguments print their usage and exit 2.
func TestEveryHelp(t *testing.T) {
	for _, c := range [][]string{{"run"}, {"check"}, {"validate"}, {"segments"}, {"segments", "build"}, {"segments", "inspect"},
		{"segments", "upload"}, {"prefs"}, {"prefs", "get"}, {"prefs", "set"}, {"loadgen"}, {"report"}, {"keys"}, {"version"}, {"help"}} {
		name := strings.Join(c, " ")
		cmd := exec.Command(capperBin, append(c, "--help")...)
		var stdout, stderr strings.Builder
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		out := stdout.String()
		if err != nil || !strings.Contains(strings.ToLower(out), "usage:") || !strings.Contains(strings.ToLower(out), "examples:") {
			t.Errorf("capper %s --help: %v; stdout:\n%s\nstderr:\n%s", name, err, out, stderr.String())
		}
		for _, sentinel := range []string{"9223372036854775808", "(default -1)"} {
			if strings.Contains(out, sentinel) {
				t.Errorf("capper %s --help shows a sentinel default %s:\n%s", name, sentinel, out)
			}
		}
	}
	if out, _ := capper(t, "", nil, "prefs", "get", "--help"); strings.Contains(out, "-channel") || strings.Contains(out, "-vip-until") {
		t.Errorf("capper prefs get --help lists set's flags:\n%s", out)
	}
	if out, _ := capper(t, "", nil, "report", "--help"); !strings.Contains(out, "-hold-wait") {
		t.Errorf("capper report --help lacks its flags:\n%s", out)
	}
	dir := t.TempDir()
	for _, tool := range []string{"capper-passthrough", "capper-devstack"} {
		bin := filepath.Join(dir, tool)
		if out, err := exec.Command("go", "build", "-o", bin, "../"+tool).CombinedOutput(); err != nil {
			t.Fatalf("build %s: %v\n%s", tool, err, out)
		}
		out, err := exec.Command(bin, "--help").CombinedOutput()
		if err != nil || !strings.Contains(string(out), "usage:") || !strings.Contains(string(out), "examples:") {
			t.Errorf("%s --help: %v\n%s", tool, err, out)
		}
		out, err = exec.Command(bin).CombinedOutput()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 2 || !strings.Contains(string(out), "usage:") {
			t.Errorf("%s without arguments: %v (want exit 2 and the usage)\n%s", tool, err, out)
		}
	}
}

// TestReportTakesTheConfigsDurations: report's durations take the
// configuration's syntax (7d), as every other duration does.
func TestReportTakesTheConfigsDurations(t *testing.T) {
	out, err := capper(t, "", []string{"CAPPER_KAFKA_BROKERS=" + freeAddr(t)}, "report", "--config", "../../config.example.yaml",
		"--manifest", filepath.Join(t.TempDir(), "none.csv"), "--hold-wait", "1d", "--idle", "500ms")
	if strings.Contains(out, "invalid value") || !strings.Contains(out, "none.csv") {
		t.Fatalf("--hold-wait 1d refused, or the command did not go on to read the manifest: %v\n%s", err, out)
	}
}
