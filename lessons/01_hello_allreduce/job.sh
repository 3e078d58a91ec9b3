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
# shellcheck source=common/job_env.sh
source "${COURSE_ROOT:=$SLURM_SUBMIT_DIR}/common/job_env.sh"

echo "job $SLURM_JOB_ID on nodes $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x 1 task, ${SLURM_GPUS_ON_NODE:-0} GPU(s) per node"

# What every task sees before any process group exists (one JSON line per node).
srun python -m common.env

# One Python per node; `--nprocs auto` spawns as many processes as SLURM gave the node GPUs.
# The first node of the job hosts the rendezvous (common/ picks it from the node list).
srun python "$COURSE_ROOT/lessons/01_hello_allreduce/hello_allreduce.py" --nprocs auto
