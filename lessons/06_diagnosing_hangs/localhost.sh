#!/bin/bash
# FAILURE: MASTER_ADDR=localhost in a job that spans two nodes.
# Every node looks for rank 0 on itself: the ranks of node2 wait at the rendezvous until the
# timeout (or reach some other process listening on their own localhost). The preflight and
# common.env refuse a loopback address in a multi-node job before anything waits; the last
# step shows what a script without that check does.
#
#   sbatch lessons/06_diagnosing_hangs/localhost.sh          (from the course root)
#
# Fix: leave MASTER_ADDR unset under srun (common.env takes the first node of the step), or set
# it to that node's name: $(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1).
#
#SBATCH --job-name=localhost
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=1
#SBATCH --mem=4G
#SBATCH --time=00:03:00
set -euo pipefail
# A failure should show in seconds here, not after torch's 10 minutes: every rendezvous and
# collective of this job gives up after COURSE_DIST_TIMEOUT seconds.
export COURSE_DIST_TIMEOUT=${COURSE_DIST_TIMEOUT:-10}

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"
lesson=$COURSE_ROOT/lessons/06_diagnosing_hangs

echo "job $SLURM_JOB_ID on nodes $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE task(s), COURSE_DIST_TIMEOUT=$COURSE_DIST_TIMEOUT s"

export MASTER_ADDR=localhost   # the mistake

echo "== preflight"
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" python -m common.preflight || echo "== preflight failed (exit $?)"
echo "== the job"
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" python "$lesson/step.py" || echo "== the job failed (exit $?)"

echo "== the same mistake without common/: plain torch.distributed"
# Rank 0 (node1) opens the rendezvous store on its localhost; node2's ranks knock on their own
# localhost, where nothing listens, until the timeout. --kill-on-bad-exit=1 ends the rest then.
# (grep keeps each error's first line; the full tracebacks are long.)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 python -c '
import datetime, os, torch.distributed as dist
dist.init_process_group(
    "gloo", init_method="tcp://%s:%s" % (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]),
    rank=int(os.environ["SLURM_PROCID"]), world_size=int(os.environ["SLURM_NTASKS"]),
    timeout=datetime.timedelta(seconds=int(os.environ["COURSE_DIST_TIMEOUT"])))
print("rank", dist.get_rank(), "joined")
' 2>&1 | grep -E "^(rank |torch\.distributed\.\w+: |srun: )|trying to connect" || true
