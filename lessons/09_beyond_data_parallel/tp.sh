#!/bin/bash
# Lesson 09, part 1: tensor parallelism on one node. The 2 tasks split every layer of one model
# between them; the job runs tp.py twice, first without and then with sequence parallelism, and
# each run counts the collectives of one step (CommDebugMode) before it trains.
#
#   sbatch lessons/09_beyond_data_parallel/tp.sh                # from the course root
#   STEPS=20 sbatch lessons/09_beyond_data_parallel/tp.sh       # fewer steps (default 100)
#   sbatch lessons/09_beyond_data_parallel/tp.sh --dim 256      # more arguments: tp.py
#
# CPU nodes (gloo), as on the course's local cluster. On GPU nodes ask for one GPU per task
# (`#SBATCH --gpus-per-task=1`): tp.py then takes the GPU Slurm gave the task (cuda:0, the one
# it sees: cuda_device_index in common/launch.py) and NCCL.
#SBATCH --job-name=tp
#SBATCH --output=%x-%j.out
#SBATCH --nodes=1                  # TP exchanges activations in every block: one node
#SBATCH --ntasks-per-node=2        # one task (= one process) per device
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

# In Slurm 22.05 to 23.02 srun does not inherit --cpus-per-task from the job: pass it.
for sp in --no-sequence-parallel --sequence-parallel; do
    echo "=== tp.py $sp"
    srun --ntasks="$SLURM_NTASKS" --cpus-per-task="$SLURM_CPUS_PER_TASK" \
        python "$COURSE_ROOT/lessons/09_beyond_data_parallel/tp.py" "$sp" --count-comms \
        --steps "${STEPS:-100}" "$@"
done
