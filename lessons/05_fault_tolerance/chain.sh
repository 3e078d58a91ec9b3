#!/bin/bash
# Lesson 05: one long training as a chain of shorter jobs, each link resuming the last checkpoint.
#
# Where the time limit is shorter than the training, or shorter jobs start sooner, submit the
# training as links that run one after another and share one checkpoint:
#
#   sbatch lessons/05_fault_tolerance/chain.sh                # --array=1-3%1 below: 3 links
#   sbatch --array=1-5%1 lessons/05_fault_tolerance/chain.sh  # 5 links
#   SUBSET=2048 sbatch lessons/05_fault_tolerance/chain.sh    # quicker: the first 2,048 images
#   # or as separate jobs of one link each, each starting once the one before has ended, however
#   # it ended (--array=N on the command line replaces the 1-3%1 below, else each is 3 links):
#   dep=()
#   for link in 1 2 3; do
#       id=$(sbatch --parsable --array="$link" "${dep[@]}" --export=ALL,CHAIN=mnist lessons/05_fault_tolerance/chain.sh)
#       dep=(--dependency=afterany:"${id%%;*}")
#   done
#
# `%1` lets one link of the array run at a time; afterany (not afterok) starts the next job
# also when the previous one was stopped by its time limit or failed: the checkpoint is there.
# A link that finds the training finished says so and ends.
#
#SBATCH --job-name=ft-chain
#SBATCH --array=1-3%1              # 3 links, at most 1 running at a time
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2        # one task (= one training process) per GPU
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=4
#SBATCH --mem=16G
#SBATCH --time=00:30:00
#SBATCH --output=%x-%A.out         # every link of the chain writes to one file...
#SBATCH --open-mode=append         # ...one after the other
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

EPOCHS=${EPOCHS:-3}                  # of the whole training
EPOCHS_PER_RUN=${EPOCHS_PER_RUN:-1}  # of each link
for v in EPOCHS EPOCHS_PER_RUN; do
    [[ ${!v} =~ ^[0-9]+$ && ${!v} -ge 1 ]] || { echo "error: $v='${!v}' is not a whole number >= 1: pass e.g. $v=1" >&2; exit 2; }
done
course_subset || exit 2  # SUBSET=N: the first N images of each set
set -- "${SUBSET_ARGS[@]}" "$@"
# Every link has its own job id; they share the array's id (SLURM_ARRAY_JOB_ID), or a name
# given to every job of a dependency chain (CHAIN=...).
CHAIN=${CHAIN:-${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}}
CHECKPOINT=${CHECKPOINT:-$COURSE_ROOT/checkpoints/ft-chain-$CHAIN.pt}

echo "=== link ${SLURM_ARRAY_TASK_ID:-1} of chain $CHAIN (job $SLURM_JOB_ID) starts $(date -u '+%F %T') UTC"
eval "$(python -m common.env --export)"
# In Slurm 22.05 to 23.02 srun does not inherit --cpus-per-task from the job (23.11 restored
# it through SLURM_CPUS_PER_TASK): passing it explicitly is right on every version.
srun --cpus-per-task="$SLURM_CPUS_PER_TASK" --kill-on-bad-exit=1 \
    python "$COURSE_ROOT/lessons/05_fault_tolerance/train.py" --epochs "$EPOCHS" \
    --epochs-per-run "$EPOCHS_PER_RUN" --checkpoint "$CHECKPOINT" "$@"
echo "=== $(date -u '+%T') link ${SLURM_ARRAY_TASK_ID:-1} of chain $CHAIN ends"
