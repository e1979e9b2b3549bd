#!/usr/bin/env bash
# bench-lifetime.sh (make bench-lifetime) — what lifetime caps cost, side by side in one run, alternated ROUNDS
# times (default 3), medians:
#   1. no lifetime cap: BenchmarkDecide/batch=512/pipelines=1 (daily and weekly caps) at BASE (default: the commit
#      before the tally, 57e2c8d) and at the working tree: decisions/s, and the tree's as a share of BASE's;
#   2. a lifetime cap of the job's campaign on every job: BenchmarkLifetime/lifetime/* against /none/* (the same
#      caps without it), 40 campaigns: decisions/s and the share, for users of 1,000,000 (mostly new) and of
#      50,000 (warm: each has 8 sends of 8 campaigns before the row is timed, then WARM_BATCHES batches of
#      512, default 300: a count, not a time, since every send lengthens a log and a row's cost grows with
#      the decisions taken), with every decision a script call (script) and with the worker's default near
#      cache (cache); and, with the near cache, for 50,000 users past the spill (each first sent 24 of the
#      campaigns: a user's tally items past 16 are in a tally key of their own), WARM_BATCHES batches;
#   3. end to end: BENCH_JOBS (default 1,000,000) jobs for BENCH_USERS (250,000) users through demo.sh on
#      bench-lib's decide.yaml, and on the same rules with a lifetime cap of the job's campaign added to every
#      segment's and the default caps (limit 1000: it counts every job and caps none, so both runs decide the
#      same), alternated: jobs/s, the worker's and the Redis masters' CPU per job, and the ratios;
#   4. collapse keys, end to end as in 3, on bench-lib's decide.yaml: the worker of the working tree against the
#      worker of BASE_COLLAPSE (default: the commit before collapse keys, 5c023ce) with no key on any job, and the
#      tree's with a collapse key on every job (loadgen --collapse-share 1: one of three keys a user, so a
#      user's older sends of a key collapse): jobs/s, worker and Redis masters' us/job, and the ratios;
#   5. Redis memory of the tally: BenchmarkTallyMemory, what the tally adds to users' logs (MEMORY USAGE with
#      and without it, the same sends): bytes per scope over 8 campaigns, and for a user of one.
# `scripts/bench-lifetime.sh returning` runs instead 3 as it costs users with history: for each config, a run
# whose Redis keys are kept (DEMO_KEEP_KEYS), then the timed run on them (DEMO_KEY_PREFIX), alternated ROUNDS
# times: every user's first send of the timed run finds a log (with its tally items under the lifetime cap),
# and the worker's near cache starts empty, as after a deploy.
# Uses the running local stack, or starts (and afterwards stops) it.
#   ROUNDS=5 BENCHTIME=3s BASE=HEAD~3 scripts/bench-lifetime.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bench-lib.sh"
eval "$(scripts/stack.sh env)"
export CI=true # the Go benchmarks fail, not skip, without the stack
ROUNDS=${ROUNDS:-3}
BENCHTIME=${BENCHTIME:-3s}
WARM_BATCHES=${WARM_BATCHES:-300}
BASE=${BASE:-57e2c8d}
BASE_COLLAPSE=${BASE_COLLAPSE:-5c023ce}
JOBS=${BENCH_JOBS:-1000000}
USERS=${BENCH_USERS:-250000}
remove_worktrees() {
  git worktree remove --force "$work/base" >/dev/null 2>&1 || true
  git worktree remove --force "$work/base-collapse" >/dev/null 2>&1 || true
}
at_exit+=(remove_worktrees)
if [[ ${1:-} != returning ]]; then
  git worktree add -f --detach "$work/base" "$BASE" >/dev/null 2>&1
  (cd "$work/base" && go test -c -o "$work/base.test" ./capping/)
  go test -c -o "$work/head.test" ./capping/
  git worktree add -f --detach "$work/base-collapse" "$BASE_COLLAPSE" >/dev/null 2>&1
  (cd "$work/base-collapse" && go build -o "$work/capper-base" ./cmd/capper)
