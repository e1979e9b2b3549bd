package segments_test

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/RoaringBitmap/roaring/v2"

	"github.com/capper-dev/capper/segments"
)

// TestLookupMatchesProbingTheBitmaps checks the snapshot's owner index against
// the definition: the first bitmap, in priority order, that holds the user.
// Segments mix dense chunks (random halves of whole chunks), short dense spans
// (most ids of a block), sparse chunks (scattered ids) and overlaps; 3 segments use 4-bit owners, 20 use 8-bit.
func TestLookupMatchesProbingTheBitmaps(t *testing.T) {
	for _, n := range []int{1, 3, 15, 16, 20} {
		t.Run(fmt.Sprintf("%d segments", n), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(n), 9))
			bms := make([]*roaring.Bitmap, n)
			segs := make([]segments.Segment, n)
			for i := range bms {
				bm := roaring.New()
				for c := 0; c < 3; c++ { // dense: about half of a few whole chunks
					base := uint32(rng.IntN(8)) << 16
					for low := uint32(0); low < 1<<16; low++ {
						if rng.IntN(2) == 0 {
							bm.Add(base | low)
						}
					}
				}
				for k := 0; k < 2000; k++ { // sparse: scattered over the whole id space
					bm.Add(rng.Uint32())
				}
				for k, base := 0, uint32(8+rng.IntN(4))<<16; k < 3000; k++ { // sparse but crowded: a directory's
					bm.Add(base | rng.Uint32N(1<<16))
				}
				for u := uint32(13<<16 + 1001 + i); u < 13<<16+3500; u++ { // a short dense span (a workspace's users
					if rng.IntN(5) > 0 { // in a block), from an odd id in one segment and an even one in the next
						bm.Add(u)
					}
				}
				bm.AddRange(1<<32-1000, 1<<32) // the top of the id range in every segment
				bms[i] = bm
				segs[i] = segments.Segment{Name: fmt.Sprintf("s%d", i), Bitmap: bm.Clone()}
			}
			snap, err := segments.NewSnapshot(segs, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			want := func(u uint32) string {
				for i, bm := range bms {
					if bm.Contains(u) {
						return segs[i].Name
					}
				}
				return ""
			}
			check := func(u uint32) {
				got, ok := snap.Lookup(u)
				if w := want(u); got != w || ok != (w != "") {
					t.Fatalf("Lookup(%d) = %q, %v; want %q", u, got, ok, w)
				}
			}
			for _, bm := range bms {
				it := bm.Iterator()
				for it.HasNext() {
					check(it.Next())
				}
			}
			for k := 0; k < 200000; k++ {
				check(rng.Uint32())
				check(uint32(rng.IntN(8 << 16)))
			}
			for u := uint32(13<<16 + 990); u < 13<<16+3510; u++ { // the span and its edges
				check(u)
			}
			check(0)
			check(1<<32 - 1)
			for i, s := range snap.Segments() {
				if s.Users != bms[i].GetCardinality() {
					t.Fatalf("segment %d: %d users, want %d", i, s.Users, bms[i].GetCardinality())
				}
			}
		})
	}
}

func TestSnapshotRejectsTooManySegments(t *testing.T) {
	segs := make([]segments.Segment, segments.MaxSegments+1)
	for i := range segs {
		segs[i] = segments.Segment{Name: fmt.Sprint(i), Bitmap: roaring.BitmapOf(uint32(i))}
	}
	if _, err := segments.NewSnapshot(segs, time.Now()); err == nil {
		t.Fatal("a snapshot of 256 segments was built")
	}
}
