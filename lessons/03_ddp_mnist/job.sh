#!/bin/bash
# Lesson 03: MNIST with DistributedDataParallel on 2 nodes x 2 GPUs, one process per GPU,
# with a checkpoint every epoch and automatic requeue when SLURM warns that time is running out.
#
#   python -m common.mnist                      # once, on the login node: compute nodes may
#                                               # have no internet
#   sbatch lessons/03_ddp_mnist/job.sh          # from the course root
#   sbatch lessons/03_ddp_mnist/job.sh 1        # another number of epochs (or EPOCHS=1 sbatch ...)
#   sbatch lessons/03_ddp_mnist/job.sh 2 --train-subset 6000   # more arguments go to train.py
#
#SBATCH --job-name=ddp-mnist
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2        # one task (= one training process) per GPU
#SBATCH --gres=gpu:2               # two GPUs per node
#SBATCH --cpus-per-task=4          # for the process's own threads (and data loading, if any)
#SBATCH --mem=16G                  # per node
#SBATCH --time=00:30:00
#SBATCH --signal=B:USR1@120        # SIGUSR1 to this batch shell 120 s before the time limit
#SBATCH --requeue                  # this job may be put back in the queue (by itself, below)
#SBATCH --open-mode=append         # a requeued run appends to the same output file
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
# shellcheck source=common/job_env.sh
source "${COURSE_ROOT:=$SLURM_SUBMIT_DIR}/common/job_env.sh"

EPOCHS=${1:-${EPOCHS:-3}}
(( $# )) && shift  # what is left in "$@" is passed on to train.py
# Set CHECKPOINT to continue another job's run (same number of tasks, batch size and epochs).
# By default the file is keyed by the job id, which a requeued job keeps: its second run finds
# the first run's checkpoint. Job ids can repeat (a re-created cluster counts from 1 again), so a
# job's first run moves a checkpoint it did not write out of the way instead of continuing it.
own_checkpoint=0
if [[ -z ${CHECKPOINT:-} ]]; then
    CHECKPOINT=$COURSE_ROOT/checkpoints/ddp_mnist-$SLURM_JOB_ID.pt
    own_checkpoint=1
fi
export EPOCHS CHECKPOINT

echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) starts $(date -u '+%F %T') UTC," \
     "SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}"
echo "nodes $SLURM_JOB_NODELIST: $SLURM_NNODES x $SLURM_NTASKS_PER_NODE tasks = $SLURM_NTASKS processes," \
     "${SLURM_GPUS_ON_NODE:-0} GPU(s) and $SLURM_CPUS_PER_TASK CPUs per task"
echo "epochs $EPOCHS, checkpoint $CHECKPOINT"
if (( own_checkpoint )) && [[ ${SLURM_RESTART_COUNT:-0} == 0 && -e $CHECKPOINT ]]; then
    mv "$CHECKPOINT" "$CHECKPOINT.old"
    echo "(an older job with the same id left $CHECKPOINT: moved to $CHECKPOINT.old)"
fi
# Where the processes meet: rank 0's node and a port derived from the job id (so two jobs on
# one node do not collide). common/env.py works these out, here and again in every task.
eval "$(python -m common.env --export)"
echo "MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT WORLD_SIZE=$SLURM_NTASKS" \
     "($NNODES nodes x $SLURM_NTASKS_PER_NODE tasks)"

# The warning signal goes to this shell only (the "B:" in --signal). While srun runs in the
# foreground, bash would not run a trap until srun ended, so srun runs in the background and we
# wait for it; the trap passes the signal on to srun, which forwards it to every task.
srun_pid=
interrupted=0
# shellcheck disable=SC2317  # called by the trap, not reachable in the normal flow
forward_usr1() {
    interrupted=1
    echo "=== $(date -u '+%T') got SIGUSR1: asking the training to checkpoint and stop"
    if [[ -n $srun_pid ]]; then kill -USR1 "$srun_pid" 2>/dev/null || true; fi
}
trap forward_usr1 USR1

# Since Slurm 22.05 srun does not inherit --cpus-per-task from sbatch: pass it on explicitly.
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    bash "$COURSE_ROOT/lessons/03_ddp_mnist/train.sh" "$@" &
srun_pid=$!
# A trap cuts `wait` short (status > 128) while srun is still running: then wait again.
status=
while [[ -z $status ]]; do
    interrupted=0
    wait "$srun_pid" && rc=0 || rc=$?
    if (( interrupted && rc > 128 )); then continue; fi
    status=$rc
done

if (( status == 75 )); then
    # train.py saved a checkpoint and asks to be run again (exit status 75, see train.py).
    echo "=== $(date -u '+%T') requeueing job $SLURM_JOB_ID; it will resume from $CHECKPOINT"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
echo "=== $(date -u '+%T') job $SLURM_JOB_ID finished with status $status"
exit "$status"
