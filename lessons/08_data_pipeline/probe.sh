#!/bin/bash
# Lesson 08: augment_probe.py on 2 nodes, one rank each: do the DataLoader workers of every
# rank draw different random augmentations? (Three seedings; rank 0 prints every draw.)
#
#   sbatch lessons/08_data_pipeline/probe.sh          # from the course root
#
#SBATCH --job-name=augment-probe
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2          # the probe's loaders start 2 workers per rank
#SBATCH --mem=4G
#SBATCH --time=00:05:00
#SBATCH --output=%x-%j.out        # augment-probe-<jobid>.out
set -euo pipefail

COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"
echo "=== job $SLURM_JOB_ID ($SLURM_JOB_NAME) on $SLURM_JOB_NODELIST, $(sinfo --version)"
export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK  # srun -c: see job.sh
srun python "$COURSE_ROOT/lessons/08_data_pipeline/augment_probe.py"
