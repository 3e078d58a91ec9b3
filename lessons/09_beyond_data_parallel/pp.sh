#!/bin/bash
# Lesson 09, part 2: pipeline parallelism on 2 nodes x 2 tasks = 4 stages (8 with the
# interleaved schedule). pp.py times GPipe, 1F1B and interleaved 1F1B at several microbatch
# counts and prints the measured bubble next to the expected one, (p-1)/(m+p-1) for GPipe and
# 1F1B; then GPipe and interleaved 1F1B with fewer microbatches than stages (1F1B refuses those).
#
#   sbatch lessons/09_beyond_data_parallel/pp.sh                       # from the course root
#   MICROBATCHES=4 STEPS=1 sbatch lessons/09_beyond_data_parallel/pp.sh   # a short run
#   sbatch lessons/09_beyond_data_parallel/pp.sh --layers 16           # more arguments: pp.py
#
# CPU nodes (gloo), as on the course's local cluster. On GPU nodes ask for one GPU per task
# (`#SBATCH --gpus-per-task=1`): pp.py then takes the GPU Slurm gave the task (cuda:0, the one
# it sees: cuda_device_index in common/launch.py) and NCCL.
#SBATCH --job-name=pp
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2                  # a pipeline sends only activations at the cuts: nodes are fine
#SBATCH --ntasks-per-node=2        # one task (= one stage) per device
#SBATCH --cpus-per-task=1
#SBATCH --mem=4G                   # per node
#SBATCH --time=00:10:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) on $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE tasks"
# Where the processes meet: rank 0's node and a port derived from the job id (common/env.py).
eval "$(python -m common.env --export)"

# --compute-ms: each stage also does 30 ms of fixed work per microbatch (60 in the backward),
# work that takes as long however many ranks share a core: on the local cluster's few cores
# the real compute times would measure the ranks' contention for them as much as the bubble.
# On GPU nodes, pass --compute-ms 0 to measure the model alone.
# (Slurm 22.05 to 23.02: srun does not inherit --cpus-per-task from the job: pass it.)
srun --ntasks="$SLURM_NTASKS" --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    python "$COURSE_ROOT/lessons/09_beyond_data_parallel/pp.py" \
    --schedule gpipe,1f1b,interleaved --compute-ms 30 \
    --microbatches "${MICROBATCHES:-4,8,16}" --steps "${STEPS:-4}" "$@"
# Fewer microbatches than stages: every microbatch still passes through every stage, only the
# bubble grows. torch's Schedule1F1B raises a ValueError for it; GPipe and interleaved run it.
srun --ntasks="$SLURM_NTASKS" --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    python "$COURSE_ROOT/lessons/09_beyond_data_parallel/pp.py" \
    --schedule gpipe,interleaved --compute-ms 30 --microbatches 1,2 --steps "${STEPS:-4}" "$@"
