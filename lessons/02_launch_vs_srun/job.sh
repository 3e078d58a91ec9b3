#!/bin/bash
# Several nodes: srun starts node_launch.sh once per node, and each copy starts
# python -m torch.distributed.launch, which spawns one worker per GPU of its node.
#
#   sbatch lessons/02_launch_vs_srun/job.sh          (from the course root)
#
#SBATCH --job-name=launch-multinode
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
lesson=$COURSE_ROOT/lessons/02_launch_vs_srun

echo "job $SLURM_JOB_ID on nodes $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE task(s), ${SLURM_GPUS_ON_NODE:-0} GPU(s) per node"

# One task per node: the launcher, not srun, starts the per-GPU processes.
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" bash "$lesson/node_launch.sh" launch "$lesson/hello.py"
