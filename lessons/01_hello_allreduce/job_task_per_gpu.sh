#!/bin/bash
# Hello all_reduce, "one SLURM task per GPU" pattern:
# srun itself starts every process and numbers it (SLURM_PROCID); Python spawns nothing.
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
# shellcheck source=common/job_env.sh
source "${COURSE_ROOT:=$SLURM_SUBMIT_DIR}/common/job_env.sh"

echo "job $SLURM_JOB_ID on nodes $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE tasks, ${SLURM_GPUS_ON_NODE:-0} GPU(s) per node"

# --ntasks-per-node equals the GPUs per node, so each task drives one GPU (cuda:<local rank>).
# Every task on a node sees all the node's GPUs (--gres, not --gpus-per-task), so the local
# rank is a valid device index.
srun python "$COURSE_ROOT/lessons/01_hello_allreduce/hello_allreduce.py"
