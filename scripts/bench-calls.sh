#!/usr/bin/env bash
# bench-calls.sh — what one script call costs the Redis Cluster's masters, in CPU time (INFO cpu, user + sys,
# summed over the masters, divided by the calls), for three scripts called by redis-benchmark --cluster with
# the same keys and load (REQUESTS calls over USERS random users, CLIENTS connections, PIPELINE deep):
#   seed    scripts/lua/seed.lua: the seed's design (ZCOUNT per window, ZADD, ZREMRANGEBYSCORE), two windows
#   decide  capping/decide.lua: capper's script, write path, the same two caps (daily and weekly, every send)
#   bare    scripts/lua/bare.lua: returns at once, with decide.lua's arguments: the cost of the call itself
#   floor   scripts/lua/floor.lua: ZRANGE, ZADD and PEXPIRE of the user's log and nothing else, with decide.lua's
#           arguments: the commands decide.lua cannot do without on a new user's first send (decide less floor
#           is what its logic costs)
#   batch   decide.lua's body run for BATCH users (default 16) in one call (a wrapper made here, with the
#           allow-cross-slot-keys flag of Redis 7 and the users' keys undeclared, all on one node): what issue
#           27's first lever (one call per cluster node per batch) could save; reported per user, not per call
# Alternates ROUNDS times (default 3) and prints one line: "seed S decide D bare B floor F batch N" (medians,
# us per call; batch: per user).
# Scripts given as arguments (scripts/bench-calls.sh FILE.lua ...) are measured too, each with decide.lua's
# arguments and named by its file's base name after the others: a variant of decide.lua (cut short after a
# step, or reworked) is measured side by side with the script in the same rounds.
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
BATCH=${BATCH:-16}
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
batch_lua=$(mktemp --suffix=.lua)
{ # decide.lua's body as a function, called once per user: ARGV = n, n pairs of key and member, decide's ARGV[1]
  # and ARGV[3..]
  echo '#!lua flags=allow-cross-slot-keys'
  echo 'local function decide(KEYS, ARGV)'
  sed -n '/^local key = KEYS\[1\]/,$p' capping/decide.lua
  cat <<'LUA'
end
local n = tonumber(ARGV[1])
local rest = {}
for i = 2 + 2 * n, #ARGV do rest[#rest + 1] = ARGV[i] end
local out = {}
for u = 0, n - 1 do
  local a = {rest[1], ARGV[3 + 2 * u]}
  for i = 2, #rest do a[i + 1] = rest[i] end
  out[u + 1] = decide({ARGV[2 + 2 * u]}, a)
end
return out
LUA
} >"$batch_lua"
grep -q '^local key = KEYS\[1\]' "$batch_lua" || { echo "bench-calls: cannot wrap capping/decide.lua" >&2; exit 1; }
declare -A sha=([seed]=$(load scripts/lua/seed.lua) [decide]=$(load capping/decide.lua) [bare]=$(load scripts/lua/bare.lua) [floor]=$(load scripts/lua/floor.lua) [batch]=$(load "$batch_lua"))
rm -f "$batch_lua"
extra=()
for f in "$@"; do
  n=$(basename "$f" .lua)
  [[ -z ${sha[$n]:-} ]] || { echo "bench-calls: $f: the name $n is taken" >&2; exit 1; }
  sha[$n]=$(load "$f")
  extra+=("$n")
done
args() { # args NAME NOW KEY MEMBER -> the script's arguments after EVALSHA ("#" in KEY and MEMBER: batch's user)
  local day=$(($2 - 86400000 + 1)) week=$(($2 - 604800000 + 1)) key=${3//\#/} member=${4//\#/}
  case $1 in
    seed) echo "${sha[seed]} 1 $key $2 $member $(($2 - 604800000)) $day 1073741824 $week 1073741824" ;;
    batch) # BATCH users: KEY and MEMBER with "#" numbered 1..BATCH; the first key declared (it routes the call)
      local users="" i
      for i in $(seq "$BATCH"); do users="$users ${3//\#/$i} ${4//\#/$i}"; done
      echo "${sha[batch]} 1 ${3//\#/1} $BATCH$users $2 1 604800000 0 0 0 0 $day 1073741824 86400000 '' $week 1073741824 604800000 ''" ;;
    *) echo "${sha[$1]} 1 $key $2 $member 1 604800000 0 0 0 0 $day 1073741824 86400000 '' $week 1073741824 604800000 ''" ;;
  esac
}
call() { # call NAME ROUND: REQUESTS decisions on keys of their own, prints the masters' us of CPU per call
  # (batch: per decision, REQUESTS / BATCH calls)
  local now before after per=1
  [[ $1 == batch ]] && per=$BATCH
  now=$(date +%s%3N)
  local check
  check=$(eval "redis-cli -c -p $port evalsha $(args "$1" "$now" "rbcost:{x}:0:#" m0#)" 2>&1)
  [[ $check =~ ^(ERR|NOSCRIPT|WRONGTYPE)|error ]] && { echo "bench-calls: $1 failed: $check" >&2; exit 1; }
  before=$(redis_masters_cpu "${addrs[@]}")
  eval "redis-benchmark -p $port --cluster -q -n $((REQUESTS / per)) -c $CLIENTS -P $PIPELINE -r $USERS \
    evalsha $(args "$1" "$now" "rbcost:$1:$2:{tag}:__rand_int__:#" "m__rand_int__#")" >/dev/null 2>&1
  after=$(redis_masters_cpu "${addrs[@]}")
  awk -v a="$before" -v b="$after" -v n="$((REQUESTS / per * per))" 'BEGIN {printf "%.2f", 1e6 * (b - a) / n}'
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
  for s in seed decide bare floor batch "${extra[@]}"; do
    rows+=("$s $(call "$s" "$r")")
  done
  echo "bench-calls round $r: ${rows[*]: -$((5 + ${#extra[@]}))}" >&2
done
printf '%s\n' "${rows[@]}" | python3 -c '
import statistics, sys
v = {}
for line in sys.stdin:
    k, x = line.split()
    v.setdefault(k, []).append(float(x))
print(" ".join("%s %.2f" % (k, statistics.median(v[k])) for k in ("seed", "decide", "bare", "floor", "batch") + tuple(sys.argv[1:])))' "${extra[@]}"
