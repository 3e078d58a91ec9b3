#!/bin/bash
# A job array: one script, submitted once, run as 4 independent jobs (array tasks 0..3),
# each with its own learning rate. A stand-in for a hyperparameter sweep.
#
#   sbatch lessons/00_slurm_basics/sweep.sh                          (from the course root)
#
# %A is the array's job id, %a the task's index: one output file per array task.
#SBATCH --job-name=sweep
#SBATCH --output=%x-%A_%a.out
#SBATCH --array=0-3
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --cpus-per-task=1
#SBATCH --mem=100M
#SBATCH --time=00:02:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

rates=(0.01 0.1 0.4 1.05)
lr=${rates[$SLURM_ARRAY_TASK_ID]}
echo "array job $SLURM_ARRAY_JOB_ID task $SLURM_ARRAY_TASK_ID (job id $SLURM_JOB_ID) on $(hostname): lr=$lr"

# "Training": 20 gradient steps on f(x) = x^2 from x = 1; the final loss depends on lr.
loss=$(awk -v lr="$lr" 'BEGIN { x = 1; for (i = 0; i < 20; i++) x -= lr * 2 * x; printf "%.3g", x * x }')
echo "lr=$lr final loss $loss"

# Results go to one folder per array (in the working directory, on the shared filesystem),
# for the job that follows.
results=runs/sweep-$SLURM_ARRAY_JOB_ID
mkdir -p "$results"
echo "$lr $loss" > "$results/task-$SLURM_ARRAY_TASK_ID.txt"
