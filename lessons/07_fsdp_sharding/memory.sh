#!/bin/bash
# Lesson 07: bytes per rank under DDP and FSDP2 at world sizes 1, 2 and 4, in one allocation of
# 2 nodes x 2 GPUs: three job steps of 1, 2 and 4 tasks, each one world running memory.py.
#
#   sbatch lessons/07_fsdp_sharding/memory.sh                 # from the course root
#   sbatch lessons/07_fsdp_sharding/memory.sh --width 2048    # more arguments: memory.py
#
#SBATCH --job-name=fsdp-memory
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2        # one task (= one process) per GPU
#SBATCH --gres=gpu:2               # two GPUs per node
#SBATCH --cpus-per-task=4
#SBATCH --mem=16G                  # per node
#SBATCH --time=00:15:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) starts $(date -u '+%F %T') UTC on $SLURM_JOB_NODELIST"
# Each step is a world of its own: its tasks find rank 0 and the port from the step's own
# SLURM_STEP_* variables (common/env.py), one step after the other.
for shape in "1 1" "1 2" "2 4"; do
    read -r nodes tasks <<< "$shape"
    echo "--- step: $nodes node(s), $tasks task(s)"
    srun --nodes="$nodes" --ntasks="$tasks" --ntasks-per-node=2 --cpus-per-task="$SLURM_CPUS_PER_TASK" \
        python "$COURSE_ROOT/lessons/07_fsdp_sharding/memory.py" "$@"
done
echo "=== $(date -u '+%T') job $SLURM_JOB_ID finished"
