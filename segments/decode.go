package segments

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/RoaringBitmap/roaring/v2"
)

// MaxObjectBytes bounds the size of one segment object (1 GiB, far above the
// ~34 MB a segment of all 2³² ids takes as bitmap containers).
const MaxObjectBytes = 1 << 30

// Decode deserialises one segment object in the portable roaring format and
// validates it. The bitmap does not keep a reference to data. Trailing bytes
// after the serialized bitmap are an error: they mean a corrupt or concatenated
// object.
func Decode(data []byte) (*roaring.Bitmap, error) {
	if len(data) == 0 {
		return nil, errors.New("empty object")
	}
	bm := roaring.New()
	r := bytes.NewReader(data)
	n, err := bm.ReadFrom(r)
	if err != nil {
		return nil, fmt.Errorf("not a valid roaring bitmap: %w", err)
	}
	if n != int64(len(data)) {
		return nil, fmt.Errorf("not a valid roaring bitmap: %d trailing bytes after %d", int64(len(data))-n, n)
	}
	if err := bm.Validate(); err != nil {
		return nil, fmt.Errorf("invalid roaring bitmap: %w", err)
	}
	return bm, nil
}

// Encode serialises bm in the portable format, run-optimised.
func Encode(bm *roaring.Bitmap) ([]byte, error) {
	bm.RunOptimize()
	return bm.ToBytes()
}

// Build reads user ids, one decimal uint32 per line (blank lines and lines
// starting with # are skipped), into a bitmap. A bad line is an error that
// names its line number.
func Build(r io.Reader) (*roaring.Bitmap, error) {
	bm := roaring.New()
	sc := bufio.NewScanner(r)
	buf := make([]uint32, 0, 4096)
	line := 0
	for sc.Scan() {
		line++
		s := strings.TrimSpace(sc.Text())
		if s == "" || s[0] == '#' {
			continue
		}
		id, err := strconv.ParseUint(s, 10, 32)
		if err != nil {
			return nil, fmt.Errorf("line %d: %q is not a user id (0..4294967295)", line, s)
		}
		buf = append(buf, uint32(id))
		if len(buf) == cap(buf) {
			bm.AddMany(buf)
			buf = buf[:0]
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("line %d: %w", line+1, err)
	}
	bm.AddMany(buf)
	return bm, nil
}

// Info describes one bitmap, for `capper segments inspect`.
type Info struct {
	Cardinality     uint64
	SerializedBytes uint64
	HeapBytes       uint64
	Min, Max        uint32 // zero when empty
	Containers      map[string]uint64
	Runs            bool
}

// Inspect describes bm.
func Inspect(bm *roaring.Bitmap) Info {
	st := bm.Stats()
	in := Info{
		Cardinality:     bm.GetCardinality(),
		SerializedBytes: bm.GetSerializedSizeInBytes(),
		HeapBytes:       bm.GetSizeInBytes(),
		Runs:            bm.HasRunCompression(),
		Containers: map[string]uint64{
			"array":  st.ArrayContainers,
			"bitmap": st.BitmapContainers,
			"run":    st.RunContainers,
		},
	}
	if !bm.IsEmpty() {
		in.Min, in.Max = bm.Minimum(), bm.Maximum()
	}
	return in
}
