package segments

import (
	"time"

	"github.com/RoaringBitmap/roaring/v2"
)

// Segment is one segment's users: what NewSnapshot builds a snapshot from.
type Segment struct {
	Name   string
	Bitmap *roaring.Bitmap
	// ETag of the object it was loaded from.
	ETag string
	// SerializedBytes is the size of the object.
	SerializedBytes int64
}

// SegmentInfo describes one segment of a Snapshot (which keeps an owner index,
// not the bitmaps).
type SegmentInfo struct {
	Name string
	// Users is the segment's cardinality.
	Users           uint64
	ETag            string
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
	segments []SegmentInfo
	overlaps []Overlap
	index    *index
	loadedAt time.Time
}

// NewSnapshot builds a snapshot of segs, in priority order (the first wins):
// it counts each segment's users and every pair's overlap, then keeps an owner
// index of all users instead of the bitmaps (see index). At most MaxSegments.
func NewSnapshot(segs []Segment, loadedAt time.Time) (*Snapshot, error) {
	bms := make([]*roaring.Bitmap, len(segs))
	for i := range segs {
		bms[i] = segs[i].Bitmap
	}
	ix, err := newIndex(bms)
	if err != nil {
		return nil, err
	}
	s := &Snapshot{segments: make([]SegmentInfo, len(segs)), index: ix, loadedAt: loadedAt}
	for i, seg := range segs {
		s.segments[i] = SegmentInfo{Name: seg.Name, Users: seg.Bitmap.GetCardinality(), ETag: seg.ETag, SerializedBytes: seg.SerializedBytes}
		for j := i + 1; j < len(segs); j++ {
			if n := segs[i].Bitmap.AndCardinality(segs[j].Bitmap); n > 0 {
				s.overlaps = append(s.overlaps, Overlap{A: segs[i].Name, B: segs[j].Name, Users: n})
			}
		}
	}
	return s, nil
}

// Lookup returns the first segment, in priority order, that holds user, and
// false when none does (the caller applies its default caps). It does not
// allocate.
func (s *Snapshot) Lookup(user uint32) (segment string, ok bool) {
	if o := s.index.owner(user); o > 0 {
		return s.segments[o-1].Name, true
	}
	return "", false
}

// Segments returns the snapshot's segments in priority order; do not modify them.
func (s *Snapshot) Segments() []SegmentInfo { return s.segments }

// Overlaps returns the pairs of segments that share users.
func (s *Snapshot) Overlaps() []Overlap { return s.overlaps }

// LoadedAt is when the snapshot was built.
func (s *Snapshot) LoadedAt() time.Time { return s.loadedAt }

// HeapBytes is the memory the snapshot's index holds.
func (s *Snapshot) HeapBytes() uint64 { return s.index.bytes() }
