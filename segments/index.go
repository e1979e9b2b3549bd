package segments

import (
	"fmt"
	"slices"

	"github.com/RoaringBitmap/roaring/v2"
)

// MaxSegments is the most segments a snapshot holds (owners are one byte at most).
const MaxSegments = 255

// index maps every user id to its owner: the 1-based position, in priority
// order, of the first segment that holds it (0: none). It answers a lookup
// with one table read and one memory access, where probing the bitmaps one
// after the other costs a cache miss per segment.
//
// The id space is cut into 65,536 chunks of 65,536 ids (the high and low 16
// bits, as in roaring). A dense chunk stores an owner per id of the span from
// its lowest id to its highest, 4 bits each when there are at most 15
// segments and 8 otherwise (32 or 64 KiB for a whole chunk, about what the
// bitmap containers of 4 or 8 segments take for it); a sparse chunk stores its
// sorted low bits and their owners (3 bytes per id). A chunk is dense when
// that takes no more memory: a run of consecutive ids (a workspace's users in
// a range of 65,536) is a short dense span, read with one access.
type index struct {
	bits   uint     // 4 or 8
	table  []uint32 // high 16 bits -> chunk number + 1; 0: no id in the chunk
	chunks []chunk  // dense or sparse
}

type chunk struct {
	dense  []byte   // owners by low 16 bits less base, when dense
	base   uint16   // the lowest id's low bits, when dense (even with 4 bits)
	lows   []uint16 // sorted low 16 bits, when sparse
	owners []uint8  // owners of lows
	// dir, for a sparse chunk of more than dirMin ids, is where in lows each
	// value of their high byte starts (257 entries: the last is len(lows)),
	// so a lookup searches the few ids of its byte, not all of them: a chunk
	// of a few thousand ids (a workspace's users in a range of 65,536) was
	// 12 dependent reads, and a hundred workspaces' chunks do not stay in
	// the CPU's caches. 514 bytes a chunk.
	dir []uint16
}

// dirMin is the fewest ids of a sparse chunk that get a directory.
const dirMin = 64

// newIndex builds the owner index of bms, in priority order.
func newIndex(bms []*roaring.Bitmap) (*index, error) {
	if len(bms) > MaxSegments {
		return nil, fmt.Errorf("%d segments: at most %d", len(bms), MaxSegments)
	}
	ix := &index{bits: 8, table: make([]uint32, 1<<16)}
	if len(bms) <= 15 {
		ix.bits = 4
	}
	// Pass 1: ids per chunk (summed over segments: an upper bound of the distinct
	// ids) and their span choose each chunk's form. A sparse chunk costs 3
	// bytes an id.
	counts := make([]uint32, 1<<16)
	lowest, highest := make([]uint16, 1<<16), make([]uint16, 1<<16)
	buf := make([]uint32, 4096)
	for _, bm := range bms {
		it := bm.ManyIterator()
		for n := it.NextMany(buf); n > 0; n = it.NextMany(buf) {
			for _, v := range buf[:n] {
				h, low := v>>16, uint16(v)
				if counts[h] == 0 || low < lowest[h] {
					lowest[h] = low
				}
				highest[h] = max(highest[h], low)
				counts[h]++
			}
		}
	}
	for h, c := range counts {
		if c == 0 {
			continue
		}
		ix.chunks = append(ix.chunks, chunk{})
		ix.table[h] = uint32(len(ix.chunks))
		ch := &ix.chunks[len(ix.chunks)-1]
		base := lowest[h]
		if ix.bits == 4 {
			base &^= 1 // two owners a byte, from an even id
		}
		if span := ((int(highest[h]-base)+1)*int(ix.bits) + 7) / 8; 3*int(c) >= span {
			ch.dense, ch.base = make([]byte, span), base
		} else {
			ch.lows = make([]uint16, 0, c)
			ch.owners = make([]uint8, 0, c)
		}
	}
	// Pass 2: the lowest-priority segment first, so higher priorities overwrite.
	for s := len(bms) - 1; s >= 0; s-- {
		owner := uint8(s + 1)
		it := bms[s].ManyIterator()
		for n := it.NextMany(buf); n > 0; n = it.NextMany(buf) {
			for _, v := range buf[:n] {
				ch := &ix.chunks[ix.table[v>>16]-1]
				low := uint16(v)
				if ch.dense == nil {
					ch.lows = append(ch.lows, low)
					ch.owners = append(ch.owners, owner)
					continue
				}
				switch low -= ch.base; {
				case ix.bits == 8:
					ch.dense[low] = owner
				case low&1 == 0:
					ch.dense[low>>1] = ch.dense[low>>1]&0xF0 | owner
				default:
					ch.dense[low>>1] = ch.dense[low>>1]&0x0F | owner<<4
				}
			}
		}
	}
	for i := range ix.chunks {
		if ch := &ix.chunks[i]; ch.dense == nil {
			ch.sortSparse()
			if len(ch.lows) > dirMin {
				ch.dir = make([]uint16, 257)
				for b, k := 0, 0; b <= 256; b++ {
					for k < len(ch.lows) && int(ch.lows[k]>>8) < b {
						k++
					}
					ch.dir[b] = uint16(k)
				}
			}
		}
	}
	// The table ends at the last chunk with an id: a snapshot of ids below
	// 2^24 keeps 1 KiB of it, not 256 (a deployment with a hundred
	// workspaces keeps a snapshot per workspace).
	last := len(ix.table) - 1
	for last >= 0 && ix.table[last] == 0 {
		last--
	}
	ix.table = append([]uint32(nil), ix.table[:last+1]...)
	return ix, nil
}

