#!/bin/bash
# FAILURE: one rank stops making progress (stuck in its own code) while the others wait for it
# in an all_reduce. Nothing is printed: the job just stops moving. Two ways to see where every
# rank is, while the job runs:
#   * py-spy dump --pid <pid>, run on the rank's node: the Python stack of a live process,
#     from outside, without stopping it (py-spy is in requirements.txt; it needs permission to
#     trace the process: same user, and kernel.yama.ptrace_scope 0 or CAP_SYS_PTRACE);
#   * faulthandler, registered by step.py on SIGUSR1: `scancel --signal=USR1 <jobid>` makes
#     every rank print its own stack into the job's output. No extra tool, no permission.
# Then the waiting ranks reach COURSE_DIST_TIMEOUT and fail, and --kill-on-bad-exit=1 ends the
# stuck one.
#
#   sbatch lessons/06_diagnosing_hangs/hung_rank.sh          (from the course root)
#
#SBATCH --job-name=hung-rank
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=1
#SBATCH --mem=4G
#SBATCH --time=00:04:00
set -euo pipefail
# A failure should show in seconds here, not after torch's 10 minutes: every rendezvous and
# collective of this job gives up after COURSE_DIST_TIMEOUT seconds, long enough here to look
# at the stuck job before the waiting ranks give up.
export COURSE_DIST_TIMEOUT=${COURSE_DIST_TIMEOUT:-20}

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"
lesson=$COURSE_ROOT/lessons/06_diagnosing_hangs

echo "job $SLURM_JOB_ID on nodes $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE task(s), COURSE_DIST_TIMEOUT=$COURSE_DIST_TIMEOUT s"

# Each rank writes <host>-rank<R>.pid here (a folder every node sees), so that py-spy can be
# pointed at the right process on the right node.
pids=$COURSE_ROOT/runs/hung-rank-$SLURM_JOB_ID
mkdir -p "$pids"

echo "== the job: rank 1 gets stuck at step 2"
# --label puts the task's rank in front of each line it prints: four stacks arriving at once
# interleave line by line, and faulthandler cannot say which rank it is.
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 --label \
    python "$lesson/step.py" --hang-rank 1 --pid-dir "$pids" &
job_step=$!

# Wait until every rank has written its pid, then give them a moment to reach step 2.
for _ in $(seq 60); do
    (( $(find "$pids" -name '*.pid' | wc -l) == SLURM_NTASKS )) && break
    sleep 0.5
done
sleep 3

echo "== py-spy dump of every rank, on its own node (srun --overlap: a second step beside the stuck one)"
if command -v py-spy >/dev/null; then
    # One task per node (the job's own task count is inherited: override it). $0 in the inner
    # script is the pid folder, passed after it; the rest is expanded on each node.
    # shellcheck disable=SC2016
    srun --overlap --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 \
        --cpus-per-task=1 bash -c \
        'for f in "$0/$(hostname)"-rank*.pid; do py-spy dump --pid "$(cat "$f")"; done' "$pids" \
        || echo "py-spy could not inspect every rank (see above)"
else
    echo "py-spy is not installed in this environment (pip install py-spy)"
fi

echo "== faulthandler: scancel --signal=USR1 $SLURM_JOB_ID (every rank prints its stack)"
scancel --signal=USR1 "$SLURM_JOB_ID" || true

status=0
wait "$job_step" || status=$?
echo "== the job step ended with exit status $status"
rm -rf "$pids"
exit "$status"
