#!/usr/bin/env bash
# bench-workspaces.sh (make bench-workspaces) — what workspaces cost, side by side in one run: the same blast
# (BENCH_JOBS, default 500,000, for BENCH_USERS, default 250,000) through demo.sh on bench-lib's decide.yaml,
# its rules as one workspace and as MANY (default 100) identical workspaces, the users spread over them (each
# workspace with its own rules, segment store, key space and near cache), alternated ROUNDS times (default 3).
# Prints the medians of jobs/s, of the worker's CPU per job from ready on (its start-up, a segment store per
# workspace, apart) and of its peak resident set, the ratios many/one, and the memory each workspace beyond the
# first adds. Every run's report must find nothing lost and no cap exceeded.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bench-lib.sh"
JOBS=${BENCH_JOBS:-500000}
USERS=${BENCH_USERS:-250000}
ROUNDS=${ROUNDS:-3}
MANY=${MANY:-100}

run() { # run WORKSPACES -> prints "jobs_per_sec rss_mib cpu_us"
  local out rc=0
  out=$(watched env DEMO_CONFIG="$work/decide.yaml" DEMO_JOBS=$JOBS DEMO_USERS=$USERS DEMO_WORKSPACES=$1 scripts/demo.sh) || rc=$? # under bench-lib.sh's stall watcher
  if ((rc)) || ! grep -q '"unaccounted":0,"violations":0' <<<"$out" || ! grep -q '"pending":0,' <<<"$out"; then
    echo "$out" >&2; echo "bench-workspaces: the run with $1 workspaces failed" >&2; exit 1
  fi
  echo "$out" | grep -E '^(  (decisions|throughput|checks)|worker)' | sed "s/^/  [$1 workspaces] /" >&2
  python3 - "$(grep '^{"jobs"' <<<"$out" | tail -1)" "$(grep '^worker:' <<<"$out" | tail -1)" "$(grep '^worker after start-up:' <<<"$out" | tail -1)" <<'PY'
import json, re, sys
r = json.loads(sys.argv[1])
rss = re.search(r'peak rss (\d+) MiB', sys.argv[2]).group(1)
cpu = re.search(r'\(([\d.]+) us/job\)', sys.argv[3]).group(1)  # from ready on: start-up (a segment store per workspace) apart
print(r["jobs_per_sec"], rss, cpu)
PY
}

echo "bench-workspaces: $JOBS jobs for $USERS users, 1 and $MANY workspaces, $ROUNDS rounds, $(nproc) cores" >&2
for i in $(seq "$ROUNDS"); do
  echo "round $i" >&2
  run 1 >>"$work/one.txt"
  run "$MANY" >>"$work/many.txt"
done
python3 - "$work/one.txt" "$work/many.txt" "$MANY" <<'PY'
import statistics, sys
def load(p):
    rows = [list(map(float, l.split())) for l in open(p) if l.strip()]
    return [statistics.median(c) for c in zip(*rows)], rows
(ojps, orss, ocpu), orows = load(sys.argv[1])
(mjps, mrss, mcpu), mrows = load(sys.argv[2])
n = int(sys.argv[3])
print(f"1 workspace     {ojps:9.0f} jobs/s (rounds {[round(r[0]) for r in orows]}), worker {ocpu:.1f} us/job, peak rss {orss:.0f} MiB (rounds {[round(r[1]) for r in orows]})")
print(f"{n} workspaces  {mjps:9.0f} jobs/s (rounds {[round(r[0]) for r in mrows]}), worker {mcpu:.1f} us/job, peak rss {mrss:.0f} MiB (rounds {[round(r[1]) for r in mrows]})")
print(f"{n} / 1         {mjps/ojps:.3f} jobs/s, {mcpu/ocpu:.2f} worker CPU per job; memory per workspace beyond the first {(mrss-orss)/(n-1)*1024:.0f} KiB")
PY
stalled_runs
