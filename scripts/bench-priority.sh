#!/usr/bin/env bash
# bench-priority.sh — what priority costs per decision, side by side in one run.
#
# Alternates ROUNDS times (default 3) capping's BenchmarkPriority modes against the local Redis Cluster:
# unused, reserved (a reserved slot), arbitrated (arbitrated caps never at their last slot) and competing
# (every send a candidate for a last slot). Prints each round, the medians and each mode's median as a
# share of unused's.
#   ROUNDS=5 BENCHTIME=3s scripts/bench-priority.sh
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

median() { sort -g | awk '{a[NR]=$1} END{print (NR%2)? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
modes=(unused reserved arbitrated competing)
declare -A runs
for r in $(seq "$ROUNDS"); do
  line="round $r:"
  for m in "${modes[@]}"; do
    dps=$("${CAPPER_STACK_DIR}/capping.test" -test.run '^$' -test.bench "BenchmarkPriority/$m\$" -test.benchtime "$BENCHTIME" \
      | awk '/decisions\/s/{for(i=1;i<=NF;i++) if($i=="decisions/s") print $(i-1)}')
    runs[$m]+="$dps "
    line+=" $m $dps/s"
  done
  echo "$line"
done
base=$(printf '%s\n' ${runs[unused]} | median)
for m in "${modes[@]}"; do
  k=$(printf '%s\n' ${runs[$m]} | median)
  awk -v m="$m" -v k="$k" -v b="$base" 'BEGIN{printf "median %-10s %8.0f decisions/s  %5.1f%% of unused\n", m, k, 100*k/b}'
done
