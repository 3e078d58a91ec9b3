#!/bin/bash
#SBATCH --job-name=l04-charliecloud
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=8
#SBATCH --mem=16G
#SBATCH --time=00:10:00
# Lesson 04 with Charliecloud instead of enroot: the same job as run_script.sh, with
# torchrun.sh started on every node by
#     ch-run --unset-env='*' --set-env=<node's list> -b <top folder of the course> -c <course> <image> -- ...
# The image is a directory, built once as root (make container, or charliecloud_image.sh);
# COURSE_CHARLIECLOUD_IMAGE points at another one. Charliecloud is a Debian package, so this
# job runs for real on the course's local cluster: torch comes from the image only.
#     sbatch lessons/04_torchrun_enroot/run_charliecloud.sh
# ENROOT_DRY_RUN=1 prints the ch-run commands instead of running them.
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
export COURSE_TORCH_IN_CONTAINER=${COURSE_TORCH_IN_CONTAINER:-1}
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"
export COURSE_CONTAINER_RUNTIME=charliecloud
# shellcheck source=lessons/04_torchrun_enroot/env.sh
source "$COURSE_ROOT/lessons/04_torchrun_enroot/env.sh"

# The image must be there before any node starts (one directory on a filesystem every node sees).
if [[ ! -x $CHARLIECLOUD_IMAGE/usr/bin/python3 ]]; then
    echo "error: no Charliecloud image at COURSE_CHARLIECLOUD_IMAGE='$CHARLIECLOUD_IMAGE' (no usr/bin/python3 in it): build it once, as root, with 'make container' (bash lessons/04_torchrun_enroot/charliecloud_image.sh), or point COURSE_CHARLIECLOUD_IMAGE at an image directory." >&2
    exit 2
fi

# Everything else is run_script.sh; only the container runtime differs.
exec bash "$COURSE_ROOT/lessons/04_torchrun_enroot/run_script.sh"
