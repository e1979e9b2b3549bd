// Package version is the build's identity: the version stamped at link time
// by scripts/build.sh (-ldflags -X), the VCS revision and the Go version the
// toolchain recorded. `capper version` prints it and the worker exports it as
// capper_build_info.
package version

import (
	"runtime"
	"runtime/debug"
)

// Version and Revision are set with -ldflags "-X
// github.com/capper-dev/capper/internal/version.Version=v1.2.3" (and
// .Revision=COMMIT); without them Revision comes from the VCS information the
// toolchain recorded, if any.
var Version, Revision = "dev", ""

// Info is what a binary knows about its build.
type Info struct {
	Version, Revision, GoVersion string
	Modified                     bool // built from a tree with uncommitted changes
}

// Get returns the build's Info; Revision is "unknown" when it was neither
// stamped nor recorded (-buildvcs=false, or built outside a checkout).
func Get() Info {
	i := Info{Version: Version, Revision: Revision, GoVersion: runtime.Version()}
	if i.Revision != "" {
		return i
	}
	i.Revision = "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				i.Revision = s.Value
			case "vcs.modified":
				i.Modified = s.Value == "true"
			}
		}
	}
	return i
}

// String is the line `capper version` prints.
func (i Info) String() string {
	s := "capper " + i.Version + " (revision " + i.Revision
	if i.Modified {
		s += ", modified"
	}
	return s + ", " + i.GoVersion + ")"
}
