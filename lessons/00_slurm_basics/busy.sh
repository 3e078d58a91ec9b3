#!/bin/bash
# A job that keeps its node busy for a while: something to look at from outside while it
# runs (squeue, scontrol show job, srun --overlap), then to cancel (scancel).
#
#   sbatch lessons/00_slurm_basics/busy.sh                           (from the course root)
#   srun --jobid=<jobid> --overlap --pty bash      # a shell inside the running job
#   scancel <jobid>
#SBATCH --job-name=busy
#SBATCH --output=%x-%j.out
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

echo "job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: working for at most 60 s"
# The step takes every CPU of the job: a second srun would wait for it, unless --overlap.
# shellcheck disable=SC2016  # $i belongs to the step's shell, not to this one
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" bash -c \
    'for i in $(seq 60); do echo "working: $i s"; sleep 1; done'
