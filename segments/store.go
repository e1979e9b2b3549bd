package segments

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/capper-dev/capper/internal/backoff"
)

// Config configures a Store.
type Config struct {
	// Segments names the segments to load, in priority order: a user in several
	// segments belongs to the first. Each must exist in the source. (Required)
	Segments []string
	// Source is where the segment objects are. (Required)
	Source Source
	// RefreshInterval is how often the source is polled for changed objects.
	// Defaults to 5m.
	RefreshInterval time.Duration
	// StartupTimeout bounds how long Start waits for the first complete
	// snapshot, retrying with backoff. Defaults to 2m.
	StartupTimeout time.Duration
	// Logger receives load reports and refresh failures. Defaults to slog.Default().
	Logger *slog.Logger
	// Registerer receives the store's metrics. Optional.
	Registerer prometheus.Registerer
	// Clock defaults to time.Now.
	Clock func() time.Time
	// CacheDir keeps the downloaded objects, so that a refresh re-reads the
	// unchanged ones from local disk instead of downloading them or holding
	// their bitmaps in memory. Defaults to a new temporary directory, removed by Close.
	// One process at a time: New fails while another holds it, and removes
	// the cached copies a killed process left (see cacheDir).
	CacheDir string
}

// Validate reports whether the configuration is usable.
func (c *Config) Validate() error {
	if len(c.Segments) == 0 {
		return errors.New("segments: no segments configured")
	}
	if len(c.Segments) > MaxSegments {
		return fmt.Errorf("segments: %d segments configured, at most %d", len(c.Segments), MaxSegments)
	}
	seen := map[string]bool{}
	for _, s := range c.Segments {
		if s == "" || strings.ContainsAny(s, "/ ") {
			return fmt.Errorf("segments: segment name %q must be non-empty, without / or spaces", s)
		}
		if seen[s] {
			return fmt.Errorf("segments: segment %q is listed twice", s)
		}
		seen[s] = true
	}
	if c.Source == nil {
		return errors.New("segments: no source")
	}
	if c.RefreshInterval < 0 || c.StartupTimeout < 0 {
		return errors.New("segments: refresh interval and startup timeout must not be negative")
	}
	return nil
}

// cached is a downloaded object kept in the cache directory.
type cached struct {
	etag string
	path string
}

// Store holds the current Snapshot and refreshes it from its source. It is
// safe for concurrent use; Refresh calls are serialised.
type Store struct {
	cfg     Config
	current atomic.Pointer[Snapshot]
	mu      sync.Mutex // serialises refreshes; guards cache
	cache   map[string]cached
	dir     *cacheDir
	seq     int // numbers the cached files

	refreshes  *prometheus.CounterVec
	downloaded prometheus.Counter
	users      *prometheus.GaugeVec
}

// New returns a Store with no snapshot yet: call Start.
func New(cfg Config) (*Store, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.RefreshInterval == 0 {
		cfg.RefreshInterval = 5 * time.Minute
	}
	if cfg.StartupTimeout == 0 {
		cfg.StartupTimeout = 2 * time.Minute
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	s := &Store{cfg: cfg, cache: map[string]cached{}}
	s.refreshes = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "capper_segments_refreshes_total", Help: "Segment snapshot refreshes by result (ok, unchanged, error).",
	}, []string{"result"})
	s.downloaded = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "capper_segments_downloaded_bytes_total", Help: "Bytes of segment objects downloaded.",
	})
	s.users = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "capper_segments_users", Help: "Users in each segment of the current snapshot.",
	}, []string{"segment"})
	age := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "capper_segments_snapshot_age_seconds", Help: "Age of the current segment snapshot (-1 before the first).",
	}, func() float64 {
		if snap := s.current.Load(); snap != nil {
			return s.cfg.Clock().Sub(snap.LoadedAt()).Seconds()
		}
		return -1
	})
	if cfg.Registerer != nil {
		for _, c := range []prometheus.Collector{s.refreshes, s.downloaded, s.users, age} {
			if err := cfg.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("segments: register metrics: %w", err)
			}
		}
	}
	dir, err := openCacheDir(cfg.CacheDir, cfg.Logger)
	if err != nil {
		return nil, err
	}
	s.dir, s.cfg.CacheDir = dir, dir.path
	return s, nil
}

// Snapshot returns the current snapshot, nil before the first load.
func (s *Store) Snapshot() *Snapshot { return s.current.Load() }

// Refresh lists the source, downloads the objects whose ETag changed, and
// swaps in a new snapshot when anything changed. On any error the current
// snapshot stays. It reports whether a new snapshot was published.
func (s *Store) Refresh(ctx context.Context) (bool, error) {
	changed, err := s.refresh(ctx)
	switch {
	case err != nil:
		s.refreshes.WithLabelValues("error").Inc()
	case changed:
		s.refreshes.WithLabelValues("ok").Inc()
	default:
		s.refreshes.WithLabelValues("unchanged").Inc()
	}
	return changed, err
}

func (s *Store) refresh(ctx context.Context) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	start := s.cfg.Clock()
	p, err := s.plan(ctx)
	if err != nil {
		return false, err
	}
	if len(p.downloads) == 0 && s.current.Load() != nil {
		return false, nil
	}
	segs, bytes, err := s.load(ctx, p)
	if err != nil {
		return false, err
	}
	s.downloaded.Add(float64(bytes))
	snap, err := NewSnapshot(segs, s.cfg.Clock())
	if err != nil {
		return false, fmt.Errorf("segments: %w", err)
	}
	s.publish(snap, p.next)
	s.report(snap, p.downloads, bytes, s.cfg.Clock().Sub(start))
	return true, nil
}

