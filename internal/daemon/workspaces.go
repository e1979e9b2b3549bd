package daemon

// Workspaces in the daemon: each one's rules (from its own file, reloaded on
// its own), segment store and users' key space.

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/consumer"
	"github.com/capper-dev/capper/internal/config"
	"github.com/capper-dev/capper/rules"
	"github.com/capper-dev/capper/segments"
)

// Workspace is one workspace's part of the backends: its rules, its segment
// store and its users' key space. A deployment without workspaces has one,
// unnamed, with the rules section's rules and Space 0.
type Workspace struct {
	Name  string // "" without workspaces
	Space capping.Space
	// Rules are the rules it started with (capper check uses them); a
	// running daemon's are its workers' (consumer.Workspaces).
	Rules *rules.Rules
	Store *segments.Store // nil when its rules name no segment

	cfg      config.Workspace
	data     []byte                            // its rules file as last read
	snapshot atomic.Pointer[segments.Snapshot] // the last one a worker was given
	running  atomic.Bool                       // its store refreshes (Run)
}

// Config returns the workspace's settings (zero without workspaces).
func (ws *Workspace) Config() config.Workspace { return ws.cfg }

// Workspace returns the workspace called name: the default one for "" (the
// only one without workspaces).
func (b *Backends) Workspace(name string) (*Workspace, error) {
	spaces := *b.spaces.Load()
	if !b.Config.HasWorkspaces() {
		return spaces[0], nil
	}
	name = cmp.Or(name, b.Config.DefaultWorkspace)
	for _, ws := range spaces {
		if ws.Name == name {
			return ws, nil
		}
	}
	names := make([]string, len(spaces))
	for i, ws := range spaces {
		names[i] = ws.Name
	}
	if name == "" {
		return nil, fmt.Errorf("name a workspace (--workspace): no default_workspace is configured (workspaces: %v)", names)
	}
	return nil, fmt.Errorf("workspace %q is not configured (workspaces: %v)", name, names)
}

// openWorkspaces opens the workspaces of cfg: the single one without
// workspaces, each configured one otherwise.
func (b *Backends) openWorkspaces(ctx context.Context, cfg *config.Config, noSegments bool) error {
	var spaces []*Workspace
	if !cfg.HasWorkspaces() {
		ws, err := b.openWorkspace(ctx, cfg, nil, 1, noSegments)
		if err != nil {
			return err
		}
		spaces = append(spaces, ws)
	}
	for i := range cfg.Workspaces {
		ws, err := b.openWorkspace(ctx, cfg, &cfg.Workspaces[i], 1, noSegments)
		if err != nil {
			return err
		}
		spaces = append(spaces, ws)
	}
	b.spaces.Store(&spaces)
	return nil
}

// openWorkspace compiles a workspace's rules (wc nil: the rules section's),
// adds its key space and starts its segment store.
func (b *Backends) openWorkspace(ctx context.Context, cfg *config.Config, wc *config.Workspace, version int64, noSegments bool) (*Workspace, error) {
	ws := &Workspace{}
	segCfg, reg, log := cfg.Segments, prometheus.Registerer(b.Registry), b.Log
	var err error
	if wc == nil {
		ws.Rules, err = rules.Compile(cfg.Rules, version)
	} else {
		ws.Name, ws.cfg = wc.Name, *wc
		if ws.Rules, ws.data, err = cfg.CompileWorkspace(*wc, version); err == nil {
			ws.Space, err = b.Limiter.AddSpace(cfg.WorkspaceKeyPrefix(*wc))
		}
		segCfg = cfg.WorkspaceSegments(*wc)
		reg = prometheus.WrapRegistererWith(prometheus.Labels{"workspace": wc.Name}, reg)
		log = log.With("workspace", wc.Name)
	}
	if err != nil {
		return nil, err
	}
	if noSegments || (len(ws.Rules.SegmentNames()) == 0 && wc != nil) { // (a workspace whose users all get its default caps)
		return ws, nil
	}
	src, err := NewSegmentSource(ctx, segCfg)
	if err != nil {
		return nil, err
	}
	ws.Store, err = segments.New(segments.Config{
		Segments: ws.Rules.SegmentNames(), Source: src, Logger: log, Registerer: reg,
		RefreshInterval: time.Duration(segCfg.RefreshInterval), StartupTimeout: time.Duration(segCfg.StartupTimeout),
		CacheDir: segCfg.CacheDir,
	})
	if err != nil {
		return nil, err
	}
	b.closes = append(b.closes, func() { _ = ws.Store.Close() })
	if err := ws.Store.Start(ctx); err != nil {
		if ws.Name != "" {
			err = fmt.Errorf("workspace %s: %w", ws.Name, err)
		}
		return nil, err
	}
	return ws, nil
}

// segmentsOf returns the current snapshot of ws's segments to a worker; the
// first time a new one is given out, the near cache is dropped (a user's
// caps may have changed).
func (d *Daemon) segmentsOf(ws *Workspace) func() consumer.Segmenter {
	if ws.Store == nil {
		return func() consumer.Segmenter { return noSegments{} }
	}
	return func() consumer.Segmenter {
		snap := ws.Store.Snapshot()
		if old := ws.snapshot.Swap(snap); old != nil && old != snap {
			d.Limiter.InvalidateCache()
		}
		return snap
	}
}

// Segmenter returns the current snapshot of ws's segments.
func (ws *Workspace) Segmenter() consumer.Segmenter {
	if ws.Store == nil {
		return noSegments{}
	}
	return ws.Store.Snapshot()
}

// Ready reports whether ws's segments are loaded.
func (ws *Workspace) Ready() bool { return ws.Store == nil || ws.Store.Snapshot() != nil }

// noSegments is the segments of a workspace whose rules name none.
type noSegments struct{}

