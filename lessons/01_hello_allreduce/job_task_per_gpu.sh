#!/bin/bash
# Hello all_reduce, "one SLURM task per GPU" pattern:
# srun itself starts every process (SLURM_NODEID, SLURM_LOCALID tell each who it is); Python spawns nothing.
#
#   sbatch lessons/01_hello_allreduce/job_task_per_gpu.sh          (from the course root)
#
#SBATCH --job-name=hello-allreduce-task-per-gpu
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=2
#SBATCH --mem=8G
#SBATCH --time=00:05:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

echo "job $SLURM_JOB_ID on nodes $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE tasks, ${SLURM_GPUS_ON_NODE:-0} GPU(s) per node"

# --ntasks-per-node equals the GPUs per node, so each task drives one GPU (cuda:<local rank>).
# Every task on a node sees all the node's GPUs (--gres, not --gpus-per-task), so the local
# rank is a valid device index.
# Slurm 22.05 to 23.02: srun does not inherit --cpus-per-task from the job, so pass it on.
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    python "$COURSE_ROOT/lessons/01_hello_allreduce/hello_allreduce.py"
