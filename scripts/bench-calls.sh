#!/usr/bin/env bash
# bench-calls.sh — what one script call costs the Redis Cluster's masters, in CPU time (INFO cpu, user + sys,
# summed over the masters, divided by the calls), for scripts called by `capper-devstack calls` with the same
# keys and load (REQUESTS calls over USERS random users, CLIENTS connections, PIPELINE deep, as redis-benchmark
# -c and -P; decide.lua's arguments are binary, which redis-benchmark cannot send):
#   seed    scripts/lua/seed.lua: the seed's design (ZCOUNT per window, ZADD, ZREMRANGEBYSCORE), two windows
#   decide  capping/decide.lua as capper calls it: FCALL of its function library, with capper's own arguments
#           (capping.ScriptCall), write path, the same two caps (daily and weekly, every send)
#   evalsha the same script called as a script (EVALSHA), as capper called it before its function library:
#           the chunk runs from the top on every call, making its local functions anew
#   bare    scripts/lua/bare.lua: returns at once, with decide.lua's arguments: the cost of the call itself
#   floor   scripts/lua/floor.lua: GET and APPEND (SET PX for a new log) and nothing else, with decide.lua's
#           arguments: the commands decide.lua cannot do without on a new user's first send (decide less floor
#           is what its logic costs)
#   newkey  scripts/lua/newkey.lua: a new log written whole with its TTL (SET PX) and nothing else, with
#           decide.lua's arguments: what a first send costs any sliding log whose keys expire
#   seedttl scripts/lua/seed.lua given a TTL: the seed with a PEXPIRE of its key after each call, the seed's
#           design as a deployment must run it (its sorted sets never expire)
#   batch   decide.lua (FCALL) deciding BATCH users (default 16) in one call, as capper sends a node's requests (its
#           allow-cross-slot-keys flag; every key on one node): reported per user, not per call
#   copy    decide.lua recording BATCH sends in one call that the near cache decided allowed from its whole
#           copies of the users' logs (mode 4: GET, compare, APPEND), each user's log written before the
#           CPU is read (capper-devstack calls -setup): per user, as batch
#   copy1   the same, one user per call: per call
# Alternates ROUNDS times (default 3) and prints one line: "seed S decide D bare B floor F batch N copy C
# copy1 C1 newkey K seedttl T evalsha E" (medians, us per call; batch and copy: per user).
# Scripts given as arguments (scripts/bench-calls.sh FILE.lua ...) are measured too, each with decide.lua's
# arguments and named by its file's base name after the others: a variant of decide.lua (cut short after a
# step, or reworked) is measured side by side with the script in the same rounds. They are called with
# EVALSHA: compare them with evalsha, not decide.
# An error reply stops the bench (an erroring script is cheap and would measure nothing).
# Uses the running local stack (scripts/stack.sh env).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
ROUNDS=${ROUNDS:-3}
REQUESTS=${REQUESTS:-300000}
USERS=${USERS:-250000}
CLIENTS=${CLIENTS:-32}
PIPELINE=${PIPELINE:-16}
BATCH=${BATCH:-16}
eval "$(scripts/stack.sh env)"
addrs=(${CAPPER_TEST_REDIS_ADDRS//,/ })

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
driver=$(mktemp -d)/capper-devstack
go build -o "$driver" ./cmd/capper-devstack
"$driver" calls -addrs "$CAPPER_TEST_REDIS_ADDRS" -load || { echo "bench-calls: loading capper's function library failed" >&2; exit 1; }
declare -A sha=([seed]=$(load scripts/lua/seed.lua) [evalsha]=$(load capping/decide.lua) [bare]=$(load scripts/lua/bare.lua) [floor]=$(load scripts/lua/floor.lua)
  [newkey]=$(load scripts/lua/newkey.lua))
sha[seedttl]=${sha[seed]}
for n in decide batch copy copy1; do
  sha[$n]=fcall # capper's function: calls without -sha
done
extra=()
for f in "$@"; do
  n=$(basename "$f" .lua)
  [[ -z ${sha[$n]:-} ]] || { echo "bench-calls: $f: the name $n is taken" >&2; exit 1; }
  sha[$n]=$(load "$f")
  extra+=("$n")
done
call() { # call NAME ROUND: REQUESTS decisions on keys of their own, prints the masters' us of CPU per call
  # (batch: per decision, REQUESTS / BATCH calls)
  local before after per=1 kind=decide batch=$BATCH at script=${sha[$1]}
  [[ $script == fcall ]] && script=""
  case $1 in seed | seedttl | batch | copy) kind=$1 ;; copy1) kind=copy batch=1 ;; esac
  [[ $1 == batch || $1 == copy ]] && per=$BATCH
  at=$(date +%s%3N)
  if [[ $kind == copy ]]; then # the users' logs, as the near cache's copies hold them: written before the CPU is read
    "$driver" calls -addrs "$CAPPER_TEST_REDIS_ADDRS" -sha "$script" -args copy -setup -at "$at" -n "$REQUESTS" \
      -clients "$CLIENTS" -pipeline "$PIPELINE" -batch "$batch" -prefix "rbcost:$1:$2" >/dev/null ||
      { echo "bench-calls: $1's setup failed" >&2; exit 1; }
  fi
  before=$(redis_masters_cpu "${addrs[@]}")
  "$driver" calls -addrs "$CAPPER_TEST_REDIS_ADDRS" -sha "$script" -args "$kind" -at "$at" -n "$REQUESTS" -users "$USERS" \
    -clients "$CLIENTS" -pipeline "$PIPELINE" -batch "$batch" -prefix "rbcost:$1:$2" >/dev/null ||
    { echo "bench-calls: $1 failed" >&2; exit 1; }
  after=$(redis_masters_cpu "${addrs[@]}")
  awk -v a="$before" -v b="$after" -v n="$((REQUESTS / per * per))" 'BEGIN {printf "%.2f", 1e6 * (b - a) / n}'
  # Its keys go at once, outside the measure: every call then starts from the same keyspace and pays for
  # the same dict resizes (left to the end, the node's keyspace grew by 250k keys a call, and whichever
  # call crossed a resize paid for it: the seed measured 6.3 to 9.9 us in one run).
  "$driver" drop-keys -addrs "$CAPPER_TEST_REDIS_ADDRS" -prefix "rbcost:$1:$2:" >/dev/null ||
    { echo "bench-calls: dropping $1's keys failed" >&2; exit 1; }
}
cleanup() { # drop what a failed run left of the benchmark's keys
  local a
  for a in "${addrs[@]}"; do
    redis-cli -h "${a%:*}" -p "${a##*:}" --scan --pattern 'rbcost:*' | xargs -r -n 500 redis-cli -h "${a%:*}" -p "${a##*:}" unlink >/dev/null 2>&1 || true
  done
  rm -rf "$(dirname "$driver")"
}
trap cleanup EXIT
rows=()
for r in $(seq "$ROUNDS"); do
  for s in seed decide bare floor batch copy copy1 newkey seedttl evalsha "${extra[@]}"; do
    rows+=("$s $(call "$s" "$r")")
  done
  echo "bench-calls round $r: ${rows[*]: -$((10 + ${#extra[@]}))}" >&2
done
printf '%s\n' "${rows[@]}" | python3 -c '
import statistics, sys
v = {}
for line in sys.stdin:
    k, x = line.split()
    v.setdefault(k, []).append(float(x))
print(" ".join("%s %.2f" % (k, statistics.median(v[k])) for k in ("seed", "decide", "bare", "floor", "batch", "copy", "copy1", "newkey", "seedttl", "evalsha") + tuple(sys.argv[1:])))' "${extra[@]}"