// refreshPlan is what a refresh will read: each configured segment's object,
// where its copy will be cached, and which ones changed.
type refreshPlan struct {
	objects   map[string]Object // by segment
	next      map[string]cached // the cache after this refresh
	downloads []string          // segments whose object is new or changed
}

// plan lists the source and compares it with the cache: an object whose
// ETag changed (or that has none) is downloaded to a new cached file, so
// the copy in use is never overwritten.
func (s *Store) plan(ctx context.Context) (refreshPlan, error) {
	objs, err := s.cfg.Source.List(ctx)
	if err != nil {
		return refreshPlan{}, fmt.Errorf("segments: %w", err)
	}
	p := refreshPlan{objects: make(map[string]Object, len(objs)), next: make(map[string]cached, len(s.cfg.Segments))}
	for _, o := range objs {
		p.objects[o.Segment] = o
	}
	for _, name := range s.cfg.Segments {
		o, ok := p.objects[name]
		if !ok {
			return refreshPlan{}, fmt.Errorf("segments: segment %q: no object %s%s in %s", name, name, Ext, s.cfg.Source)
		}
		c, ok := s.cache[name]
		if !ok || c.etag != o.ETag || o.ETag == "" {
			p.downloads = append(p.downloads, name)
			s.seq++
			c = cached{etag: o.ETag, path: filepath.Join(s.cfg.CacheDir, fmt.Sprintf("%s.%d%s", name, s.seq, Ext))}
		}
		p.next[name] = c
	}
	return p, nil
}

// load reads every segment of the plan (unchanged ones from the cache
// directory, changed ones from the source), decodes it, and caches the new
// copies. It returns the segments in priority order and the bytes downloaded.
func (s *Store) load(ctx context.Context, p refreshPlan) ([]Segment, int64, error) {
	segs := make([]Segment, len(s.cfg.Segments))
	var bytes int64
	for i, name := range s.cfg.Segments {
		o, c := p.objects[name], p.next[name]
		fresh := c != s.cache[name]
		var data []byte
		var err error
		if fresh {
			if data, err = s.cfg.Source.Read(ctx, o.Key); err != nil {
				return nil, 0, fmt.Errorf("segments: segment %q: %w", name, err)
			}
			bytes += int64(len(data))
		} else if data, err = os.ReadFile(c.path); err != nil {
			return nil, 0, fmt.Errorf("segments: segment %q: cached copy: %w", name, err)
		}
		bm, err := Decode(data)
		if err != nil {
			return nil, 0, fmt.Errorf("segments: segment %q (%s in %s): %w", name, o.Key, s.cfg.Source, err)
		}
		if fresh {
			if err := writeFileAtomic(c.path, data); err != nil {
				return nil, 0, fmt.Errorf("segments: segment %q: cache: %w", name, err)
			}
		}
		segs[i] = Segment{Name: name, Bitmap: bm, ETag: o.ETag, SerializedBytes: int64(len(data))}
	}
	return segs, bytes, nil
}

// publish swaps snap in and drops the cached copies it replaced.
func (s *Store) publish(snap *Snapshot, next map[string]cached) {
	for name, c := range s.cache {
		if next[name] != c {
			_ = os.Remove(c.path)
		}
	}
	s.cache = next
	s.current.Store(snap)
}

func (s *Store) report(snap *Snapshot, downloaded []string, bytes int64, took time.Duration) {
	log := s.cfg.Logger
	log.Info("segment snapshot loaded", "source", s.cfg.Source.String(), "downloaded", downloaded,
		"downloaded_bytes", bytes, "heap_bytes", snap.HeapBytes(), "took", took)
	for _, seg := range snap.Segments() {
		s.users.WithLabelValues(seg.Name).Set(float64(seg.Users))
		log.Info("segment", "segment", seg.Name, "users", seg.Users, "serialized_bytes", seg.SerializedBytes)
	}
	for _, o := range snap.Overlaps() {
		log.Warn("users in more than one segment; the first in priority order applies",
			"segment_a", o.A, "segment_b", o.B, "users", o.Users)
	}
}

// Close removes the cache directory if New created it, or else the cached
// copies in it, and releases it. The current snapshot stays usable.
func (s *Store) Close() error { return s.dir.close() }

func writeFileAtomic(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// Start loads the first complete snapshot, retrying with exponential backoff
// (from 250ms up to 10s) until it succeeds, ctx ends or StartupTimeout passes.
func (s *Store) Start(parent context.Context) error {
	ctx, cancel := context.WithTimeout(parent, s.cfg.StartupTimeout)
	defer cancel()
	b := backoff.New(250*time.Millisecond, 10*time.Second)
	for {
		_, err := s.Refresh(ctx)
		if err == nil {
			return nil
		}
		d := b.Next()
		s.cfg.Logger.Warn("segment snapshot not loaded yet; retrying", "attempt", b.Attempt(), "in", d, "err", err)
		if !backoff.Sleep(ctx, d) {
			if parent.Err() != nil { // stopped (SIGTERM), not timed out
				return fmt.Errorf("segments: stopped before a complete snapshot: %w", err)
			}
			return fmt.Errorf("segments: no complete snapshot within %v: %w", s.cfg.StartupTimeout, err)
		}
	}
}

// Run refreshes the snapshot every RefreshInterval until ctx ends. A failed
// refresh is logged and counted; the previous snapshot stays.
func (s *Store) Run(ctx context.Context) {
	t := time.NewTicker(s.cfg.RefreshInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if _, err := s.Refresh(ctx); err != nil && ctx.Err() == nil {
				age := time.Duration(0)
				if snap := s.Snapshot(); snap != nil {
					age = s.cfg.Clock().Sub(snap.LoadedAt())
				}
				s.cfg.Logger.Error("segment refresh failed; keeping the current snapshot", "err", err, "snapshot_age", age)
			}
		}
	}
}
