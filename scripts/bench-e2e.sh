#!/usr/bin/env bash
# bench-e2e.sh — end-to-end throughput on this machine, in one run, alternated ROUNDS times (default 3):
#   1. capper: BENCH_JOBS jobs (default 1,000,000) for BENCH_USERS users through demo.sh (loadgen ->
#      capper run -> report), with the near cache (the default);
#   2. the same with the near cache off (redis.near_cache_size 0);
#   3. pass-through baseline: the same consume -> produce -> commit path with capping skipped
#      (cmd/capper-passthrough: the same daemon with capping skipped);
# then the redis-benchmark EVALSHA ceiling of the capping script on the same cluster (median of 3), and the
# medians: jobs/s, the ratios, the worker's and the broker's (Apache Kafka's JVM) CPU time per job, script
# calls and cache hits per job.
# Goals (issue 14): capper >= 100% of the ceiling with the cache, >= 80% without; <= 0.6 script calls/job.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bench-lib.sh"
JOBS=${BENCH_JOBS:-1000000}
USERS=${BENCH_USERS:-250000}
ROUNDS=${ROUNDS:-3}

run() { # run LABEL PASSTHROUGH(0|1) CACHE_SIZE -> prints "jobs_per_sec cpu_us calls_per_job hits_per_job broker_us"
  local out
  local rc=0
  out=$(CAPPER_REDIS_NEAR_CACHE_SIZE=$3 DEMO_CONFIG="$work/drop.yaml" DEMO_JOBS=$JOBS DEMO_USERS=$USERS DEMO_PASSTHROUGH="$2" \
    scripts/demo.sh 2>&1) || rc=$?
  # The baseline forwards everything, so its report finds cap violations; it must still lose nothing.
  if { [[ $2 != 1 ]] && ((rc)); } || ! grep -q '"unaccounted":0,' <<<"$out"; then
    echo "$out" >&2; echo "bench-e2e: $1 run failed" >&2; exit 1
  fi
  echo "$out" | grep -E '^(  (decisions|throughput|checks)|worker:|broker:)' | sed "s/^/  [$1] /" >&2
  local json worker broker
  json=$(echo "$out" | grep '^{"jobs"' | tail -1)
  worker=$(echo "$out" | grep '^worker:' | tail -1)
  broker=$(echo "$out" | grep '^broker:' | tail -1)
  python3 - "$json" "$worker" "$broker" <<'PY'
import json, re, sys
r = json.loads(sys.argv[1])
m = re.search(r'\(([\d.]+) us/job\).*?([\d.]+) script calls/job, ([\d.]+) near cache hits/job', sys.argv[2])
b = re.search(r'\(([\d.]+) us/job\)', sys.argv[3])
print(r["jobs_per_sec"], m.group(1), m.group(2), m.group(3), b.group(1))
PY
}

echo "bench-e2e: $JOBS jobs for $USERS users on $(nproc) cores, $ROUNDS rounds" >&2
results=()
for r in $(seq "$ROUNDS"); do
  echo "round $r" >&2
  results+=("cache $(run cache 0 1000000)")
  results+=("nocache $(run nocache 0 0)")
  results+=("pass $(run passthrough 1 0)")
done
ceiling=$(CEILING_ONLY=1 ROUNDS=3 scripts/bench-capping.sh)
summary=$(cat <<'PY'
import statistics, sys
ceil = float(sys.argv[1])
rows = {}
for line in sys.stdin:
    label, *vals = line.split()
    rows.setdefault(label, []).append([float(v) for v in vals])
med = {k: [statistics.median(col) for col in zip(*v)] for k, v in rows.items()}
each = {k: ", ".join("%.0f" % v[0] for v in vs) for k, vs in rows.items()}
c, n, p = med["cache"], med["nocache"], med["pass"]
print("capper, near cache on     %10.0f jobs/s  (rounds: %s; worker CPU %.1f us/job, broker CPU %.1f us/job, %.3f script calls/job, %.3f cache hits/job)" % (c[0], each["cache"], c[1], c[4], c[2], c[3]))
print("capper, near cache off    %10.0f jobs/s  (rounds: %s; worker CPU %.1f us/job, broker CPU %.1f us/job, %.3f script calls/job)" % (n[0], each["nocache"], n[1], n[4], n[2]))
print("pass-through baseline     %10.0f jobs/s  (rounds: %s; worker CPU %.1f us/job, broker CPU %.1f us/job)" % (p[0], each["pass"], p[1], p[4]))
print("redis EVALSHA ceiling     %10.0f decisions/s (redis-benchmark, median of 3)" % ceil)
print("cache on / ceiling        %9.0f%%   (goal >= 100%%)" % (100 * c[0] / ceil))
print("cache off / ceiling       %9.0f%%   (goal >= 80%%)" % (100 * n[0] / ceil))
print("cache on / pass-through   %9.0f%%" % (100 * c[0] / p[0]))
print("cache on / cache off      %9.2fx" % (c[0] / n[0]))
PY
)
printf '%s\n' "${results[@]}" | python3 -c "$summary" "$ceiling"
