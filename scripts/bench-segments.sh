#!/usr/bin/env bash
# bench-segments.sh — the segment snapshot of a synthetic population: CAPPER_BENCH_USERS (default 270
# million) user ids split at random into 4 disjoint segments. Reports, as medians of COUNT runs (default 5):
# heap held by the snapshot (heap_MB), time to load it from local files (load ns/op) and one lookup (ns/op,
# allocations). Goals: <= 200 MB, < 3 s, < 100 ns with 0 allocations.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
COUNT=${COUNT:-5}
out=$(go test -run '^$' -bench 'BenchmarkPopulation' -count "$COUNT" -timeout 30m ./segments/)
echo "$out" | grep -E '^Benchmark'
echo "$out" | awk '
  /Population\/load/   { for (i=1;i<=NF;i++) { if ($i=="ns/op") L[++nl]=$(i-1); if ($i=="heap_MB") H[++nh]=$(i-1) } }
  /Population\/lookup/ { for (i=1;i<=NF;i++) { if ($i=="ns/op") K[++nk]=$(i-1); if ($i=="allocs/op") A=$(i-1) } }
  function med(a, n,   i, j, t) { for (i=1;i<=n;i++) for (j=i+1;j<=n;j++) if (a[j]+0<a[i]+0) { t=a[i]; a[i]=a[j]; a[j]=t }
                                  return (n%2) ? a[(n+1)/2] : (a[n/2]+a[n/2+1])/2 }
  END { printf "median: load %.2f s, snapshot heap %.0f MB, lookup %.1f ns/op with %d allocs/op\n", med(L,nl)/1e9, med(H,nh), med(K,nk), A }'
