#!/usr/bin/env bash
# bench-capping.sh — capper's decisions/s against the Redis ceiling, side by side in one run.
#
# Alternates ROUNDS times (default 3): `capper-devstack calls` running FCALL of capping/decide.lua's function with
# capper's own arguments, 32 decisions per call as capper sends them (same caps, write path, random users;
# CLIENTS connections sending pipelines of PIPELINE calls, as redis-benchmark -c and -P, which cannot send
# decide.lua's binary arguments) as the ceiling, then `go test -bench BenchmarkDecide/batch=512/pipelines=1`
# (one pipeline per batch, one batch in flight per core).
# Prints each round, the medians and capper's median as a share of the ceiling's median.
# Uses the running local stack, or starts (and afterwards stops) it.
#   ROUNDS=5 BENCHTIME=3s scripts/bench-capping.sh
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
ROUNDS=${ROUNDS:-3}
CEILING_ONLY=${CEILING_ONLY:-0}   # 1: print only the median ceiling (decisions/s), for bench-e2e.sh
BENCHTIME=${BENCHTIME:-3s}
REQUESTS=${REQUESTS:-300000}
CLIENTS=${CLIENTS:-32}
PIPELINE=${PIPELINE:-16}

if ! scripts/stack.sh status >/dev/null 2>&1; then
  scripts/stack.sh up >/dev/null
  trap 'scripts/stack.sh down' EXIT
fi
eval "$(scripts/stack.sh env)"
port=${CAPPER_REDIS_PORT:-7000}
((CEILING_ONLY)) || go test -c -o "${CAPPER_STACK_DIR}/capping.test" ./capping/
driver=$(mktemp -d)/capper-devstack
go build -o "$driver" ./cmd/capper-devstack
"$driver" calls -addrs "$CAPPER_TEST_REDIS_ADDRS" -load

median() { sort -g | awk '{a[NR]=$1} END{print (NR%2)? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
ceil_runs=() capper_runs=()
for r in $(seq "$ROUNDS"); do
  # Same script and arguments as capper's benchmark: daily + weekly all-channel caps, 1M users, write path.
  rps=$("$driver" calls -addrs "$CAPPER_TEST_REDIS_ADDRS" -args batch -batch 32 -n "$REQUESTS" -users 1000000 \
    -clients "$CLIENTS" -pipeline "$PIPELINE" -prefix rbbench)
  if ((CEILING_ONLY)); then ceil_runs+=("$rps"); continue; fi
  dps=$("${CAPPER_STACK_DIR}/capping.test" -test.run '^$' -test.bench 'BenchmarkDecide/batch=512/pipelines=1$' -test.benchtime "$BENCHTIME" \
    | awk '/decisions\/s/{for(i=1;i<=NF;i++) if($i=="decisions/s") print $(i-1)}')
  printf 'round %d: FCALL ceiling %s/s   capper batch=512 %s decisions/s\n' "$r" "$rps" "$dps"
  ceil_runs+=("$rps") capper_runs+=("$dps")
done
rm -rf "$(dirname "$driver")"
for p in $(seq "$port" $((port + 5))); do # drop the ceiling's keys (capper's benchmark deletes its own)
  redis-cli -p "$p" --scan --pattern 'rbbench:*' | xargs -r -n 500 redis-cli -p "$p" unlink >/dev/null 2>&1 || true
done
c=$(printf '%s\n' "${ceil_runs[@]}" | median)
if ((CEILING_ONLY)); then echo "$c"; exit 0; fi
k=$(printf '%s\n' "${capper_runs[@]}" | median)
awk -v c="$c" -v k="$k" 'BEGIN{printf "median: ceiling %.0f/s, capper %.0f decisions/s, capper/ceiling = %.0f%%\n", c, k, 100*k/c}'
