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
# (Without kafka.heartbeat_interval, whose default is the example's value: a worker of an older commit,
# DEMO_WORKER_BIN, refuses it, and runs with its own default, 500 ms before 100 ms was.)
grep -v -e 'on_capped: {policy: hold' -e '^  heartbeat_interval:' config.example.yaml >"$work/drop.yaml"
sed -E 's/, arbitration: [^,}]+//' "$work/drop.yaml" >"$work/decide.yaml"
if grep -qE '^[^#]*arbitration:' "$work/decide.yaml"; then
  echo "bench-lib: cannot take the arbitration windows out of config.example.yaml (its format changed?)" >&2; exit 1
fi

# A stalled machine: a VM paused for a snapshot or a migration, or a host that gives the guest no CPU, stops every
# process at once, and the windows it covers measure the host, not capper (a paused VM's wall clock is stepped on
# when it resumes: "virtual machine fork" in the kernel's log). stalls_start FILE starts a watcher that wakes every
# 20 ms and appends "UNIX_SECONDS GAP_SECONDS" to FILE when a wakeup comes more than STALL_GAP seconds (default 1)
# of wall time after the last, or the wall clock stepped that far against the monotonic one; stalls_stop stops it,
# and the watcher appends "late P50 P99 MAX": how late its wakeups came, in ms (a host that gives the guest less
# CPU without pausing it shows there, not as a stall: a quiet machine's p99 is well under a millisecond).
STALL_GAP=${STALL_GAP:-1}
stalls_pid=
stalls_start() {
  : >"$1"
  python3 -u - "$STALL_GAP" >>"$1" 2>/dev/null <<'PY' &
import signal, sys, time
limit = float(sys.argv[1])
late = []
def done(*_):
    late.sort()
    q = lambda f: 1000 * late[min(len(late) - 1, int(f * len(late)))] if late else 0
    print("late %.1f %.1f %.1f" % (q(0.5), q(0.99), q(1)))
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
wall, mono = time.time(), time.monotonic()
while True:
    time.sleep(0.02)
    w, m = time.time(), time.monotonic()
    late.append(max(0, m - mono - 0.02))
    gap = max(w - wall, abs((w - m) - (wall - mono)))
    if gap > limit:
        print("%.3f %.3f" % (w, gap))
    wall, mono = w, m
PY
  stalls_pid=$!
}
stalls_stop() { [[ -n $stalls_pid ]] && { kill "$stalls_pid" 2>/dev/null; wait "$stalls_pid" 2>/dev/null; stalls_pid=; }; return 0; }
at_exit+=(stalls_stop)

# watched CMD... runs CMD under the watcher (its output and errors captured) and prints its output and how late
# the watcher's wakeups came. A run during which the machine stalled measured the host: it is said so with its
# stalls and run again, up to STALL_RETRIES times (default 2; 0 for a run that cannot be repeated as it is); if
# every try stalled the last stands. Returns CMD's status. stalled_runs prints how many runs stalled.
STALL_RETRIES=${STALL_RETRIES:-2}
watched() {
  local try rc out stalls
  for try in $(seq 0 "$STALL_RETRIES"); do
    stalls_start "$work/stalls"
    rc=0
    out=$("$@" 2>&1) || rc=$?
    stalls_stop
    awk '$1 == "late" { printf "  the machine: the watcher'"'"'s 20 ms wakeups late by p50 %s ms, p99 %s ms, at most %s ms\n", $2, $3, $4 }' "$work/stalls" >&2
    grep -qv '^late' "$work/stalls" || break
    stalls=$(grep -v '^late' "$work/stalls" | while read -r t g; do printf '%.1f s to %s ' "$g" "$(date -d "@${t%.*}" +%T)"; done)
    echo "  the machine stalled during this run (${stalls% }): $(if ((try < STALL_RETRIES)); then echo "run again"; else echo "kept"; fi)" >&2
    echo "$stalls" >>"$work/stalled.txt"
  done
  echo "$out"
  return "$rc"
}
stalled_runs() { [[ -s $work/stalled.txt ]] && echo "runs during which the machine stalled: $(wc -l <"$work/stalled.txt") (each printed above, and what became of it)"; return 0; }
