#!/bin/bash
# Where does common.env put the processes of a 2-node x 2-task job: the batch script, the srun
# tasks, and a double spawn it must refuse?
# Submitted by tests/test_env_on_cluster.py:  sbatch tests/workers/env_job.sh
#SBATCH --job-name=common-env
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=1
#SBATCH --mem=1G
#SBATCH --time=00:05:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
# shellcheck source=common/job_env.sh
source "${COURSE_ROOT:=$SLURM_SUBMIT_DIR}/common/job_env.sh"
export COURSE_DIST_TIMEOUT=30
worker=$COURSE_ROOT/tests/workers/allreduce.py

# The batch script is one process, whatever the job asked for.
echo "batch: $(python -m common.env)"
echo "export: $(python -m common.env --export | tr '\n' ' ')"

# srun starts the 4 tasks; every one prints what it sees.
srun python -m common.env | sed 's/^/step: /'

# (One task per node with mp.spawn starting 2 processes in each is lesson 01's job.sh, whose
# test checks every rank, its node and the sum: tests/test_lesson01.py.)

# 2 tasks per node AND 2 spawned processes in each: must be refused at once.
errors=$(mktemp)
if srun python "$worker" --spawn 2 2>"$errors" >/dev/null; then
    echo "double spawn: not refused"
else
    echo "double spawn: refused: $(grep -m1 -o 'double spawn: [^(]*' "$errors")"
fi
rm -f "$errors"
