#!/usr/bin/env bash
# bench-hold.sh — the throughput cost of holding capped sends, measured side by side in one run:
# the same blast (BENCH_JOBS, default 200,000, for BENCH_USERS, default 50,000) through demo.sh with
# config.example.yaml's rules under two policies, alternated ROUNDS times (default 3):
#   drop  every capped send goes to the capped topic;
#   hold  every capped send is held for its slot (max_hold 48h: about a day later, so held jobs stay on the
#         delay tiers for the whole run and each costs a tier write and an audit record).
# Prints the medians of jobs/s and worker CPU per job, the share of jobs held, and hold/drop. Then one
# release run (RELEASE=0 skips it): the same blast with rolling windows of seconds (24h -> 10s, 7d -> 30s)
# and every capped send held up to 2m, so held jobs are released while `capper report` waits: its release
# lag p50/p99 (due time to decision) and its verdict (none early, none lost, none over a cap).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bench-lib.sh"
JOBS=${BENCH_JOBS:-200000}
USERS=${BENCH_USERS:-50000}
ROUNDS=${ROUNDS:-3}
RELEASE=${RELEASE:-1}

# drop: no hold policy anywhere; hold: one rules-wide policy, the segments' own removed.
sed 's/^  on_capped: {policy: drop}/  on_capped: {policy: hold, max_hold: 48h}/' "$work/drop.yaml" >"$work/hold.yaml"
grep -q 'on_capped: {policy: hold, max_hold: 48h}' "$work/hold.yaml" || { echo "bench-hold: cannot derive the hold config" >&2; exit 1; }
sed -e 's/max_hold: 48h/max_hold: 2m/' -e 's/window: 24h/window: 10s/g' -e 's/window: 7d/window: 30s/g' "$work/hold.yaml" >"$work/release.yaml"

run() { # run POLICY -> prints "jobs_per_sec cpu_us held_share"
  local out rc=0
  out=$(watched env DEMO_CONFIG="$work/$1.yaml" DEMO_JOBS=$JOBS DEMO_USERS=$USERS scripts/demo.sh) || rc=$? # under bench-lib.sh's stall watcher
  echo "$out" >"$work/$1.out"
  if ((rc)) || ! grep -q '"unaccounted":0,"violations":0' <<<"$out"; then
    echo "$out" >&2; echo "bench-hold: $1 run failed" >&2; exit 1
  fi
  echo "$out" | grep -E '^(  (decisions|holds|throughput|checks)|worker:)' | sed "s/^/  [$1] /" >&2
  python3 - "$(grep '^{"jobs"' <<<"$out" | tail -1)" "$(grep '^worker:' <<<"$out" | tail -1)" <<'PY'
import json, re, sys
r = json.loads(sys.argv[1])
cpu = re.search(r'\(([\d.]+) us/job\)', sys.argv[2]).group(1)
print(r["jobs_per_sec"], cpu, r["held"] / r["jobs"])
PY
}

echo "bench-hold: $JOBS jobs for $USERS users, $ROUNDS rounds, $(nproc) cores" >&2
for i in $(seq "$ROUNDS"); do
  run drop >>"$work/drop.txt"
  run hold >>"$work/hold.txt"
done
python3 - "$work/drop.txt" "$work/hold.txt" <<'PY'
import statistics, sys
def load(p):
    rows = [list(map(float, l.split())) for l in open(p) if l.strip()]
    return [statistics.median(c) for c in zip(*rows)], [r[0] for r in rows]
(djps, dcpu, _), dall = load(sys.argv[1])
(hjps, hcpu, hshare), hall = load(sys.argv[2])
print(f"drop  {djps:9.0f} jobs/s (median of {[round(x) for x in dall]}), worker CPU {dcpu:.1f} us/job")
print(f"hold  {hjps:9.0f} jobs/s (median of {[round(x) for x in hall]}), worker CPU {hcpu:.1f} us/job, {100*hshare:.0f}% of jobs held")
print(f"hold / drop  {hjps/djps:.2f} throughput, {hcpu/dcpu:.2f} CPU per job")
PY
if ((RELEASE)); then
  read -r rjps _ _ < <(run release)
  python3 - "$(grep -h '^{"jobs"' "$work/release.out" | tail -1)" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
print(f"release run: {r['held']} holds, {r['released']} released jobs decided, release lag p50 {r['release_p50_ms']:.0f} ms, p99 {r['release_p99_ms']:.0f} ms; "
      f"{r['unaccounted']} unaccounted, {r['violations']} violations, {r['pending']} still held")
PY
fi
stalled_runs
