#!/bin/bash
# Lesson 09, part 4: the same model under DDP, FSDP2, TP, PP (1F1B) and 2D (TP in a node x
# FSDP2 across nodes) on 2 nodes x 2 tasks. compare.py trains each form a few steps from the
# same weights on the same batches and prints one row per form: memory per rank, bytes sent per
# step and rank, step time, and the loss.
#
#   sbatch lessons/09_beyond_data_parallel/compare.sh                  # from the course root
#   STEPS=2 sbatch lessons/09_beyond_data_parallel/compare.sh          # fewer timed steps (10)
#   FORMS="ddp pp" sbatch lessons/09_beyond_data_parallel/compare.sh   # some of the forms
#   sbatch lessons/09_beyond_data_parallel/compare.sh --dim 256        # more arguments: compare.py
#
# Each form runs in a job step of its own: fresh processes, so that one form's process groups,
# hooks and DTensor state never meet the next's (one process running all five has ended in a
# crash inside gloo on the local cluster; the README's torchrun line runs one form).
#
# CPU nodes (gloo), as on the course's local cluster. On GPU nodes ask for one GPU per task
# (`#SBATCH --gpus-per-task=1`): compare.py then takes the GPU Slurm gave the task and NCCL, and the
# step times include NVLink inside a node and the network between them (a bigger model,
# --dim 1024 --hidden 4096 --layers 8, makes the comparison worth reading there).
#SBATCH --job-name=compare
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2                  # 2D needs a row of the mesh per node
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

# A job step per form, one after the other, all on the same 4 tasks' CPUs and rank 0's port.
# (Slurm 22.05 to 23.02: pass --cpus-per-task.)
header=()  # the first step prints the table's header, the others their rows
for form in ${FORMS:-ddp fsdp2 tp pp 2d}; do
    srun --ntasks="$SLURM_NTASKS" --cpus-per-task="$SLURM_CPUS_PER_TASK" \
        python "$COURSE_ROOT/lessons/09_beyond_data_parallel/compare.py" --steps "${STEPS:-10}" \
        --forms "$form" "${header[@]}" "$@"
    header=(--no-header)
done
