#!/bin/bash
# FAILURE: a WORLD_SIZE exported by the job script that does not match the tasks srun starts.
# Scripts copied from another cluster often carry `export WORLD_SIZE=8` (2 nodes x 4 GPUs
# there); here srun starts 2 x 2 = 4 tasks. torch alone would wait for 8 ranks that never come.
#
#   sbatch lessons/06_diagnosing_hangs/world_size.sh          (from the course root)
#
# Fix: do not export WORLD_SIZE (or RANK) in a job script; let srun's variables decide.
#
#SBATCH --job-name=world-size
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

export WORLD_SIZE=8   # the mistake

# A real job script stops here when the preflight fails (`|| exit 1`); this one goes on, to show
# what the job itself would have printed.
echo "== preflight"
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" python -m common.preflight || echo "== preflight failed (exit $?)"
echo "== the job"
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" python "$lesson/step.py"
