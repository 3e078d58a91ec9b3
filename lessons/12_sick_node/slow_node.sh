#!/bin/bash
# Lesson 12: make the training tasks of one node of a running job stragglers, as a sick node
# makes them (a GPU that throttles, a CPU another job shares, a failing fan): from outside the
# training, which does not know. A step of its own on that node (srun --overlap shares the
# job's CPUs) stops and continues the training tasks there in turn, SIGSTOP for STOP_MS then
# SIGCONT for RUN_MS, for SECONDS seconds: their work takes (STOP_MS + RUN_MS) / RUN_MS longer.
#
#   bash lessons/12_sick_node/slow_node.sh <jobid> node2           # 120 s, 75 ms of every 100
#   bash lessons/12_sick_node/slow_node.sh <jobid> node2 60 30 70   # 60 s, 30 ms of every 100
set -euo pipefail

job=${1:-} node=${2:-} seconds=${3:-120} stop_ms=${4:-75} run_ms=${5:-25}
usage="usage: bash lessons/12_sick_node/slow_node.sh JOBID NODE [SECONDS [STOP_MS [RUN_MS]]]"
[[ $job =~ ^[0-9]+$ ]] || { echo "error: JOBID='$job' is not a job id (squeue --me lists yours). $usage" >&2; exit 2; }
for v in seconds stop_ms run_ms; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "error: ${v^^}='${!v}' is not a whole number >= 1. $usage" >&2; exit 2; }
done
read -r state nodes <<<"$(squeue -h -j "$job" -o '%T %N' 2>/dev/null)" || true
[[ $state == RUNNING ]] || { echo "error: job $job is not running (${state:-not in the queue}): slow a job while it trains" >&2; exit 2; }
scontrol show hostnames "$nodes" | grep -qxF "$node" || { echo "error: node '$node' is not one of job $job's nodes ($nodes)" >&2; exit 2; }

echo "=== $(date -u '+%T') slowing job $job's training tasks on $node: stopped ${stop_ms} ms of every $((stop_ms + run_ms)) ms, for $seconds s or until the job ends"
# shellcheck disable=SC2016  # expanded on the node, by the bash that srun starts there
srun --overlap --jobid="$job" --nodelist="$node" --nodes=1 --ntasks=1 bash -c '
    job=$1 seconds=$2 stop=$(awk "BEGIN { print $3 / 1000 }") run=$(awk "BEGIN { print $4 / 1000 }")
    # The tasks of the job'"'"'s first step (the training) on this node, as slurmd knows them.
    tasks() { scontrol listpids "$job.0" 2>/dev/null | awk "NR > 1 && \$4 ~ /^[0-9]+$/ { print \$1 }"; }
    pids=() next=0
    trap '"'"'kill -CONT "${pids[@]}" 2>/dev/null; exit 0'"'"' EXIT TERM INT
    end=$((SECONDS + seconds))
    while ((SECONDS < end)); do
        # Asked again every 2 s only: scontrol itself takes tens of milliseconds.
        if ((SECONDS >= next)); then mapfile -t pids < <(tasks); next=$((SECONDS + 2)); fi
        if ((${#pids[@]} == 0)); then sleep 0.5; next=0; continue; fi  # not started, or ended
        kill -STOP "${pids[@]}" 2>/dev/null || true
        sleep "$stop"
        kill -CONT "${pids[@]}" 2>/dev/null || true
        sleep "$run"
    done' slow "$job" "$seconds" "$stop_ms" "$run_ms"
echo "=== $(date -u '+%T') done with $node"