func (noSegments) Lookup(uint32) (string, bool) { return "", false }

// workspaces returns the consumer's view of the workspaces spaces, with the
// rules of each (rulesOf; nil: the ones it was opened with).
func (d *Daemon) workspaces(spaces []*Workspace, def string, rulesOf map[string]*rules.Rules) (*consumer.Workspaces, error) {
	if !d.Config.HasWorkspaces() {
		return consumer.SingleWorkspace(spaces[0].Rules, d.segmentsOf(spaces[0])), nil
	}
	list := make([]*consumer.Workspace, len(spaces))
	for i, ws := range spaces {
		r := ws.Rules
		if rulesOf[ws.Name] != nil {
			r = rulesOf[ws.Name]
		}
		list[i] = &consumer.Workspace{Name: ws.Name, Space: ws.Space, Rules: r, Segments: d.segmentsOf(ws)}
	}
	return consumer.NewWorkspaces(list, def)
}

// runStores refreshes every workspace's segments until ctx ends (those added
// later start with them).
func (d *Daemon) runStores(ctx context.Context) {
	d.storesCtx.Store(&ctx)
	for _, ws := range *d.spaces.Load() {
		d.runStore(ctx, ws)
	}
}

func (d *Daemon) runStore(ctx context.Context, ws *Workspace) {
	if ws.Store != nil && ws.running.CompareAndSwap(false, true) {
		go ws.Store.Run(ctx)
	}
}

// reloadWorkspaces applies cfg's workspaces: each one's rules file is read
// again and compiled if it changed (force: always); a file that does not
// compile, or changes the list of segments (a restart), keeps that
// workspace on the rules in force, and the others go on. A workspace new in
// cfg is opened (its segments loaded), one no longer in it is dropped: its
// jobs are dead-lettered from then on. The shared budgets are cfg's: force
// when the configuration file changed.
func (d *Daemon) reloadWorkspaces(ctx context.Context, cfg *config.Config, force bool) error {
	cur := d.workers[0].Workspaces()
	opened := map[string]*Workspace{}
	for _, ws := range *d.spaces.Load() {
		opened[ws.Name] = ws
	}
	var next []*Workspace
	rulesOf := map[string]*rules.Rules{}
	changed, rejected := false, 0
	for i := range cfg.Workspaces {
		wc := &cfg.Workspaces[i]
		ws := opened[wc.Name]
		if ws != nil && (ws.cfg.Segments != wc.Segments || cfg.WorkspaceKeyPrefix(ws.cfg) != cfg.WorkspaceKeyPrefix(*wc)) {
			d.Log.Error("rules reload: a workspace's segments or key_prefix changed: that needs a restart; keeping its segments and key space", "workspace", wc.Name)
			rejected++
		}
		if ws == nil {
			var err error
			if ws, err = d.openWorkspace(ctx, cfg, wc, d.version+1, false); err != nil {
				d.Log.Error("rules reload: a new workspace could not be opened; it is not added", "workspace", wc.Name, "err", err)
				rejected++
				continue
			}
			if p := d.storesCtx.Load(); p != nil {
				d.runStore(*p, ws)
			}
			d.metrics.AddWorkspaces([]string{ws.Name})
			d.Log.Info("workspace added", "workspace", ws.Name, "segments", ws.Rules.SegmentNames())
			rulesOf[ws.Name], changed = ws.Rules, true
			next = append(next, ws)
			continue
		}
		next = append(next, ws)
		in := cur.Get(ws.Name)
		if in == nil { // dropped by an earlier reload and listed again
			changed = true
		}
		rc, data, err := cfg.WorkspaceRules(*wc)
		if err == nil && !force && in != nil && bytes.Equal(data, ws.data) {
			rulesOf[ws.Name] = in.Rules
			continue
		}
		var rs *rules.Rules
		if err == nil {
			rs, err = rules.Compile(rc, d.version+1)
		}
		if err == nil && !slices.Equal(rs.SegmentNames(), ws.Rules.SegmentNames()) {
			err = fmt.Errorf("the list of segments changed (%v to %v): that needs a restart", ws.Rules.SegmentNames(), rs.SegmentNames())
		}
		if err == nil {
			err = config.CheckRules(rs, d.wheel)
		}
		if err != nil {
			d.Log.Error("rules reload rejected for one workspace; keeping its rules in force", "workspace", ws.Name, "err", err)
			rejected++
			if in != nil {
				rulesOf[ws.Name] = in.Rules
			}
			ws.data = data // logged once, not at every check
			continue
		}
		ws.data, rulesOf[ws.Name], changed = data, rs, true
		d.Log.Info("workspace rules reloaded", "workspace", ws.Name, "rules_version", d.version+1)
	}
	if len(next) != len(cur.Names()) {
		changed = true
	}
	if !changed {
		return rejectedErr(rejected)
	}
	all := *d.spaces.Load()
	for _, ws := range next {
		if !slices.Contains(all, ws) {
			all = append(slices.Clip(all), ws)
		}
	}
	d.spaces.Store(&all)
	set, err := d.workspaces(next, cfg.DefaultWorkspace, rulesOf)
	if err != nil {
		d.Log.Error("rules reload rejected; keeping the workspaces in force", "err", err)
		return err
	}
	d.version++
	for _, w := range d.workers {
		w.SetWorkspaces(set, d.version)
	}
	d.Limiter.InvalidateCache() // a user's caps may have changed
	d.Log.Info("workspaces reloaded", "rules_version", d.version, "workspaces", set.Names())
	return rejectedErr(rejected)
}

func rejectedErr(n int) error {
	if n == 0 {
		return nil
	}
	return fmt.Errorf("rules reload: %d workspace changes rejected (logged); the rest applied", n)
}
