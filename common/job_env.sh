# shellcheck shell=bash
# Sourced by every job script of the course, right after its #SBATCH lines:
#
#     COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
#     [[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: ..." >&2; exit 2; }
#     source "$COURSE_ROOT/common/job_env.sh"
#
# sbatch runs a *copy* of the job script from its spool directory, so a job
# cannot find the course through "$0"; it finds it through the directory it was
# submitted from (or COURSE_ROOT when you submit from elsewhere).
#
# Everything that differs between clusters is read from the environment or from
# one site file, never edited into the lessons:
#   COURSE_SITE_FILE  file sourced first (default: $COURSE_ROOT/site.sh, if it exists);
#                     put `module load ...`, NCCL_SOCKET_IFNAME=... and similar there.
#                     Every variable it sets is exported, so it reaches the srun tasks.
#   COURSE_VENV       the Python environment: a venv (default: $COURSE_ROOT/.venv) or a
#                     conda environment (the folder with conda-meta/ in it). Without either,
#                     an active conda environment or the python3 on PATH (module load) is used
#                     if it has torch. It must live on a filesystem every compute node mounts.
#   SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_QOS, ...  read by sbatch itself.

if [[ ! -d ${COURSE_ROOT:-}/common ]]; then
    echo "error: COURSE_ROOT='${COURSE_ROOT:-}' is not the course directory (no common/ in it): submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>." >&2
    exit 2
fi
COURSE_ROOT=$(cd "$COURSE_ROOT" && pwd)
export COURSE_ROOT

COURSE_SITE_FILE=${COURSE_SITE_FILE:-$COURSE_ROOT/site.sh}
if [[ -f $COURSE_SITE_FILE ]]; then
    # A plain NAME=value in a sourced file stays in this shell; srun hands its tasks only what is
    # exported. `set -a` exports every variable the site file sets (`module load` exports its own).
    set -a
    # shellcheck source=/dev/null
    source "$COURSE_SITE_FILE"
    set +a
fi

# The Python environment, in order: COURSE_VENV, the course's .venv, an active conda
# environment, the python3 on PATH.
if [[ -n ${COURSE_VENV:-} && -f $COURSE_VENV/bin/activate ]]; then
    # shellcheck source=/dev/null
    source "$COURSE_VENV/bin/activate"
elif [[ -n ${COURSE_VENV:-} && -d $COURSE_VENV/conda-meta ]]; then
    # A conda environment, activated the way `conda activate` would for python and its tools.
    export CONDA_PREFIX=$COURSE_VENV PATH="$COURSE_VENV/bin:$PATH"
elif [[ -n ${COURSE_VENV:-} ]]; then
    echo "error: COURSE_VENV='$COURSE_VENV' is neither a venv (no bin/activate) nor a conda environment (no conda-meta/): point it at one, or unset it." >&2
    exit 2
elif [[ -f $COURSE_ROOT/.venv/bin/activate ]]; then
    # shellcheck source=/dev/null
    source "$COURSE_ROOT/.venv/bin/activate"
else
    course_python=$(command -v python3 || true)
    if [[ -z $course_python ]] || ! "$course_python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)' 2>/dev/null; then
        echo "error: no Python environment with torch: no $COURSE_ROOT/.venv, no COURSE_VENV, and ${course_python:-no python3 on PATH}${course_python:+ cannot import torch}. Create the venv on a shared filesystem (make -C \"$COURSE_ROOT\" venv), set COURSE_VENV, or module load / conda activate one in site.sh." >&2
        exit 2
    fi
    echo "using ${CONDA_PREFIX:+the conda environment $CONDA_PREFIX: }$course_python (no .venv in the course, no COURSE_VENV)"
    unset course_python
fi

# Every task started by srun inherits this, so `python -m common.env` and the
# lessons' `from common... import ...` work on every node.
export PYTHONPATH="$COURSE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Python buffers stdout when it is a file; unbuffered output keeps the job log in order.
export PYTHONUNBUFFERED=1
# The course's local cluster (cluster/up.sh, ClusterName=course) has no slow filesystem and no
# big model: a rank that is not there within a minute is not coming. Real clusters keep
# common.dist's defaults (COURSE_RDZV_TIMEOUT 120 s, COURSE_DIST_TIMEOUT 600 s).
if [[ ${SLURM_CLUSTER_NAME:-} == course ]]; then
    export COURSE_DIST_TIMEOUT=${COURSE_DIST_TIMEOUT:-60}
fi
