#!/bin/bash
#SBATCH --job-name=l04-torchrun
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=8
#SBATCH --mem=16G
#SBATCH --time=00:10:00
# Lesson 04: torchrun on every node, in an enroot container when the node has enroot.
#     sbatch lessons/04_torchrun_enroot/run_script.sh
# One SLURM task per node (--ntasks-per-node=1): that task is torchrun, and
# torchrun starts one worker per GPU itself. Asking SLURM for a task per GPU as
# well would start every worker NPROC_PER_NODE times over.
#
# run_rdzv.sh and run_standalone.sh run this same script with another
# TORCHRUN_FORM: only torchrun's arguments change (see torchrun.sh).
set -euo pipefail

# sbatch runs a copy of this script, so find the course from where it was submitted.
COURSE_ROOT=${COURSE_ROOT:-$SLURM_SUBMIT_DIR}
[[ -f $COURSE_ROOT/common/job_env.sh ]] || { echo "error: no course at COURSE_ROOT='$COURSE_ROOT': submit from the course root (cd <course> && sbatch lessons/...) or export COURSE_ROOT=<course>" >&2; exit 2; }
# shellcheck source=common/job_env.sh
source "$COURSE_ROOT/common/job_env.sh"
LESSON_DIR=$COURSE_ROOT/lessons/04_torchrun_enroot
# shellcheck source=lessons/04_torchrun_enroot/env.sh
source "$LESSON_DIR/env.sh"

TORCHRUN_FORM=${TORCHRUN_FORM:-static}
# Job id plus start time: a restarted cluster (or a second step of one job) reuses job ids.
LOG_DIR=$LOG_ROOT/$SLURM_JOB_ID-$(date +%Y%m%d-%H%M%S)

# ---- Master address: the first node of the job --------------------------------
# SLURM_JOB_NODELIST is compressed ("node[1-2]"); scontrol expands it to one name
# per line, in the order SLURM numbers the nodes. Node 0 runs rank 0 and hosts
# the rendezvous store, so every node connects to the first name.
# A host name is enough: torch resolves it. (Grepping /etc/hosts for an IP breaks
# where names come from DNS, and "node1" also matches "node10".)
mapfile -t JOB_NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
MASTER_ADDR=${JOB_NODES[0]}
# A port derived from the job id, so two jobs sharing a node do not collide.
MASTER_PORT=$(python -c 'import sys; from common.env import master_port_for_job
print(master_port_for_job(sys.argv[1]))' "$SLURM_JOB_ID")
# The elastic form names the rendezvous; the job id is unique and the same on every node.
RDZV_ID=lesson04-$SLURM_JOB_ID
JOB_NODE_LIST=${JOB_NODES[*]}
export TORCHRUN_FORM LOG_DIR MASTER_ADDR MASTER_PORT RDZV_ID JOB_NODE_LIST LESSON_DIR

echo "job $SLURM_JOB_ID: form $TORCHRUN_FORM, $NNODES nodes x $NPROC_PER_NODE processes" \
    "= world size $WORLD_SIZE, nodes: $JOB_NODE_LIST, master $MASTER_ADDR:$MASTER_PORT"

# ---- Functions that run on every node (srun below ships them there) ----------

# run_or_print CMD...: run CMD, or with ENROOT_DRY_RUN=1 only print it (shell-quoted).
run_or_print() {
    if [[ $ENROOT_DRY_RUN == 1 ]]; then
        echo "$SLURMD_NODENAME: dry-run: $(printf '%q ' "$@")"
    else
        "$@"
    fi
}

# start_on_this_node: take this node's rank from SLURM on the host (where the SLURM
# variables exist), then run torchrun.sh inside the container if enroot is
# installed here, or on the host if not.
start_on_this_node() {
    # The node rank torchrun's static form needs is this node's position in the
    # job's node list. SLURM hands it to every task as SLURM_NODEID, and the node's
    # SLURM name as SLURMD_NODENAME: no lookup, and right where a node's SLURM name
    # is not its `hostname -s` (FQDNs, aliases on cloud clusters).
    local host=$SLURMD_NODENAME
    NODE_RANK=$SLURM_NODEID
    export NODE_RANK
    echo "$host: node rank $NODE_RANK (SLURM_NODEID)"

    if ! command -v enroot >/dev/null; then
        echo "$host: enroot is not installed on this node; running torchrun.sh on the host"
        bash "$LESSON_DIR/torchrun.sh" "$TORCHRUN_FORM"
        return
    fi

    # Create the container once: later jobs find it in the cache by name.
    # ENROOT_DATA_PATH may be shared by all nodes (it defaults to a directory
    # in $HOME), so the check and the creation happen under a lock.
    mkdir -p "$CONTAINER_DATA_PATH"
    (
        flock 9
        if [[ -d $CONTAINER_CACHE_DIR ]]; then
            echo "$host: container $CONTAINER_NAME already created in $CONTAINER_CACHE_DIR"
        else
            run_or_print enroot create --name "$CONTAINER_NAME" "$CONTAINER_IMAGE"
        fi
    ) 9>"$CONTAINER_DATA_PATH/.$CONTAINER_NAME.lock"

    # enroot does not pass the host's environment into the container: name
    # every variable torchrun.sh and train.py need (--env NAME takes the host's
    # value). PYTHONPATH is set to the course only: the host's venv is not used
    # inside, the container brings its own Python and torch.
    local name names envs=(--env "PYTHONPATH=$COURSE_ROOT")
    names=(COURSE_ROOT PYTHONUNBUFFERED TORCHRUN_FORM NNODES NPROC_PER_NODE NODE_RANK
        MASTER_ADDR MASTER_PORT RDZV_ID RDZV_TIMEOUT LOG_DIR COURSE_DIST_TIMEOUT
        SLURM_JOB_ID SLURM_NODEID SLURMD_NODENAME SLURM_CPUS_PER_TASK SLURM_GPUS_ON_NODE
        CUDA_VISIBLE_DEVICES)
    mapfile -t -O "${#names[@]}" names < <(compgen -e NCCL_ || true)
    for name in "${names[@]}"; do
        if [[ -n ${!name+set} ]]; then
            envs+=(--env "$name")
        fi
    done
    run_or_print enroot start --mount "$CONTAINER_MOUNT" "${envs[@]}" "$CONTAINER_NAME" \
        bash "$LESSON_DIR/torchrun.sh" "$TORCHRUN_FORM"
}

# ---- Import the image once per job, on this (the first) node ----------------
# The .sqsh file is on a shared filesystem, so one import serves every node.
# (Compute nodes without internet access: run the import on a login node.)
if command -v enroot >/dev/null; then
    if [[ -f $CONTAINER_IMAGE ]]; then
        echo "image $CONTAINER_IMAGE already imported"
    else
        run_or_print mkdir -p "$(dirname "$CONTAINER_IMAGE")"
        run_or_print enroot import --output "$CONTAINER_IMAGE" "$CONTAINER_URI"
    fi
fi

# ---- One torchrun per node --------------------------------------------------
# srun starts a fresh bash on each node; the function definitions travel in its
# command line. --label prefixes every output line with the task number (= node
# index here), --kill-on-bad-exit stops the other nodes when one fails.
# --cpus-per-task again: Slurm 22.05-23.02's srun does not inherit it from the job.
srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" --label --kill-on-bad-exit=1 \
    bash -c "set -euo pipefail; $(declare -f run_or_print start_on_this_node); start_on_this_node"

if [[ $ENROOT_DRY_RUN != 1 ]]; then
    echo "torchrun's per-worker logs:"
    (cd "$LOG_DIR" && find . -name '*.log' | sort)
fi