// sortSparse sorts by low bits and keeps, for an id in several segments, the
// highest priority (lowest owner).
func (ch *chunk) sortSparse() {
	order := make([]int32, len(ch.lows))
	for i := range order {
		order[i] = int32(i)
	}
	slices.SortFunc(order, func(a, b int32) int {
		if d := int(ch.lows[a]) - int(ch.lows[b]); d != 0 {
			return d
		}
		return int(ch.owners[a]) - int(ch.owners[b])
	})
	lows := make([]uint16, 0, len(order))
	owners := make([]uint8, 0, len(order))
	for _, i := range order {
		if n := len(lows); n > 0 && lows[n-1] == ch.lows[i] {
			continue
		}
		lows = append(lows, ch.lows[i])
		owners = append(owners, ch.owners[i])
	}
	ch.lows, ch.owners = lows, owners
}

// owner returns the 1-based owner of user, 0 when no segment holds it.
func (ix *index) owner(user uint32) int {
	h := int(user >> 16)
	if h >= len(ix.table) {
		return 0
	}
	ci := ix.table[h]
	if ci == 0 {
		return 0
	}
	ch := &ix.chunks[ci-1]
	low := uint16(user)
	if ch.dense != nil {
		off := uint(low) - uint(ch.base) // below base: past the end
		if ix.bits == 8 {
			if off >= uint(len(ch.dense)) {
				return 0
			}
			return int(ch.dense[off])
		}
		if off>>1 >= uint(len(ch.dense)) {
			return 0
		}
		return int(ch.dense[off>>1]>>((off&1)*4)) & 0xF
	}
	lo, hi := 0, len(ch.lows)
	if ch.dir != nil {
		lo, hi = int(ch.dir[low>>8]), int(ch.dir[low>>8+1])
	}
	for lo < hi {
		m := int(uint(lo+hi) >> 1)
		if ch.lows[m] < low {
			lo = m + 1
		} else {
			hi = m
		}
	}
	if lo < len(ch.lows) && ch.lows[lo] == low {
		return int(ch.owners[lo])
	}
	return 0
}

// bytes is the memory the index holds.
func (ix *index) bytes() uint64 {
	n := uint64(len(ix.table)) * 4
	for _, ch := range ix.chunks {
		n += uint64(len(ch.dense)) + uint64(len(ch.lows))*3 + uint64(len(ch.dir))*2 + 72
	}
	return n
}
