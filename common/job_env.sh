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
#                     Every variable it sets is exported, so it reaches the srun tasks, and
#                     its names are listed in COURSE_SITE_VARS (for containers, which start
#                     with an empty environment). It is sourced with `set -u`/`set -e` off
#                     (conda's activate scripts read unset variables); a command in it that
#                     fails is reported in one line and the job goes on.
#   COURSE_VENV       the Python environment: a venv (default: $COURSE_ROOT/.venv) or a
#                     conda environment (the folder with conda-meta/ in it). Without either,
#                     an active conda environment or the python3 on PATH (module load) is used
#                     if it has torch. It must live on a filesystem every compute node mounts.
#   COURSE_TORCH_IN_CONTAINER=1  set by a job script before sourcing this file when its tasks
#                     run Python in a container image that brings torch (lesson 04: enroot,
#                     pyxis, Apptainer): the host then needs only python3, for common.env.
#   SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_QOS, ...  read by sbatch itself.
#
# Sites that make --export=NONE the default (SBATCH_EXPORT=NONE in the login profile, or a
# submit plugin) start the job script with the SLURM_* variables and a login shell's
# environment only: nothing of the submitting shell (no venv on PATH, no PYTHONPATH, no
# COURSE_*). Everything the jobs need is set here, from COURSE_ROOT (the submit directory),
# so the batch script runs as it does elsewhere (cluster/README.md, "Sites with --export=NONE").

if [[ ! -d ${COURSE_ROOT:-}/common ]]; then
    echo "error: COURSE_ROOT='${COURSE_ROOT:-}' is not the course directory (no common/ in it): submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>." >&2
    exit 2
fi
COURSE_ROOT=$(cd "$COURSE_ROOT" && pwd)
export COURSE_ROOT

# Sites with --export=NONE: sbatch also sets SLURM_EXPORT_ENV=NONE in the job, and srun reads it
# as its own --export: every step would start with the SLURM_* variables alone, without the
# PATH, the venv and the PYTHONPATH set below ("execve(): python: No such file or directory").
# The steps are to run in the environment this file makes, as sbatch(1) advises: ALL. (Also for
# --export=NAME,...: the named variables are in this shell already.) Variables given at
# submission do not reach such a job: say so once, with the way that does.
if [[ -n ${SLURM_EXPORT_ENV:-} && $SLURM_EXPORT_ENV != ALL && $SLURM_EXPORT_ENV != ALL,* ]]; then
    echo "note: this job was submitted with --export=${SLURM_EXPORT_ENV} (a site default?): variables of the submitting shell (EPOCHS=, CHECKPOINT=, COURSE_*) did not reach it; pass them with sbatch --export=ALL,NAME=value or set them in site.sh. Its srun steps get the course's environment (SLURM_EXPORT_ENV=ALL)." >&2
    export SLURM_EXPORT_ENV=ALL
fi

