# redis-cpu.sh — sourced by demo.sh and bench-calls.sh: redis_masters_cpu ADDR... prints the CPU seconds
# (INFO cpu, user + sys) the Redis Cluster's masters among ADDR (host:port) have used; replicas count 0.
redis_masters_cpu() {
  local a
  for a in "$@"; do
    redis-cli -h "${a%:*}" -p "${a##*:}" info 2>/dev/null | tr -d '\r' | awk -F: '
      /^role:/ {m = ($2 == "master")} /^used_cpu_(sys|user):/ {c += $2} END {printf "%.6f\n", m ? c : 0}'
  done | awk '{t += $1} END {printf "%.6f", t}'
}
