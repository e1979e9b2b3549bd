#!/usr/bin/env bash
# bench-calls.sh — what one script call costs the Redis Cluster's masters, in CPU time (INFO cpu, user + sys,
# summed over the masters, divided by the calls), for three scripts called by redis-benchmark --cluster with
# the same keys and load (REQUESTS calls over USERS random users, CLIENTS connections, PIPELINE deep):
#   seed    scripts/lua/seed.lua: the seed's design (ZCOUNT per window, ZADD, ZREMRANGEBYSCORE), two windows
#   decide  capping/decide.lua: capper's script, write path, the same two caps (daily and weekly, every send)
#   bare    scripts/lua/bare.lua: returns at once, with decide.lua's arguments: the cost of the call itself
# Alternates ROUNDS times (default 3) and prints one line: "seed S decide D bare B" (medians, us per call).
# Each script is called once by redis-cli first: an error reply stops the bench (an erroring script is cheap).
# Uses the running local stack (scripts/stack.sh env).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
ROUNDS=${ROUNDS:-3}
REQUESTS=${REQUESTS:-300000}
USERS=${USERS:-250000}
CLIENTS=${CLIENTS:-32}
PIPELINE=${PIPELINE:-16}
eval "$(scripts/stack.sh env)"
addrs=(${CAPPER_TEST_REDIS_ADDRS//,/ })
port=${addrs[0]##*:}

source scripts/redis-cpu.sh
load() { # load FILE -> sha, loaded on every node
  local sha a got
  sha=$(sha1sum "$1" | cut -d' ' -f1)
  for a in "${addrs[@]}"; do
    got=$(redis-cli -h "${a%:*}" -p "${a##*:}" -x script load <"$1")
    [[ $got == "$sha" ]] || { echo "bench-calls: script load of $1 on $a returned $got" >&2; exit 1; }
  done
  echo "$sha"
}
declare -A sha=([seed]=$(load scripts/lua/seed.lua) [decide]=$(load capping/decide.lua) [bare]=$(load scripts/lua/bare.lua))
args() { # args NAME NOW KEY MEMBER -> the script's arguments after EVALSHA
  local day=$(($2 - 86400000 + 1)) week=$(($2 - 604800000 + 1))
  case $1 in
    seed) echo "${sha[seed]} 1 $3 $2 $4 $(($2 - 604800000)) $day 1073741824 $week 1073741824" ;;
    *) echo "${sha[$1]} 1 $3 $2 $4 1 604800000 0 0 0 0 $day 1073741824 86400000 '' $week 1073741824 604800000 ''" ;;
  esac
}
call() { # call NAME ROUND: REQUESTS calls on keys of their own, prints the masters' us of CPU per call
  local now before after
  now=$(date +%s%3N)
  local check
  check=$(eval "redis-cli -c -p $port evalsha $(args "$1" "$now" "rbcost:{x}:0" m0)" 2>&1)
  [[ $check =~ ^(ERR|NOSCRIPT|WRONGTYPE)|error ]] && { echo "bench-calls: $1 failed: $check" >&2; exit 1; }
  before=$(redis_masters_cpu "${addrs[@]}")
  eval "redis-benchmark -p $port --cluster -q -n $REQUESTS -c $CLIENTS -P $PIPELINE -r $USERS \
    evalsha $(args "$1" "$now" "rbcost:$1:$2:{tag}:__rand_int__" "m__rand_int__")" >/dev/null 2>&1
  after=$(redis_masters_cpu "${addrs[@]}")
  awk -v a="$before" -v b="$after" -v n="$REQUESTS" 'BEGIN {printf "%.2f", 1e6 * (b - a) / n}'
}
cleanup() { # drop the benchmark's keys (once, at the end: a scan of every key)
  local a
  for a in "${addrs[@]}"; do
    redis-cli -h "${a%:*}" -p "${a##*:}" --scan --pattern 'rbcost:*' | xargs -r -n 500 redis-cli -h "${a%:*}" -p "${a##*:}" unlink >/dev/null 2>&1 || true
  done
}
trap cleanup EXIT
rows=()
for r in $(seq "$ROUNDS"); do
  for s in seed decide bare; do
    rows+=("$s $(call "$s" "$r")")
  done
  echo "bench-calls round $r: ${rows[*]: -3}" >&2
done
printf '%s\n' "${rows[@]}" | python3 -c '
import statistics, sys
v = {}
for line in sys.stdin:
    k, x = line.split()
    v.setdefault(k, []).append(float(x))
print(" ".join("%s %.2f" % (k, statistics.median(v[k])) for k in ("seed", "decide", "bare")))'
