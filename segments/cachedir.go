package segments

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
)

// A Store's cache directory is held by one process at a time, through an
// exclusive lock on its lock file (flock: the kernel releases it when the
// process ends, however it ends). That gives two guarantees:
//   - a configured directory is never shared: two processes would write the
//     same cached file names (New fails instead, naming the directory);
//   - what a process left when it was killed (kill -9, the OOM killer) is
//     removed by the next one: the cached copies in a configured directory,
//     and the temporary directories of ended processes (each holds a copy of
//     every segment object).
const (
	lockName    = ".lock"
	tempPattern = "capper-segments-"
)

// cacheDir is a Store's cache directory and the lock it holds on it.
type cacheDir struct {
	path string
	temp bool     // created by openCacheDir: removed by close
	lock *os.File // nil where locks are not supported
}

// openCacheDir locks the configured directory (creating it) and removes the
// cached copies an earlier process left there; or, when none is configured,
// creates a locked temporary directory and removes those of ended processes.
func openCacheDir(configured string, log *slog.Logger) (*cacheDir, error) {
	if configured == "" {
		return openTempDir(log)
	}
	if err := os.MkdirAll(configured, 0o755); err != nil {
		return nil, fmt.Errorf("segments: cache directory: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(configured, lockName), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("segments: cache directory: %w", err)
	}
	switch ok, err := tryLock(lock); {
	case errors.Is(err, errors.ErrUnsupported):
		lock.Close()
		return &cacheDir{path: configured}, nil
	case err != nil:
		lock.Close()
		return nil, fmt.Errorf("segments: cache directory %s: lock: %w", configured, err)
	case !ok:
		lock.Close()
		return nil, fmt.Errorf("segments: cache directory %s is in use by another process: give each process its own segments.cache_dir", configured)
	}
	if n := removeCachedFiles(configured); n > 0 {
		log.Info("segments: removed cached copies an earlier process left", "dir", configured, "files", n)
	}
	return &cacheDir{path: configured, lock: lock}, nil
}

// openTempDir creates the temporary directory with its lock file already
// locked (locked under another name, then renamed: a sweeping process never
// finds the lock file of a starting one unlocked).
func openTempDir(log *slog.Logger) (*cacheDir, error) {
	dir, err := os.MkdirTemp("", tempPattern)
	if err != nil {
		return nil, fmt.Errorf("segments: cache directory: %w", err)
	}
	d := &cacheDir{path: dir, temp: true}
	lock, err := os.OpenFile(filepath.Join(dir, lockName+".new"), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o644)
	if err == nil {
		ok, lerr := tryLock(lock)
		switch {
		case lerr == nil && ok:
			err = os.Rename(lock.Name(), filepath.Join(dir, lockName))
			d.lock = lock
		case errors.Is(lerr, errors.ErrUnsupported):
			lock.Close()
			return d, nil // no sweeping without locks
		default:
			lock.Close()
			err = fmt.Errorf("lock %s: %v", lock.Name(), lerr)
		}
	}
	if err != nil {
		d.close()
		return nil, fmt.Errorf("segments: cache directory: %w", err)
	}
	if n := sweepTempDirs(filepath.Dir(dir), dir); n > 0 {
		log.Info("segments: removed the cache directories of ended processes", "dirs", n)
	}
	return d, nil
}

// sweepTempDirs removes, in parent, the temporary cache directories whose
// lock file no process holds. A directory without a lock file (a starting
// process, or an older capper) is left alone. It returns how many it removed.
func sweepTempDirs(parent, own string) int {
	matches, _ := filepath.Glob(filepath.Join(parent, tempPattern+"*"))
	n := 0
	for _, dir := range matches {
		if dir == own {
			continue
		}
		f, err := os.OpenFile(filepath.Join(dir, lockName), os.O_RDWR, 0)
		if err != nil {
			continue
		}
		if ok, err := tryLock(f); err == nil && ok && os.RemoveAll(dir) == nil {
			n++
		}
		f.Close()
	}
	return n
}

// removeCachedFiles removes the files a Store writes in its cache directory
// (segment.N.roaring, and .tmp while one is written), and nothing else: the
// directory may hold other files. It returns how many it removed.
func removeCachedFiles(dir string) int {
	entries, _ := os.ReadDir(dir)
	n := 0
	for _, e := range entries {
		if e.Type().IsRegular() && isCachedName(e.Name()) && os.Remove(filepath.Join(dir, e.Name())) == nil {
			n++
		}
	}
	return n
}

// isCachedName reports whether name is one plan gives a cached copy:
// SEGMENT.SEQ.roaring, or that with .tmp.
func isCachedName(name string) bool {
	name = strings.TrimSuffix(name, ".tmp")
	base, ok := strings.CutSuffix(name, Ext)
	if !ok {
		return false
	}
	i := strings.LastIndexByte(base, '.')
	if i <= 0 || i == len(base)-1 {
		return false
	}
	for _, r := range base[i+1:] {
		if r < '0' || r > '9' {
			return false
		}
	}
	return true
}

// close removes the directory if openCacheDir made it, or else the cached
// copies in it; then it releases the lock.
func (d *cacheDir) close() error {
	var err error
	switch {
	case d.temp:
		err = os.RemoveAll(d.path)
	case d.lock != nil:
		removeCachedFiles(d.path)
	}
	if d.lock != nil {
		d.lock.Close()
	}
	return err
}
