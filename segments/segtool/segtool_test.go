package segtool_test

import (
	"strings"
	"testing"

	"github.com/RoaringBitmap/roaring/v2"

	"github.com/capper-dev/capper/segments/segtool"
)

func TestBuild(t *testing.T) {
	bm, err := segtool.Build(strings.NewReader("# users\n1\n\n  42 \n4294967295\n1\n"))
	if err != nil {
		t.Fatal(err)
	}
	if !bm.Equals(roaring.BitmapOf(1, 42, 4294967295)) {
		t.Fatalf("built %v", bm.ToArray())
	}
	for in, line := range map[string]string{"1\nx\n": "line 2", "1\n2\n-3\n": "line 3", "4294967296\n": "line 1"} {
		if _, err := segtool.Build(strings.NewReader(in)); err == nil || !strings.Contains(err.Error(), line) {
			t.Errorf("Build(%q) error %v, want one naming %s", in, err, line)
		}
	}
}