COURSE_SITE_FILE=${COURSE_SITE_FILE:-$COURSE_ROOT/site.sh}
if [[ -f $COURSE_SITE_FILE ]]; then
    # A plain NAME=value in a sourced file stays in this shell; srun hands its tasks only what is
    # exported. `set -a` exports every variable the site file sets (`module load` exports its own).
    # The job scripts run under `set -euo pipefail`, which a site file is not written for: conda's
    # activate.d scripts read unset variables (conda/conda#3200, #8186: "PROJ_LIB: unbound
    # variable" would end the job here, and no `|| true` can catch that), and `module load` may
    # return non-zero after doing its work. So the file runs with those options off, an ERR trap
    # notes every command in it that fails, and the options are put back afterwards.
    declare -A course_site_before=()
    for course_name in $(compgen -e); do
        course_site_before[$course_name]=${!course_name}
    done
    # ($- and `shopt -o` in this shell: $(set +o) would run in a subshell, where errexit is off.)
    course_site_opts=$-
    course_site_pipefail=0
    shopt -qo pipefail && course_site_pipefail=1
    course_site_err_trap=$(trap -p ERR)
    course_site_failed=()
    set +euE -a
    set +o pipefail
    trap 'course_site_failed+=("line $LINENO: $BASH_COMMAND (exit $?)")' ERR
    # shellcheck source=/dev/null
    source "$COURSE_SITE_FILE"
    trap - ERR
    set +a
    [[ $course_site_opts == *a* ]] && set -a
    [[ $course_site_opts == *e* ]] && set -e
    [[ $course_site_opts == *u* ]] && set -u
    [[ $course_site_opts == *E* ]] && set -E
    ((course_site_pipefail)) && set -o pipefail
    [[ -z $course_site_err_trap ]] || eval "$course_site_err_trap"
    if ((${#course_site_failed[@]})); then
        course_site_msg=$(printf '%s; ' "${course_site_failed[@]}")
        echo "warning: site file $COURSE_SITE_FILE: ${course_site_msg%; } — going on; fix or remove the line if the job needs what it sets (its other lines ran)." >&2
    fi
    # The names the site file set or changed: a container (lesson 04) starts with none of the
    # host's environment and is handed these by name. (A job script that runs another one
    # sources this file twice; the second time the values are already there: keep the names.)
    COURSE_SITE_VARS=${COURSE_SITE_VARS:-}
    for course_name in $(compgen -e); do
        if [[ -z ${course_site_before[$course_name]+set} || ${course_site_before[$course_name]} != "${!course_name}" ]] &&
            [[ " $COURSE_SITE_VARS " != *" $course_name "* ]]; then
            COURSE_SITE_VARS+="${COURSE_SITE_VARS:+ }$course_name"
        fi
    done
    export COURSE_SITE_VARS
    unset course_site_before course_site_opts course_site_pipefail course_site_err_trap course_site_failed course_site_msg course_name
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
    if [[ -z $course_python ]]; then
        echo "error: no Python environment: no $COURSE_ROOT/.venv, no COURSE_VENV, and no python3 on PATH. Create the venv on a shared filesystem (make -C \"$COURSE_ROOT\" venv), set COURSE_VENV, or module load / conda activate one in site.sh." >&2
        exit 2
    fi
    # The host side of every job (common.env, host lists, ports) needs python3 only; torch is
    # needed where the training runs. A job whose tasks run in a container that brings torch
    # says so (COURSE_TORCH_IN_CONTAINER=1) and checks the host's torch only where it falls
    # back to the host (course_require_host_torch below).
    if [[ ${COURSE_TORCH_IN_CONTAINER:-0} != 1 ]] && ! "$course_python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)' 2>/dev/null; then
        echo "error: no Python environment with torch: no $COURSE_ROOT/.venv, no COURSE_VENV, and $course_python cannot import torch. Create the venv on a shared filesystem (make -C \"$COURSE_ROOT\" venv), set COURSE_VENV, or module load / conda activate one in site.sh." >&2
        exit 2
    fi
    echo "using ${CONDA_PREFIX:+the conda environment $CONDA_PREFIX: }$course_python (no .venv in the course, no COURSE_VENV)"
    unset course_python
fi
# common/ needs Python 3.10 or newer (pyproject.toml's requires-python) on the host too, also
# where torch runs in a container: RHEL 8's own /usr/bin/python3 is 3.6, and would stop with a
# SyntaxError in the middle of the job.
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    echo "error: $(command -v python3 || echo python3) is $(python3 -V 2>&1 || echo missing), and common/ needs Python 3.10 or newer: load a newer one in site.sh (module load python/3.11, or RHEL 8's dnf install python3.11 and its python3.11 first on PATH), or set COURSE_VENV." >&2
    exit 2
fi

# course_require_host_torch WHAT: stop with one line unless the python3 on PATH imports torch.
# For a job that runs its training in a container where it can, and on the host where not.
course_require_host_torch() {
    local python
    python=$(command -v python3 || true)
    if [[ -z $python ]] || ! "$python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("torch") is None)' 2>/dev/null; then
        echo "error: $1 needs torch on the host, and ${python:-no python3 on PATH}${python:+ cannot import torch}: install the container runtime on this node, or give the host a Python with torch (COURSE_VENV, or module load / conda activate in site.sh)." >&2
        return 2
    fi
}

# Every task started by srun inherits this, so `python -m common.env` and the
# lessons' `from common... import ...` work on every node.
export PYTHONPATH="$COURSE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Python buffers stdout when it is a file; unbuffered output keeps the job log in order.
export PYTHONUNBUFFERED=1
# The course's local cluster (cluster/up.sh, ClusterName=course) has no slow filesystem and no
# big model: a rank that is not there within a minute is not coming. Real clusters keep
# common.launch.dist_timeout()'s default of 600 s (COURSE_DIST_TIMEOUT unset).
if [[ ${SLURM_CLUSTER_NAME:-} == course ]]; then
    export COURSE_DIST_TIMEOUT=${COURSE_DIST_TIMEOUT:-60}
fi

# course_need_file FILE FIX: return 0 if FILE exists and this user may read it; else print one
# line saying whether it is missing or cannot be read, and why (a folder on the way without x
# for this user, or the file without r, with its mode and owner), with FIX for the missing case.
#     course_need_file "$data/$f" "prepare the data once, on the login node: python -m common.mnist_prepare" || exit 2
course_need_file() {
    local file=$1 fix=$2 dir="" part me
    me=$(id -un)
    [[ -f $file && -r $file ]] && return 0
    [[ $file == /* ]] || file=$PWD/$file
    local -a parts
    IFS=/ read -ra parts <<<"${file%/*}"
    for part in "${parts[@]}"; do
        [[ -n $part ]] || continue
        dir+=/$part
        [[ -d $dir ]] || break
        if [[ ! -x $dir ]]; then
            echo "error: $file cannot be read: the folder $dir ($(stat -c '%A %U:%G' "$dir")) may not be entered by $me (it needs x for you: chmod o+x $dir, or a group you are in); ask its owner, or use a copy of your own." >&2
            return 2
        fi
    done
    if [[ -e $file && ! -r $file ]]; then
        echo "error: $file cannot be read: the file ($(stat -c '%A %U:%G' "$file")) may not be read by $me (chmod o+r $file, or a group you are in); ask its owner, or use a copy of your own." >&2
        return 2
    fi
    echo "error: $file is missing: $fix" >&2
    return 2
}

# course_subset: SUBSET=N in front of sbatch asks the MNIST jobs (lessons 03, 05, 07) for a
# quicker run on the first N images of each set: SUBSET_ARGS holds train.py's arguments for it
# (none when SUBSET is unset); anything but a whole number is one line, and status 2.
#     course_subset || exit 2; set -- "${SUBSET_ARGS[@]}" "$@"
# shellcheck disable=SC2034  # SUBSET_ARGS is read by the job script that sourced this file
course_subset() {
    SUBSET_ARGS=()
    [[ -z ${SUBSET:-} ]] && return 0
    if [[ ! $SUBSET =~ ^[1-9][0-9]*$ ]]; then
        echo "error: SUBSET='$SUBSET' is not a whole number of images >= 1: pass e.g. SUBSET=2048, or unset it for all of MNIST" >&2
        return 2
    fi
    SUBSET_ARGS=(--train-subset "$SUBSET" --test-subset "$SUBSET")
}

# --- A job that stops in time, saves and comes back (lessons 05 and 07) -----------------------
# Two pieces that the requeueing job scripts share, so that their stop and requeue rules cannot
# drift apart (lessons/05_fault_tolerance/README.md §1-§3 explains each rule).
#
#     COURSE_RESUME="CHECKPOINT=$CHECKPOINT sbatch lessons/...sh"  # how to go on by hand
#     course_srun_stoppable srun ... python train.py ...      # sets COURSE_STATUS
#     course_requeue_or_end "$COURSE_STATUS" "resumes from $CHECKPOINT" "$COURSE_RESUME"
#
# course_srun_stoppable COMMAND...: run COMMAND (an srun) in the background and wait for it,
# passing a SIGUSR1 or SIGTERM sent to this batch shell on to it as SIGUSR1: the tasks then save
# and exit 75. bash runs a trap only once the foreground command has ended, so srun may not run in
# the foreground; a trapped signal cuts `wait` short, so it is waited for again. Always SIGUSR1:
# srun answers a SIGTERM of its own by killing the tasks at once ("forcing job termination").
# Sets COURSE_STATUS (srun's exit status) and COURSE_SIGNALLED (USR1, TERM or empty).
# COURSE_RESUME, set before, is the command that goes on by hand (said at a cancel: below).
# shellcheck disable=SC2034  # COURSE_STATUS and COURSE_SIGNALLED are read by the job script
course_srun_stoppable() {
    COURSE_SIGNALLED=
    COURSE_STATUS=
    course_srun_pid=
    course_check_pid=
    trap 'course_on_stop USR1' USR1
    trap 'course_on_stop TERM' TERM
    "$@" &
    course_srun_pid=$!
    local rc
    while [[ -z $COURSE_STATUS ]]; do
        wait "$course_srun_pid" && rc=0 || rc=$?
        if ((rc > 128)) && kill -0 "$course_srun_pid" 2>/dev/null; then continue; fi
        COURSE_STATUS=$rc
    done
}
# shellcheck disable=SC2317,SC2329  # called by the traps above
course_on_stop() {
    COURSE_SIGNALLED=$1
    echo "=== $(date -u '+%T') got SIG$1: asking the training to checkpoint and stop"
    if [[ -n $course_srun_pid ]]; then kill -USR1 "$course_srun_pid" 2>/dev/null || true; fi
    # Said here, at the signal: whether Slurm requeued the job itself, or (after a SIGTERM) how to
    # go on with a job that is ending. Until SIGKILL there is only KillWait, and the tasks' own
    # exit may outlast it (measured: saved 0.8 s after the SIGTERM, then 4 ranks leaving for
    # more than 10 s on a loaded machine): what waits for srun's end may never be said.
    # Asked in the background: a loaded slurmctld may answer after the training has saved, and
    # this shell must then be free to say how to go on (course_requeue_or_end).
    course_check_answer
    if [[ -z ${COURSE_REQUEUED_BY_SLURM:-}${COURSE_RESUME_SAID:-} && -z ${course_check_pid:-} ]]; then
        course_stop_check "$1" &
        course_check_pid=$!
    fi
}

# course_stop_check SIGNAL: the job's state at a stop signal, in the background. Status 0: Slurm
# requeued it itself (said: nothing to do); 2: after a SIGTERM, it is ending, not requeued (a
# cancel, the time limit), and COURSE_RESUME was said; 1: it still runs (a time-limit warning,
# a preemption's grace time: the script requeues it after the save), or no answer.
course_stop_check() {
    course_requeued_by_slurm && return 0
    [[ $1 == TERM && -n ${COURSE_RESUME:-} ]] || return 1
    local state restarts
    read -r state restarts <<<"$(course_job_state)"
    [[ -n $state && $state != RUNNING ]] || return 1
    echo "=== $(date -u '+%T') job $SLURM_JOB_ID is ending (JobState=$state: cancelled with scancel, or at its time limit), not requeued: once the training has saved, go on later with: $COURSE_RESUME"
    return 2
}

# course_check_answer [wait|stop]: take the answer of the check course_on_stop started, once it
# has ended (with "wait": waiting for it; with "stop": ending it if it has not answered yet):
# COURSE_REQUEUED_BY_SLURM is set if Slurm requeued the job, COURSE_RESUME_SAID if the way to go
# on was said.
course_check_answer() {
    [[ -n ${course_check_pid:-} ]] || return 0
    if kill -0 "$course_check_pid" 2>/dev/null; then
        case ${1:-} in
        wait) ;;
        stop) kill "$course_check_pid" 2>/dev/null || true ;;
        *) return 0 ;;
        esac
    fi
    local rc
    while :; do
        wait "$course_check_pid" && rc=0 || rc=$?
        # (A trapped signal cuts `wait` short, as in course_srun_stoppable.)
        if ((rc > 128)) && kill -0 "$course_check_pid" 2>/dev/null; then continue; fi
        break
    done
    course_check_pid=
    if ((rc == 0)); then COURSE_REQUEUED_BY_SLURM=yes; fi
    if ((rc == 2)); then COURSE_RESUME_SAID=yes; fi
    return 0
}

# course_requeued_by_slurm: has Slurm requeued this job itself (its Restarts above the
# SLURM_RESTART_COUNT this run started with)? If so, say it once and return 0.
course_requeued_by_slurm() {
    [[ -n ${COURSE_REQUEUED_BY_SLURM:-} ]] && return 0
    local state restarts
    read -r state restarts <<<"$(course_job_state)"
    if [[ -z $state || $state == RUNNING ]] || ((restarts <= ${SLURM_RESTART_COUNT:-0})); then
        return 1
    fi
    COURSE_REQUEUED_BY_SLURM=$restarts
    echo "=== $(date -u '+%T') job $SLURM_JOB_ID was requeued by Slurm itself (Restarts=$restarts: a preemption, a node failure or an administrator's scontrol requeue): the training saves, and the requeued run resumes from its checkpoint. Nothing to do: squeue -j $SLURM_JOB_ID shows it pending"
}

# course_job_state: the job's state and restart count as slurmctld reports them now (scontrol
# show job's JobState and Restarts), e.g. "RUNNING 0"; empty if it cannot be asked.
course_job_state() {
    local line
    line=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null) || return 0
    [[ $line =~ JobState=([A-Z_]+) ]] || return 0
    local state=${BASH_REMATCH[1]}
    [[ $line =~ Restarts=([0-9]+) ]] && echo "$state ${BASH_REMATCH[1]}"
    return 0
}

# course_requeue_or_end STATUS NEXT RESUME: after course_srun_stoppable, end the job or put it back
# in the queue; returns STATUS when there is nothing to requeue (the training finished or
# failed), else exits.
# - 143 or 138 (the tasks ended by the SIGTERM or SIGUSR1 itself: a stop that came while Python
#   was still starting, before train.py set its handler), or any failure after a trapped signal,
#   count as a stop: nothing was saved this time, the last checkpoint (if any) is kept.
# - A stop (exit 75) is requeued only while the job still runs: after a time-limit warning, or
#   within a preemption's grace time. A plain `scancel` (and the time limit itself) first makes
#   the job CANCELLED (TIMEOUT) and COMPLETING in slurmctld, then signals the batch shell:
#   job_signal() in src/slurmctld/job_mgr.c sets `job_term_state | JOB_COMPLETING` before
#   deallocate_nodes() (Slurm 22.05, 24.11 and 26.05 alike), and `scontrol show job` then reports
#   JobState=COMPLETING (job_state_string() names the COMPLETING flag before the base state).
#   Slurm would still accept the requeue of such a job (_job_requeue_op: "we support requeue of
#   done/exit/exiting jobs"), and a cancelled job would come back and run again. So the state is
#   asked first, and only RUNNING is requeued.
# - Slurm may have requeued the job itself (a preemption with no grace time left, a node failure,
#   an administrator's `scontrol requeue`): _job_requeue_op counts the restart at once and leaves
#   the job PENDING and COMPLETING, which scontrol also shows as JobState=COMPLETING. Its Restarts
#   is then above SLURM_RESTART_COUNT, the count this run started with: the job comes back by
#   itself, and nothing is to be done (a resubmitted copy would train on the same checkpoint).
# - `scontrol requeue Incomplete` requeues the job only while slurmctld, under its own lock, still
#   finds it incomplete (running, suspended): a cancel that lands between the state check and the
#   requeue then wins. It exits 0 either way (measured on 22.05, 24.11 and 26.05), so the
#   restart count is read again to know which happened.
# - A refused requeue (--no-requeue, JobRequeue=0, a site's job_submit plugin) must not end the
#   job COMPLETED as if the training had finished: one line, and exit 75 (the job ends FAILED).
# - A SIGTERM to this shell brings SIGKILL after KillWait, and each `scontrol` waits on slurmctld
#   (seconds when it is loaded): RESUME is said before any of them, the state-dependent line after.
#   The check at the signal (course_on_stop) runs in the background for the same reason.
# NEXT says what the requeued run will do ("resumes from <checkpoint>"); RESUME is the command
# that continues the run later, by hand, from the kept checkpoint.
course_requeue_or_end() {
    local status=$1 next=$2 resume=$3 state said
    if ((status == 143 || status == 138)) || [[ -n ${COURSE_SIGNALLED:-} && $status -ne 0 && $status -ne 75 ]]; then
        echo "=== $(date -u '+%T') the training ended with status $status, stopped before it could save"
        status=75
    fi
    ((status == 75)) || return "$status"
    course_check_answer
    [[ -n ${COURSE_REQUEUED_BY_SLURM:-} ]] && exit 0
    # A SIGTERM to this shell (scancel, the time limit, Slurm's own requeue) is followed by SIGKILL
    # after KillWait, which a loaded slurmctld's answers below may outlast: unless the check at
    # the signal said it, the way to go on is said first, and that check, still waiting for
    # slurmctld, is ended (the questions are asked again below). (After the time limit's SIGUSR1,
    # or a preemption's SIGTERM to the tasks alone, the job still runs and is requeued below: no
    # command to submit it again.)
    if [[ ${COURSE_SIGNALLED:-} == TERM && -z ${COURSE_RESUME_SAID:-} ]]; then
        course_check_answer stop
        [[ -n ${COURSE_REQUEUED_BY_SLURM:-} ]] && exit 0
        if [[ -z ${COURSE_RESUME_SAID:-} ]]; then
            echo "=== $(date -u '+%T') job $SLURM_JOB_ID stopped after SIGTERM: unless the next line says it is requeued, go on later with: $resume"
        fi
    fi
    course_check_answer wait
    course_requeued_by_slurm && exit 0
    local started=${SLURM_RESTART_COUNT:-0} restarts
    read -r state restarts <<<"$(course_job_state)"
    if [[ -n $state && $state != RUNNING ]]; then
        echo "=== $(date -u '+%T') job $SLURM_JOB_ID is ending (JobState=$state: cancelled with scancel, or at its time limit): saved, not requeued. To go on later: $resume"
        exit 75
    fi
    echo "=== $(date -u '+%T') requeueing job $SLURM_JOB_ID${COURSE_SIGNALLED:+ (after SIG$COURSE_SIGNALLED)}; it $next"
    if ! said=$(scontrol requeue Incomplete "$SLURM_JOB_ID" 2>&1); then
        echo "error: scontrol requeue $SLURM_JOB_ID was refused (${said//$'\n'/ }): the job ends here, not requeued. The checkpoint is kept: resume it with $resume" >&2
        exit 75
    fi
    read -r state restarts <<<"$(course_job_state)"
    if [[ -n $restarts ]] && ((restarts <= started)); then
        echo "=== $(date -u '+%T') job $SLURM_JOB_ID ended before Slurm took the requeue (JobState=$state: cancelled meanwhile, or at its time limit): saved, not requeued. To go on later: $resume"
        exit 75
    fi
    exit 0
}

# course_same_request: what this job got, as sbatch options (one per line), for the job that goes
# on in its place elsewhere (lesson 11's group.sh and lesson 12's job.sh move off a node: a
# running job's nodes cannot be changed). Options typed on sbatch's command line are not kept
# with the script, so they are read back from slurmctld's record of this job: CPUs per task,
# GPUs (per node, per job or per task, with their type), memory, time limit, partition, account,
# QOS, features (--constraint), reservation and whole nodes (--exclusive). Nodes and tasks are
# the caller's.
# Memory: a job given --mem-per-gpu runs with MinMemoryNode=0 in its record, which as --mem=0
# would ask for all of each node's memory (and be refused beside a header's --mem-per-gpu), so
# MemPerTres is read first.
course_same_request() {
    local record value
    record=$(scontrol show job -o "$SLURM_JOB_ID") || return 1
    _course_field() { sed -n "s|.* $1=\([^ ]*\).*|\1|p" <<<"$record" | grep -vx '(null)'; }
    echo "--cpus-per-task=$(_course_field CPUs/Task)"
    # GPUs, with their type if given: "gres:gpu:2" (22.05, 24.11), "gres/gpu:2" and per task
    # "gres/gpu=1" (26.05, whose TresPerTask also says "cpu=N" for --cpus-per-task).
    _course_gpus() { [[ $(_course_field "$1") =~ gres[:/]gpu[:=]([^,]+) ]] && echo "${BASH_REMATCH[1]}"; }
    if value=$(_course_gpus TresPerNode); then echo "--gres=gpu:$value"
    elif value=$(_course_gpus TresPerJob); then echo "--gpus=$value"
    elif value=$(_course_gpus TresPerTask); then echo "--gpus-per-task=$value"
    fi
    if value=$(_course_field MemPerTres) && [[ $value =~ gpu:([0-9]+)$ ]]; then
        echo "--mem-per-gpu=${BASH_REMATCH[1]}M"
    elif value=$(_course_field MinMemoryNode); then echo "--mem=$value"
    elif value=$(_course_field MinMemoryCPU); then echo "--mem-per-cpu=$value"
    fi
    echo "--time=$(_course_field TimeLimit)"
    echo "--partition=$SLURM_JOB_PARTITION"
    [[ -n ${SLURM_JOB_ACCOUNT:-} ]] && echo "--account=$SLURM_JOB_ACCOUNT"
    [[ -n ${SLURM_JOB_QOS:-} ]] && echo "--qos=$SLURM_JOB_QOS"
    if value=$(_course_field Features); then echo "--constraint=$value"; fi
    if value=$(_course_field Reservation); then echo "--reservation=$value"; fi
    # Whole nodes: Slurm 26.05 prints Exclusive= (NO, NODE, USER, MCS, TOPO); before it one field
    # said both, OverSubscribe=NO for --exclusive (job_share_string,
    # src/common/slurm_protocol_defs.c).
    if value=$(_course_field Exclusive); then
        case $value in NODE) echo "--exclusive" ;; USER | MCS | TOPO) echo "--exclusive=${value,,}" ;; esac
    else
        value=$(_course_field OverSubscribe) || true
        case $value in NO) echo "--exclusive" ;; USER | MCS) echo "--exclusive=${value,,}" ;; esac
    fi
    return 0
}
