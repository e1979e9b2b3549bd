#!/usr/bin/env bash
# test.sh — the whole test suite: brings the local stack and the secured one
# (stack.sh --secure) up, runs every test (unit and integration) with the race
# detector against them, and brings both down again even when tests fail.
# Exits with the tests' status.
#
# Extra arguments go to `go test` (e.g. scripts/test.sh -run TestDecide ./capping/).
#
# --contended runs the suite on a busy machine, as production and shared CI
# machines are: one process per core spins for the whole run (`make
# test-contended`). A test that passes only on an idle machine fails here.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

hogs=()
if [[ ${1:-} == --contended ]]; then
  shift
  for _ in $(seq "$(nproc)"); do
    ( while :; do :; done ) &
    hogs+=($!)
  done
  echo "test.sh: contended: ${#hogs[@]} busy processes, one per core"
fi

start=$(date +%s)
down() {
  if [[ ${#hogs[@]} -gt 0 ]]; then kill "${hogs[@]}" 2>/dev/null; fi
  scripts/stack.sh down; scripts/stack.sh --secure down
}
{ scripts/stack.sh up && scripts/stack.sh --secure up; } || { down; echo "test.sh: the local stacks did not come up" >&2; exit 1; }
trap down EXIT
eval "$(scripts/stack.sh env)"
eval "$(scripts/stack.sh --secure env)"

pkgs=("$@"); [[ ${#pkgs[@]} -eq 0 ]] && pkgs=(./...)
go test -race -count=1 -p 1 -timeout 25m "${pkgs[@]}"
rc=$?
echo "test.sh: go test exited $rc after $(( $(date +%s) - start )) s"
exit $rc
