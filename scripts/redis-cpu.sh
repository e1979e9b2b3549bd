# redis-cpu.sh — sourced by demo.sh and bench-calls.sh: redis_masters_cpu ADDR... prints the CPU seconds
# (INFO cpu, user + sys) the Redis Cluster's masters among ADDR (host:port) have used; replicas count 0.
redis_masters_cpu() {
  local a
  for a in "$@"; do
    redis-cli -h "${a%:*}" -p "${a##*:}" info 2>/dev/null | tr -d '\r' | awk -F: '
      /^role:/ {m = ($2 == "master")} /^used_cpu_(sys|user):/ {c += $2} END {printf "%.6f\n", m ? c : 0}'
  done | awk '{t += $1} END {printf "%.6f", t}'
}

# redis_masters_commands ADDR... prints "command calls usec" for every command the masters among ADDR have
# run (INFO commandstats, summed; the commands a script runs count as their own too, inside its usec).
redis_masters_commands() {
  local a
  for a in "$@"; do
    redis-cli -h "${a%:*}" -p "${a##*:}" info everything 2>/dev/null | tr -d '\r' | awk -F'[:,=]' '
      /^role:/ {m = ($2 == "master")} /^cmdstat_/ {c[substr($1, 9)] = $3; u[substr($1, 9)] = $5}
      END {if (m) for (k in c) print k, c[k], u[k]}'
  done | awk '{c[$1] += $2; u[$1] += $3} END {for (k in c) print k, c[k], u[k]}'
}

# redis_commands_per_job BEFORE AFTER JOBS: one line of what the masters ran per job between two
# redis_masters_commands snapshots (files): each command's calls per job, most first, and the scripts' time.
redis_commands_per_job() {
  awk -v jobs="$3" 'FNR == NR {c0[$1] = $2; u0[$1] = $3; next} {c[$1] = $2 - c0[$1]; u[$1] = $3 - u0[$1]}
    END {
      line = ""; n = 0
      for (k in c) if (c[k] / jobs >= 0.001 && k !~ /^(info|cluster|config|role|hello|ping|time|replconf|script|function)/) keys[++n] = k
      for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (c[keys[j]] > c[keys[i]]) {t = keys[i]; keys[i] = keys[j]; keys[j] = t}
      for (i = 1; i <= n; i++) line = line sprintf("%s%s %.3f", (i > 1 ? ", " : ""), keys[i], c[keys[i]] / jobs)
      if (line == "") line = "none"
      s = c["fcall"] + c["evalsha"] + c["eval"]
      printf "redis calls: per job on the masters: %s; a script call ran %.1f us (wall, its commands included)\n", line, (s ? (u["fcall"] + u["evalsha"] + u["eval"]) / s : 0)
    }' "$1" "$2"
}
