#!/bin/bash
# Lesson 10, part 4: reshard. A checkpoint saved from lesson 09's 2-D mesh, (dp, tp) = (nodes,
# tasks per node), resumed as plain FSDP2 on 2 ranks (one per node), then loaded by one process
# with no process group; parameters and AdamW state compared, bit for bit, with the saved ones.
#
#   sbatch lessons/10_fit_and_keep/reshard.sh                              # from the course root
#   RESHARD_DIR=checkpoints/mine sbatch lessons/10_fit_and_keep/reshard.sh  # another folder
#
# RESHARD_DIR (default checkpoints/reshard-<jobid> in the course) is read by every node.
#SBATCH --job-name=reshard
#SBATCH --output=%x-%j.out
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2        # tp: the tasks of one node split each layer
#SBATCH --cpus-per-task=1
#SBATCH --mem=4G                   # per node
#SBATCH --time=00:10:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

dir=${RESHARD_DIR:-$COURSE_ROOT/checkpoints/reshard-$SLURM_JOB_ID}
mkdir -p "$dir"
echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) on $SLURM_JOB_NODELIST: $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE tasks; checkpoint in $dir"
eval "$(python -m common.env --export)"
script=$COURSE_ROOT/lessons/10_fit_and_keep/reshard.py
echo "--- save: (dp, tp) = ($SLURM_NNODES, $SLURM_NTASKS_PER_NODE), $SLURM_NTASKS ranks"
srun --ntasks="$SLURM_NTASKS" --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    python "$script" save "$dir" --tp "$SLURM_NTASKS_PER_NODE"
echo "--- resume: FSDP2, 2 ranks on 2 nodes"
srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" \
    python "$script" resume "$dir"
echo "--- plain: one process, no process group"
python "$script" plain "$dir"
