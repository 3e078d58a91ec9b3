#!/bin/bash
# Lesson 05: a rank that crashes, and a node that keeps failing.
#
# One torchrun per node starts that node's workers and watches them. When a worker dies,
# torchrun stops the others and, while it has restarts left (--max-restarts), starts them all
# again on every node; the workers resume from the last checkpoint. Each worker writes its
# traceback to the file torchrun gives it (TORCHELASTIC_ERROR_FILE, through @record in
# train.py), and torchrun's report names the failing rank and its host.
#
#   sbatch lessons/05_fault_tolerance/crash.sh 2 --crash-rank 3    # rank 3 fails once: restarted
#   sbatch lessons/05_fault_tolerance/crash.sh 2 --faulty-node node2 --crash-in-epoch 1
#       # every worker on node2 fails every time: restarts run out, the job fails, the report
#       # names node2; then leave that node out:
#   sbatch --nodes=1 --exclude=node2 lessons/05_fault_tolerance/crash.sh 2
#   SUBSET=2048 sbatch ...   # any of them, quicker: the first 2,048 images of each set
#
#SBATCH --job-name=ft-crash
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1        # one torchrun per node; it starts the node's workers
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=8          # for both workers of the node
#SBATCH --mem=16G
#SBATCH --time=00:30:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

EPOCHS=${1:-${EPOCHS:-2}}
(( $# )) && shift  # what is left in "$@" goes on to train.py
[[ $EPOCHS =~ ^[0-9]+$ && $EPOCHS -ge 1 ]] || { echo "error: EPOCHS='$EPOCHS' is not a whole number of epochs >= 1: pass e.g. 2" >&2; exit 2; }
course_subset || exit 2  # SUBSET=N: the first N images of each set
set -- "${SUBSET_ARGS[@]}" "$@"
NPROC_PER_NODE=${NPROC_PER_NODE:-2}  # workers per node: one per GPU
MAX_RESTARTS=${MAX_RESTARTS:-1}
# CPU threads per worker (unset, torchrun would set 1 and print a warning about it).
export OMP_NUM_THREADS=$(( SLURM_CPUS_PER_TASK / NPROC_PER_NODE > 0 ? SLURM_CPUS_PER_TASK / NPROC_PER_NODE : 1 ))
# A checkpoint of this job's own, so that it starts afresh (a restart within it resumes), unless
# CHECKPOINT names one: that run goes on (or starts, if the file is not there yet), and nothing
# of it is deleted. An old file under this job's name (job ids start again on a new cluster) is
# moved aside, as requeue.sh does.
if [[ -z ${CHECKPOINT:-} ]]; then
    CHECKPOINT=$COURSE_ROOT/checkpoints/ft-crash-$SLURM_JOB_ID.pt
    if [[ ${SLURM_RESTART_COUNT:-0} == 0 && -e $CHECKPOINT ]]; then mv "$CHECKPOINT" "$CHECKPOINT.old"; fi
fi

eval "$(python -m common.env --export)"
echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) on $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x" \
     "$NPROC_PER_NODE workers, torchrun --max-restarts $MAX_RESTARTS"
# The nodes meet at a c10d rendezvous on the first node: after a failure the agents meet
# there again and hand out the ranks anew. --local-addr is the name each agent announces (the
# first one's becomes the workers' MASTER_ADDR); by default torchrun announces what the host
# calls itself, which the other nodes may not reach. It differs per node, so a shell on each
# node fills it in. srun --kill-on-bad-exit: when one torchrun gives up, the others are
# stopped at once instead of waiting for the lost node.
# The workers of each attempt get a store of their own (hosted by rank 0) instead of sharing the
# rendezvous' store, which outlives the attempts: with it, restarted workers
# can meet the keys of the previous attempt's dead workers (torch 2.13 then fails with "Gloo
# connectFullMesh failed ... Connection refused").
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
status=0
# shellcheck disable=SC2016  # $SLURMD_NODENAME is expanded on each node, by the task's shell
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 \
    bash -c 'exec torchrun --local-addr "$SLURMD_NODENAME" "$@"' torchrun \
    --nnodes "$SLURM_NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --max-restarts "$MAX_RESTARTS" --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "ft-$SLURM_JOB_ID" \
    "$COURSE_ROOT/lessons/05_fault_tolerance/train.py" \
    --epochs "$EPOCHS" --checkpoint "$CHECKPOINT" "$@" || status=$?
if (( status )); then
    echo "=== $(date -u '+%T') job $SLURM_JOB_ID failed (status $status): the \"Root Cause\" above" \
         "names the rank and host that failed first. A node that fails every time: resubmit" \
         "without it, sbatch --exclude=<host> ..."
    exit "$status"
fi
echo "=== $(date -u '+%T') job $SLURM_JOB_ID finished"
