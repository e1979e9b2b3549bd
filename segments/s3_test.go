package segments_test

import (
	"context"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/RoaringBitmap/roaring/v2"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/capper-dev/capper/internal/testenv"
	"github.com/capper-dev/capper/segments"
	"github.com/capper-dev/capper/segments/segtool"
)

// countingSource counts the objects a real source reads.
type countingSource struct {
	segments.Source
	mu    sync.Mutex
	reads map[string]int
}

func (c *countingSource) Read(ctx context.Context, key string) ([]byte, error) {
	c.mu.Lock()
	c.reads[key[strings.LastIndex(key, "/")+1:]]++
	c.mu.Unlock()
	return c.Source.Read(ctx, key)
}

func (c *countingSource) take() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	r := c.reads
	c.reads = map[string]int{}
	return r
}

func TestStoreAgainstS3(t *testing.T) {
	endpoint, bucket := testenv.S3(t)
	ctx := context.Background()
	// A proxy in front of the endpoint, to take the endpoint away mid-test.
	target, _ := url.Parse(endpoint)
	proxy := httptest.NewServer(httputil.NewSingleHostReverseProxy(target))
	defer proxy.Close()

	up := &segtool.Uploader{Client: testenv.S3Client(endpoint), Bucket: bucket, Prefix: testenv.Unique("segtest/")}
	put := func(name string, data []byte) {
		t.Helper()
		if err := up.Put(ctx, name, data); err != nil {
			t.Fatal(err)
		}
	}
	enc := func(ids ...uint32) []byte {
		data, err := segtool.Encode(roaring.BitmapOf(ids...))
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
	put("new", enc(1, 2, 3))
	put("active", enc(10, 11, 3))
	put("dormant", enc(20))

	src := &countingSource{Source: &segments.S3Source{Client: testenv.S3Client(proxy.URL), Bucket: bucket, Prefix: up.Prefix}, reads: map[string]int{}}
	reg := prometheus.NewRegistry()
	st, err := segments.New(segments.Config{Segments: []string{"new", "active", "dormant"}, Source: src, Registerer: reg, StartupTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close() // removes its cache directory
	if err := st.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if got := src.take(); len(got) != 3 {
		t.Fatalf("first load read %v, want all 3 objects", got)
	}
	lookup := func(u uint32) string { s, _ := st.Snapshot().Lookup(u); return s }
	if lookup(3) != "new" || lookup(11) != "active" || lookup(20) != "dormant" || lookup(99) != "" {
		t.Fatalf("lookups wrong: 3=%q 11=%q 20=%q 99=%q", lookup(3), lookup(11), lookup(20), lookup(99))
	}
	if ov := st.Snapshot().Overlaps(); len(ov) != 1 || ov[0].Users != 1 {
		t.Fatalf("overlaps %v, want new/active sharing user 3", ov)
	}

	// Unchanged source: nothing downloaded, same snapshot.
	snap := st.Snapshot()
	if changed, err := st.Refresh(ctx); err != nil || changed || st.Snapshot() != snap {
		t.Fatalf("refresh of an unchanged source: changed=%v err=%v", changed, err)
	}
	if got := src.take(); len(got) != 0 {
		t.Fatalf("unchanged refresh read %v", got)
	}

	// Replace one object: only it is downloaded.
	put("active", enc(10, 11, 12))
	if changed, err := st.Refresh(ctx); err != nil || !changed {
		t.Fatalf("refresh after a change: changed=%v err=%v", changed, err)
	}
	if got := src.take(); len(got) != 1 || got["active.roaring"] != 1 {
		t.Fatalf("refresh read %v, want only active.roaring", got)
	}
	if lookup(12) != "active" || lookup(20) != "dormant" {
		t.Fatal("the reloaded snapshot does not have the new object")
	}

	// A corrupt object keeps the previous snapshot.
	snap = st.Snapshot()
	put("dormant", []byte("not a bitmap"))
	if _, err := st.Refresh(ctx); err == nil || !strings.Contains(err.Error(), "dormant.roaring") {
		t.Fatalf("refresh with a corrupt object: %v, want an error naming it", err)
	}
	if st.Snapshot() != snap || lookup(20) != "dormant" {
		t.Fatal("a corrupt object replaced the snapshot")
	}
	put("dormant", enc(20, 21))

	// The endpoint goes away: refresh fails, lookups keep working.
	proxy.Close()
	if _, err := st.Refresh(ctx); err == nil {
		t.Fatal("refresh with the endpoint down succeeded")
	}
	if st.Snapshot() != snap || lookup(12) != "active" {
		t.Fatal("the snapshot changed while the endpoint was down")
	}
	if n := counterValue(t, reg, "capper_segments_refreshes_total", "error"); n != 2 {
		t.Fatalf("refresh errors metric = %v, want 2", n)
	}
}

func counterValue(t *testing.T, reg *prometheus.Registry, name, result string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.Metric {
			if mf.GetName() == name && len(m.Label) == 1 && m.Label[0].GetValue() == result {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("metric %s{result=%q} not found", name, result)
	return 0
}