fi
run() { # run BINARY BENCH [BENCHTIME] -> decisions/s
  "$1" -test.run '^$' -test.bench "$2" -test.benchtime "${3:-$BENCHTIME}" | awk '/decisions\/s/{for(i=1;i<=NF;i++) if($i=="decisions/s") print $(i-1)}'
}
median() { sort -g | awk '{a[NR]=$1} END{print (NR%2)? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2}'; }
rows="$work/rounds.txt" # one line per round, the figures in columns (returning: its own file)
col() { awk -v c="$1" '{print $c}' "$rows" | median; }
ratio() { # ratio A B: the median over the rounds of column A / column B, the runs of each round side by side
  awk -v a="$1" -v b="$2" '{printf "%.3f\n", $a/$b}' "$rows" | median
}
rounds() { awk -v a="$1" -v b="$2" '{printf "%s%.2f", (NR>1 ? " / " : ""), $a/$b}' "$rows"; }
# decide.yaml without its (empty) collapse section, which a worker from before collapse keys refuses
python3 - "$work/decide.yaml" <<'PY'
import sys
lines, out, skip = open(sys.argv[1]).read().split('\n'), [], False
for l in lines:
    if l.startswith('  collapse:'):
        skip = True
        continue
    if skip and (l.startswith('   ') or l.strip().startswith('#')):
        continue
    skip = False
    out.append(l)
open(sys.argv[1], 'w').write('\n'.join(out))
PY
! grep -qE '^ *(collapse|tag_prefix):' "$work/decide.yaml" || { echo "bench-lifetime: cannot take the collapse section out" >&2; exit 1; }
# decide.yaml with a lifetime cap of the job's campaign after every caps list's header
python3 - "$work/decide.yaml" "$work/lifetime.yaml" <<'PY'
import re, sys
src, out = open(sys.argv[1]).read().split('\n'), []
for i, line in enumerate(src):
    out.append(line)
    if re.match(r'^\s*(caps|default_caps):\s*(#.*)?$', line):
        item = next(l for l in src[i + 1:] if l.strip().startswith('- {'))
        out.append(item[:len(item) - len(item.lstrip())] + '- {name: campaign-life, window: lifetime, limit: 1000, per_campaign: true}')
open(sys.argv[2], 'w').write('\n'.join(out))
PY
grep -q 'campaign-life' "$work/lifetime.yaml" || { echo "bench-lifetime: cannot derive the lifetime config" >&2; exit 1; }
# e2e's runs go under bench-lib.sh's stall watcher; returning's timed runs are not run again if the machine stalls
# (the first try used up the users' history), a stall is said.
e2e_retries=$STALL_RETRIES
e2e() { # e2e CONFIG [WORKER_BIN [LOADGEN_ARGS]] -> "jobs_per_sec worker_us redis_us"
  local out
  out=$(STALL_RETRIES=$e2e_retries watched env DEMO_CONFIG="$1" DEMO_WORKER_BIN="${2:-}" DEMO_LOADGEN_ARGS="${3:-}" DEMO_JOBS=$JOBS DEMO_USERS=$USERS scripts/demo.sh) || { echo "$out" >&2; exit 1; }
  grep -q '"unaccounted":0,"violations":0' <<<"$out" || { echo "$out" >&2; echo "bench-lifetime: a run failed its report" >&2; exit 1; }
  python3 - "$(grep '^{"jobs"' <<<"$out" | tail -1)" "$(grep '^worker:' <<<"$out" | tail -1)" "$(grep '^redis:' <<<"$out" | tail -1)" <<'PY'
import json, re, sys
r = json.loads(sys.argv[1])
print(round(r["jobs_per_sec"]), re.search(r'\(([\d.]+) us/job\)', sys.argv[2]).group(1), re.search(r'\(([\d.]+) us/job\)', sys.argv[3]).group(1))
PY
}
if [[ ${1:-} == returning ]]; then
  # Users with history: a run whose keys are kept (each user first sent BENCH_JOBS / BENCH_USERS jobs), then
  # the timed run on the same keys, so that every user's first send of it finds a log (with its tally items
  # under the lifetime cap) and the near cache starts empty, as after a deploy.
  echo "bench-lifetime returning: $ROUNDS rounds, $JOBS jobs for $USERS users with history, $(nproc) cores" >&2
  rows="$work/returning.txt"
  e2e_retries=0
  for r in $(seq "$ROUNDS"); do
    for c in decide lifetime; do
      export DEMO_KEY_PREFIX="ret-$$-$r-$c"
      DEMO_KEEP_KEYS=1 DEMO_CONFIG="$work/$c.yaml" DEMO_JOBS=$JOBS DEMO_USERS=$USERS scripts/demo.sh >/dev/null 2>&1 ||
        { echo "bench-lifetime: the run that gives users their history failed" >&2; exit 1; }
      if [[ $c == decide ]]; then en=$(e2e "$work/$c.yaml"); else el=$(e2e "$work/$c.yaml"); fi
      unset DEMO_KEY_PREFIX
    done
    printf 'round %d: users with history, end to end (jobs/s, worker and Redis us/job): none %s, lifetime %s\n' "$r" "$en" "$el" >&2
    echo "$en $el" >>"$rows"
  done
  echo "users with history, end to end, a lifetime cap on every job: median of the rounds' ratios $(ratio 4 1) (rounds $(rounds 4 1); goal >= 0.90)"
  awk -v j="$(col 1)" -v w="$(col 2)" -v rr="$(col 3)" -v lj="$(col 4)" -v lw="$(col 5)" -v lr="$(col 6)" 'BEGIN{
    printf "users with history, end to end: medians %.0f vs %.0f jobs/s: %.3f; worker %.1f vs %.1f us/job (%.2fx), Redis masters %.1f vs %.1f us/job (%.2fx)\n", lj, j, lj/j, lw, w, lw/w, lr, rr, lr/rr }'
  stalled_runs
  exit 0
