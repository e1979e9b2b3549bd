#!/usr/bin/env bash
# bench-e2e.sh (make bench-e2e, make bench-cost) — what a job costs each process, and the throughput, on this
# machine in one run, alternated ROUNDS times (default 3; each round runs them in the reverse order of the
# round before):
#   1. capper: BENCH_JOBS jobs (default 1,000,000) for BENCH_USERS users through demo.sh (loadgen ->
#      capper run -> report), with the near cache (the default), on bench-lib's decide.yaml (the drop path,
#      without arbitration windows: every job decided within the run, which each run checks);
#   2. the same with the near cache off (redis.near_cache_size 0);
#   2b. the same with the near cache on and redis.script_only (every decision by the script, no new log
#      written with SET NX: what that path saves);
#   3. pass-through baseline: the same consume -> produce -> commit path with capping skipped
#      (cmd/capper-passthrough: the same daemon with capping skipped);
# then scripts/bench-calls.sh (what one call of the seed's script, of capping/decide.lua (FCALL, as capper calls it, and EVALSHA), of a bare script and of
# decide.lua's floor (its GET and APPEND alone), of a new log's SET PX alone and of the seed with a TTL on its key,
# and decide.lua per decision when it decides 16 users in one call, as capper calls it
# costs the Redis masters, and decide.lua's mode 4 (a send the near cache allowed from its whole copy of the
# log: GET, compare, APPEND) per call and at 16 per call, medians of 3; once with the default 250,000 users, mostly first sends, and once with
# 50,000, six calls each: logs with a history) and the FCALL ceiling of decide.lua (bench-capping.sh, median of 3).
# BENCH_WORKLOAD names the workload: stream (the default: loadgen produces the blast while the worker decides
# it) or backlog (the whole blast is in Kafka before the worker starts, demo.sh's DEMO_PREPRODUCE: full fetches,
# the worker never waits on the producer, as after a scheduler released a campaign); make bench-cost runs both.
# BENCH_CALLS=0 leaves out the per-call benchmarks and the ceiling (the job rows and their ratios only).
# BENCH_REDIS_CORE=1 gives the Redis Cluster its own core, as production gives it its own hosts: its nodes and
# the S3 endpoint (and loadgen and the report, which only measure) run on the last core, the broker and the
# worker on the others (taskset), in every run, the pass-through's too; the job rows' ratios then compare what
# capper and the pass-through get from the same cores, not also what Redis takes from them.
# Each run goes under bench-lib.sh's stall watcher (watched: its wakeups' lateness printed, run again if the
# machine stalled). Prints the medians: jobs/s; the Redis masters' CPU per job (INFO cpu), the worker's and the broker's (Apache
# Kafka's JVM) from /proc, from the worker's start to the drain; script calls and cache hits per job; and
# the ratios against the seed's script and the pass-through.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bench-lib.sh"
JOBS=${BENCH_JOBS:-1000000}
USERS=${BENCH_USERS:-250000}
ROUNDS=${ROUNDS:-3}
WORKLOAD=${BENCH_WORKLOAD:-stream}
CALLS=${BENCH_CALLS:-1}
REDIS_CORE=${BENCH_REDIS_CORE:-0}
case $WORKLOAD in
stream) preproduce=0 ;;
backlog) preproduce=1 ;;
*) echo "bench-e2e: BENCH_WORKLOAD is stream or backlog, not $WORKLOAD" >&2; exit 2 ;;
esac

