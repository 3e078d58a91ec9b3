# shellcheck shell=bash
# Sourced by every job script of the course, right after its #SBATCH lines:
#
#     source "${COURSE_ROOT:=$SLURM_SUBMIT_DIR}/common/job_env.sh"
#
# sbatch runs a *copy* of the job script from its spool directory, so a job
# cannot find the course through "$0"; it finds it through the directory it was
# submitted from (or COURSE_ROOT when you submit from elsewhere).
#
# Everything that differs between clusters is read from the environment or from
# one site file, never edited into the lessons:
#   COURSE_SITE_FILE  file sourced first (default: $COURSE_ROOT/site.sh, if it exists);
#                     put `module load ...`, NCCL_SOCKET_IFNAME=... and similar there.
#   COURSE_VENV       the Python environment to activate (default: $COURSE_ROOT/.venv).
#                     It must live on a filesystem that every compute node mounts.
#   SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_QOS, ...  read by sbatch itself.

if [[ ! -d ${COURSE_ROOT:-}/common ]]; then
    echo "error: COURSE_ROOT='${COURSE_ROOT:-}' is not the course directory (no common/ in it)." >&2
    echo "       Submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>." >&2
    exit 2
fi
COURSE_ROOT=$(cd "$COURSE_ROOT" && pwd)
export COURSE_ROOT

COURSE_SITE_FILE=${COURSE_SITE_FILE:-$COURSE_ROOT/site.sh}
if [[ -f $COURSE_SITE_FILE ]]; then
    # shellcheck source=/dev/null
    source "$COURSE_SITE_FILE"
fi

COURSE_VENV=${COURSE_VENV:-$COURSE_ROOT/.venv}
if [[ ! -f $COURSE_VENV/bin/activate ]]; then
    echo "error: no Python environment at COURSE_VENV='$COURSE_VENV'." >&2
    echo "       Create it on a shared filesystem (make -C \"$COURSE_ROOT\" venv) or point COURSE_VENV at yours." >&2
    exit 2
fi
# shellcheck source=/dev/null
source "$COURSE_VENV/bin/activate"

# Every task started by srun inherits this, so `python -m common.env` and the
# lessons' `from common... import ...` work on every node.
export PYTHONPATH="$COURSE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Python buffers stdout when it is a file; unbuffered output keeps the job log in order.
export PYTHONUNBUFFERED=1
