#!/bin/bash
# Lesson 09, part 3: 2D parallelism on 2 nodes x 2 tasks. The mesh is (dp, tp) = (nodes, tasks
# per node): tensor parallelism inside each node, FSDP2 across the nodes. tp.py checks that
# every tp group lies within one node before it builds anything.
#
#   sbatch lessons/09_beyond_data_parallel/2d.sh                # from the course root
#   STEPS=20 sbatch lessons/09_beyond_data_parallel/2d.sh       # fewer steps (default 100)
#   TP=4 sbatch lessons/09_beyond_data_parallel/2d.sh           # refused: a tp group over 2 nodes
#
# CPU nodes (gloo), as on the course's local cluster. On GPU nodes ask for one GPU per task
# (`#SBATCH --gpus-per-task=1`): tp.py then takes the GPU Slurm gave the task (cuda:0, the one
# it sees: cuda_device_index in common/launch.py) and NCCL.
#SBATCH --job-name=2d
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2                  # dp: one row of the mesh per node
#SBATCH --ntasks-per-node=2        # tp: the tasks of one node split each layer
#SBATCH --cpus-per-task=1
#SBATCH --mem=4G                   # per node
#SBATCH --time=00:10:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) on $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE tasks"
# Where the processes meet: rank 0's node and a port derived from the job id (common/env.py).
eval "$(python -m common.env --export)"

# tp = tasks per node, so dp = nodes. common/env.py numbers the ranks node by node (whatever
# order srun deals the tasks in), which puts each tp group on one node. (Slurm 22.05 to 23.02:
# pass --cpus-per-task to srun.)
srun --ntasks="$SLURM_NTASKS" --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    python "$COURSE_ROOT/lessons/09_beyond_data_parallel/tp.py" --count-comms \
    --tp "${TP:-$SLURM_NTASKS_PER_NODE}" --steps "${STEPS:-100}" "$@"
