#!/bin/bash
# One node, torchrun --standalone --nproc_per_node 1.
# srun starts ONE task (torchrun); torchrun spawns the 1 worker process(es).
#
#   sbatch lessons/02_launch_vs_srun/torchrun_nproc1.sh          (from the course root)
#
#SBATCH --job-name=torchrun-nproc1
#SBATCH --output=%x-%j.out
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=2
#SBATCH --mem=4G
#SBATCH --time=00:05:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"
lesson=$COURSE_ROOT/lessons/02_launch_vs_srun

echo "job $SLURM_JOB_ID on nodes $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE task(s), ${SLURM_GPUS_ON_NODE:-0} GPU(s) per node"

# --standalone: a single-node rendezvous on this host with a free port torchrun picks itself.
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" torchrun --standalone --nproc_per_node 1 "$lesson/hello.py"
