package segments

import (
	"bytes"
	"errors"
	"fmt"

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
