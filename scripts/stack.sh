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
#
# --secure (with any command) is the secured stack, on its own ports and state directory
# ($CAPPER_SECURE_STACK_DIR, default .stack-secure/), beside the plain one:
#
#   TLS            a throwaway CA, server and client certificates made with openssl at `up` (in $STATE/tls,
#                  never committed), and random passwords (in $STATE/secrets); `down` deletes them all
#   Redis Cluster  TLS only (clients, cluster bus and replication) on $CAPPER_SECURE_REDIS_PORT..+5 (default
#                  7100-7105); ACL users: default off, admin (the stack's own tools), repl (replication),
#                  capper (the worker: exactly $REDIS_CAPPER_ACL below) and capper-noperm (capper without EVALSHA)
#   Kafka          TLS + SASL/SCRAM-SHA-512 with ACLs enforced on $CAPPER_SECURE_KAFKA_PORT (default 9192):
#                  users admin (superuser), capper (capper's ACLs on the default topics), capper-noperm (no
#                  ACL); and a broker that demands a client certificate (mTLS) on $CAPPER_SECURE_MTLS_PORT (9193)
#   S3             as above, on $CAPPER_SECURE_S3_PORT (default 9100)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SECURE=0
ARGS=()
for a in "$@"; do if [[ $a == --secure ]]; then SECURE=1; else ARGS+=("$a"); fi; done
set -- "${ARGS[@]+"${ARGS[@]}"}"
if ((SECURE)); then
  STATE=${CAPPER_SECURE_STACK_DIR:-$ROOT/.stack-secure}
  REDIS_BASE=${CAPPER_SECURE_REDIS_PORT:-7100}
  KAFKA_PORT=${CAPPER_SECURE_KAFKA_PORT:-9192}
  MTLS_PORT=${CAPPER_SECURE_MTLS_PORT:-9193}
  S3_PORT=${CAPPER_SECURE_S3_PORT:-9100}
else
  STATE=${CAPPER_STACK_DIR:-$ROOT/.stack}
  REDIS_BASE=${CAPPER_REDIS_PORT:-7000}
  KAFKA_PORT=${CAPPER_KAFKA_PORT:-9092}
  S3_PORT=${CAPPER_S3_PORT:-9000}
fi
# REDIS_CAPPER_ACL is what the worker's Redis user may do, and nothing else: its keys (key_prefix fc), the two
# scripts and the commands they call, WAIT (redis.min_replicas_acked), TIME (max_clock_skew), and what the cluster client needs
# (CLUSTER SLOTS for the slot map, COMMAND for the commands' key positions).
# README prints this line for operators; the secured tests run the worker with exactly it.
REDIS_CAPPER_ACL='resetkeys ~fc:* resetchannels -@all +evalsha +eval +script|load +zrange +zremrangebyscore +zadd +pexpire +hget +hgetall +hincrby +hdel +wait +time +ping +cluster|slots +command'
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

ensure_openssl() {
  command -v openssl >/dev/null && return
  log "installing openssl with apt-get"
  local sudo=""; [[ $(id -u) -ne 0 ]] && sudo=sudo
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq openssl >/dev/null
}

# the secured stack's redis-cli runs as its admin user over TLS (the password through the environment)
rcli() {
  if ((SECURE)); then
    REDISCLI_AUTH=$(cat "$STATE/secrets/redis-admin") redis-cli --tls --cacert "$STATE/tls/ca.crt" --user admin \
      -h 127.0.0.1 -p "$1" "${@:2}"
  else
    redis-cli -h 127.0.0.1 -p "$1" "${@:2}"
  fi
}

