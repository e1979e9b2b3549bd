#!/usr/bin/env bash
# stack.sh up|down|status|env|purge — the local stack capper runs and is tested against.
#
#   Redis Cluster  3 masters + 3 replicas, 127.0.0.1:$CAPPER_REDIS_PORT..+5 (default 7000-7005), no persistence
#   Kafka          Apache Kafka (version pinned in scripts/kafka/pom.xml, resolved from Maven Central into
#                  $CAPPER_KAFKA_CACHE, default ~/.cache/capper/kafka-VERSION), KRaft, one combined broker and
#                  controller: PLAINTEXT on 127.0.0.1:$CAPPER_KAFKA_PORT (default 9092), its controller on port+2;
#                  data kept in $STATE/kafka/data so topics and committed offsets survive a restart of the stack;
#                  its log in $STATE/kafka/server.log; topics created by `up`
#   S3             S3-compatible endpoint (gofakes3, cmd/capper-devstack) on 127.0.0.1:$CAPPER_S3_PORT (default
#                  9000), bucket $CAPPER_S3_BUCKET (default capper-segments)
#
# Every process runs on 127.0.0.1; its PID file and log live under $CAPPER_STACK_DIR (default .stack/,
# git-ignored). `up` is idempotent; `down` stops exactly the processes `up` started, by PID.
# `env` prints the variables the tests and the demo read. `purge` = down + delete the state directory.
# `restart-node PORT` starts a Redis node that was killed (crash tests) and waits for 3 linked replicas;
# `restart-kafka` starts the broker again on its data after a test killed it.
# Java and Maven (for the broker) and redis-server are installed with apt-get when missing.
#
# --secure (with any command) is the secured stack, on its own ports and state directory
# ($CAPPER_SECURE_STACK_DIR, default .stack-secure/), beside the plain one:
#
#   TLS            a throwaway CA, server and client certificates made with openssl at `up` (in $STATE/tls,
#                  never committed), and random passwords (in $STATE/secrets); `down` deletes them all
#   Redis Cluster  TLS only (clients, cluster bus and replication) on $CAPPER_SECURE_REDIS_PORT..+5 (default
#                  7100-7105); ACL users: default off, admin (the stack's own tools), repl (replication),
#                  capper (the worker: exactly $REDIS_CAPPER_ACL below) and capper-noperm (capper without FCALL, EVALSHA or EVAL)
#   Kafka          one Apache Kafka broker with the StandardAuthorizer (allow.everyone.if.no.acl.found=false):
#                  SASL_SSL with SCRAM-SHA-512 on $CAPPER_SECURE_KAFKA_PORT (default 9192), users admin (super
#                  user), capper (exactly internal/kafkaadmin's grants on the stack's topics) and capper-noperm (no
#                  ACL), created at format time; and an mTLS listener on $CAPPER_SECURE_MTLS_PORT (9193) that
#                  requires a client certificate of the stack's CA and maps CN=capper to User:capper, so the same
#                  ACLs hold; the controller on port+2 (TLS, the broker's own certificate). Started empty each time.
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
# docs/security.md prints this line for operators; the secured tests run the worker with exactly it.
REDIS_CAPPER_ACL='resetkeys ~fc:* resetchannels -@all +fcall +function|load +evalsha +eval +script|load +get +set +append +setrange +del +zrange +zrem +zadd +zscore +zremrangebyscore +exists +pexpire +hget +hgetall +hset +hincrby +hdel +hlen +pttl +wait +time +ping +cluster|slots +command'
S3_BUCKET=${CAPPER_S3_BUCKET:-capper-segments}
PARTITIONS=${CAPPER_PARTITIONS:-6}
TOPICS=${CAPPER_TOPICS:-sends,sends.allowed,sends.capped,sends.dlq,sends.held,sends.delay.100ms,sends.delay.1s,sends.delay.10s,sends.delay.1m,sends.delay.10m,sends.delay.1h,sends.delay.6h}
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
  [[ -f $t/server-keystore.pem && -f $s/redis-admin ]] && return
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
  cat "$t/server.key" "$t/server.crt" "$t/ca.crt" >"$t/server-keystore.pem" # the broker's PEM keystore (PKCS#8 key, chain)
  openssl req -x509 "${ec[@]}" -keyout "$t/other-ca.key" -out "$t/other-ca.crt" -days 30 -subj "/CN=another CA" 2>/dev/null
  [[ -s $t/server.crt && -s $t/client.crt && -s $t/other-ca.crt ]] || die "openssl did not make the certificates"
  local u; for u in redis-admin redis-repl redis-capper redis-noperm kafka-admin kafka-capper kafka-noperm; do
    openssl rand -hex 16 >"$s/$u"
  done
  chmod 600 "$s"/* "$t"/*.key "$t/server-keystore.pem"
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
user capper-noperm on >$(pw redis-noperm) $REDIS_CAPPER_ACL -fcall -evalsha -eval
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

# ---- Apache Kafka (KRaft) -------------------------------------------------------------------------------------
# The broker is Apache Kafka from Maven Central (scripts/kafka/pom.xml pins the version), resolved once into
# $KAFKA_CACHE and run as one combined broker+controller process with a bounded heap. Its state lives in
# $STATE/kafka: data/ (the log directory, kept by the plain stack so topics and committed offsets survive a
# restart), server.properties (written at every start), server.log (the broker's log) and kafka.pid.
KAFKA_VERSION=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' "$ROOT/scripts/kafka/pom.xml")
KAFKA_CACHE=${CAPPER_KAFKA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capper/kafka-$KAFKA_VERSION}
KAFKA_HEAP=${CAPPER_KAFKA_HEAP:-768m}
KAFKA_READY_TIMEOUT=${CAPPER_KAFKA_READY_TIMEOUT:-180}

ensure_java() {
  if command -v java >/dev/null && command -v mvn >/dev/null; then return; fi
  log "installing a Java runtime and Maven with apt-get (Apache Kafka runs on the JVM)"
  local sudo=""; [[ $(id -u) -ne 0 ]] && sudo=sudo
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq default-jre-headless maven >/dev/null
}

# kafka_libs: the broker's jars in $KAFKA_CACHE, resolved from Maven Central the first time (about 45 jars, 45 MB)
kafka_libs() {
  [[ -f $KAFKA_CACHE/.complete ]] && return
  ensure_java
  log "resolving Apache Kafka $KAFKA_VERSION from Maven Central into $KAFKA_CACHE"
  local tmp="$KAFKA_CACHE.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  mvn -q -B -f "$ROOT/scripts/kafka/pom.xml" dependency:copy-dependencies -DoutputDirectory="$tmp" >"$tmp.log" 2>&1 \
    || { tail -20 "$tmp.log" >&2; rm -rf "$tmp"; die "mvn could not resolve Apache Kafka $KAFKA_VERSION (see above)"; }
  ls "$tmp"/kafka_2.13-"$KAFKA_VERSION".jar >/dev/null 2>&1 || die "mvn resolved no kafka_2.13-$KAFKA_VERSION.jar"
  touch "$tmp/.complete"
  rm -rf "$KAFKA_CACHE" "$tmp.log"; mkdir -p "$(dirname "$KAFKA_CACHE")"; mv "$tmp" "$KAFKA_CACHE"
}

kjava() { # kjava CLASS ARGS...: a Kafka class on the cached classpath
  java -Xmx256m -Djava.net.preferIPv4Stack=true -Dkafka.logs.dir="$STATE/kafka" \
    -Dlog4j2.configurationFile="$ROOT/scripts/kafka/log4j2.yaml" -cp "$KAFKA_CACHE/*" "$@"
}

# kafka_properties: the broker's configuration. Settings that differ from Kafka's defaults, and why:
#   one node, so every internal topic has replication factor 1 (offsets, transactions, share state);
#   group.initial.rebalance.delay.ms=0: a group forms at once (the default 3 s delays every test's first batch);
#   group.min.session.timeout.ms=1000: tests run workers with short session timeouts so that a SIGKILLed member
#     is expired in seconds (production keeps kafka.session_timeout at its default, 10 s);
#   offsets.topic.num.partitions=6: creating __consumer_offsets with the default 50 takes seconds on 2 cores;
#   auto.create.topics.enable=false: capper never creates topics; a missing one must show as missing;
#   log.retention.hours=24 and 64 MB segments: benchmarks write gigabytes; a day later they are gone.
kafka_properties() {
  local k=$STATE/kafka ctrl=$((KAFKA_PORT + 2))
  {
    echo "process.roles=broker,controller"
    echo "node.id=1"
    echo "controller.quorum.voters=1@127.0.0.1:$ctrl"
    echo "controller.listener.names=CONTROLLER"
    echo "log.dirs=$k/data"
    echo "num.partitions=$PARTITIONS"
    echo "offsets.topic.replication.factor=1"
    echo "offsets.topic.num.partitions=6"
    echo "transaction.state.log.replication.factor=1"
    echo "transaction.state.log.min.isr=1"
    echo "share.coordinator.state.topic.replication.factor=1"
    echo "share.coordinator.state.topic.min.isr=1"
    echo "group.initial.rebalance.delay.ms=0"
    echo "group.min.session.timeout.ms=1000"
    echo "auto.create.topics.enable=false"
    echo "log.retention.hours=24"
    echo "log.segment.bytes=67108864"
    echo "num.network.threads=2"
    echo "num.io.threads=4"
    if ((SECURE)); then
      local t=$STATE/tls
      # SASL_SSL: SCRAM-SHA-512 users (created at format time); MTLS: TLS with a required client certificate whose
      # subject is mapped to its CN (CN=capper -> User:capper), so ACLs hold for certificates too; CONTROLLER: TLS
      # with a required certificate too (the broker's own, CN=localhost, a super user), never plaintext.
      echo "listeners=SASL_SSL://127.0.0.1:$KAFKA_PORT,MTLS://127.0.0.1:$MTLS_PORT,CONTROLLER://127.0.0.1:$ctrl"
      echo "advertised.listeners=SASL_SSL://127.0.0.1:$KAFKA_PORT,MTLS://127.0.0.1:$MTLS_PORT"
      echo "listener.security.protocol.map=SASL_SSL:SASL_SSL,MTLS:SSL,CONTROLLER:SSL"
      echo "inter.broker.listener.name=SASL_SSL"
      echo "sasl.enabled.mechanisms=SCRAM-SHA-512"
      echo "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512"
      echo "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username=\"admin\" password=\"$(pw kafka-admin)\";"
      echo "ssl.keystore.type=PEM"
      echo "ssl.keystore.location=$t/server-keystore.pem"
      echo "ssl.truststore.type=PEM"
      echo "ssl.truststore.location=$t/ca.crt"
      echo "ssl.endpoint.identification.algorithm="
      echo "listener.name.mtls.ssl.client.auth=required"
      echo "listener.name.controller.ssl.client.auth=required"
      echo 'ssl.principal.mapping.rules=RULE:^(.*,)?CN=([^,]+)(,.*)?$/$2/,DEFAULT'
      echo "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer"
      echo "allow.everyone.if.no.acl.found=false"
      echo "super.users=User:admin;User:localhost"
    else
      echo "listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$ctrl"
      echo "advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT"
      echo "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
      echo "inter.broker.listener.name=PLAINTEXT"
    fi
  } >"$k/server.properties"
  chmod 600 "$k/server.properties"
}

kafka_start() { # the broker on the data it has (formatted first when new); waits until it serves
  local k=$STATE/kafka pidf=$STATE/kafka/kafka.pid
  alive "$pidf" && return
  kafka_libs
  mkdir -p "$k/data"
  local ports=("$KAFKA_PORT" $((KAFKA_PORT + 2))); ((SECURE)) && ports+=("$MTLS_PORT")
  for p in "${ports[@]}"; do port_open "$p" && die "port $p is taken by a process this stack did not start"; done
  kafka_properties
  if [[ ! -f $k/data/meta.properties ]]; then
    local scram=()
    ((SECURE)) && scram=(--add-scram "SCRAM-SHA-512=[name=admin,password=$(pw kafka-admin)]"
      --add-scram "SCRAM-SHA-512=[name=capper,password=$(pw kafka-capper)]"
      --add-scram "SCRAM-SHA-512=[name=capper-noperm,password=$(pw kafka-noperm)]")
    kjava kafka.tools.StorageTool format -t "$(kjava kafka.tools.StorageTool random-uuid)" -c "$k/server.properties" \
      "${scram[@]+"${scram[@]}"}" >"$k/format.log" 2>&1 || { cat "$k/format.log" >&2; die "formatting the broker's storage failed"; }
  fi
  # This start's "started" line is the one stamped after this moment (the log rolls over, so no line count).
  local since; since="[$(date '+%Y-%m-%d %H:%M:%S')"
  # -Djava.net.preferIPv4Stack: the listeners bind 127.0.0.1 itself, not ::ffff:127.0.0.1
  nohup java -Xms256m -Xmx"$KAFKA_HEAP" -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -Djava.awt.headless=true \
    -Djava.net.preferIPv4Stack=true -Dkafka.logs.dir="$k" -Dlog4j2.configurationFile="$ROOT/scripts/kafka/log4j2.yaml" \
    -cp "$KAFKA_CACHE/*" kafka.Kafka "$k/server.properties" >>"$k/stdout.log" 2>&1 </dev/null &
  echo $! >"$pidf"
  local began=$SECONDS
  for i in $(seq $((KAFKA_READY_TIMEOUT * 10))); do
    if grep -hs 'Kafka Server started' "$k"/server.log* | awk -v s="$since" '$0 >= s {f=1} END {exit !f}' && port_open "$KAFKA_PORT"; then
      log "kafka $KAFKA_VERSION ready on 127.0.0.1:$KAFKA_PORT in $((SECONDS - began)) s"; return 0
    fi
    alive "$pidf" || { kafka_tail; die "the broker exited (log: $k/server.log)"; }
    ((i == 100)) && log "the broker is still starting after 10 s (recovering $(du -sh "$k/data" 2>/dev/null | cut -f1) of logs? '$0 purge' starts it empty)"
    sleep 0.1
  done
  kafka_tail
  die "the broker was not ready in $KAFKA_READY_TIMEOUT s (log: $k/server.log)"
}

kafka_tail() { # the broker's last words, for a start that failed
  log "the broker's last log lines:"
  tail -n 25 "$STATE/kafka/server.log" "$STATE/kafka/stdout.log" 2>/dev/null | sed 's/^/  /' >&2
}

devstack_bin() {
  mkdir -p "$STATE/bin"
  (cd "$ROOT" && go build -o "$STATE/bin/capper-devstack" ./cmd/capper-devstack) || die "build capper-devstack"
}

# kafka_setup: the stack's topics (created when missing) and, on the secured stack, capper's ACLs on them
kafka_setup() {
  local args=(kafka-setup -brokers "127.0.0.1:$KAFKA_PORT" -topics "$TOPICS" -partitions "$PARTITIONS")
  ((SECURE)) && args+=(-ca "$STATE/tls/ca.crt" -sasl-user admin -sasl-password-file "$STATE/secrets/kafka-admin" -grant capper)
  "$STATE/bin/capper-devstack" "${args[@]}" >>"$STATE/kafka/setup.log" 2>&1 \
    || { tail -5 "$STATE/kafka/setup.log" >&2; die "creating the topics failed (log: $STATE/kafka/setup.log)"; }
}

# s3_up: the S3-compatible endpoint (gofakes3 in cmd/capper-devstack), objects in memory
s3_up() {
  local pidf="$STATE/s3.pid"
  alive "$pidf" && return
  port_open "$S3_PORT" && die "port $S3_PORT is taken by a process this stack did not start"
  touch "$STATE/s3.log"
  local lines; lines=$(wc -l <"$STATE/s3.log")
  nohup "$STATE/bin/capper-devstack" s3 -addr "127.0.0.1:$S3_PORT" -buckets "$S3_BUCKET" >>"$STATE/s3.log" 2>&1 </dev/null &
  echo $! >"$pidf"
  for _ in $(seq 200); do
    # grep -c reads all of tail's output: grep -q would leave tail a SIGPIPE, a failure under pipefail
    if port_open "$S3_PORT" && tail -n +"$((lines + 1))" "$STATE/s3.log" | grep -c 's3 endpoint ready' >/dev/null; then return 0; fi
    alive "$pidf" || die "the S3 endpoint exited (log: $STATE/s3.log)"
    sleep 0.05
  done
  die "the S3 endpoint did not answer in 10 s (log: $STATE/s3.log)"
}

stop_pids() { # stop_pids [-w SECONDS] PIDFILE...: SIGTERM to all at once, wait (5 s), SIGKILL as a last resort
  local wait=5
  if [[ $1 == -w ]]; then wait=$2; shift 2; fi
  local pids=() f
  for f in "$@"; do
    if alive "$f"; then pids+=("$(cat "$f")"); fi
    rm -f "$f"
  done
  ((${#pids[@]})) || return 0
  kill "${pids[@]}" 2>/dev/null || true
  local p any
  for _ in $(seq $((wait * 20))); do
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
  devstack_bin
  s3_up
  kafka_start
  kafka_setup
  log "up in $(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN{printf "%.1f", e-s}') s"
  cmd_status
}

cmd_down() {
  local files=("$STATE/s3.pid" "$STATE/devstack.pid") # devstack.pid: the fake broker of a stack started before 4.4.0
  for p in "${REDIS_PORTS[@]}"; do files+=("$STATE/redis/$p.pid"); done
  stop_pids -w 30 "$STATE/kafka/kafka.pid" & # a clean shutdown spares the next start a log recovery
  stop_pids "${files[@]}"
  wait
  rm -f "$STATE"/redis/nodes-*.conf
  ((SECURE)) && rm -rf "$STATE/tls" "$STATE/secrets" "$STATE/kafka" "$STATE"/redis/*.acl "$STATE"/redis/*.conf
  local left=()
  for p in "${REDIS_PORTS[@]}" "$KAFKA_PORT" $((KAFKA_PORT + 2)) "$S3_PORT" ${MTLS_PORT:+"$MTLS_PORT"}; do port_open "$p" && left+=("$p"); done
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
  local kind="PLAINTEXT"; ((SECURE)) && kind="SASL_SSL, SCRAM-SHA-512"
  if port_open "$KAFKA_PORT"; then printf 'kafka  127.0.0.1:%s  Apache Kafka %s, %s (log: %s; topics: %s)\n' "$KAFKA_PORT" "$KAFKA_VERSION" "$kind" "$STATE/kafka/server.log" "$TOPICS"
  else printf 'kafka  127.0.0.1:%s  DOWN\n' "$KAFKA_PORT"; rc=1; fi
  if ((SECURE)); then
    if port_open "$MTLS_PORT"; then printf 'kafka  127.0.0.1:%s  mTLS (client certificate required, CN -> User:CN)\n' "$MTLS_PORT"
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

# restart_kafka: start the broker again on its data directory after a test killed it (kill -9 or SIGTERM)
restart_kafka() {
  [[ -f $STATE/kafka/data/meta.properties ]] || die "no broker data in $STATE/kafka: run $0 up"
  kafka_start
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) cmd_env ;;
  purge) cmd_down; rm -rf "$STATE" ;;
  restart-node) restart_node "${2:?usage: $0 restart-node PORT}" ;;
  restart-kafka) restart_kafka ;;
  *) echo "usage: $0 [--secure] up|down|status|env|purge|restart-node PORT|restart-kafka" >&2; exit 2 ;;
esac
