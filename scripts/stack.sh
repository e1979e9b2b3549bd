#!/usr/bin/env bash
# stack.sh up|down|status|env|purge — the local stack capper runs and is tested against.
#
#   Redis Cluster  3 masters + 3 replicas, 127.0.0.1:$CAPPER_REDIS_PORT..+5 (default 7000-7005), no persistence
#   Kafka          Kafka-protocol broker (kfake) on 127.0.0.1:$CAPPER_KAFKA_PORT (default 9092), data kept
#                  in $STATE/kafka so logs and committed offsets survive a restart of the stack
#   S3             S3-compatible endpoint (gofakes3) on 127.0.0.1:$CAPPER_S3_PORT (default 9000),
#                  bucket $CAPPER_S3_BUCKET (default capper-segments)
#
# Every process runs on 127.0.0.1; its PID file and log live under $CAPPER_STACK_DIR (default .stack/,
# git-ignored). `up` is idempotent; `down` stops exactly the processes `up` started, by PID.
# `env` prints the variables the tests and the demo read. `purge` = down + delete the state directory.
# `restart-node PORT` starts a Redis node that was killed (crash tests) and waits for 3 linked replicas.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${CAPPER_STACK_DIR:-$ROOT/.stack}
REDIS_BASE=${CAPPER_REDIS_PORT:-7000}
KAFKA_PORT=${CAPPER_KAFKA_PORT:-9092}
S3_PORT=${CAPPER_S3_PORT:-9000}
S3_BUCKET=${CAPPER_S3_BUCKET:-capper-segments}
PARTITIONS=${CAPPER_PARTITIONS:-6}
TOPICS=${CAPPER_TOPICS:-sends,sends.allowed,sends.capped,sends.dlq,sends.held,sends.delay.1s,sends.delay.10s,sends.delay.1m,sends.delay.10m,sends.delay.1h,sends.delay.6h}
REDIS_PORTS=()
for i in 0 1 2 3 4 5; do REDIS_PORTS+=($((REDIS_BASE + i))); done

