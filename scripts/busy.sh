#!/usr/bin/env bash
# make test-busy: run a command beside busy loops, PER_CORE of them for each core, at the command's own priority;
# a suite that passes here depends on no test's wall time. Prints the 1-minute load average (sampled each minute)
# when the command ends, and exits with the command's status.
#   bash scripts/busy.sh <busy loops per core> <command...>
set -uo pipefail
per_core=$1
shift
loops=$((per_core * $(nproc)))
loads=$(mktemp)
pids=()
for _ in $(seq "$loops"); do
    sh -c 'while :; do :; done' &
    pids+=($!)
done
( while :; do cut -d' ' -f1 /proc/loadavg >>"$loads"; sleep 60; done ) &
pids+=($!)
trap 'kill "${pids[@]}" 2>/dev/null; rm -f "$loads"' EXIT
echo "busy.sh: $loops busy loops ($per_core per core on $(nproc)) beside: $*"
started=$(date +%s)
"$@"
status=$?
sort -n "$loads" | awk -v s="$(($(date +%s) - started))" -v c="$*" \
    '{ v[NR] = $1 } END { if (NR) printf "busy.sh: %s took %d s; 1-minute load average min %s, median %s, max %s (%d samples)\n", c, s, v[1], v[int((NR + 1) / 2)], v[NR], NR }'
exit $status
