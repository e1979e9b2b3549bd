package segments

import (
	"time"

	"github.com/RoaringBitmap/roaring/v2"
)

// Segment is one loaded segment of a Snapshot. Its bitmap must not be modified.
type Segment struct {
	Name   string
	Bitmap *roaring.Bitmap
	// ETag of the object it was loaded from.
	ETag string
	// SerializedBytes is the size of the object.
	SerializedBytes int64
}

// Overlap counts the users that are in both segments A and B. Users should be
// in one segment; when they are in several, the first in priority order wins.
type Overlap struct {
	A, B  string
	Users uint64
}

// Snapshot is an immutable set of segments in priority order. It is safe for
// concurrent use.
type Snapshot struct {
	segments []Segment
	overlaps []Overlap
	loadedAt time.Time
}

// NewSnapshot builds a snapshot of segs, in priority order (the first wins),
// and computes the overlap of every pair. The bitmaps must not be modified
// afterwards.
func NewSnapshot(segs []Segment, loadedAt time.Time) *Snapshot {
	s := &Snapshot{segments: segs, loadedAt: loadedAt}
	for i := range segs {
		for j := i + 1; j < len(segs); j++ {
			if n := segs[i].Bitmap.AndCardinality(segs[j].Bitmap); n > 0 {
				s.overlaps = append(s.overlaps, Overlap{A: segs[i].Name, B: segs[j].Name, Users: n})
			}
		}
	}
	return s
}

// Lookup returns the first segment, in priority order, that holds user, and
// false when none does (the caller applies its default caps). It does not
// allocate.
func (s *Snapshot) Lookup(user uint32) (segment string, ok bool) {
	for i := range s.segments {
		if s.segments[i].Bitmap.Contains(user) {
			return s.segments[i].Name, true
		}
	}
	return "", false
}

// Segments returns the snapshot's segments in priority order; do not modify them.
func (s *Snapshot) Segments() []Segment { return s.segments }

// Overlaps returns the pairs of segments that share users.
func (s *Snapshot) Overlaps() []Overlap { return s.overlaps }

// LoadedAt is when the snapshot was built.
func (s *Snapshot) LoadedAt() time.Time { return s.loadedAt }

// HeapBytes estimates the memory the snapshot's bitmaps hold.
func (s *Snapshot) HeapBytes() uint64 {
	var n uint64
	for _, seg := range s.segments {
		n += seg.Bitmap.GetSizeInBytes()
	}
	return n
}
