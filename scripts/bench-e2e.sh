#!/usr/bin/env bash
# bench-e2e.sh — end-to-end throughput on this machine, in one run:
#   1. capper: BENCH_JOBS jobs (default 1,000,000) through demo.sh (loadgen -> capper run -> report);
#   2. pass-through baseline: the same consume -> produce -> commit path with capping skipped
#      (cmd/capper-passthrough: the same daemon with capping skipped);
#   3. the redis-benchmark EVALSHA ceiling of the capping script on the same cluster;
# then the ratios, the worker's CPU time per job and its Redis round trips per batch.
# Goal: capper end to end >= 50% of the Redis ceiling.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
JOBS=${BENCH_JOBS:-1000000}
work=$(mktemp -d)
# The drop path, as in the figures before holding existed: config.example.yaml without its hold policy.
grep -v "on_capped: {policy: hold" config.example.yaml >"$work/drop.yaml"
USERS=${BENCH_USERS:-250000}

started=0
if ! scripts/stack.sh status >/dev/null 2>&1; then scripts/stack.sh up >/dev/null; started=1; fi
trap '((started)) && scripts/stack.sh down >/dev/null; rm -rf "$work"' EXIT

run() { # run LABEL PASSTHROUGH(0|1) -> prints "jobs_per_sec p99_ms cpu_us rt"
  local out
  local rc=0
  out=$(DEMO_CONFIG="$work/drop.yaml" DEMO_JOBS=$JOBS DEMO_USERS=$USERS DEMO_PASSTHROUGH="$2" scripts/demo.sh 2>&1) || rc=$?
  # The baseline forwards everything, so its report finds cap violations; it must still lose nothing.
  if { [[ $2 != 1 ]] && ((rc)); } || ! grep -q '"unaccounted":0,' <<<"$out"; then
    echo "$out" >&2; echo "bench-e2e: $1 run failed" >&2; exit 1
  fi
  echo "$out" | grep -E '^(  (decisions|throughput|checks)|worker:)' | sed "s/^/  [$1] /" >&2
  local json worker
  json=$(echo "$out" | grep '^{"jobs"' | tail -1)
  worker=$(echo "$out" | grep '^worker:' | tail -1)
  python3 - "$json" "$worker" <<'PY'
import json, re, sys
r = json.loads(sys.argv[1])
m = re.search(r'\(([\d.]+) us/job\).*?([\d.]+) redis round trips/batch', sys.argv[2])
print(r["jobs_per_sec"], r["p99_ms"], m.group(1), m.group(2))
PY
}

echo "bench-e2e: $JOBS jobs for $USERS users on $(nproc) cores" >&2
read -r capper_jps capper_p99 capper_cpu capper_rt < <(run capper 0)
read -r pass_jps pass_p99 pass_cpu _ < <(run passthrough 1)
ceiling=$(CEILING_ONLY=1 ROUNDS=3 scripts/bench-capping.sh)
python3 - "$capper_jps" "$pass_jps" "$ceiling" "$capper_cpu" "$pass_cpu" "$capper_rt" "$capper_p99" <<'PY'
import sys
cj, pj, ceil, ccpu, pcpu, rt, p99 = map(float, sys.argv[1:])
print(f"capper end to end        {cj:10.0f} jobs/s   (p99 produce->forward {p99:.0f} ms, worker CPU {ccpu:.1f} us/job, {rt:.2f} redis round trips/batch)")
print(f"pass-through baseline    {pj:10.0f} jobs/s   (worker CPU {pcpu:.1f} us/job)")
print(f"redis EVALSHA ceiling    {ceil:10.0f} decisions/s (redis-benchmark, median of 3)")
print(f"capper / ceiling         {100*cj/ceil:9.0f}%   (goal >= 50%)")
print(f"capper / pass-through    {100*cj/pj:9.0f}%")
print(f"pass-through / ceiling   {100*pj/ceil:9.0f}%")
PY
