#!/bin/bash
# Lesson 10, part 3: keep it. On 2 nodes x 2 tasks, FSDP2 trains two steps and saves a sharded
# DCP checkpoint, resumes from it and converts it to one safetensors file, reads that back into
# FSDP2; then one plain process (no process group) loads the file with load_state_dict.
#
#   sbatch lessons/10_fit_and_keep/keep.sh                       # from the course root
#   MODEL=tiny sbatch lessons/10_fit_and_keep/keep.sh            # the tests' model
#   KEEP_DIR=checkpoints/mine sbatch lessons/10_fit_and_keep/keep.sh   # another folder
#
# KEEP_DIR (default checkpoints/keep-<jobid> in the course) must be one folder for every node:
# DCP's consolidation reads every rank's shard files on rank 0. keep.py checks, and refuses a
# node-local folder in one line.
#SBATCH --job-name=keep
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --mem=4G                   # per node
#SBATCH --time=00:10:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

dir=${KEEP_DIR:-$COURSE_ROOT/checkpoints/keep-$SLURM_JOB_ID}
echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) on $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE tasks; checkpoints in $dir"
eval "$(python -m common.env --export)"
srun --ntasks="$SLURM_NTASKS" --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    python "$COURSE_ROOT/lessons/10_fit_and_keep/keep.py" --model "${MODEL:-lesson}" --dir "$dir"
echo "--- one process, no process group:"
python "$COURSE_ROOT/lessons/10_fit_and_keep/keep.py" --model "${MODEL:-lesson}" --check "$dir"
