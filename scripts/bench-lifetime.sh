#!/usr/bin/env bash
# bench-lifetime.sh (make bench-lifetime) — what lifetime caps cost, side by side in one run, alternated ROUNDS
# times (default 3), medians:
#   1. no lifetime cap: BenchmarkDecide/batch=512/pipelines=1 (daily and weekly caps) at BASE (default: the commit
#      before the tally, 57e2c8d) and at the working tree: decisions/s, and the tree's as a share of BASE's;
#   2. a lifetime cap of the job's campaign on every job: BenchmarkLifetime/lifetime/* against /none/* (the same
#      caps without it), 40 campaigns: decisions/s and the share, for users of 1,000,000 (mostly new) and of
#      50,000 (warm: most have a log);
#   3. Redis memory of the tally: BenchmarkTallyMemory, what the tally adds to users' logs (MEMORY USAGE with
#      and without it, the same sends): bytes per scope over 8 campaigns, and for a user of one.
# Uses the running local stack, or starts (and afterwards stops) it.
#   ROUNDS=5 BENCHTIME=3s BASE=HEAD~3 scripts/bench-lifetime.sh
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
ROUNDS=${ROUNDS:-3}
BENCHTIME=${BENCHTIME:-3s}
BASE=${BASE:-57e2c8d}
if ! scripts/stack.sh status >/dev/null 2>&1; then
  scripts/stack.sh up >/dev/null
  trap 'scripts/stack.sh down' EXIT
fi
eval "$(scripts/stack.sh env)"
work=$(mktemp -d)
trap 'git worktree remove --force "$work/base" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git worktree add -f --detach "$work/base" "$BASE" >/dev/null 2>&1
(cd "$work/base" && go test -c -o "$work/base.test" ./capping/)
go test -c -o "$work/head.test" ./capping/
run() { # run BINARY BENCH -> decisions/s
  "$1" -test.run '^$' -test.bench "$2" -test.benchtime "$BENCHTIME" | awk '/decisions\/s/{for(i=1;i<=NF;i++) if($i=="decisions/s") print $(i-1)}'
}
median() { sort -g | awk '{a[NR]=$1} END{print (NR%2)? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
echo "bench-lifetime: $ROUNDS rounds of ${BENCHTIME} each, base $BASE, $(nproc) cores" >&2
for r in $(seq "$ROUNDS"); do
  b=$(run "$work/base.test" 'BenchmarkDecide/batch=512/pipelines=1$')
  h=$(run "$work/head.test" 'BenchmarkDecide/batch=512/pipelines=1$')
  n=$(run "$work/head.test" 'BenchmarkLifetime/none/cold$')
  l=$(run "$work/head.test" 'BenchmarkLifetime/lifetime/cold$')
  nw=$(run "$work/head.test" 'BenchmarkLifetime/none/warm$')
  lw=$(run "$work/head.test" 'BenchmarkLifetime/lifetime/warm$')
  printf 'round %d: no lifetime cap: base %s, tree %s decisions/s; every job with one: none %s, lifetime %s; warm: none %s, lifetime %s decisions/s\n' \
    "$r" "$b" "$h" "$n" "$l" "$nw" "$lw" >&2
  echo "$b $h $n $l $nw $lw" >>"$work/rounds.txt"
done
mem=$("$work/head.test" -test.run '^$' -test.bench 'BenchmarkTallyMemory' -test.benchtime 1x)
col() { awk -v c="$1" '{print $c}' "$work/rounds.txt" | median; }
b=$(col 1) h=$(col 2) n=$(col 3) l=$(col 4) nw=$(col 5) lw=$(col 6)
awk -v b="$b" -v h="$h" -v n="$n" -v l="$l" -v nw="$nw" -v lw="$lw" 'BEGIN{
  printf "no lifetime cap: base %.0f, tree %.0f decisions/s: tree/base = %.3f (goal >= 0.98)\n", b, h, h/b
  printf "a lifetime cap on every job: cold %.0f vs %.0f decisions/s without: %.3f; warm %.0f vs %.0f: %.3f (goal >= 0.90)\n", l, n, l/n, lw, nw, lw/nw }'
echo "$mem" | awk '/bytes\/scope/{for(i=1;i<=NF;i++){if($i=="bytes/scope")s=$(i-1); if($i=="bytes/user-of-1-scope")u=$(i-1)}}
  END{printf "tally memory: %s bytes per scope (goal <= 32), %s bytes for a user of one scope\n", s, u}'
