#!/bin/bash
# Lesson 12: make the training tasks of one node of a running job stragglers, as a sick node
# makes them (a GPU that throttles, a CPU that another job or a runaway process shares), from
# outside the training, which does not know. A step of its own on that node (srun --overlap
# shares the job's CPUs) puts each training task there in a CPU cgroup of its own with a quota
# (cgroup v1's cpu.cfs_quota_us over a 10 ms cpu.cfs_period_us): each may use PERCENT of one CPU,
# for SECONDS seconds or until the job ends, then goes back where it was.
#
#   bash lessons/12_sick_node/slow_node.sh <jobid> node2           # 10 % of a CPU, 120 s
#   bash lessons/12_sick_node/slow_node.sh <jobid> node2 60 25     # 25 %, 60 s
#
# It writes the node's cgroups: root's (or an administrator's) tool, as on a test rig. A
# quota, not SIGSTOP/SIGCONT in turns: a training step syncs itself to such a cycle (it computes
# in the windows where it runs, and waits out the stops inside the collectives), so the
# slowness would show up as every rank's wait, not as the sick node's compute.
set -euo pipefail

job=${1:-} node=${2:-} seconds=${3:-120} percent=${4:-10}
usage="usage: bash lessons/12_sick_node/slow_node.sh JOBID NODE [SECONDS [PERCENT]]"
[[ $job =~ ^[0-9]+$ ]] || { echo "error: JOBID='$job' is not a job id (squeue --me lists yours). $usage" >&2; exit 2; }
[[ $seconds =~ ^[1-9][0-9]*$ ]] || { echo "error: SECONDS='$seconds' is not a whole number >= 1. $usage" >&2; exit 2; }
[[ $percent =~ ^[1-9][0-9]$ ]] || { echo "error: PERCENT='$percent' is not a whole number from 10 to 99 (the share of one CPU each task keeps; the kernel's smallest quota is 1 ms of the 10 ms period). $usage" >&2; exit 2; }
read -r state nodes <<<"$(squeue -h -j "$job" -o '%T %N' 2>/dev/null)" || true
[[ $state == RUNNING ]] || { echo "error: job $job is not running (${state:-not in the queue}): slow a job while it trains" >&2; exit 2; }
scontrol show hostnames "$nodes" | grep -qxF "$node" || { echo "error: node '$node' is not one of job $job's nodes ($nodes)" >&2; exit 2; }

echo "=== $(date -u '+%T') slowing job $job's training tasks on $node: each to $percent % of a CPU, for $seconds s or until the job ends"
# shellcheck disable=SC2016  # expanded on the node, by the bash that srun starts there
srun --overlap --jobid="$job" --nodelist="$node" --nodes=1 --ntasks=1 bash -c '
    job=$1 seconds=$2 percent=$3 base=/sys/fs/cgroup/cpu
    [[ -w $base/cgroup.procs ]] || { echo "error: cannot write $base/cgroup.procs on $(hostname) (the cgroup v1 cpu controller, as root): slow_node.sh needs root there" >&2; exit 2; }
    # The tasks of the job'"'"'s first step (the training) on this node, as slurmd knows them.
    tasks() { scontrol listpids "$job.0" 2>/dev/null | awk "NR > 1 && \$4 ~ /^[0-9]+$/ { print \$1 }"; }
    pids=()
    for _ in $(seq 60); do mapfile -t pids < <(tasks); ((${#pids[@]})) && break; sleep 0.5; done
    ((${#pids[@]})) || { echo "error: no training task of job $job on $(hostname)" >&2; exit 2; }
    back() {
        for p in "${pids[@]}"; do echo "$p" >"$base/cgroup.procs" 2>/dev/null || true; done
        rmdir "$base"/course-slow-"$job"-* 2>/dev/null || true
    }
    trap back EXIT
    trap "exit 0" TERM INT
    for p in "${pids[@]}"; do
        g=$base/course-slow-$job-$p
        mkdir -p "$g"
        echo 10000 >"$g/cpu.cfs_period_us"
        echo $((percent * 100)) >"$g/cpu.cfs_quota_us"
        echo "$p" >"$g/cgroup.procs"  # the process with all of its threads
    done
    end=$((SECONDS + seconds))
    while ((SECONDS < end)) && kill -0 "${pids[@]}" 2>/dev/null; do sleep 1; done' slow "$job" "$seconds" "$percent"
echo "=== $(date -u '+%T') done with $node"
