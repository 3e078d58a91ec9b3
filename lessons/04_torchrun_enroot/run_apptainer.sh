#!/bin/bash
#SBATCH --job-name=l04-apptainer
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=8
#SBATCH --mem=16G
#SBATCH --time=00:10:00
# Lesson 04 with Apptainer (Singularity) instead of enroot: the same job as run_script.sh,
# with torchrun.sh started on every node by
#     apptainer exec --cleanenv --env-file <node's list> [--nv] --bind <course> <image.sif> ...
# The image is a .sif file built once (COURSE_APPTAINER_IMAGE, see env.sh and the README).
#     sbatch lessons/04_torchrun_enroot/run_apptainer.sh
# ENROOT_DRY_RUN=1 prints the apptainer command instead of running it.
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
export COURSE_TORCH_IN_CONTAINER=${COURSE_TORCH_IN_CONTAINER:-1}
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"

# Everything else is run_script.sh; only the container runtime differs.
COURSE_CONTAINER_RUNTIME=apptainer exec bash "$COURSE_ROOT/lessons/04_torchrun_enroot/run_script.sh"
