#!/bin/bash
# Lesson 03: MNIST with DistributedDataParallel on 2 nodes x 2 GPUs, one process per GPU.
#
#   python -m common.mnist_prepare              # once, on the login node (compute nodes may
#                                               # have no internet)
#   sbatch lessons/03_ddp_mnist/job.sh          # from the course root: 3 epochs
#   sbatch lessons/03_ddp_mnist/job.sh 1        # another number of epochs (or EPOCHS=1 sbatch ...)
#   sbatch lessons/03_ddp_mnist/job.sh 2 --sync-bn   # more arguments go to train.py
#   CHECKPOINT=checkpoints/x.pt sbatch ...      # continue (or start) the run saved in x.pt
#   SUBSET=2048 sbatch ...                      # a quick first run: the first 2,048 images of
#                                               # each set (train.py's --train/--test-subset)
#
#SBATCH --job-name=ddp-mnist
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2        # one task (= one training process) per GPU
#SBATCH --gres=gpu:2               # two GPUs per node
#SBATCH --cpus-per-task=4          # CPU threads for each process
#SBATCH --mem=16G                  # per node
#SBATCH --time=00:30:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

EPOCHS=${1:-${EPOCHS:-3}}
(( $# )) && shift  # what is left in "$@" goes on to train.py
# Refuse bad input here, in one line, before srun starts 4 processes that would all fail.
[[ $EPOCHS =~ ^[0-9]+$ && $EPOCHS -ge 1 ]] || { echo "error: EPOCHS='$EPOCHS' is not a whole number of epochs >= 1: pass e.g. 3 (sbatch lessons/03_ddp_mnist/job.sh 3)" >&2; exit 2; }
course_subset || exit 2  # SUBSET=N: the first N images of each set
set -- "${SUBSET_ARGS[@]}" "$@"
# MNIST_DIR: the folder whose MNIST/raw/ holds the idx files (torchvision's layout).
data=${MNIST_DIR:-$COURSE_ROOT/data/mnist}/MNIST/raw
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
    course_need_file "$data/$f" "prepare the data once, on the login node: python -m common.mnist_prepare" || exit 2
done
# A checkpoint per job unless CHECKPOINT names one. A job that Slurm requeued (after a node
# failure, say: JobRequeue=1 is the default) runs again with the same id and
# SLURM_RESTART_COUNT >= 1: it resumes from its own file. In a first run a file with this id
# belongs to another job, from before the cluster's ids started again: move it aside.
if [[ -z ${CHECKPOINT:-} ]]; then
    CHECKPOINT=$COURSE_ROOT/checkpoints/ddp_mnist-$SLURM_JOB_ID.pt
    if [[ -e $CHECKPOINT && ${SLURM_RESTART_COUNT:-0} == 0 ]]; then
        mv "$CHECKPOINT" "$CHECKPOINT.old"
    fi
fi
export EPOCHS CHECKPOINT

echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) starts $(date -u '+%F %T') UTC on $SLURM_JOB_NODELIST"
echo "$SLURM_NNODES nodes x $SLURM_NTASKS_PER_NODE tasks = $SLURM_NTASKS processes;" \
     "${SLURM_GPUS_ON_NODE:-0} GPU(s) per node, $SLURM_CPUS_PER_TASK CPUs per task"
echo "epochs $EPOCHS, checkpoint $CHECKPOINT"
# Where the processes meet: rank 0's node and a port derived from the job id, worked out by the
# same code (common/env.py) that every task runs again for itself.
eval "$(python -m common.env --export)"
echo "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT WORLD_SIZE=$SLURM_NTASKS"

# srun starts train.sh once per task. In Slurm 22.05 to 23.02 srun does not inherit
# --cpus-per-task from the job (23.11 restored it through SLURM_CPUS_PER_TASK): passing it
# explicitly is right on every version.
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" bash "$COURSE_ROOT/lessons/03_ddp_mnist/train.sh" "$@"
echo "=== $(date -u '+%T') job $SLURM_JOB_ID finished"
