// Package segtool is the tools' side of segments: building a segment bitmap
// from user ids, encoding it in the portable roaring format, describing it,
// and uploading segment objects to S3. The worker's side (Store, Snapshot,
// Source, Decode) is package segments; segtool uses it to validate what it
// uploads.
package segtool

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"github.com/RoaringBitmap/roaring/v2"
	"github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/capper-dev/capper/segments"
)

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

// PutAPI is the part of *s3.Client that an Uploader uses.
type PutAPI interface {
	PutObject(ctx context.Context, in *s3.PutObjectInput, opts ...func(*s3.Options)) (*s3.PutObjectOutput, error)
}

// Uploader writes segment objects to s3://Bucket/Prefix, where a
// segments.S3Source with the same bucket and prefix reads them.
type Uploader struct {
	Client PutAPI
	Bucket string
	// Prefix is the key prefix without a trailing slash; empty for the bucket's root.
	Prefix string
}

// Key returns the object key of segment.
func (u *Uploader) Key(segment string) string {
	if u.Prefix == "" {
		return segment + segments.Ext
	}
	return strings.TrimSuffix(u.Prefix, "/") + "/" + segment + segments.Ext
}

// Put uploads one segment object named segment.
func (u *Uploader) Put(ctx context.Context, segment string, data []byte) error {
	key := u.Key(segment)
	if _, err := u.Client.PutObject(ctx, &s3.PutObjectInput{Bucket: &u.Bucket, Key: &key, Body: bytes.NewReader(data)}); err != nil {
		return fmt.Errorf("put s3://%s/%s: %w", u.Bucket, key, err)
	}
	return nil
}

// Uploaded is one object UploadDir wrote.
type Uploaded struct {
	File, URI string
	Bytes     int
}

// UploadDir validates every DIR/*.roaring file and then uploads them all, in
// name order; when one is not a valid segment, nothing is uploaded.
func (u *Uploader) UploadDir(ctx context.Context, dir string) ([]Uploaded, error) {
	files, _ := filepath.Glob(filepath.Join(dir, "*"+segments.Ext))
	if len(files) == 0 {
		return nil, fmt.Errorf("no *%s files in %s", segments.Ext, dir)
	}
	sort.Strings(files)
	datas := make([][]byte, len(files))
	for i, f := range files {
		var err error
		if datas[i], err = os.ReadFile(f); err != nil {
			return nil, err
		}
		if _, err := segments.Decode(datas[i]); err != nil {
			return nil, fmt.Errorf("%s: %w (nothing uploaded)", f, err)
		}
	}
	var out []Uploaded
	for i, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), segments.Ext)
		if err := u.Put(ctx, name, datas[i]); err != nil {
			return out, err
		}
		out = append(out, Uploaded{File: f, URI: "s3://" + u.Bucket + "/" + u.Key(name), Bytes: len(datas[i])})
	}
	return out, nil
}
