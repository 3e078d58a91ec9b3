#!/bin/bash
#SBATCH --job-name=ft-signals
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --mem=100M
#SBATCH --requeue
# Lesson 05: which process gets which signal, and when SIGKILL follows. No training: the batch
# shell and one task of one srun step log every signal they can catch, with the time, and
# write a heartbeat every 0.1 s (its last value is when SIGKILL, which nobody can catch, came).
#     sbatch [--time=1 --signal=B:USR1@30 ...] lessons/05_fault_tolerance/signal_probe.sh
# then cancel, preempt or let it run out, and read slurm-<jobid>.out and the heartbeats
# (PROBE_DIR, default runs/signal-probe/<jobid>/).
set -uo pipefail
# A site with --export=NONE would start the srun steps below without PATH (the course's job_env.sh,
# which this script does not need, says why): give them this script's environment.
[[ ${SLURM_EXPORT_ENV:-ALL} == ALL* ]] || export SLURM_EXPORT_ENV=ALL

COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
PROBE_DIR=${PROBE_DIR:-$COURSE_ROOT/runs/signal-probe}/$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}
mkdir -p "$PROBE_DIR" || { echo "error: cannot create PROBE_DIR=$PROBE_DIR: set PROBE_DIR to a folder you may write" >&2; exit 2; }
export PROBE_DIR

# Every signal a process can catch that Slurm might send.
SIGNALS="TERM INT HUP USR1 USR2 CONT QUIT"
export SIGNALS

# The task: log each signal, beat every 0.1 s.
# shellcheck disable=SC2016  # expanded by the task's bash
srun --ntasks=1 bash -c '
for s in $SIGNALS; do trap "echo \"\$(date +%s.%N) task got SIG$s\"" "$s"; done
echo "$(date +%s.%N) task started (pid $$)"
while :; do date +%s.%N >"$PROBE_DIR/task.heartbeat"; sleep 0.1; done' &
srun_pid=$!

# The batch shell: the same. A trap runs when `wait` is interrupted, at once.
for s in $SIGNALS; do
    # shellcheck disable=SC2064  # $s now, the time when the trap runs
    trap "echo \"\$(date +%s.%N) batch got SIG$s\"" "$s"
done
echo "$(date +%s.%N) batch started (pid $$), srun pid $srun_pid"
srun_running=1
while :; do
    date +%s.%N >"$PROBE_DIR/batch.heartbeat"
    if ((srun_running)) && ! kill -0 "$srun_pid" 2>/dev/null; then
        wait "$srun_pid"
        echo "$(date +%s.%N) batch: srun ended with status $?"
        srun_running=0
    fi
    sleep 0.1 &
    wait $!
done
