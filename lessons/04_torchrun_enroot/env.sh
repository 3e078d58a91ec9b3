# shellcheck shell=bash
# Lesson 04 settings, sourced by the job scripts (run_script.sh, run_rdzv.sh, run_standalone.sh,
# run_apptainer.sh, run_charliecloud.sh).
# Edit them here, or override the COURSE_* / ENROOT_* / TORCHRUN_* ones at submit time, e.g.
#     COURSE_CONTAINER_NAME=my-torch sbatch lessons/04_torchrun_enroot/run_script.sh

# ---- Job size -------------------------------------------------------------
# N nodes x M processes per node: WORLD_SIZE = N * M, ranks 0..WORLD_SIZE-1,
# local ranks 0..M-1 on every node.
# Read them from the allocation instead of typing them a second time: the
# #SBATCH lines are the one place the size is written, so the two cannot
# disagree. One process per GPU; where SLURM reports no GPUs, 2 per node.
NNODES=${SLURM_JOB_NUM_NODES:-2}
NPROC_PER_NODE=${SLURM_GPUS_ON_NODE:-2}
WORLD_SIZE=$((NNODES * NPROC_PER_NODE))

# How long torchrun waits for all nodes to join before giving up (seconds).
# torchrun's own default is 600 s (static and c10d forms alike): a node that never
# arrives would hold the whole allocation for ten minutes before anything is printed.
RDZV_TIMEOUT=${TORCHRUN_RDZV_TIMEOUT:-60}

# torchrun writes one stdout/stderr file per worker under this directory,
# one sub-directory per node, so a failure can be traced to its node.
LOG_ROOT=${TORCHRUN_LOG_ROOT:-$COURSE_ROOT/runs/lesson04-logs}

# ---- Container runtime ----------------------------------------------------
# enroot (the default), apptainer (run_apptainer.sh sets it) or charliecloud
# (run_charliecloud.sh). A node without its command runs torchrun.sh on the host instead.
CONTAINER_RUNTIME=${COURSE_CONTAINER_RUNTIME:-enroot}
case $CONTAINER_RUNTIME in
enroot | apptainer) CONTAINER_COMMAND=$CONTAINER_RUNTIME ;;
charliecloud) CONTAINER_COMMAND=ch-run ;;
*)
    echo "error: COURSE_CONTAINER_RUNTIME='$CONTAINER_RUNTIME' is not a runtime this lesson knows: use enroot, apptainer or charliecloud (or unset it)." >&2
    exit 2
    ;;
esac
# Charliecloud runs an image directory, built once by charliecloud_image.sh (make container).
CHARLIECLOUD_IMAGE=${COURSE_CHARLIECLOUD_IMAGE:-/var/cache/course-charliecloud/bookworm-torch-2.14.1}
# Apptainer runs a .sif file, built once from the same image (on a login node):
#     apptainer pull $HOME/apptainer-images/pytorch-25.01-py3.sif docker://nvcr.io/nvidia/pytorch:25.01-py3
APPTAINER_IMAGE=${COURSE_APPTAINER_IMAGE:-$HOME/apptainer-images/pytorch-25.01-py3.sif}

# ---- Container (enroot) ---------------------------------------------------
# Where the image comes from, and the squashfs file `enroot import` turns it
# into. The file lives on a shared filesystem so it is imported only once.
# By default it, enroot's layer cache (ENROOT_CACHE_PATH, ~/.cache/enroot) and
# the unpacked container (ENROOT_DATA_PATH, ~/.local/share/enroot) are all in
# $HOME: the image three times over, more than many home quotas hold. Point
# the three at project or scratch space (README.md, "Three copies in your home").
CONTAINER_URI=${COURSE_CONTAINER_URI:-docker://nvcr.io#nvidia/pytorch:25.01-py3}
CONTAINER_IMAGE=${COURSE_CONTAINER_IMAGE:-$HOME/enroot-images/nvidia+pytorch+25.01-py3.sqsh}
# `enroot create --name` unpacks the image into $ENROOT_DATA_PATH/<name>; later
# jobs find it there and skip the (slow) unpacking.
CONTAINER_NAME=${COURSE_CONTAINER_NAME:-course-torch}
# The course directory is mounted at the same path inside the container, so
# every path in these scripts means the same thing on both sides.
CONTAINER_MOUNT=$COURSE_ROOT:$COURSE_ROOT

# enroot_data_path: the directory enroot unpacks containers into, found the way
# enroot itself finds it: the ENROOT_DATA_PATH environment variable wins, then
# the ENROOT_DATA_PATH line of enroot.conf (expanded with `eval echo`, exactly
# as enroot expands it, so `$(id -u)` and `# comments` behave the same), then
# enroot's default ${XDG_DATA_HOME:-~/.local/share}/enroot.
# Sites often point it at node-local disk (e.g. /enroot/$UID/data), so never
# hard-code it: ask the configuration.
ENROOT_CONF_FILE=${ENROOT_CONF_FILE:-/etc/enroot/enroot.conf}
enroot_data_path() {
    if [[ -n ${ENROOT_DATA_PATH:-} ]]; then
        echo "$ENROOT_DATA_PATH"
        return
    fi
    local key value line=""
    if [[ -r $ENROOT_CONF_FILE ]]; then
        line=$(grep -E '^[[:space:]]*ENROOT_DATA_PATH[[:space:]=]' "$ENROOT_CONF_FILE" | tail -n 1 || true)
    fi
    if [[ -n $line ]]; then
        IFS=$' \t=' read -r key value <<<"$line"
        : "$key"
        eval echo "$value"
    else
        echo "${XDG_DATA_HOME:-$HOME/.local/share}/enroot"
    fi
}
CONTAINER_DATA_PATH=$(enroot_data_path)
CONTAINER_CACHE_DIR=$CONTAINER_DATA_PATH/$CONTAINER_NAME

# Set ENROOT_DRY_RUN=1 to print the enroot commands instead of running them.
ENROOT_DRY_RUN=${ENROOT_DRY_RUN:-0}

export NNODES NPROC_PER_NODE WORLD_SIZE RDZV_TIMEOUT LOG_ROOT
export CONTAINER_URI CONTAINER_IMAGE CONTAINER_NAME CONTAINER_MOUNT
export CONTAINER_DATA_PATH CONTAINER_CACHE_DIR ENROOT_DRY_RUN CONTAINER_RUNTIME APPTAINER_IMAGE
export CONTAINER_COMMAND CHARLIECLOUD_IMAGE
