#!/bin/bash
# Time cluster/up.sh and cluster/down.sh (packages already installed) and print the figures.
# It restarts the cluster, cancelling every job, and leaves it up in the default shape.
# On a shared machine run it under the cluster lock:
#     flock /tmp/course-cluster.lock bash cluster/bench.sh
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROUNDS=${1:-3}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] || {
    echo "usage: bash cluster/bench.sh [ROUNDS]  (ROUNDS: a positive whole number, default 3)" >&2
    exit 1
}

# timed LABEL CMD...: run CMD quietly and print its wall time in seconds.
timed() {
    local label=$1 start end
    shift
    start=$EPOCHREALTIME
    "$@" >/dev/null 2>&1 || {
        echo "failed: $*" >&2
        "$@"
        exit 1
    }
    end=$EPOCHREALTIME
    printf '%-46s %7.2f s\n' "$label" "$(awk -v a="$start" -v b="$end" 'BEGIN{print b-a}')"
}

bash "$HERE/up.sh" >/dev/null 2>&1
for ((r = 1; r <= ROUNDS; r++)); do
    echo "round $r"
    timed "up.sh, already up (nothing to do)" bash "$HERE/up.sh"
    timed "down.sh" bash "$HERE/down.sh"
    timed "up.sh from stopped, until all nodes idle" bash "$HERE/up.sh"
    timed "up.sh --nodes 3 --gpus-per-node 1 (restart)" bash "$HERE/up.sh" --nodes 3 --gpus-per-node 1
    timed "up.sh back to the default shape (restart)" bash "$HERE/up.sh"
done
