#!/usr/bin/env bash
# bench-modes.sh — the modes of one of capping's benchmarks, side by side in one run.
#
#   scripts/bench-modes.sh Priority unused reserved arbitrated competing   (make bench-priority)
#   scripts/bench-modes.sh Preferences off none every_user                 (make bench-prefs)
#
# Alternates ROUNDS times (default 3) the modes of capping's BenchmarkNAME against the local Redis
# Cluster; prints each round, the medians and each mode's median as a share of the first mode's.
#   ROUNDS=5 BENCHTIME=3s scripts/bench-modes.sh Priority unused competing
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
ROUNDS=${ROUNDS:-3}
BENCHTIME=${BENCHTIME:-3s}

if ! scripts/stack.sh status >/dev/null 2>&1; then
  scripts/stack.sh up >/dev/null
  trap 'scripts/stack.sh down' EXIT
fi
eval "$(scripts/stack.sh env)"
go test -c -o "${CAPPER_STACK_DIR}/capping.test" ./capping/
bench=${1:?usage: bench-modes.sh NAME MODE...}
shift
modes=("$@")

median() { sort -g | awk '{a[NR]=$1} END{print (NR%2)? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
declare -A runs
for r in $(seq "$ROUNDS"); do
  line="round $r:"
  for m in "${modes[@]}"; do
    dps=$("${CAPPER_STACK_DIR}/capping.test" -test.run '^$' -test.bench "Benchmark$bench/$m\$" -test.benchtime "$BENCHTIME" \
      | awk '/decisions\/s/{for(i=1;i<=NF;i++) if($i=="decisions/s") print $(i-1)}')
    runs[$m]+="$dps "
    line+=" $m $dps/s"
  done
  echo "$line"
done
base=$(printf '%s\n' ${runs[${modes[0]}]} | median)
for m in "${modes[@]}"; do
  k=$(printf '%s\n' ${runs[$m]} | median)
  awk -v m="$m" -v k="$k" -v b="$base" 'BEGIN{printf "median %-10s %8.0f decisions/s  %5.1f%% of the first\n", m, k, 100*k/b}'
done