fi
echo "bench-lifetime: $ROUNDS rounds of ${BENCHTIME} each (warm rows: $WARM_BATCHES batches), base $BASE, $(nproc) cores" >&2
for r in $(seq "$ROUNDS"); do
  b=$(run "$work/base.test" 'BenchmarkDecide/batch=512/pipelines=1$')
  h=$(run "$work/head.test" 'BenchmarkDecide/batch=512/pipelines=1$')
  n=$(run "$work/head.test" 'BenchmarkLifetime/none/cold/script$')
  l=$(run "$work/head.test" 'BenchmarkLifetime/lifetime/cold/script$')
  nw=$(run "$work/head.test" 'BenchmarkLifetime/none/warm/script$' "${WARM_BATCHES}x")
  lw=$(run "$work/head.test" 'BenchmarkLifetime/lifetime/warm/script$' "${WARM_BATCHES}x")
  nc=$(run "$work/head.test" 'BenchmarkLifetime/none/cold/cache$')
  lc=$(run "$work/head.test" 'BenchmarkLifetime/lifetime/cold/cache$')
  nwc=$(run "$work/head.test" 'BenchmarkLifetime/none/warm/cache$' "${WARM_BATCHES}x")
  lwc=$(run "$work/head.test" 'BenchmarkLifetime/lifetime/warm/cache$' "${WARM_BATCHES}x")
  nsc=$(run "$work/head.test" 'BenchmarkLifetime/none/spilled/cache$' "${WARM_BATCHES}x")
  lsc=$(run "$work/head.test" 'BenchmarkLifetime/lifetime/spilled/cache$' "${WARM_BATCHES}x")
  en=$(e2e "$work/decide.yaml")
  el=$(e2e "$work/lifetime.yaml")
  cb=$(e2e "$work/decide.yaml" "$work/capper-base")
  ck=$(e2e "$work/decide.yaml" "" "--collapse-share 1")
  printf 'round %d: no lifetime cap: base %s, tree %s decisions/s; every job with one, script: none %s, lifetime %s; warm: none %s, lifetime %s; near cache: none %s, lifetime %s; warm: none %s, lifetime %s; spilled: none %s, lifetime %s decisions/s; end to end (jobs/s, worker and Redis us/job): none %s, lifetime %s; collapse keys: base worker %s, every job keyed %s\n' \
    "$r" "$b" "$h" "$n" "$l" "$nw" "$lw" "$nc" "$lc" "$nwc" "$lwc" "$nsc" "$lsc" "$en" "$el" "$cb" "$ck" >&2
  echo "$b $h $n $l $nw $lw $en $el $cb $ck $nc $lc $nwc $lwc $nsc $lsc" >>"$rows"
