# bench-lib.sh — sourced by the end-to-end bench scripts (bench-e2e, bench-blast, bench-hold, bench-budget):
#   - the repository root is the working directory;
#   - the local stack runs: started here (and stopped at exit) unless it runs already;
#   - $work is a directory removed at exit;
#   - $work/drop.yaml is config.example.yaml on the drop path (without its hold policy), the base every
#     bench derives its configurations from;
#   - $work/decide.yaml is drop.yaml without arbitration windows: every job gets its final decision within
#     the run (with the example's 2m window a send that would take the active segment's last daily slot
#     waits 2 minutes on a delay tier, which is about a fifth of bench-e2e's jobs: the run ended with them
#     pending, their second decision never counted). What the decision path costs per job is measured on it
#     (bench-e2e, bench-blast); what arbitration costs, by make bench-priority.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
started=0
if ! scripts/stack.sh status >/dev/null 2>&1; then scripts/stack.sh up >/dev/null; started=1; fi
work=$(mktemp -d)
at_exit=() # a script's own cleanup, run at exit before the stack stops
trap 'for c in "${at_exit[@]}"; do $c; done; ((started)) && scripts/stack.sh down >/dev/null; rm -rf "$work"' EXIT
# (Without kafka.heartbeat_interval, the default anyway: a worker of an older commit, DEMO_WORKER_BIN, refuses it.)
grep -v -e 'on_capped: {policy: hold' -e '^  heartbeat_interval:' config.example.yaml >"$work/drop.yaml"
sed -E 's/, arbitration: [^,}]+//' "$work/drop.yaml" >"$work/decide.yaml"
if grep -qE '^[^#]*arbitration:' "$work/decide.yaml"; then
  echo "bench-lib: cannot take the arbitration windows out of config.example.yaml (its format changed?)" >&2; exit 1
fi
