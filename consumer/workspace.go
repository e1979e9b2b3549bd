package consumer

// Workspaces: one deployment serving several brands or apps, each with its
// own rules, segments and users (a job's workspace field names its own).

import (
	"fmt"
	"slices"

	"github.com/capper-dev/capper/capping"
	"github.com/capper-dev/capper/jobs"
	"github.com/capper-dev/capper/rules"
)

// Workspace is one workspace as a worker sees it: its rules, its users'
// segments and the key space of its users' logs.
type Workspace struct {
	// Name is what a job's workspace field says; "" in a deployment without workspaces.
	Name string
	// Space is the capping key space of its users.
	Space capping.Space
	// Rules are its rules in force.
	Rules *rules.Rules
	// Segments returns its current segment snapshot.
	Segments func() Segmenter

	index int // its position in its Workspaces: a batch's per-workspace arrays are indexed by it
}

// Workspaces are the workspaces in force. They are immutable: a change (a
// workspace's rules reloaded, one added) makes a new Workspaces
// (Worker.SetWorkspaces).
type Workspaces struct {
	byName map[string]*Workspace
	names  []string   // sorted
	def    *Workspace // of jobs that name none; nil: they are dead-lettered
	named  bool       // false: one workspace, whatever a job's workspace field says
}

// NewWorkspaces returns the workspaces ws, of which jobs without a workspace
// field go to the one named def ("": such jobs are dead-lettered).
func NewWorkspaces(ws []*Workspace, def string) (*Workspaces, error) {
	s := &Workspaces{byName: make(map[string]*Workspace, len(ws)), named: true}
	for _, w := range ws {
		w := *w // its index is this Workspaces' own
		switch {
		case w.Name == "":
			return nil, fmt.Errorf("consumer: a workspace has no name")
		case s.byName[w.Name] != nil:
			return nil, fmt.Errorf("consumer: workspace %q is listed twice", w.Name)
		case w.Rules == nil || w.Segments == nil:
			return nil, fmt.Errorf("consumer: workspace %q needs its rules and segments", w.Name)
		}
		s.byName[w.Name] = &w
		s.names = append(s.names, w.Name)
	}
	slices.Sort(s.names)
	for i, n := range s.names {
		s.byName[n].index = i
	}
	if def != "" {
		if s.def = s.byName[def]; s.def == nil {
			return nil, fmt.Errorf("consumer: the default workspace %q is not one of %v", def, s.names)
		}
	}
	return s, nil
}

// SingleWorkspace is a deployment without workspaces: every job gets these
// rules and segments, and its users' keys are capping's Space 0.
func SingleWorkspace(r *rules.Rules, segments func() Segmenter) *Workspaces {
	w := &Workspace{Rules: r, Segments: segments}
	return &Workspaces{byName: map[string]*Workspace{"": w}, names: []string{""}, def: w}
}

// Named reports whether jobs name their workspaces (false: a deployment
// without workspaces).
func (s *Workspaces) Named() bool { return s.named }

// Names returns the workspaces' names, sorted ([""] without workspaces).
func (s *Workspaces) Names() []string { return s.names }

// Default returns the workspace of jobs that name none; nil when such jobs
// are dead-lettered.
func (s *Workspaces) Default() *Workspace { return s.def }

// Len returns how many workspaces there are.
func (s *Workspaces) Len() int { return len(s.names) }

// Get returns the workspace called name, nil when there is none.
func (s *Workspaces) Get(name string) *Workspace { return s.byName[name] }

// Lookup returns the workspace of a job (or event) whose workspace field is
// name; the error (a malformed job's reason) says why there is none.
func (s *Workspaces) Lookup(name string) (*Workspace, error) {
	switch {
	case !s.named || (name == "" && s.def != nil):
		return s.def, nil
	case name == "":
		return nil, fmt.Errorf("workspace is missing and no default_workspace is configured (workspaces: %v)", s.names)
	}
	if w := s.byName[name]; w != nil {
		return w, nil
	}
	return nil, fmt.Errorf("workspace %q is not configured (workspaces: %v)", jobs.Truncate(name, 64), s.names)
}

// WithRules returns s with the rules of workspace name replaced by r.
func (s *Workspaces) WithRules(name string, r *rules.Rules) *Workspaces {
	next := *s
	next.byName = make(map[string]*Workspace, len(s.byName))
	for k, w := range s.byName {
		next.byName[k] = w
	}
	w := *s.byName[name] // the same index
	w.Rules = r
	next.byName[name] = &w
	if s.def != nil && s.def.Name == name {
		next.def = &w
	}
	return &next
}
