# bench-lib.sh — sourced by the end-to-end bench scripts (bench-e2e, bench-blast, bench-hold, bench-budget):
#   - the repository root is the working directory;
#   - the local stack runs: started here (and stopped at exit) unless it runs already;
#   - $work is a directory removed at exit;
#   - $work/drop.yaml is config.example.yaml on the drop path (without its hold policy), the base every
#     bench derives its configurations from.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
started=0
if ! scripts/stack.sh status >/dev/null 2>&1; then scripts/stack.sh up >/dev/null; started=1; fi
work=$(mktemp -d)
trap '((started)) && scripts/stack.sh down >/dev/null; rm -rf "$work"' EXIT
grep -v 'on_capped: {policy: hold' config.example.yaml >"$work/drop.yaml"
