package segments_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/RoaringBitmap/roaring/v2"

	"github.com/capper-dev/capper/segments"
	"github.com/capper-dev/capper/segments/segtool"
)

// javaValues are the values of the RoaringFormatSpec test bitmaps.
func javaValues() *roaring.Bitmap {
	bm := roaring.New()
	for k := uint32(0); k < 100000; k += 1000 {
		bm.Add(k)
	}
	for k := uint32(100000); k < 200000; k++ {
		bm.Add(3 * k)
	}
	bm.AddRange(700000, 800000)
	return bm
}

func TestDecodeJavaWrittenFixtures(t *testing.T) {
	want := javaValues()
	for _, name := range []string{"bitmapwithoutruns.bin", "bitmapwithruns.bin"} {
		t.Run(name, func(t *testing.T) {
			data, err := os.ReadFile(filepath.Join("..", "fixtures", "roaring", "java", name))
			if err != nil {
				t.Fatal(err)
			}
			bm, err := segments.Decode(data)
			if err != nil {
				t.Fatalf("decode: %v", err)
			}
			if bm.GetCardinality() != 200100 || !bm.Equals(want) {
				t.Fatalf("decoded %d values, want the 200100 of the spec's test bitmap", bm.GetCardinality())
			}
			if runs := segtool.Inspect(bm).Containers["run"] > 0; runs != strings.Contains(name, "withruns") {
				t.Errorf("run containers present = %v", runs)
			}
		})
	}
}

func TestDecodeRejectsBadInput(t *testing.T) {
	good, err := os.ReadFile("../fixtures/roaring/java/bitmapwithruns.bin")
	if err != nil {
		t.Fatal(err)
	}
	cases := map[string][]byte{
		"empty":           {},
		"truncated":       good[:len(good)/2],
		"trailing bytes":  append(append([]byte{}, good...), 1, 2, 3),
		"not a bitmap":    []byte("user_id\n1\n2\n"),
		"header only":     good[:8],
		"flipped cookie":  append([]byte{0xff}, good[1:]...),
		"truncated by 1":  good[:len(good)-1],
		"zero-filled 64B": make([]byte, 64),
	}
	crashers, _ := filepath.Glob("../fixtures/roaring/crashers/*.bin")
	if len(crashers) == 0 {
		t.Fatal("no crasher fixtures")
	}
	for _, f := range crashers {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		cases["crasher "+filepath.Base(f)] = data
	}
	for name, data := range cases {
		t.Run(name, func(t *testing.T) {
			if bm, err := segments.Decode(data); err == nil {
				t.Fatalf("decoded %d values from bad input, want an error", bm.GetCardinality())
			}
		})
	}
}

func FuzzDecode(f *testing.F) {
	for _, pattern := range []string{"../fixtures/roaring/java/*.bin", "../fixtures/roaring/crashers/*.bin"} {
		files, _ := filepath.Glob(pattern)
		for _, file := range files {
			data, err := os.ReadFile(file)
			if err != nil {
				f.Fatal(err)
			}
			if len(data) > 4096 {
				data = data[:4096]
			}
			f.Add(data)
		}
	}
	small, _ := segtool.Encode(roaring.BitmapOf(1, 2, 3, 70000, 1<<31))
	f.Add(small)
	f.Fuzz(func(t *testing.T, data []byte) {
		bm, err := segments.Decode(data)
		if err != nil {
			return
		}
		// A bitmap that decodes must be usable and round-trip.
		again, err := segtool.Encode(bm.Clone())
		if err != nil {
			t.Fatalf("encode a decoded bitmap: %v", err)
		}
		back, err := segments.Decode(again)
		if err != nil || !back.Equals(bm) {
			t.Fatalf("round trip failed: %v", err)
		}
		bm.Contains(12345)
	})
}

func TestSnapshotPriorityOverlapAndNone(t *testing.T) {
	snap, err := segments.NewSnapshot([]segments.Segment{
		{Name: "new", Bitmap: roaring.BitmapOf(1, 2, 3)},
		{Name: "active", Bitmap: roaring.BitmapOf(3, 4, 5, 6)},
		{Name: "dormant", Bitmap: roaring.BitmapOf(6, 7, 2)},
	}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for user, want := range map[uint32]string{1: "new", 2: "new", 3: "new", 4: "active", 6: "active", 7: "dormant", 8: "", 1 << 31: ""} {
		got, ok := snap.Lookup(user)
		if got != want || ok != (want != "") {
			t.Errorf("Lookup(%d) = %q, %v; want %q", user, got, ok, want)
		}
	}
	want := []segments.Overlap{{A: "new", B: "active", Users: 1}, {A: "new", B: "dormant", Users: 1}, {A: "active", B: "dormant", Users: 1}}
	got := snap.Overlaps()
	if len(got) != len(want) {
		t.Fatalf("overlaps %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("overlap %d = %v, want %v", i, got[i], want[i])
		}
	}
}

func writeSegment(t *testing.T, dir, name string, ids ...uint32) {
	t.Helper()
	data, err := segtool.Encode(roaring.BitmapOf(ids...))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, name+segments.Ext), data, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestStoreFromDirectory(t *testing.T) {
	dir := t.TempDir()
	writeSegment(t, dir, "new", 1, 2)
	writeSegment(t, dir, "active", 3)
	ctx := context.Background()

	st, err := segments.New(segments.Config{Segments: []string{"new", "active", "dormant"}, Source: segments.DirSource{Dir: dir}, StartupTimeout: 600 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close() // removes its cache directory
	if err := st.Start(ctx); err == nil || !strings.Contains(err.Error(), `"dormant"`) || !strings.Contains(err.Error(), "within 600ms") {
		t.Fatalf("start with a missing segment: %v, want a timeout naming it", err)
	}
	stopped, stop := context.WithCancel(ctx)
	time.AfterFunc(100*time.Millisecond, stop)
	if err := st.Start(stopped); err == nil || !strings.Contains(err.Error(), "stopped before a complete snapshot") {
		t.Fatalf("start stopped after 100ms: %v, want it to say it was stopped, not timed out", err)
	}
	if st.Snapshot() != nil {
		t.Fatal("a partial snapshot was published")
	}
	writeSegment(t, dir, "dormant", 4)
	if err := st.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if seg, _ := st.Snapshot().Lookup(4); seg != "dormant" {
		t.Fatalf("user 4 in %q, want dormant", seg)
	}
	if err := os.WriteFile(filepath.Join(dir, "active.roaring"), []byte("garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	before := st.Snapshot()
	if _, err := st.Refresh(ctx); err == nil || !strings.Contains(err.Error(), "active.roaring") {
		t.Fatalf("refresh with a corrupt object: %v, want an error naming the object", err)
	}
	if st.Snapshot() != before {
		t.Fatal("a failed refresh replaced the snapshot")
	}
}

func TestConfigValidate(t *testing.T) {
	src := segments.DirSource{Dir: "."}
	for name, cfg := range map[string]segments.Config{
		"no segments": {Source: src},
		"duplicate":   {Segments: []string{"a", "a"}, Source: src},
		"bad name":    {Segments: []string{"a/b"}, Source: src},
		"no source":   {Segments: []string{"a"}},
	} {
		if err := cfg.Validate(); err == nil {
			t.Errorf("%s: Validate() = nil, want an error", name)
		}
	}
	if _, err := segments.New(segments.Config{}); err == nil {
		t.Error("New with an empty config succeeded")
	}
}
