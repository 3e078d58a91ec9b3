#!/bin/bash
# Lesson 08: lesson 03's DDP training fed from files, on 2 nodes x 2 GPUs: the data is staged
# to each node's local disk first, then every rank reads its share through DataLoader workers.
#
#   PYTHONPATH=. python lessons/08_data_pipeline/mnist_files.py   # once, on the login node
#   sbatch lessons/08_data_pipeline/job.sh                    # from the course root: 1 epoch
#   FORM=folder sbatch lessons/08_data_pipeline/job.sh        # one file per image instead
#   FROM=shared sbatch lessons/08_data_pipeline/job.sh        # read the shared copy, no staging
#   STAGE_WITH=srun sbatch ...                                # one cp per node instead of sbcast
#   sbatch lessons/08_data_pipeline/job.sh --epochs 2 --workers 1   # more arguments: train.py
#
#SBATCH --job-name=data-pipeline
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=2        # one task (= one training process) per GPU
#SBATCH --gres=gpu:2               # two GPUs per node
#SBATCH --cpus-per-task=4          # per process: 1 for training, 3 for DataLoader workers
#SBATCH --mem=16G                  # per node
#SBATCH --time=00:30:00
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"
LESSON=$COURSE_ROOT/lessons/08_data_pipeline

FORM=${FORM:-packed}
FROM=${FROM:-local}
STAGE_WITH=${STAGE_WITH:-sbcast}
[[ $FORM == packed || $FORM == folder ]] || { echo "error: FORM='$FORM': packed (one array file per split) or folder (one file per image)" >&2; exit 2; }
[[ $FROM == local || $FROM == shared ]] || { echo "error: FROM='$FROM': local (stage to each node's disk first) or shared (read the shared copy)" >&2; exit 2; }
SHARED_DATA=${MNIST_FILES:-$COURSE_ROOT/data/mnist-files}
course_need_file "$SHARED_DATA/folder.tar" "prepare the files once, on the login node: PYTHONPATH=. python lessons/08_data_pipeline/mnist_files.py" || exit 2

echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) starts $(date -u '+%F %T') UTC on $SLURM_JOB_NODELIST, $(sinfo --version)"
echo "$SLURM_NNODES nodes x $SLURM_NTASKS_PER_NODE tasks, $SLURM_CPUS_PER_TASK CPUs per task; data: $FORM form, read from $FROM"
# Node-local disk: a folder of this job's own in the site's per-job folder where it has one
# ($SLURM_TMPDIR on some clusters), else in /tmp, removed on every node when the job ends
# (local_copy.sh says how and why).
if [[ $FROM == local ]]; then
    # shellcheck source=lessons/08_data_pipeline/local_copy.sh
    source "$LESSON/local_copy.sh"  # LOCAL_DATA: this job's folder on each node, removed at the end
    DATA=$LOCAL_DATA
    bash "$LESSON/stage.sh" "$FORM" "$SHARED_DATA" "$DATA" "$STAGE_WITH"
else
    DATA=$SHARED_DATA
fi

# Slurm 22.05 to 23.02: srun does not take --cpus-per-task from the job (it did before, and does
# again from 23.11), and each task would get one CPU for its training and its loader workers.
# There SRUN_CPUS_PER_TASK is srun's input variable for -c (srun -c "$SLURM_CPUS_PER_TASK" is the
# same). 23.11 replaced it with SLURM_CPUS_PER_TASK (NEWS of 23.11.0rc1, src/srun/opt.c), which
# the job already has: from 23.11 srun ignores this export and takes -c from the job instead.
export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
# --kill-on-bad-exit=1: a rank that fails ends the step at once, instead of leaving the others
# to wait for it until the collective timeout (lesson 06 shows both).
srun --kill-on-bad-exit=1 python "$LESSON/train.py" --data-dir "$DATA" --form "$FORM" "$@"
echo "=== $(date -u '+%T') job $SLURM_JOB_ID finished"
