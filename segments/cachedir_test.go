package segments_test

import (
	"bufio"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/capper-dev/capper/segments"
)

// TestMain runs the test binary as a holder process when asked: a Store that
// loads a segment, says "ready", and closes when its stdin does. The tests
// below kill holders with SIGKILL, as the OOM killer or kill -9 would.
func TestMain(m *testing.M) {
	if src := os.Getenv("CAPPER_TEST_HOLDER_SOURCE"); src != "" {
		holdStore(src, os.Getenv("CAPPER_TEST_HOLDER_CACHE_DIR"))
		return
	}
	os.Exit(m.Run())
}

func holdStore(src, cacheDir string) {
	st, err := segments.New(segments.Config{Segments: []string{"new"}, Source: segments.DirSource{Dir: src}, CacheDir: cacheDir})
	if err != nil {
		os.Stdout.WriteString("error " + err.Error() + "\n")
		os.Exit(1)
	}
	if err := st.Start(context.Background()); err != nil {
		os.Stdout.WriteString("error " + err.Error() + "\n")
		os.Exit(1)
	}
	os.Stdout.WriteString("ready\n")
	_, _ = io.Copy(io.Discard, os.Stdin)
	if err := st.Close(); err != nil {
		os.Exit(1)
	}
}

type holder struct {
	cmd   *exec.Cmd
	stdin io.Closer
}

// startHolder starts a holder process with TMPDIR tmp and returns once its
// Store has loaded.
func startHolder(t *testing.T, src, tmp, cacheDir string) *holder {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "CAPPER_TEST_HOLDER_SOURCE="+src, "CAPPER_TEST_HOLDER_CACHE_DIR="+cacheDir, "TMPDIR="+tmp)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h := &holder{cmd: cmd, stdin: stdin}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if line != "ready\n" {
		t.Fatalf("holder: %q, %v", line, err)
	}
	return h
}

func (h *holder) kill9(t *testing.T) {
	t.Helper()
	if err := h.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = h.cmd.Wait()
}

func (h *holder) stop(t *testing.T) {
	t.Helper()
	h.stdin.Close()
	if err := h.cmd.Wait(); err != nil {
		t.Fatalf("holder stopped: %v", err)
	}
}

func tempDirs(t *testing.T, parent string) []string {
	t.Helper()
	dirs, err := filepath.Glob(filepath.Join(parent, "capper-segments-*"))
	if err != nil {
		t.Fatal(err)
	}
	return dirs
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// TestTempCacheDirOfAKilledProcessIsRemoved: a worker killed with SIGKILL
// leaves its temporary cache directory (a copy of every segment object); the
// next Store on the machine removes it, and leaves the directories of live
// processes and those it cannot tell are ended.
func TestTempCacheDirOfAKilledProcessIsRemoved(t *testing.T) {
	src, tmp := t.TempDir(), t.TempDir()
	writeSegment(t, src, "new", 1, 2)
	unknown := filepath.Join(tmp, "capper-segments-unknown") // no lock file: an older capper, or one starting
	if err := os.Mkdir(unknown, 0o755); err != nil {
		t.Fatal(err)
	}

	killed := startHolder(t, src, tmp, "")
	killedDir := slices.DeleteFunc(tempDirs(t, tmp), func(d string) bool { return d == unknown })
	live := startHolder(t, src, tmp, "")
	liveDir := slices.DeleteFunc(tempDirs(t, tmp), func(d string) bool { return d == unknown || slices.Contains(killedDir, d) })
	if len(killedDir) != 1 || len(liveDir) != 1 {
		t.Fatalf("holders' directories: %v and %v, want one each", killedDir, liveDir)
	}
	if !exists(filepath.Join(killedDir[0], "new.1"+segments.Ext)) {
		t.Fatal("the holder has no cached copy of its segment")
	}
	killed.kill9(t)
	if !exists(killedDir[0]) {
		t.Fatal("a killed process's directory vanished by itself: nothing to sweep")
	}

	t.Setenv("TMPDIR", tmp)
	st, err := segments.New(segments.Config{Segments: []string{"new"}, Source: segments.DirSource{Dir: src}})
	if err != nil {
		t.Fatal(err)
	}
	if exists(killedDir[0]) {
		t.Error("the killed process's cache directory is still there")
	}
	if !exists(filepath.Join(liveDir[0], "new.1"+segments.Ext)) {
		t.Error("a live process's cache directory was removed")
	}
	if !exists(unknown) {
		t.Error("a directory without a lock file was removed")
	}

	live.stop(t)
	if exists(liveDir[0]) {
		t.Error("a stopped process left its cache directory")
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	if got := tempDirs(t, tmp); !slices.Equal(got, []string{unknown}) {
		t.Errorf("left in TMPDIR: %v, want only %s", got, unknown)
	}
}

// TestConfiguredCacheDirHasOneProcess: a second process on a configured cache
// directory fails with an error naming it; once the holder is killed, the
// next Store takes the directory and removes the cached copies it left, and
// nothing else.
func TestConfiguredCacheDirHasOneProcess(t *testing.T) {
	src, dir := t.TempDir(), filepath.Join(t.TempDir(), "cache")
	writeSegment(t, src, "new", 1, 2)
	cfg := segments.Config{Segments: []string{"new"}, Source: segments.DirSource{Dir: src}, CacheDir: dir}

	h := startHolder(t, src, t.TempDir(), dir)
	if _, err := segments.New(cfg); err == nil || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), "in use by another process") {
		t.Fatalf("New on a directory another process holds: %v, want an error naming it", err)
	}
	keep := []string{"notes.txt", "other" + segments.Ext, "a.b" + segments.Ext}
	for _, name := range keep {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("x"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	h.kill9(t)
	left := filepath.Join(dir, "new.1"+segments.Ext)
	if !exists(left) {
		t.Fatal("the killed holder left no cached copy: nothing to remove")
	}

	st, err := segments.New(cfg)
	if err != nil {
		t.Fatalf("New after the holder was killed: %v", err)
	}
	if exists(left) {
		t.Error("the killed holder's cached copy is still there")
	}
	for _, name := range keep {
		if !exists(filepath.Join(dir, name)) {
			t.Errorf("%s, not a cached copy, was removed", name)
		}
	}
	if err := st.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	if seg, _ := st.Snapshot().Lookup(2); seg != "new" {
		t.Fatalf("user 2 in %q, want new", seg)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	entries, _ := os.ReadDir(dir)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	if want := append([]string{".lock"}, keep...); !slices.Equal(names, slices.Sorted(slices.Values(want))) {
		t.Errorf("after Close the directory holds %v, want %v", names, want)
	}
	st, err = segments.New(cfg)
	if err != nil {
		t.Fatalf("New after Close: %v", err)
	}
	st.Close()
}
