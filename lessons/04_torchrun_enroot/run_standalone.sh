#!/bin/bash
#SBATCH --job-name=l04-standalone
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=8
#SBATCH --mem=16G
#SBATCH --time=00:05:00
# Lesson 04, what NOT to do: torchrun --standalone on a two-node job.
#     sbatch lessons/04_torchrun_enroot/run_standalone.sh
# Two steps, each bounded so the job ends in seconds instead of hanging:
#   1. --standalone --nnodes 2 (plus --node-rank/--master-addr/--master-port,
#      which --standalone ignores): each node waits alone for a second node and
#      gives up after RDZV_TIMEOUT seconds (torchrun's default: 600).
#   2. --standalone --nnodes 1: torchrun would run two unrelated one-node
#      jobs, each with its own ranks 0..1 of a world of 2; common/ notices that
#      srun started 2 torchruns for a world of 1 node and stops every worker.
# Both steps are expected to fail; the job reports their exit codes and ends
# normally. See the README for the output explained.
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
export COURSE_TORCH_IN_CONTAINER=${COURSE_TORCH_IN_CONTAINER:-1}
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

export TORCHRUN_RDZV_TIMEOUT=${TORCHRUN_RDZV_TIMEOUT:-15}

# Both steps are run_script.sh with another torchrun form (see torchrun.sh).
job=$COURSE_ROOT/lessons/04_torchrun_enroot/run_script.sh

echo "=== step 1: torchrun --standalone --nnodes 2 on each of 2 nodes"
status=0
TORCHRUN_FORM=standalone bash "$job" || status=$?
echo "=== step 1 ended with exit code $status"

echo "=== step 2: torchrun --standalone --nnodes 1 on each of 2 nodes"
status=0
TORCHRUN_FORM=standalone-1node bash "$job" || status=$?
echo "=== step 2 ended with exit code $status"
