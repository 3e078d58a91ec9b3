#!/bin/bash
# Lesson 05: a job that stops in time, saves, and comes back on its own.
#
# Two ways a running job is told to stop, handled alike:
#   SIGUSR1  the time-limit warning asked for below (--signal=B:USR1@120)
#   SIGTERM  preemption: a job of a higher-priority partition needs the nodes; SLURM sends
#            SIGTERM to the tasks (not to this shell) at once, GraceTime seconds later SIGTERM
#            to everything, and SIGKILL KillWait seconds after that (measured: README,
#            "Which process gets which signal")
# Either way the training saves a checkpoint at its next safe point and exits with 75, and
# the job is put back in the queue; its next run resumes from the checkpoint. A plain
# `scancel <jobid>` (SIGTERM to this shell and the tasks) saves too, but the job stays cancelled.
#
#   sbatch lessons/05_fault_tolerance/requeue.sh [EPOCHS [train.py arguments...]]
#   SUBSET=12800 sbatch lessons/05_fault_tolerance/requeue.sh   # quicker: the first 12,800 images
#   scancel --signal=USR1 --batch <jobid>      # rehearse the warning now
#   sbatch lessons/05_fault_tolerance/preempt.sh   # preempt it from partition "urgent"
#
#SBATCH --job-name=ft-requeue
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2        # one task (= one training process) per GPU
#SBATCH --gres=gpu:2               # two GPUs per node
#SBATCH --cpus-per-task=4
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

EPOCHS=${1:-${EPOCHS:-3}}
(( $# )) && shift  # what is left in "$@" goes on to train.py
[[ $EPOCHS =~ ^[0-9]+$ && $EPOCHS -ge 1 ]] || { echo "error: EPOCHS='$EPOCHS' is not a whole number of epochs >= 1: pass e.g. 3" >&2; exit 2; }
course_subset || exit 2  # SUBSET=N: the first N images of each set
set -- "${SUBSET_ARGS[@]}" "$@"
# The checkpoint is keyed by the job id, which a requeued job keeps. Job ids start again at 1
# when a cluster is re-created: a file there at the job's first run is an older job's.
if [[ -z ${CHECKPOINT:-} ]]; then
    CHECKPOINT=$COURSE_ROOT/checkpoints/ft-$SLURM_JOB_ID.pt
    if [[ ${SLURM_RESTART_COUNT:-0} == 0 && -e $CHECKPOINT ]]; then mv "$CHECKPOINT" "$CHECKPOINT.old"; fi
fi
export CHECKPOINT

echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) starts $(date -u '+%F %T') UTC in partition" \
     "$SLURM_JOB_PARTITION, SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}"
eval "$(python -m common.env --export)"

# The signals come to this shell; common/job_env.sh's course_srun_stoppable runs srun in the
# background, traps SIGUSR1 and SIGTERM and passes them on to srun as SIGUSR1, which forwards it
# to every task: train.py saves and exits 75 (§1 of the README says why each step is needed).
# In Slurm 22.05 to 23.02 srun does not inherit --cpus-per-task from the job (23.11 restored
# it through SLURM_CPUS_PER_TASK): passing it explicitly is right on every version.
# (No --kill-on-bad-exit here: it counts exit status 75 as a failure, and would kill the
# ranks that are still leaving after the checkpoint, so srun would not report 75.)
# What to type to go on by hand, said as soon as a cancel is known (common/job_env.sh).
COURSE_RESUME="CHECKPOINT=$CHECKPOINT sbatch lessons/05_fault_tolerance/requeue.sh $EPOCHS"
course_srun_stoppable srun --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    python "$COURSE_ROOT/lessons/05_fault_tolerance/train.py" \
    --epochs "$EPOCHS" --checkpoint "$CHECKPOINT" "$@"

# Stopped (75, or ended by the signal itself): back to the queue while the job still runs (the
# time-limit warning, a preemption's grace time); a job cancelled with scancel is not requeued,
# and a refused requeue fails the job in one line. Both keep the checkpoint (course_requeue_or_end).
next="resumes from $CHECKPOINT"
[[ -e $CHECKPOINT ]] || next="starts from the beginning (no checkpoint yet)"
status=0
course_requeue_or_end "$COURSE_STATUS" "$next" "$COURSE_RESUME" || status=$?
echo "=== $(date -u '+%T') job $SLURM_JOB_ID finished with status $status"
exit "$status"
