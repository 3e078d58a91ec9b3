#!/bin/bash
# One node, python -m torch.distributed.launch --nproc_per_node 2.
# srun starts ONE task (the launcher); the launcher spawns the 2 worker process(es).
#
#   sbatch lessons/02_launch_vs_srun/launch_nproc2.sh          (from the course root)
#
#SBATCH --job-name=launch-nproc2
#SBATCH --output=%x-%j.out
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=4
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

# Without --master_port a single-node launch picks a free port itself (torch 2.14.1; older
# versions all wanted 127.0.0.1:29500). The one common/ derives from the job id is the same
# in every lesson and shows in the log.
exports=$(python -m common.env --export)
eval "$exports"

# torch.distributed.launch is deprecated: it prints a FutureWarning, and it passes
# --local-rank=N to hello.py (torchrun does not; see README.md).
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" python -m torch.distributed.launch --nproc_per_node 2 --master_port "$MASTER_PORT" \
    "$lesson/hello.py"
