#!/bin/bash
# Lesson 07: lesson 03's MNIST job with the model sharded by FSDP2 and sharded DCP checkpoints,
# on 2 nodes x 2 GPUs. Stopped, it saves and requeues itself (lesson 05); it may come back on
# fewer nodes: the checkpoint written by 4 ranks is loaded by 2. Cancelled, it saves and ends.
#
#   sbatch lessons/07_fsdp_sharding/job.sh            # from the course root: 2 epochs
#   sbatch lessons/07_fsdp_sharding/job.sh 1 --train-subset 12000   # more arguments: train.py
#   scancel --signal=USR1 --batch <jobid>             # rehearse the time-limit warning now
#   scontrol update JobId=<jobid> NumNodes=1 NumTasks=2 NumCPUs=8   # requeued, waiting: shrink it
#   CHECKPOINT_DIR=checkpoints/x sbatch ...           # continue (or start) the run saved in x
#   SUBSET=6400 sbatch ...                            # a quicker run: the first 6,400 images
#                                                     # of each set (--train/--test-subset)
#
#SBATCH --job-name=fsdp-mnist
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2        # one task (= one training process) per GPU
#SBATCH --gres=gpu:2               # two GPUs per node
#SBATCH --cpus-per-task=4          # CPU threads for each process
#SBATCH --mem=16G                  # per node
#SBATCH --time=00:30:00
#SBATCH --signal=B:USR1@120        # SIGUSR1 to this batch shell about 120 s before the limit
#SBATCH --requeue                  # the job may be put back in the queue
#SBATCH --open-mode=append         # a requeued run appends to the same output file
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

EPOCHS=${1:-${EPOCHS:-2}}
(( $# )) && shift  # what is left in "$@" goes on to train.py
# Refuse bad input here, in one line, before srun starts 4 processes that would all fail.
[[ $EPOCHS =~ ^[0-9]+$ && $EPOCHS -ge 1 ]] || { echo "error: EPOCHS='$EPOCHS' is not a whole number of epochs >= 1: pass e.g. 2 (sbatch lessons/07_fsdp_sharding/job.sh 2)" >&2; exit 2; }
course_subset || exit 2  # SUBSET=N: the first N images of each set
set -- "${SUBSET_ARGS[@]}" "$@"
# MNIST_DIR: the folder whose MNIST/raw/ holds the idx files (torchvision's layout).
data=${MNIST_DIR:-$COURSE_ROOT/data/mnist}/MNIST/raw
for f in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
    [[ -f $data/$f ]] || { echo "error: MNIST file $data/$f is missing: prepare the data once, on the login node: python -m common.mnist_prepare" >&2; exit 2; }
done
# One checkpoint folder per job, keyed by the job id, which a requeued job keeps. Job ids start
# again at 1 when a cluster is re-created: a folder there at the job's first run is an older job's.
if [[ -z ${CHECKPOINT_DIR:-} ]]; then
    CHECKPOINT_DIR=$COURSE_ROOT/checkpoints/fsdp-$SLURM_JOB_ID
    if [[ ${SLURM_RESTART_COUNT:-0} == 0 && -e $CHECKPOINT_DIR ]]; then mv "$CHECKPOINT_DIR" "$CHECKPOINT_DIR.old-$(date +%s)"; fi
fi
export EPOCHS CHECKPOINT_DIR
# A requeued job runs again with the environment sbatch gave its first run: SLURM_NTASKS and
# SLURM_NPROCS still count the first run's tasks (4) when the job comes back on 1 node. Count
# this run's tasks from this run's nodes, for srun and for common.env below.
SLURM_NTASKS=$(( SLURM_JOB_NUM_NODES * SLURM_NTASKS_PER_NODE ))
export SLURM_NTASKS SLURM_NPROCS=$SLURM_NTASKS

echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) starts $(date -u '+%F %T') UTC on $SLURM_JOB_NODELIST, SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}"
echo "$SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE tasks = $SLURM_NTASKS processes;" \
     "${SLURM_GPUS_ON_NODE:-0} GPU(s) per node, $SLURM_CPUS_PER_TASK CPUs per task"
echo "epochs $EPOCHS, checkpoints in $CHECKPOINT_DIR"
# Where the processes meet: rank 0's node and a port derived from the job id, worked out by the
# same code (common/env.py) that every task runs again for itself.
eval "$(python -m common.env --export)"
echo "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT WORLD_SIZE=$SLURM_NTASKS"

# The signals come to this shell: course_srun_stoppable (common/job_env.sh) runs srun in the
# background and passes SIGUSR1 or SIGTERM on to it as SIGUSR1, which srun forwards to every
# task (lesson 05's README, §1, explains each step).
# In Slurm 22.05 to 23.02 srun does not inherit --cpus-per-task from the job (23.11 restored it
# through SLURM_CPUS_PER_TASK): passing it explicitly is right on every version.
# What to type to go on by hand, said as soon as a cancel is known (common/job_env.sh).
COURSE_RESUME="CHECKPOINT_DIR=$CHECKPOINT_DIR sbatch lessons/07_fsdp_sharding/job.sh $EPOCHS"
course_srun_stoppable srun --ntasks="$SLURM_NTASKS" --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    bash "$COURSE_ROOT/lessons/07_fsdp_sharding/train.sh" "$@"

# Saved and asked to run again: back to the queue with the same id, script and arguments,
# and (Slurm 22.05) the node and task counts of this run, unless they are updated while the
# job waits: the next run may be smaller, train.py reshards the checkpoint. Not after a plain
# scancel, and a refused requeue fails the job (course_requeue_or_end, as in lesson 05).
status=0
course_requeue_or_end "$COURSE_STATUS" "resumes from $CHECKPOINT_DIR" "$COURSE_RESUME" || status=$?
if (( status == 0 )); then
    # The sharded checkpoint as one ordinary file for inference, written and read back by one
    # plain process on this (batch) host: no process group, no GPU.
    python "$COURSE_ROOT/lessons/07_fsdp_sharding/export.py" "$CHECKPOINT_DIR" || status=$?
fi
echo "=== $(date -u '+%T') job $SLURM_JOB_ID finished with status $status"
exit "$status"
