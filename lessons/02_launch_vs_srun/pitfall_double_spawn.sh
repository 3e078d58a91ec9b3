#!/bin/bash
# THE PITFALL (this job is meant to fail): two tasks per node AND a launcher in each task.
# srun starts 2 copies of node_launch.sh per node and each torchrun spawns 2 workers: 8
# processes for 4 GPUs, and two launchers per node that both claim the same node rank and port.
# `python -m common.env --export` in node_launch.sh refuses this at once with its "double spawn"
# error (every worker would refuse it too), so the job fails in seconds instead of hanging.
#
#   sbatch lessons/02_launch_vs_srun/pitfall_double_spawn.sh          (from the course root)
#
# Fix: --ntasks-per-node=1 with a launcher (job.sh), or a task per GPU without one
# (srun_native.sh).
#
#SBATCH --job-name=pitfall-double-spawn
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
lesson=$COURSE_ROOT/lessons/02_launch_vs_srun

echo "job $SLURM_JOB_ID on nodes $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE task(s), ${SLURM_GPUS_ON_NODE:-0} GPU(s) per node"

srun --cpus-per-task="$SLURM_CPUS_PER_TASK" bash "$lesson/node_launch.sh" torchrun "$lesson/hello.py"