run() { # run LABEL PASSTHROUGH(0|1) CACHE_SIZE [SCRIPT_ONLY] -> prints "jobs_per_sec cpu_us calls_per_job hits_per_job broker_us redis_us sent_per_job new_logs appends in_full" (the last four per job)
  local out
  local rc=0
  out=$(watched env CAPPER_REDIS_NEAR_CACHE_SIZE=$3 CAPPER_REDIS_SCRIPT_ONLY=${4:-false} DEMO_CONFIG="$work/decide.yaml" DEMO_JOBS=$JOBS DEMO_USERS=$USERS DEMO_PASSTHROUGH="$2" DEMO_PREPRODUCE=$preproduce \
    "${on_last[@]}" scripts/demo.sh) || rc=$?
  # The baseline forwards everything, so its report finds cap violations; it must still lose nothing.
  if { [[ $2 != 1 ]] && ((rc)); } || ! grep -q '"unaccounted":0,' <<<"$out"; then
    echo "$out" >&2; echo "bench-e2e: $1 run failed" >&2; exit 1
  fi
  # Every job decided within the run, none left on a delay tier (its decision's cost would be missing).
  if ! grep -q '"pending":0,' <<<"$out"; then
    echo "$out" >&2; echo "bench-e2e: $1 run left jobs pending on the delay tiers: the figures would leave out their decisions" >&2; exit 1
  fi
  echo "$out" | grep -E '^(  (decisions|throughput|checks)|worker:|broker:|redis:|redis calls:)' | sed "s/^/  [$1] /" >&2
  local json worker broker redis drain
  json=$(echo "$out" | grep '^{"jobs"' | tail -1)
  drain=$(echo "$out" | grep '^drain:' | tail -1) # a backlog's: jobs/s from the worker's start (the report's count the produce too)
  worker=$(echo "$out" | grep '^worker:' | tail -1)
  broker=$(echo "$out" | grep '^broker:' | tail -1)
  redis=$(echo "$out" | grep '^redis:' | tail -1)
  python3 - "$json" "$worker" "$broker" "$redis" "$drain" <<'PY'
import json, re, sys
r = json.loads(sys.argv[1])
if sys.argv[5]:
    r["jobs_per_sec"] = float(re.search(r'\(([\d.]+) jobs/s\)', sys.argv[5]).group(1))
m = re.search(r'\(([\d.]+) us/job\).*?([\d.]+) script calls/job, ([\d.]+) decisions sent to redis/job, ([\d.]+) near cache hits/job', sys.argv[2])
k = re.search(r'per job: ([\d.]+) new logs, ([\d.]+) appends to a whole copy, ([-\d.]+) decided in full', sys.argv[2])
b = re.search(r'\(([\d.]+) us/job\)', sys.argv[3])
d = re.search(r'\(([\d.]+) us/job\)', sys.argv[4])
print(r["jobs_per_sec"], m.group(1), m.group(2), m.group(4), b.group(1), d.group(1), m.group(3), k.group(1), k.group(2), k.group(3))
PY
}

