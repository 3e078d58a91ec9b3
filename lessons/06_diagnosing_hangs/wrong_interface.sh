#!/bin/bash
# FAILURE: GLOO_SOCKET_IFNAME=lo (or NCCL_SOCKET_IFNAME=lo) in a job that spans two nodes.
# The rendezvous works (it uses MASTER_ADDR), but then every rank tells the others to connect
# to it at its loopback address: each node connects to itself, and the first collective
# fails: "Connection refused" where nothing listens on that port of the connecting node, a
# connect time-out where the peer waits for a connection that never comes.
#
#   sbatch lessons/06_diagnosing_hangs/wrong_interface.sh          (from the course root)
#
# Fix: name the interface of the nodes' network (the preflight lists each node's interfaces
# and the one that routes to the master), or leave the variables unset.
#
#SBATCH --job-name=wrong-interface
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

export GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo   # the mistake

echo "== preflight"
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" python -m common.preflight || echo "== preflight failed (exit $?)"
echo "== the job"
# --kill-on-bad-exit=1: once node1's ranks give up, srun ends node2's, which would otherwise
# wait for their own connect time-out.
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 python "$lesson/step.py"
