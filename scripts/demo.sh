#!/usr/bin/env bash
# demo.sh — capper doing its real job on the local stack, end to end:
#   1. brings the local stack up (Redis Cluster, Apache Kafka, S3 endpoint) unless it runs already;
#   2. builds segment bitmaps for users 1..DEMO_USERS (new 20%, active 40%, dormant 20%, the rest in no
#      segment) and uploads them to the local S3 endpoint;
#   3. starts `capper run` with config.example.yaml (or DEMO_CONFIG; topics, delay tiers, group, key prefix
#      and segment prefix unique to this run, through CAPPER_* overrides);
#   4. `capper loadgen` sends DEMO_JOBS jobs (default 200,000) for DEMO_USERS users (default 50,000) with
#      repeat sends, redeliveries, exempt and malformed jobs;
#   5. `capper report` waits for the worker to drain and checks every job and every cap; jobs held for longer
#      than the run (config.example.yaml holds the capped sends of new users for their slot, about a day
#      later) are reported as pending; its last line is JSON;
#   6. stops the worker, drops the run's Redis keys and topics (DEMO_KEEP_KEYS=1, DEMO_KEEP_TOPICS=1 keep them), and the stack if this script started it. Exits with the report's status.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
JOBS=${DEMO_JOBS:-200000}
USERS=${DEMO_USERS:-50000}
PARTITIONS=${DEMO_PARTITIONS:-6}
METRICS=${DEMO_METRICS_ADDR:-127.0.0.1:9464}
PASSTHROUGH=${DEMO_PASSTHROUGH:-0}  # 1: run capper-passthrough (capping skipped), bench-e2e.sh's baseline
WORKER_BIN=${DEMO_WORKER_BIN:-}     # a capper binary to run as the worker (another commit's: bench-lifetime.sh); loadgen and report are the tree's
PREPRODUCE=${DEMO_PREPRODUCE:-0}    # 1: produce the blast before the worker starts (see below)
WORKER_CPUS=${DEMO_WORKER_CPUS:-}   # a CPU list (taskset -c): every worker runs on these CPUs alone (bench-e2e.sh's
                                     # BENCH_REDIS_CORE)
CONFIG=${DEMO_CONFIG:-config.example.yaml}
EXTRA_WORKERS=${DEMO_EXTRA_WORKERS:-0} # more replicas in the group (metrics on the next ports); the figures are the first's
LOADGEN_ARGS=${DEMO_LOADGEN_ARGS:-}   # more capper loadgen flags, e.g. "--rate 150 --channels sms" (bench-budget.sh)
PREFS_SHARE=${DEMO_PREFS_SHARE:-}    # users' own preferences: the run's preferences topic, and this share of the
                                     # users with one (a limit, an opt-out or VIP) before the blast
KILL_AFTER=${DEMO_KILL_AFTER:-}      # seconds: SIGKILL the last extra worker this long after the workers are ready
RESTART_AFTER=${DEMO_RESTART_AFTER:-} # seconds: start it again this long after the SIGKILL (same metrics address)
KEY_PREFIX=${DEMO_KEY_PREFIX:-}     # the users' Redis keys' prefix (default: the run's own): a run given the prefix
                                     # of an earlier one kept with DEMO_KEEP_KEYS=1 decides for users with history
WORKSPACES=${DEMO_WORKSPACES:-0}     # N > 0: CONFIG's rules as N identical workspaces ws-1..ws-N, the users in N
                                     # contiguous blocks, one per workspace (loadgen --workspace), each
                                     # workspace's bitmaps holding its users; the report judges the blast by
                                     # CONFIG itself: every workspace's rules are its rules, their bitmaps together its bitmaps
REPORT_CONFIG=$CONFIG
# DEMO_KEEP_KEYS=1 keeps the run's Redis keys (dropped at the end otherwise, see cleanup)
# DEMO_KEEP_TOPICS=1 keeps the run's topics (deleted at the end otherwise, see cleanup)

say() { printf '\n== %s\n' "$*" >&2; }

started_stack=0
if ! scripts/stack.sh status >/dev/null 2>&1; then
  say "starting the local stack"
  scripts/stack.sh up >&2
  started_stack=1
