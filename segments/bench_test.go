package segments_test

import (
	"context"
	"log/slog"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"testing"

	"github.com/RoaringBitmap/roaring/v2"

	"github.com/capper-dev/capper/segments"
	"github.com/capper-dev/capper/segments/segtool"
)

// The population benchmark: CAPPER_BENCH_USERS (default 270 million) user ids
// 0..N-1, each put in one of 4 disjoint segments at random (the worst case for
// compression: no runs, every container a bitmap container). scripts/bench-segments.sh
// runs it.
var population struct {
	once  sync.Once
	dir   string
	names []string
	err   error
}

func populationDir(b *testing.B) (string, []string) {
	population.once.Do(func() {
		n := uint64(270_000_000)
		if v := os.Getenv("CAPPER_BENCH_USERS"); v != "" {
			n, population.err = strconv.ParseUint(v, 10, 32)
		}
		population.names = []string{"new", "active", "dormant", "churned"}
		population.dir, population.err = os.MkdirTemp("", "capper-population-")
		if population.err != nil {
			return
		}
		bms := make([]*roaring.Bitmap, 4)
		bufs := make([][]uint32, 4)
		for i := range bms {
			bms[i] = roaring.New()
			bufs[i] = make([]uint32, 0, 1<<16)
		}
		rng := rand.New(rand.NewPCG(1, 2))
		for id := uint64(0); id < n; id++ {
			s := rng.Uint32() & 3
			bufs[s] = append(bufs[s], uint32(id))
			if len(bufs[s]) == cap(bufs[s]) {
				bms[s].AddMany(bufs[s])
				bufs[s] = bufs[s][:0]
			}
		}
		for i, bm := range bms {
			bm.AddMany(bufs[i])
			data, err := segtool.Encode(bm)
			if err != nil {
				population.err = err
				return
			}
			if population.err = os.WriteFile(filepath.Join(population.dir, population.names[i]+segments.Ext), data, 0o644); population.err != nil {
				return
			}
		}
	})
	if population.err != nil {
		b.Fatal(population.err)
	}
	return population.dir, population.names
}

func heapInUse() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// BenchmarkPopulation/load: time to load the 4 segment files into a snapshot,
// and the heap the snapshot holds. BenchmarkPopulation/lookup: one user's lookup.
func BenchmarkPopulation(b *testing.B) {
	dir, names := populationDir(b)
	load := func() *segments.Store {
		st, err := segments.New(segments.Config{Segments: names, Source: segments.DirSource{Dir: dir}, Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			b.Fatal(err)
		}
		defer st.Close() // removes its cache directory
		if err := st.Start(context.Background()); err != nil {
			b.Fatal(err)
		}
		return st
	}
	b.Run("load", func(b *testing.B) {
		var held uint64
		b.StopTimer()
		for i := 0; i < b.N; i++ {
			before := heapInUse()
			b.StartTimer()
			st := load()
			b.StopTimer()
			held = heapInUse() - before
			runtime.KeepAlive(st)
		}
		b.ReportMetric(float64(held)/1e6, "heap_MB")
	})
	b.Run("lookup", func(b *testing.B) {
		snap := load().Snapshot()
		var users uint64
		for _, s := range snap.Segments() {
			users += s.Users
		}
		ids := make([]uint32, 1<<16)
		rng := rand.New(rand.NewPCG(3, 4))
		for i := range ids {
			ids[i] = uint32(rng.Uint64N(users))
		}
		b.ReportAllocs()
		b.ResetTimer()
		found := 0
		for i := 0; i < b.N; i++ {
			if _, ok := snap.Lookup(ids[i&(len(ids)-1)]); ok {
				found++
			}
		}
		if found != b.N {
			b.Fatalf("%d of %d users found", found, b.N)
		}
	})
}
