#!/bin/bash
# The all_reduce bandwidth benchmark across the cluster: 2 nodes x 2 tasks, 1 KiB to 256 MiB.
# Prints algbw and busbw per size (nccl-tests' definitions) and the memory-copy bandwidth of
# the first node as the ceiling. On a GPU cluster it runs NCCL on the GPUs; here gloo over TCP.
#
#   sbatch lessons/06_diagnosing_hangs/bench.sh                          (from the course root)
#   sbatch lessons/06_diagnosing_hangs/bench.sh --max-bytes 16M          (arguments go to the script)
#
#SBATCH --job-name=allreduce-bench
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=1
#SBATCH --mem=8G
#SBATCH --time=00:10:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"
lesson=$COURSE_ROOT/lessons/06_diagnosing_hangs

echo "job $SLURM_JOB_ID on nodes $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE task(s)"
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" python "$lesson/allreduce_bench.py" "$@"
