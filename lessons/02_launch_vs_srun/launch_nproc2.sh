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
# shellcheck source=common/job_env.sh
source "${COURSE_ROOT:=$SLURM_SUBMIT_DIR}/common/job_env.sh"
lesson=$COURSE_ROOT/lessons/02_launch_vs_srun

echo "job $SLURM_JOB_ID on nodes $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE task(s), ${SLURM_GPUS_ON_NODE:-0} GPU(s) per node"

# The launcher's default master is 127.0.0.1:29500; two jobs sharing a node would both want
# port 29500, so take the one common/ derives from the job id.
exports=$(python -m common.env --export)
eval "$exports"

# torch.distributed.launch is deprecated: it prints a FutureWarning, and it passes
# --local-rank=N to hello.py (torchrun does not; see README.md).
srun python -m torch.distributed.launch --nproc_per_node 2 --master_port "$MASTER_PORT" \
    "$lesson/hello.py"