fi
eval "$(scripts/stack.sh env)"
work=$(mktemp -d)
worker_pid=""
extra_pids=()
cleanup() {
  for p in $worker_pid "${extra_pids[@]}" $(cat "$work/restarted.pid" 2>/dev/null); do
    if kill -0 "$p" 2>/dev/null; then
      kill -TERM "$p" 2>/dev/null || true
      wait "$p" 2>/dev/null || true
      for _ in $(seq 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done # a restarted worker is not our child
    fi
  done
  # The run's keys go (DEMO_KEEP_KEYS=1 keeps them): a run of 1M jobs leaves ~250k logs with TTLs of days, and
  # benchmarks that run demo.sh again and again would otherwise measure a keyspace that grows from round to round.
  if [[ -n ${keys:-} && ${DEMO_KEEP_KEYS:-0} != 1 ]] && ! ((started_stack)); then
    "$CAPPER_STACK_DIR/bin/capper-devstack" drop-keys -addrs "$CAPPER_TEST_REDIS_ADDRS" -prefix "$keys:" >/dev/null ||
      echo "demo: could not drop the run's keys ($keys:*)" >&2
  fi
  # The run's topics go too (DEMO_KEEP_TOPICS=1 keeps them): the broker keeps its data across restarts, and a
  # benchmark's runs would otherwise fill the disk (1M jobs leave ~1 GB on the broker).
  if [[ -n ${run:-} && ${DEMO_KEEP_TOPICS:-0} != 1 ]]; then
    "$CAPPER_STACK_DIR/bin/capper-devstack" drop-topics -brokers "$CAPPER_TEST_KAFKA_BROKERS" -prefix "$run." >/dev/null ||
      echo "demo: could not delete the run's topics ($run.*)" >&2
  fi
  ((started_stack)) && scripts/stack.sh down >&2
  rm -rf "$work"
}
trap cleanup EXIT

say "building capper"
go build -o "$CAPPER_STACK_DIR/bin/capper" ./cmd/capper
go build -o "$work/capper-devstack" ./cmd/capper-devstack # wait-groups (the stack's own copy may be older)
capper="$CAPPER_STACK_DIR/bin/capper"
worker=("$capper" run)
if [[ -n $WORKER_BIN ]]; then
  worker=("$WORKER_BIN" run)
fi
if ((PASSTHROUGH)); then
  go build -o "$CAPPER_STACK_DIR/bin/capper-passthrough" ./cmd/capper-passthrough
  worker=("$CAPPER_STACK_DIR/bin/capper-passthrough")
fi
if [[ -n $WORKER_CPUS ]]; then
  worker=(taskset -c "$WORKER_CPUS" "${worker[@]}")
fi

run="demo-$(date +%s)-$$"
keys=${KEY_PREFIX:-$run}
export AWS_ACCESS_KEY_ID=demo AWS_SECRET_ACCESS_KEY=demo AWS_REGION=us-east-1
export CAPPER_SEGMENTS_S3_ENDPOINT=$CAPPER_TEST_S3_ENDPOINT CAPPER_SEGMENTS_S3_PATH_STYLE=true
export CAPPER_KAFKA_BROKERS=$CAPPER_TEST_KAFKA_BROKERS CAPPER_KAFKA_GROUP_ID=$run
export CAPPER_KAFKA_TOPICS_INPUT=$run.sends CAPPER_KAFKA_TOPICS_ALLOWED=$run.sends.allowed
export CAPPER_KAFKA_TOPICS_CAPPED=$run.sends.capped CAPPER_KAFKA_TOPICS_DLQ=$run.sends.dlq
export CAPPER_KAFKA_TOPICS_HELD=$run.sends.held CAPPER_KAFKA_TOPICS_DELAY_PREFIX=$run.sends.delay.
export CAPPER_REDIS_ADDRS=$CAPPER_TEST_REDIS_ADDRS CAPPER_REDIS_KEY_PREFIX=$keys
export CAPPER_SEGMENTS_SOURCE="s3://$CAPPER_TEST_S3_BUCKET/$run" CAPPER_METRICS_ADDR=$METRICS
export CAPPER_LOG_LEVEL=${CAPPER_LOG_LEVEL:-warn}
if [[ -n $PREFS_SHARE ]]; then
  ((PREPRODUCE)) && { echo "demo: DEMO_PREFS_SHARE needs the worker running before loadgen (not DEMO_PREPRODUCE)" >&2; exit 2; }
  export CAPPER_KAFKA_TOPICS_PREFERENCES=$run.sends.prefs
  LOADGEN_ARGS="$LOADGEN_ARGS --prefs-share $PREFS_SHARE"
fi

say "segments for users 1..$USERS: new, active, dormant (the rest get the default caps)"
mkdir -p "$work/segments"
a=$((USERS / 5)) b=$((USERS * 3 / 5)) c=$((USERS * 4 / 5))
seq 1 "$a" | "$capper" segments build --name new --out "$work/segments/new.roaring"
seq $((a + 1)) "$b" | "$capper" segments build --name active --out "$work/segments/active.roaring"
seq $((b + 1)) "$c" | "$capper" segments build --name dormant --out "$work/segments/dormant.roaring"
"$capper" segments upload "$work/segments" "s3://$CAPPER_TEST_S3_BUCKET/$run"

if ((WORKSPACES > 0)); then
  say "$WORKSPACES workspaces with the rules of $CONFIG"
  block=$(((USERS + WORKSPACES - 1) / WORKSPACES)) # as loadgen --workspace gives them
  for i in $(seq "$WORKSPACES"); do # its own users of each segment
    mkdir -p "$work/ws-segments/$i"
    for seg in new:1:$a active:$((a + 1)):$b dormant:$((b + 1)):$c; do
      IFS=: read -r name lo hi <<<"$seg"
      seq "$lo" "$hi" | awk -v from=$(((i - 1) * block + 1)) -v to=$((i * block)) '$1 >= from && $1 <= to' |
        "$capper" segments build --name "$name" --out "$work/ws-segments/$i/$name.roaring" >/dev/null
    done
    "$capper" segments upload "$work/ws-segments/$i" "s3://$CAPPER_TEST_S3_BUCKET/$run/ws-$i" >/dev/null
  done
  python3 - "$CONFIG" "$work" "$WORKSPACES" <<'PY'
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
work, n = sys.argv[2], int(sys.argv[3])
rules = cfg.pop("rules")
reload = rules.pop("reload_interval", None)
yaml.safe_dump(rules, open(f"{work}/workspace-rules.yaml", "w"))
cfg["rules"] = {"reload_interval": reload} if reload else {}
cfg["workspaces"] = [{"name": f"ws-{i}", "rules_file": "workspace-rules.yaml"} for i in range(1, n + 1)]
cfg["default_workspace"] = "ws-1"
yaml.safe_dump(cfg, open(f"{work}/workspaces.yaml", "w"))
PY
  CONFIG="$work/workspaces.yaml"
  LOADGEN_ARGS="$LOADGEN_ARGS --workspace $(seq -s, -f 'ws-%g' 1 "$WORKSPACES")"
fi

say "topics $run.sends{,.allowed,.capped,.dlq,.held,.delay.*} with $PARTITIONS partitions"
"$capper" loadgen --config "$CONFIG" --create-topics "$PARTITIONS" --jobs 0 --manifest /dev/null

loadgen() {
  say "loadgen: $JOBS jobs for $USERS users"
  # shellcheck disable=SC2086 # LOADGEN_ARGS is a list of flags
  "$capper" loadgen --config "$CONFIG" --jobs "$JOBS" --users "$USERS" --seed 42 --manifest "$work/manifest.csv" $LOADGEN_ARGS
}
# DEMO_PREPRODUCE=1: the whole blast is in Kafka before the worker starts (a backlog to drain, as when a
# scheduler dumps a campaign at once); the drain line then times the worker alone.
((PREPRODUCE)) && loadgen

say "starting capper run (metrics on http://$METRICS/metrics)"
"${worker[@]}" --config "$CONFIG" 2>"$work/worker.log" &
worker_pid=$!
metrics_addrs=("$METRICS")
for i in $(seq "$EXTRA_WORKERS"); do
  addr="${METRICS%:*}:$((${METRICS##*:} + i))"
  CAPPER_METRICS_ADDR=$addr "${worker[@]}" --config "$CONFIG" 2>"$work/worker$i.log" &
  extra_pids+=($!)
  metrics_addrs+=("$addr")
done
worker_started=$(date +%s.%N)
# The broker's CPU from the worker's start to the drain: the jobs' produce (unless produced before), the
# fetches, the outputs and the commits.
broker_pid=$(cat "$CAPPER_STACK_DIR/kafka/kafka.pid")
broker_ticks() { awk '{print $14 + $15}' "/proc/$broker_pid/stat"; }
broker_start=$(broker_ticks)
# The Redis Cluster masters' CPU over the same span (INFO cpu: user + sys seconds): what the decisions cost
# the resource a deployment sizes first. Replicas are left out (they replay the writes).
source scripts/redis-cpu.sh
redis_start=$(redis_masters_cpu ${CAPPER_TEST_REDIS_ADDRS//,/ })
redis_masters_commands ${CAPPER_TEST_REDIS_ADDRS//,/ } >"$work/redis-commands.start"
for addr in "${metrics_addrs[@]}"; do for _ in $(seq 300); do
  curl -fsS "http://$addr/readyz" >/dev/null 2>&1 && break
  kill -0 "$worker_pid" 2>/dev/null || { cat "$work/worker.log" >&2; echo "demo: capper run exited" >&2; exit 1; }
  sleep 0.1
done; done
for addr in "${metrics_addrs[@]}"; do
  curl -fsS "http://$addr/readyz" >/dev/null || { cat "$work"/worker*.log >&2; echo "demo: capper ($addr) not ready after 30 s" >&2; exit 1; }
done
ready_ticks=$(awk '{print $14 + $15}' "/proc/$worker_pid/stat") # its start-up's CPU (segments loaded, rules compiled)

# A worker is ready before its groups have given it partitions. Workers that start together join each of their
# groups (the input's, one per delay tier) one after another, and each join is a rebalance: a burst produced
# meanwhile has the tiers' messages in flight redelivered to their new owners and decided again (duplicates).
# On a broker that had just started, a lone worker's run once decided nothing in its first seconds, then all the
# demand produced meanwhile at once. The runs measure steady behaviour, so the demand starts once every group the
# config gives the workers (a group not created yet too) is stable with every worker; a rebalance's cost is the
# SIGKILL's to show.
"$work/capper-devstack" wait-groups -brokers "$CAPPER_TEST_KAFKA_BROKERS" -config "$CONFIG" -members $((EXTRA_WORKERS + 1)) >&2 ||
  { echo "demo: the workers' consumer groups did not settle" >&2; exit 1; }
if [[ -n $KILL_AFTER ]] && ((EXTRA_WORKERS)); then
  victim=${extra_pids[-1]} victim_addr=${metrics_addrs[-1]}
  (
    sleep "$KILL_AFTER"
    kill -KILL "$victim" 2>/dev/null && echo "demo: SIGKILLed worker $victim at $(date +%s.%N)" >&2
    if [[ -n $RESTART_AFTER ]]; then
      sleep "$RESTART_AFTER"
      CAPPER_METRICS_ADDR=$victim_addr "${worker[@]}" --config "$CONFIG" 2>"$work/restarted.log" &
      echo $! >"$work/restarted.pid"
      echo "demo: restarted it as $! at $(date +%s.%N)" >&2
    fi
  ) &
fi
((PREPRODUCE)) || loadgen

say "waiting for capper to drain"
for _ in $(seq 1800); do
  handled=$(for addr in "${metrics_addrs[@]}"; do curl -fsS -m 2 "http://$addr/metrics" 2>/dev/null || true; done | awk '/^capper_jobs_total\{/ {n += $2} END {printf "%d", n}')
  ((handled >= JOBS)) && break
  kill -0 "$worker_pid" 2>/dev/null || break
  sleep 0.2
done
drained=$(date +%s.%N)
broker_end=$(broker_ticks)
redis_end=$(redis_masters_cpu ${CAPPER_TEST_REDIS_ADDRS//,/ })
redis_masters_commands ${CAPPER_TEST_REDIS_ADDRS//,/ } >"$work/redis-commands.end"
echo "capper handled $handled of $JOBS jobs" >&2
if ((PREPRODUCE)); then
  awk -v a="$worker_started" -v b="$drained" -v n="$handled" 'BEGIN { printf "drain: %d jobs in %.1f s from worker start (%.0f jobs/s)\n", n, b - a, n / (b - a) }' >&2
fi

say "report"
status=0
"$capper" report --config "$REPORT_CONFIG" --manifest "$work/manifest.csv" --idle 30s || status=$?

# Every replica lives (and answers) to the end but the one SIGKILLed on purpose: the report finds nothing lost when one dies
# (its partitions move to the others), but the run did not measure what it says, and a death is a defect.
for i in "${!extra_pids[@]}"; do
  p=${extra_pids[$i]}
  [[ $p == "${victim:-}" ]] && continue
  if ! kill -0 "$p" 2>/dev/null; then
    rc=0; wait "$p" || rc=$?
    echo "demo: replica $((i + 2)) (capper run) exited during the run (status $rc); its log:" >&2
    tail -50 "$work/worker$((i + 1)).log" >&2
    exit 1
  fi
  if ! curl -fsS -m 5 "http://${metrics_addrs[$((i + 1))]}/metrics" >/dev/null; then # alive but hung
    echo "demo: replica $((i + 2)) (capper run) did not answer on ${metrics_addrs[$((i + 1))]} within 5 s; its log:" >&2
    tail -50 "$work/worker$((i + 1)).log" >&2
    exit 1
  fi
done
if [[ -s $work/restarted.pid ]] && ! kill -0 "$(cat "$work/restarted.pid")" 2>/dev/null; then
  echo "demo: the restarted replica exited during the run; its log:" >&2
  tail -50 "$work/restarted.log" >&2
  exit 1
fi

# The worker's own cost: CPU time from /proc, batches and Redis round trips from its metrics.
if ! kill -0 "$worker_pid" 2>/dev/null; then
  rc=0; wait "$worker_pid" || rc=$?
  echo "demo: capper run exited during the run (status $rc); its log:" >&2
  tail -50 "$work/worker.log" >&2
  exit 1
fi
ticks=$(awk '{print $14 + $15}' "/proc/$worker_pid/stat")
rss=$(awk '/^VmHWM:/ {print $2}' "/proc/$worker_pid/status") # peak resident set, KiB
awk -v t=$((ticks - ready_ticks)) -v s="$ready_ticks" -v hz="$(getconf CLK_TCK)" -v jobs="$JOBS" 'BEGIN {
  printf "worker after start-up: cpu %.1f s (%.1f us/job) from ready to the report'"'"'s end; start-up %.1f s\n", t/hz, 1e6*t/hz/jobs, s/hz }' 
curl -fsS "http://$METRICS/metrics" | awk -v ticks="$ticks" -v hz="$(getconf CLK_TCK)" -v jobs="$JOBS" -v rss="$rss" '
  /^capper_batch_size_count/ {batches=$2} /^capper_batch_size_sum/ {handled=$2}
  /^capper_redis_round_trips_per_batch_sum/ {rt=$2} /^capper_redis_round_trips_per_batch_count/ {rtn=$2}
  /^capper_budget_redis_calls_total\{/ {bc+=$2}
  /^capper_budget_tokens_total\{/ {split($1, k, "kind=\""); split(k[2], kk, "\""); tok[kk[1]] += $2}
  /^capper_decide_script_calls_total / {sc=$2} /^capper_decide_redis_requests_total / {rq=$2} /^capper_near_cache_hits_total / {hits=$2}
  /^capper_decide_new_logs_total / {nl=$2} /^capper_near_cache_appends_total / {ap=$2}
  END { cpu=ticks/hz; printf "worker: cpu %.1f s (%.1f us/job), %d batches (%.0f jobs/batch), %.2f redis round trips/batch, %.3f script calls/job, %.3f decisions sent to redis/job, %.3f near cache hits/job, %d budget redis calls (tokens: %d granted, %d used, %d put back, %d lapsed), peak rss %.0f MiB; decisions sent to redis by kind, per job: %.3f new logs, %.3f appends to a whole copy, %.3f decided in full by the script\n",
        cpu, 1e6*cpu/jobs, batches, (batches ? handled/batches : 0), (rtn ? rt/rtn : 0), sc/jobs, rq/jobs, hits/jobs, bc, tok["granted"], tok["used"], tok["put_back"], tok["lapsed"], rss/1024, nl/jobs, ap/jobs, (rq - nl - ap)/jobs }'
awk -v t=$((broker_end - broker_start)) -v hz="$(getconf CLK_TCK)" -v jobs="$JOBS" -v pre="$PREPRODUCE" 'BEGIN {
  printf "broker: cpu %.1f s (%.1f us/job) from the worker'"'"'s start to the drain (%s)\n", t/hz, 1e6*t/hz/jobs,
    pre ? "fetches, outputs, commits" : "the jobs'"'"' produce, fetches, outputs, commits" }'
awk -v a="$redis_start" -v b="$redis_end" -v jobs="$JOBS" 'BEGIN {
  printf "redis: masters cpu %.1f s (%.1f us/job) from the worker'"'"'s start to the drain\n", b - a, 1e6*(b - a)/jobs }'
redis_commands_per_job "$work/redis-commands.start" "$work/redis-commands.end" "$JOBS"
kill -TERM "$worker_pid"
if ! wait "$worker_pid"; then
  echo "demo: capper run did not exit cleanly; its log:" >&2
  tail -50 "$work/worker.log" >&2
  status=1
fi
worker_pid=""
if [[ -s $work/worker.log ]]; then
  say "worker warnings and errors"
  lines=$(wc -l <"$work/worker.log")
  if ((lines > 20)); then # the count of each, before the last lines
    echo "$lines lines, by message (numbers as N):" >&2
    sed -nE 's/.*"level":"([A-Z]+)","msg":"([^"]{0,90}).*/\1 \2/p' "$work/worker.log" | sed -E 's/[0-9]+/N/g' |
      sort | uniq -c | sort -rn | head -10 >&2
    echo "the last 20:" >&2
  fi
  tail -20 "$work/worker.log" >&2
fi
exit $status