log() { printf 'stack: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

alive() { # alive PIDFILE -> 0 when the process it names runs
  [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

ensure_redis() {
  if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then return; fi
  log "installing redis-server and redis-tools with apt-get"
  local sudo=""; [[ $(id -u) -ne 0 ]] && sudo=sudo
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server redis-tools >/dev/null
}

rcli() { redis-cli -h 127.0.0.1 -p "$1" "${@:2}"; }

# start_redis_node PORT: one cluster node; an existing nodes-PORT.conf makes it rejoin. No persistence: a node
# always starts empty (its own RDB file, which only a replica's full sync would write, is deleted first),
# and replicas load a full sync from the socket.
start_redis_node() {
  local p=$1
  rm -f "$STATE/redis/dump-$p.rdb" "$STATE/redis/dump.rdb"
  redis-server --port "$p" --bind 127.0.0.1 --protected-mode yes \
    --daemonize yes --pidfile "$STATE/redis/$p.pid" --logfile "$STATE/redis/$p.log" --dir "$STATE/redis" \
    --cluster-enabled yes --cluster-config-file "nodes-$p.conf" --cluster-node-timeout 2000 \
    --save "" --appendonly no --dbfilename "dump-$p.rdb" \
    --repl-diskless-sync yes --repl-diskless-sync-delay 0 --repl-diskless-load swapdb \
    --maxmemory-policy noeviction >/dev/null
}

# restart_node PORT: start a node of this stack that crashed or was killed (kill -9 in a test). It rejoins
# with its old identity; if its replica was promoted meanwhile it becomes that replica's replica.
restart_node() {
  local p=$1 pidf="$STATE/redis/$1.pid"
  [[ " ${REDIS_PORTS[*]} " == *" $p "* ]] || die "$p is not a redis port of this stack"
  alive "$pidf" && { log "redis $p is running"; wait_redis_ok; return; }
  [[ -f $STATE/redis/nodes-$p.conf ]] || die "no cluster state for $p: run $0 down && $0 up"
  start_redis_node "$p"
  for _ in $(seq 100); do rcli "$p" ping >/dev/null 2>&1 && break; sleep 0.05; done
  wait_redis_ok
}

redis_up() {
  ensure_redis
  mkdir -p "$STATE/redis"
  local started=0
  for p in "${REDIS_PORTS[@]}"; do
    local pidf="$STATE/redis/$p.pid"
    if alive "$pidf"; then continue; fi
    port_open "$p" && die "port $p is taken by a process this stack did not start"
    rm -f "$STATE/redis/nodes-$p.conf"
    start_redis_node "$p"
    started=1
  done
  for p in "${REDIS_PORTS[@]}"; do
    for _ in $(seq 100); do rcli "$p" ping >/dev/null 2>&1 && break; sleep 0.05; done
    rcli "$p" ping >/dev/null 2>&1 || die "redis on $p does not answer (log: $STATE/redis/$p.log)"
  done
  if [[ $(rcli "${REDIS_PORTS[0]}" cluster info | tr -d '\r' | awk -F: '/cluster_known_nodes/{print $2}') -lt 6 ]]; then
    local nodes=(); for p in "${REDIS_PORTS[@]}"; do nodes+=("127.0.0.1:$p"); done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >"$STATE/redis/create.log" 2>&1 \
      || die "redis-cli --cluster create failed (see $STATE/redis/create.log)"
  elif [[ $started -eq 1 ]]; then
    die "some redis nodes were restarted into an existing cluster; run: $0 down && $0 up"
  fi
  wait_redis_ok
}

wait_redis_ok() { # every node says cluster_state:ok, and every replica's link to its master is up
  local deadline=$((SECONDS + 30))
  while ((SECONDS < deadline)); do
    local ok=1 replicas=0
    for p in "${REDIS_PORTS[@]}"; do
      rcli "$p" cluster info 2>/dev/null | grep -q '^cluster_state:ok' || { ok=0; break; }
      local repl; repl=$(rcli "$p" info replication 2>/dev/null | tr -d '\r')
      if grep -q '^role:slave' <<<"$repl"; then
        grep -q '^master_link_status:up' <<<"$repl" || { ok=0; break; }
        replicas=$((replicas + 1))
      fi
    done
    if ((ok && replicas == 3)); then return 0; fi
    sleep 0.1
  done
  die "redis cluster did not reach cluster_state:ok with 3 linked replicas in 30 s"
}

devstack_up() {
  mkdir -p "$STATE/bin" "$STATE/kafka"
  local pidf="$STATE/devstack.pid"
  if alive "$pidf"; then return; fi
  port_open "$KAFKA_PORT" && die "port $KAFKA_PORT is taken by a process this stack did not start"
  port_open "$S3_PORT" && die "port $S3_PORT is taken by a process this stack did not start"
  (cd "$ROOT" && go build -o "$STATE/bin/capper-devstack" ./cmd/capper-devstack) || die "build capper-devstack"
  nohup "$STATE/bin/capper-devstack" -kafka-port "$KAFKA_PORT" -data-dir "$STATE/kafka/data" \
    -topics "$TOPICS" -partitions "$PARTITIONS" -s3-addr "127.0.0.1:$S3_PORT" -buckets "$S3_BUCKET" \
    >>"$STATE/devstack.log" 2>&1 </dev/null &
  echo $! >"$pidf"
  for _ in $(seq 200); do
    if port_open "$KAFKA_PORT" && port_open "$S3_PORT" && grep -q 's3 endpoint ready' "$STATE/devstack.log"; then return 0; fi
    alive "$pidf" || die "capper-devstack exited (log: $STATE/devstack.log)"
    sleep 0.05
  done
  die "capper-devstack did not answer in 10 s (log: $STATE/devstack.log)"
}

stop_pids() { # stop_pids PIDFILE...: SIGTERM to all at once, wait, SIGKILL as a last resort
  local pids=() f
  for f in "$@"; do
    if alive "$f"; then pids+=("$(cat "$f")"); fi
    rm -f "$f"
  done
  ((${#pids[@]})) || return 0
  kill "${pids[@]}" 2>/dev/null || true
  local p any
  for _ in $(seq 100); do
    any=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && any=1; done
    ((any)) || break; sleep 0.05
  done
  for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && kill -9 "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do while kill -0 "$p" 2>/dev/null; do sleep 0.05; done; done
  return 0
}

cmd_up() {
  local t0=$SECONDS start; start=$(date +%s.%N)
  redis_up
  devstack_up
  log "up in $(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN{printf "%.1f", e-s}') s"
  cmd_status
}

cmd_down() {
  local files=("$STATE/devstack.pid")
  for p in "${REDIS_PORTS[@]}"; do files+=("$STATE/redis/$p.pid"); done
  stop_pids "${files[@]}"
  rm -f "$STATE"/redis/nodes-*.conf
  local left=()
  for p in "${REDIS_PORTS[@]}" "$KAFKA_PORT" "$S3_PORT"; do port_open "$p" && left+=("$p"); done
  ((${#left[@]} == 0)) || log "warning: still listening on ${left[*]} (not started by this stack?)"
  log "down"
}

cmd_status() {
  local rc=0
  for p in "${REDIS_PORTS[@]}"; do
    local role state
    role=$(rcli "$p" role 2>/dev/null | head -1) || role=""
    state=$(rcli "$p" cluster info 2>/dev/null | tr -d '\r' | awk -F: '/^cluster_state/{print $2}') || state=""
    if [[ -n $role ]]; then printf 'redis  127.0.0.1:%s  %-6s cluster_state:%s\n' "$p" "$role" "${state:-?}"
    else printf 'redis  127.0.0.1:%s  DOWN\n' "$p"; rc=1; fi
  done
  if port_open "$KAFKA_PORT"; then printf 'kafka  127.0.0.1:%s  up (topics: %s)\n' "$KAFKA_PORT" "$TOPICS"
  else printf 'kafka  127.0.0.1:%s  DOWN\n' "$KAFKA_PORT"; rc=1; fi
  if curl -fsS -o /dev/null "http://127.0.0.1:$S3_PORT/$S3_BUCKET" 2>/dev/null || port_open "$S3_PORT"; then
    printf 's3     http://127.0.0.1:%s  up (bucket: %s)\n' "$S3_PORT" "$S3_BUCKET"
  else printf 's3     http://127.0.0.1:%s  DOWN\n' "$S3_PORT"; rc=1; fi
  return $rc
}

cmd_env() {
  local addrs=(); for p in "${REDIS_PORTS[@]}"; do addrs+=("127.0.0.1:$p"); done
  local IFS=,
  echo "export CAPPER_TEST_REDIS_ADDRS=${addrs[*]}"
  echo "export CAPPER_TEST_KAFKA_BROKERS=127.0.0.1:$KAFKA_PORT"
  echo "export CAPPER_TEST_S3_ENDPOINT=http://127.0.0.1:$S3_PORT"
  echo "export CAPPER_TEST_S3_BUCKET=$S3_BUCKET"
  echo "export CAPPER_STACK_DIR=$STATE"
  echo "export CAPPER_STACK_SCRIPT=$ROOT/scripts/stack.sh"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) cmd_env ;;
  purge) cmd_down; rm -rf "$STATE" ;;
  restart-node) restart_node "${2:?usage: $0 restart-node PORT}" ;;
  *) echo "usage: $0 up|down|status|env|purge|restart-node PORT" >&2; exit 2 ;;
esac