done
mem=$("$work/head.test" -test.run '^$' -test.bench 'BenchmarkTallyMemory' -test.benchtime 1x)
b=$(col 1) h=$(col 2) n=$(col 3) l=$(col 4) nw=$(col 5) lw=$(col 6)
ej=$(col 7) ew=$(col 8) er=$(col 9) lj=$(col 10) lwk=$(col 11) lr=$(col 12)
awk -v b="$b" -v h="$h" -v n="$n" -v l="$l" -v nw="$nw" -v lw="$lw" 'BEGIN{
  printf "no lifetime cap: base %.0f, tree %.0f decisions/s: tree/base = %.3f (goal >= 0.98)\n", b, h, h/b
  printf "a lifetime cap on every job, every decision a script call: cold %.0f vs %.0f decisions/s without: %.3f; warm %.0f vs %.0f: %.3f (goal >= 0.90)\n", l, n, l/n, lw, nw, lw/nw }'
echo "a lifetime cap on every job, the near cache on (the worker's default): cold: median of the rounds' ratios $(ratio 20 19) (rounds $(rounds 20 19)); warm: $(ratio 22 21) (rounds $(rounds 22 21)); goal >= 0.90"
echo "a lifetime cap on every job, the near cache on, users past the spill (their tally in a tally key): median of the rounds' ratios $(ratio 24 23) (rounds $(rounds 24 23)); medians $(col 24) vs $(col 23) decisions/s"
echo "a lifetime cap on every job, every decision a script call: cold: median of the rounds' ratios $(ratio 4 3) (rounds $(rounds 4 3)); warm: $(ratio 6 5) (rounds $(rounds 6 5))"
echo "end to end, a lifetime cap on every job: median of the rounds' ratios $(ratio 10 7) (rounds $(rounds 10 7); goal >= 0.90)"
awk -v ej="$ej" -v ew="$ew" -v er="$er" -v lj="$lj" -v lw="$lwk" -v lr="$lr" 'BEGIN{
  printf "end to end, a lifetime cap on every job: medians %.0f vs %.0f jobs/s: %.3f; worker %.1f vs %.1f us/job (%.2fx), Redis masters %.1f vs %.1f us/job (%.2fx)\n", lj, ej, lj/ej, lw, ew, lw/ew, lr, er, lr/er }'
cbj=$(col 13) cbw=$(col 14) cbr=$(col 15) ckj=$(col 16) ckw=$(col 17) ckr=$(col 18)
echo "end to end, no collapse key, the tree against the commit before collapse keys: median of the rounds' ratios $(ratio 7 13) (rounds $(rounds 7 13); goal >= 0.98)"
echo "end to end, a collapse key on every job against none: median of the rounds' ratios $(ratio 16 7) (rounds $(rounds 16 7))"
awk -v ej="$ej" -v ew="$ew" -v er="$er" -v bj="$cbj" -v bw="$cbw" -v br="$cbr" -v kj="$ckj" -v kw="$ckw" -v kr="$ckr" 'BEGIN{
  printf "end to end, no collapse key: medians: the tree %.0f vs the commit before collapse keys %.0f jobs/s: %.3f; worker %.1f vs %.1f us/job (%.2fx)\n", ej, bj, ej/bj, ew, bw, ew/bw
  printf "end to end, a collapse key on every job: medians %.0f vs %.0f jobs/s without: %.3f; worker %.1f vs %.1f us/job (%.2fx), Redis masters %.1f vs %.1f us/job (%.2fx)\n", kj, ej, kj/ej, kw, ew, kw/ew, kr, er, kr/er }'
echo "$mem" | awk '/bytes\/scope/{for(i=1;i<=NF;i++){if($i=="bytes/scope")s=$(i-1); if($i=="bytes/user-of-1-scope")u=$(i-1)}}
  END{printf "tally memory: %s bytes per scope (goal <= 32), %s bytes for a user of one scope\n", s, u}'
stalled_runs
