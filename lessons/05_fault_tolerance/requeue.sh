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
# the job is put back in the queue; its next run resumes from the checkpoint.
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

# The signals come to this shell. bash runs a trap only once the foreground command has ended,
# so srun runs in the background and we `wait` for it (a trapped signal interrupts `wait`);
# the trap passes SIGUSR1 on to srun, which forwards it to every task. Always SIGUSR1: srun
# answers a SIGTERM of its own by killing the tasks at once ("forcing job termination").
srun_pid=
signalled=
# shellcheck disable=SC2317  # called by the traps
on_signal() {
    signalled=$1
    echo "=== $(date -u '+%T') got SIG$1: asking the training to checkpoint and stop"
    if [[ -n $srun_pid ]]; then kill -USR1 "$srun_pid" 2>/dev/null || true; fi
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

# In Slurm 22.05 to 23.02 srun does not inherit --cpus-per-task from the job (23.11 restored
# it through SLURM_CPUS_PER_TASK): passing it explicitly is right on every version.
# (No --kill-on-bad-exit here: it counts exit status 75 as a failure, and would kill the
# ranks that are still leaving after the checkpoint, so srun would not report 75.)
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    python "$COURSE_ROOT/lessons/05_fault_tolerance/train.py" \
    --epochs "$EPOCHS" --checkpoint "$CHECKPOINT" "$@" &
srun_pid=$!
status=
while [[ -z $status ]]; do
    wait "$srun_pid" && rc=0 || rc=$?
    # A trap cut `wait` short (status > 128) while srun still runs: wait again.
    if (( rc > 128 )) && kill -0 "$srun_pid" 2>/dev/null; then continue; fi
    status=$rc
done

# Stopped by the signal itself: a stop that came while Python was still starting, before
# train.py had set its handler, ends the tasks (SIGTERM's and SIGUSR1's default action; srun
# reports 143 or 138). Nothing was saved this time, but it is the same stop: requeue, and the
# next run resumes from the last checkpoint, if there is one.
if (( status == 143 || status == 138 )) || [[ -n $signalled && $status -ne 0 ]]; then
    echo "=== $(date -u '+%T') the training ended with status $status, stopped before it could save"
    status=75
fi
if (( status == 75 )); then
    # Saved and asked to run again. A preempted job that ends before its GraceTime is not
    # requeued by Slurm 22.05 (cluster/README.md, Preemption): this requeue is what does it. A
    # refused requeue (job cancelled, JobRequeue=0 and no --requeue, ...) must not end the
    # job COMPLETED: say so, keep the checkpoint, and exit 75 (the job ends FAILED).
    resume="resumes from $CHECKPOINT"
    [[ -e $CHECKPOINT ]] || resume="starts from the beginning (no checkpoint yet)"
    echo "=== $(date -u '+%T') requeueing job $SLURM_JOB_ID${signalled:+ (after SIG$signalled)}; it $resume"
    if ! said=$(scontrol requeue "$SLURM_JOB_ID" 2>&1); then
        echo "error: scontrol requeue $SLURM_JOB_ID was refused (${said//$'\n'/ }): the job ends here, not requeued. The checkpoint $CHECKPOINT is kept: resume it with CHECKPOINT=$CHECKPOINT sbatch lessons/05_fault_tolerance/requeue.sh $EPOCHS" >&2
        exit 75
    fi
    exit 0
fi
echo "=== $(date -u '+%T') job $SLURM_JOB_ID finished with status $status"
exit "$status"