on_last=()
placement=''
if ((REDIS_CORE)); then
  cores=$(nproc)
  ((cores >= 2)) || { echo "bench-e2e: BENCH_REDIS_CORE=1 needs 2 cores or more, this machine has $cores" >&2; exit 2; }
  last=$((cores - 1))
  eval "$(scripts/stack.sh env)"
  pin() { # pin CPUS PIDFILE...: every thread of each process onto CPUS
    local cpus=$1 f; shift
    for f in "$@"; do taskset -a -p -c "$cpus" "$(cat "$f")" >/dev/null; done
  }
  stack_pids=("$CAPPER_STACK_DIR"/redis/*.pid "$CAPPER_STACK_DIR/s3.pid")
  unpin() { pin "0-$last" "${stack_pids[@]}" "$CAPPER_STACK_DIR/kafka/kafka.pid"; }
  at_exit+=(unpin)
  pin "$last" "${stack_pids[@]}"
  pin "0-$((last - 1))" "$CAPPER_STACK_DIR/kafka/kafka.pid"
  on_last=(taskset -c "$last")
  export DEMO_WORKER_CPUS=0-$((last - 1))
  rest="cores $DEMO_WORKER_CPUS"
  ((last > 1)) || rest="core 0"
  placement=" (Redis, the S3 endpoint, loadgen and the report on core $last; the broker and the worker on $rest)"
fi
echo "bench-e2e: the $WORKLOAD workload, $JOBS jobs for $USERS users on $(nproc) cores$placement, $ROUNDS rounds" >&2
results=()
# The runs of a round go in one order, then the next round's in the reverse: the machine drifts (other
# guests, the page cache, the broker's segments), and a fixed order would hand the drift to whichever run
# comes last.
variants=(cache nocache scriptonly pass)
for r in $(seq "$ROUNDS"); do
  order=()
  for v in "${variants[@]}"; do
    if ((r % 2 == 0)); then order=("$v" "${order[@]}"); else order+=("$v"); fi
  done
  echo "round $r: ${order[*]}" >&2
  for v in "${order[@]}"; do
    case $v in
      cache) results+=("cache $(run cache 0 1000000)") ;;
      nocache) results+=("nocache $(run nocache 0 0)") ;;
      scriptonly) results+=("scriptonly $(run scriptonly 0 1000000 true)") ;;
      pass) results+=("pass $(run passthrough 1 0)") ;;
    esac
  done
done
calls='' history='' ceiling=0
if ((REDIS_CORE)); then
  unpin # the per-call benchmarks below measure Redis alone
fi
if ((CALLS)); then
  calls=$(scripts/bench-calls.sh)
  # The same with logs that have a history: 50,000 users for the 300,000 calls (six each), where the default's
  # 250,000 users make most calls a user's first send (a SET of a new log, no entries to read).
  history=$(USERS=50000 scripts/bench-calls.sh)
  ceiling=$(CEILING_ONLY=1 ROUNDS=3 scripts/bench-capping.sh)
fi
summary=$(cat <<'PY'
import statistics, sys
ceil = float(sys.argv[1])
call = dict(zip(sys.argv[2].split()[::2], map(float, sys.argv[2].split()[1::2])))  # empty with BENCH_CALLS=0
hist = dict(zip(sys.argv[3].split()[::2], map(float, sys.argv[3].split()[1::2])))
rows = {}
for line in sys.stdin:
    label, *vals = line.split()
    rows.setdefault(label, []).append([float(v) for v in vals])
med = {k: [statistics.median(col) for col in zip(*v)] for k, v in rows.items()}
each = {k: ", ".join("%.0f" % v[0] for v in vs) for k, vs in rows.items()}
c, n, p = med["cache"], med["nocache"], med["pass"]
print("| what | Redis masters CPU per job | worker CPU per job | broker CPU per job | jobs/s (rounds) |")
print("|---|---|---|---|---|")
def sent(v):  # decisions sent to Redis per job, and by kind
    return "%.2f decisions sent: %.2f new logs, %.2f appends to a whole copy, %.2f decided in full by the script" % (v[6], v[7], v[8], v[9])
print("| capper, near cache on | %.1f us (%s; %.3f script calls) | %.1f us | %.1f us | %.0f (%s) |" % (c[5], sent(c), c[2], c[1], c[4], c[0], each["cache"]))
print("| capper, near cache off | %.1f us (%s; %.3f calls) | %.1f us | %.1f us | %.0f (%s) |" % (n[5], sent(n), n[2], n[1], n[4], n[0], each["nocache"]))
so = med["scriptonly"]
print("| capper, near cache on, script only (no new logs by SET NX) | %.1f us (%s; %.3f calls) | %.1f us | %.1f us | %.0f (%s) |" % (so[5], sent(so), so[2], so[1], so[4], so[0], each["scriptonly"]))
print("| pass-through (no capping) | %.1f us | %.1f us | %.1f us | %.0f (%s) |" % (p[5], p[1], p[4], p[0], each["pass"]))
ratios = [cw[1] / pw[1] for cw, pw in zip(rows["cache"], rows["pass"])]  # worker CPU per job, round by round
def job_ratios():
    print("worker CPU per job (cache on) / pass-through %5.2f   (median of the rounds' ratios %.2f: %s; goal <= 1.15)" % (c[1] / p[1], statistics.median(ratios), " / ".join("%.2f" % r for r in ratios)))
    print("worker CPU per job, cache on / cache off     %5.2f   (goal <= 1.0)" % (c[1] / n[1]))
    print("jobs/s (cache on) / pass-through             %5.0f%%  (goal >= 75%%)" % (100 * c[0] / p[0]))
    print("jobs/s (cache on) / cache off                %5.2fx" % (c[0] / n[0]))
if not call:
    print()
    job_ratios()
    sys.exit(0)
print("| the seed's script, per call | %.1f us | - | - | - |" % call["seed"])
print("| capper's decide.lua, per call (FCALL of its function library, as capper calls it) | %.1f us | - | - | - |" % call["decide"])
print("| decide.lua called as a script (EVALSHA: its local functions made on every call), per call; with a history | %.1f / %.1f us | - | - | - |" % (call["evalsha"], hist["evalsha"]))
print("| an EVALSHA that only returns, per call | %.1f us | - | - | - |" % call["bare"])
print("| GET and APPEND of the log in a script (decide.lua's floor), per call | %.1f us | - | - | - |" % call["floor"])
print("| decide.lua deciding 16 users of one node in one call (as capper calls it), per decision | %.1f us | - | - | - |" % call["batch"])
print("| decide.lua recording a send the near cache's whole copy allowed (mode 4: GET, compare, APPEND), per call / per decision at 16 per call | %.1f / %.1f us | - | - | - |" % (call["copy1"], call["copy"]))
print("| with a history (50k users, six calls each): seed / decide.lua / decide.lua 16 per call, per decision | %.1f / %.1f / %.1f us | - | - | - |" % (hist["seed"], hist["decide"], hist["batch"]))
print("| a new log's SET PX alone (what any sliding log whose keys expire pays for a first send), per call; with a history | %.1f / %.1f us | - | - | - |" % (call["newkey"], hist["newkey"]))
print("| the seed with a PEXPIRE of its key (its sorted sets never expire), per call; with a history | %.1f / %.1f us | - | - | - |" % (call["seedttl"], hist["seedttl"]))
print()
print("Redis per job (cache on) / seed per call     %5.2f   (goal <= 0.3)" % (c[5] / call["seed"]))
print("decide.lua per call / seed per call          %5.2f   (goal <= 1.0)" % (call["decide"] / call["seed"]))
print("decide.lua per decision, 16 per call / seed   %5.2f   (as capper calls it)" % (call["batch"] / call["seed"]))
print("decide.lua mode 4 (a whole copy's send) / seed %5.2f per call, %.2f per decision at 16 per call" % (call["copy1"] / call["seed"], call["copy"] / call["seed"]))
print("with a history: decide.lua / seed, per call   %5.2f   16 per call, per decision / seed %5.2f" % (hist["decide"] / hist["seed"], hist["batch"] / hist["seed"]))
print("16 users per call / one per call (decide.lua) %5.2f   (batching users of one node in one call)" % (call["batch"] / call["decide"]))
print("decide.lua FCALL / EVALSHA, per call         %5.2f   with a history %.2f (its function library)" % (call["decide"] / call["evalsha"], hist["decide"] / hist["evalsha"]))
print("decide.lua EVALSHA / its floor, per call     %5.2f   (what its logic adds to the commands it needs; both scripts)" % (call["evalsha"] / call["floor"]))
print("floor / seed, per call                       %5.2f   with a history %.2f (below 1.0 leaves decide.lua's logic room under the seed)" % (call["floor"] / call["seed"], hist["floor"] / hist["seed"]))
print("a new log's SET PX alone / seed, per call    %5.2f   (a key with a TTL, nothing else)" % (call["newkey"] / call["seed"]))
print("decide.lua / the seed with a TTL, per call   %5.2f   with a history %.2f; 16 per call, per decision %.2f" % (call["decide"] / call["seedttl"], hist["decide"] / hist["seedttl"], call["batch"] / call["seedttl"]))
job_ratios()
print("Redis per job: new logs by SET NX / script only %5.2f   (jobs/s %.2fx)" % (c[5] / so[5], c[0] / so[0]))
print("jobs/s (cache on) / decide.lua FCALL ceiling (%.0f/s) %.0f%%" % (ceil, 100 * c[0] / ceil))
PY
)
printf '%s\n' "${results[@]}" | python3 -c "$summary" "$ceiling" "$calls" "$history"
stalled_runs
