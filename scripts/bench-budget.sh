#!/usr/bin/env bash
# bench-budget.sh — what a global budget costs end to end, measured side by side in one run: the same blast
# (BENCH_JOBS, default 200,000, for BENCH_USERS, default 50,000) through demo.sh with config.example.yaml's
# rules (drop policy), without a budget and with one budget over every send that never binds (a billion per
# second: every job takes a token, none waits), alternated ROUNDS times (default 3). Prints the medians of
# jobs/s and worker CPU per job, the budget's Redis calls per 1,000 jobs, and budget / none.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bench-lib.sh"
JOBS=${BENCH_JOBS:-200000}
USERS=${BENCH_USERS:-50000}
ROUNDS=${ROUNDS:-3}

cp "$work/drop.yaml" "$work/none.yaml"
sed 's/^  budgets: \[\]/  budgets: [{name: everything, limit: 1000000000, window: 1s}]/' "$work/none.yaml" >"$work/budget.yaml"
grep -q 'name: everything' "$work/budget.yaml" || { echo "bench-budget: cannot derive the budget config" >&2; exit 1; }

run() { # run CONFIG -> prints "jobs_per_sec cpu_us budget_calls"
  local out rc=0
  out=$(DEMO_CONFIG="$work/$1.yaml" DEMO_JOBS=$JOBS DEMO_USERS=$USERS scripts/demo.sh 2>&1) || rc=$?
  if ((rc)) || ! grep -q '"unaccounted":0,"violations":0' <<<"$out"; then
    echo "$out" >&2; echo "bench-budget: $1 run failed" >&2; exit 1
  fi
  echo "$out" | grep -E '^(  (decisions|holds|throughput|checks)|worker:)' | sed "s/^/  [$1] /" >&2
  python3 - "$(grep '^{"jobs"' <<<"$out" | tail -1)" "$(grep '^worker:' <<<"$out" | tail -1)" <<'PY'
import json, re, sys
r = json.loads(sys.argv[1])
m = re.search(r'\(([\d.]+) us/job\).*?(\d+) budget redis calls', sys.argv[2])
print(r["jobs_per_sec"], m.group(1), m.group(2))
PY
}

echo "bench-budget: $JOBS jobs for $USERS users, $ROUNDS rounds, $(nproc) cores" >&2
for i in $(seq "$ROUNDS"); do
  run none >>"$work/none.txt"
  run budget >>"$work/budget.txt"
done
python3 - "$work/none.txt" "$work/budget.txt" "$JOBS" <<'PY'
import statistics, sys
def load(p):
    rows = [list(map(float, l.split())) for l in open(p) if l.strip()]
    return [statistics.median(c) for c in zip(*rows)], [round(r[0]) for r in rows]
(njps, ncpu, _), nall = load(sys.argv[1])
(bjps, bcpu, bcalls), ball = load(sys.argv[2])
jobs = float(sys.argv[3])
print(f"no budget     {njps:9.0f} jobs/s (median of {nall}), worker CPU {ncpu:.1f} us/job")
print(f"with budget   {bjps:9.0f} jobs/s (median of {ball}), worker CPU {bcpu:.1f} us/job, {1000*bcalls/jobs:.2f} budget Redis calls per 1,000 jobs")
print(f"budget / none {bjps/njps:.2f} throughput, {bcpu/ncpu:.2f} CPU per job")
PY
