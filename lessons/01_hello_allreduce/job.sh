#!/bin/bash
# Hello all_reduce, "one task per node" pattern:
# srun starts the Python once on every node; the Python spawns one process per GPU of its node.
#
#   sbatch lessons/01_hello_allreduce/job.sh          (from the course root)
#
#SBATCH --job-name=hello-allreduce
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=4
#SBATCH --mem=8G
#SBATCH --time=00:05:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

echo "job $SLURM_JOB_ID on nodes $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x 1 task, ${SLURM_GPUS_ON_NODE:-0} GPU(s) per node"

# What software every node runs with (torch, CUDA, GPUs, NCCL, backends), then what every
# task sees before any process group exists (one JSON line per node). sort keeps each
# node's report lines together.
# Slurm 22.05 to 23.02: srun does not inherit --cpus-per-task from the job, so pass it on.
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" python -m common.sysinfo | sort --stable --key=1,1
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" python -m common.env

# One Python per node; `--nprocs auto` spawns as many processes as SLURM gave the node GPUs.
# The first node of the job hosts the rendezvous (common/ picks it from the node list).
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    python "$COURSE_ROOT/lessons/01_hello_allreduce/hello_allreduce.py" --nprocs auto