# make_secrets: a throwaway CA; a server certificate for 127.0.0.1 (server-chain.crt carries the CA too); a
# client certificate CN=capper; a second CA that signed nothing of this stack (for the unknown-CA tests); and a
# random password per user. Kept until `down --secure`.
make_secrets() {
  local t=$STATE/tls s=$STATE/secrets
  [[ -f $t/server-chain.crt && -f $s/redis-admin ]] && return
  ensure_openssl
  rm -rf "$t" "$s"; mkdir -p "$t" "$s"; chmod 700 "$t" "$s"
  local ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -noenc)
  issue() { # issue NAME SUBJECT EXTENSIONS
    openssl req -new "${ec[@]}" -keyout "$t/$1.key" -out "$t/$1.csr" -subj "$2" 2>/dev/null
    openssl x509 -req -in "$t/$1.csr" -CA "$t/ca.crt" -CAkey "$t/ca.key" -CAcreateserial -days 30 \
      -out "$t/$1.crt" -extfile <(printf '%b\n' "$3") 2>/dev/null
  }
  openssl req -x509 "${ec[@]}" -keyout "$t/ca.key" -out "$t/ca.crt" -days 30 -subj "/CN=capper dev CA" 2>/dev/null
  issue server /CN=localhost 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth'
  issue client /CN=capper 'extendedKeyUsage=clientAuth'
  cat "$t/server.crt" "$t/ca.crt" >"$t/server-chain.crt"
  openssl req -x509 "${ec[@]}" -keyout "$t/other-ca.key" -out "$t/other-ca.crt" -days 30 -subj "/CN=another CA" 2>/dev/null
  [[ -s $t/server.crt && -s $t/client.crt && -s $t/other-ca.crt ]] || die "openssl did not make the certificates"
  local u; for u in redis-admin redis-repl redis-capper redis-noperm kafka-admin kafka-capper kafka-noperm; do
    openssl rand -hex 16 >"$s/$u"
  done
  chmod 600 "$s"/* "$t"/*.key
}

pw() { cat "$STATE/secrets/$1"; }

# secure_redis_conf: the TLS settings, the ACL users and the replicas' credentials, in files (not in argv)
secure_redis_conf() {
  local t=$STATE/tls
  cat >"$STATE/redis/users.acl" <<EOF_ACL
user default off
user admin on >$(pw redis-admin) ~* &* +@all
user repl on >$(pw redis-repl) +psync +replconf +ping
user capper on >$(pw redis-capper) $REDIS_CAPPER_ACL
user capper-noperm on >$(pw redis-noperm) $REDIS_CAPPER_ACL -evalsha -eval
EOF_ACL
  cat >"$STATE/redis/secure.conf" <<EOF_CONF
tls-cert-file $t/server-chain.crt
tls-key-file $t/server.key
tls-ca-cert-file $t/ca.crt
tls-auth-clients no
tls-cluster yes
tls-replication yes
aclfile $STATE/redis/users.acl
masteruser repl
masterauth $(pw redis-repl)
EOF_CONF
  chmod 600 "$STATE/redis/users.acl" "$STATE/redis/secure.conf"
}

# start_redis_node PORT: one cluster node; an existing nodes-PORT.conf makes it rejoin. No persistence: a node
# always starts empty (its own RDB file, which only a replica's full sync would write, is deleted first),
# and replicas load a full sync from the socket.
start_redis_node() {
  local p=$1
  rm -f "$STATE/redis/dump-$p.rdb" "$STATE/redis/dump.rdb"
  local listen=(--port "$p")
  ((SECURE)) && listen=("$STATE/redis/secure.conf" --port 0 --tls-port "$p")
  redis-server "${listen[@]}" --bind 127.0.0.1 --protected-mode yes \
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
  ((SECURE)) && secure_redis_conf
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
    rcli "${REDIS_PORTS[0]}" --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >"$STATE/redis/create.log" 2>&1 \
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
  local secure=()
  if ((SECURE)); then
    port_open "$MTLS_PORT" && die "port $MTLS_PORT is taken by a process this stack did not start"
    local users="$STATE/kafka/users"
    printf 'SCRAM-SHA-512 admin %s superuser\nSCRAM-SHA-512 capper %s\nSCRAM-SHA-512 capper-noperm %s\n' \
      "$(pw kafka-admin)" "$(pw kafka-capper)" "$(pw kafka-noperm)" >"$users"
    chmod 600 "$users"
    secure=(-tls-cert "$STATE/tls/server-chain.crt" -tls-key "$STATE/tls/server.key" -sasl-users "$users"
      -acl-user capper -mtls-port "$MTLS_PORT" -client-ca "$STATE/tls/ca.crt")
  fi
  (cd "$ROOT" && go build -o "$STATE/bin/capper-devstack" ./cmd/capper-devstack) || die "build capper-devstack"
  touch "$STATE/devstack.log"
  local lines; lines=$(wc -l <"$STATE/devstack.log") # this start's "ready" lines come after these
  nohup "$STATE/bin/capper-devstack" -kafka-port "$KAFKA_PORT" -data-dir "$STATE/kafka/data" \
    -topics "$TOPICS" -partitions "$PARTITIONS" -s3-addr "127.0.0.1:$S3_PORT" -buckets "$S3_BUCKET" \
    "${secure[@]+"${secure[@]}"}" >>"$STATE/devstack.log" 2>&1 </dev/null &
  echo $! >"$pidf"
  # The broker reloads the logs kept in $STATE/kafka first: seconds per GB of them.
  for i in $(seq 2400); do
    if port_open "$KAFKA_PORT" && port_open "$S3_PORT" && tail -n +"$((lines + 1))" "$STATE/devstack.log" | grep -q 's3 endpoint ready'; then return 0; fi
    alive "$pidf" || die "capper-devstack exited (log: $STATE/devstack.log)"
    ((i == 200)) && log "the broker is still loading its kept logs ($(du -sh "$STATE/kafka" 2>/dev/null | cut -f1)); '$0 purge' starts it empty"
    sleep 0.05
  done
  die "capper-devstack did not answer in 120 s (log: $STATE/devstack.log)"
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
  local start; start=$(date +%s.%N)
  ((SECURE)) && make_secrets
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
  ((SECURE)) && rm -rf "$STATE/tls" "$STATE/secrets" "$STATE/kafka" "$STATE"/redis/*.acl "$STATE"/redis/*.conf
  local left=()
  for p in "${REDIS_PORTS[@]}" "$KAFKA_PORT" "$S3_PORT" ${MTLS_PORT:+"$MTLS_PORT"}; do port_open "$p" && left+=("$p"); done
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
  if ((SECURE)); then
    if port_open "$MTLS_PORT"; then printf 'kafka  127.0.0.1:%s  up (mTLS)\n' "$MTLS_PORT"
    else printf 'kafka  127.0.0.1:%s  DOWN (mTLS)\n' "$MTLS_PORT"; rc=1; fi
  fi
  if curl -fsS -o /dev/null "http://127.0.0.1:$S3_PORT/$S3_BUCKET" 2>/dev/null || port_open "$S3_PORT"; then
    printf 's3     http://127.0.0.1:%s  up (bucket: %s)\n' "$S3_PORT" "$S3_BUCKET"
  else printf 's3     http://127.0.0.1:%s  DOWN\n' "$S3_PORT"; rc=1; fi
  return $rc
}

cmd_env() {
  local addrs=(); for p in "${REDIS_PORTS[@]}"; do addrs+=("127.0.0.1:$p"); done
  local IFS=,
  if ((SECURE)); then
    echo "export CAPPER_TEST_SECURE_REDIS_ADDRS=${addrs[*]}"
    echo "export CAPPER_TEST_SECURE_KAFKA_BROKERS=127.0.0.1:$KAFKA_PORT"
    echo "export CAPPER_TEST_SECURE_MTLS_BROKERS=127.0.0.1:$MTLS_PORT"
    echo "export CAPPER_TEST_SECURE_S3_ENDPOINT=http://127.0.0.1:$S3_PORT"
    echo "export CAPPER_TEST_SECURE_DIR=$STATE"
    echo "export CAPPER_TEST_SECURE_REDIS_ACL='$REDIS_CAPPER_ACL'"
    return
  fi
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
  *) echo "usage: $0 [--secure] up|down|status|env|purge|restart-node PORT" >&2; exit 2 ;;
esac
