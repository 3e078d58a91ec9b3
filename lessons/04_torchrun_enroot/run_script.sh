#!/bin/bash
#SBATCH --job-name=l04-torchrun
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:2
#SBATCH --cpus-per-task=8
#SBATCH --mem=16G
#SBATCH --time=00:10:00
# Lesson 04: torchrun on every node, in an enroot container when the node has enroot
# (or, with COURSE_CONTAINER_RUNTIME=apptainer, an Apptainer one: run_apptainer.sh; with
# COURSE_CONTAINER_RUNTIME=charliecloud, a Charliecloud one: run_charliecloud.sh).
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
# torch may live in the container image only: the host needs python3 (common.env), and torch
# only on a node that falls back to the host (checked there).
export COURSE_TORCH_IN_CONTAINER=${COURSE_TORCH_IN_CONTAINER:-1}
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
MASTER_PORT=$(python3 -c 'import sys; from common.env import master_port_for_job
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

# container_env_names: the variables a container must be handed by name (enroot clears the
# environment: clearenv() in load_environment_fd, enroot's bin/common.h; `apptainer exec
# --cleanenv` keeps only TERM and the proxies: SetContainerEnv, internal/pkg/util/env/create.go).
# The fixed list torchrun.sh and train.py read; every variable site.sh set (COURSE_SITE_VARS,
# from job_env.sh) except the host's search paths (*PATH, LD_*) and module/conda bookkeeping,
# which would point into the host's file system; and the families the course, torch, NCCL and
# the libfabric/UCX plugins (aws-ofi-nccl on Slingshot or EFA) are tuned with.
container_env_names() {
    local name
    local -A seen=()
    local -a site
    read -ra site <<<"${COURSE_SITE_VARS:-}"
    for name in COURSE_ROOT PYTHONUNBUFFERED TORCHRUN_FORM NNODES NPROC_PER_NODE NODE_RANK \
        MASTER_ADDR MASTER_PORT RDZV_ID RDZV_TIMEOUT LOG_DIR \
        SLURM_JOB_ID SLURM_NODEID SLURMD_NODENAME SLURM_CPUS_PER_TASK SLURM_GPUS_ON_NODE \
        CUDA_VISIBLE_DEVICES OMP_NUM_THREADS MNIST_DIR "${site[@]}" \
        $(compgen -e | grep -E '^(COURSE_|GLOO_|TORCH_|NCCL_|FI_|UCX_)' || true); do
        case $name in
        *PATH | LD_* | PYTHONHOME | VIRTUAL_ENV | CONDA_* | _CE_* | HOME | PWD | OLDPWD | SHLVL | _ | \
            LOADEDMODULES | _LMFILES_ | MODULESHOME | MODULES_* | LMOD* | __LMOD* | _ModuleTable* | BASH_FUNC_*)
            continue ;;
        esac
        [[ -n ${!name+set} && -z ${seen[$name]+x} ]] || continue
        seen[$name]=1
        echo "$name"
    done
}

# ensure_enroot_container HOST: create the container from CONTAINER_IMAGE unless this lesson
# created it from that very image before. A marker beside it records the image (path, size,
# time): "creating ..." while `enroot create` runs, the image alone once it has finished.
# (`enroot create` leaves a half-unpacked directory behind when it fails: runtime::create in
# enroot's src/runtime.sh.) Our own container from another image, or half created, is made
# again (--force); a directory with no marker is someone else's, and is left alone.
ensure_enroot_container() {
    local host=$1 marker=$CONTAINER_DATA_PATH/.$CONTAINER_NAME.image image_id recorded=""
    image_id="$CONTAINER_IMAGE $(stat -c '%s %Y' "$CONTAINER_IMAGE" 2>/dev/null || echo not-imported)"
    [[ -f $marker ]] && recorded=$(<"$marker")
    if [[ -d $CONTAINER_CACHE_DIR && $recorded == "$image_id" ]]; then
        echo "$host: container $CONTAINER_NAME already created in $CONTAINER_CACHE_DIR"
        return
    fi
    local force=()
    if [[ -d $CONTAINER_CACHE_DIR ]]; then
        if [[ -z $recorded ]]; then
            echo "error: $host: $CONTAINER_CACHE_DIR exists but this lesson did not create it (no $marker): remove it (enroot remove $CONTAINER_NAME) or choose another COURSE_CONTAINER_NAME, then submit again." >&2
            # srun --kill-on-bad-exit ends the step as soon as this task exits, and can drop
            # the task's last output with it (seen once in the tests): give the line a second.
            sleep 1
            return 2
        fi
        echo "$host: container $CONTAINER_NAME in $CONTAINER_CACHE_DIR is ${recorded/#creating /half created from } (marker $marker), not $image_id: creating it again"
        force=(--force)
    fi
    [[ $ENROOT_DRY_RUN == 1 ]] || echo "creating $image_id" >"$marker"
    run_or_print enroot create "${force[@]}" --name "$CONTAINER_NAME" "$CONTAINER_IMAGE"
    [[ $ENROOT_DRY_RUN == 1 ]] || echo "$image_id" >"$marker"
}

# start_charliecloud HOST NAME...: torchrun.sh inside `ch-run` with the image directory.
# ch-run passes the host's whole environment in by default (ch-run(1), "Environment variables"):
# the host venv's PATH and VIRTUAL_ENV would then pick the host's Python inside. So
# --unset-env='*' clears it, and --set-env=FILE hands in the same names as for enroot, as
# NAME='value' lines (ch-run strips the quotes; --env-no-expand keeps a '$' in a value as it is).
# ch-run mounts a host folder only onto a folder the image has (it is read-only at run time):
# the course and the log folder are reached through their top folder (/work, /home, ...),
# which the image keeps empty for that; /tmp is the host's /tmp already.
start_charliecloud() {
    local host=$1 name top path tops=" " env_file=$LOG_DIR/$1.charliecloud.env
    shift
    local -a binds=()
    for name in COURSE_ROOT LOG_DIR; do
        path=${!name}
        top=${path#/}
        top=/${top%%/*}
        [[ $top == /tmp || $tops == *" $top "* ]] && continue
        if [[ ! -d $CHARLIECLOUD_IMAGE$top || -n $(ls -A "$CHARLIECLOUD_IMAGE$top") ]]; then
            echo "error: $host: $name='$path' is under $top, and the Charliecloud image $CHARLIECLOUD_IMAGE has no empty $top to bind it onto (ch-run mounts host folders only onto folders the image has): put it under /home, /work, /scratch, /project, /data or /tmp, or add $top to MOUNT_POINTS in charliecloud_image.sh and build the image again." >&2
            return 2
        fi
        tops+="$top "
        binds+=(-b "$top:$top")
    done
    mkdir -p "$LOG_DIR"
    {
        echo "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        echo "PYTHONPATH='$COURSE_ROOT'"
        for name in "$@"; do
            [[ ${!name} == *$'\n'* ]] || echo "$name='${!name}'" # one line per variable
        done
    } >"$env_file"
    echo "$host: ch-run environment ($env_file): PATH PYTHONPATH $*"
    # ch-run needs USER (it stops with "$USER not set"); without TMPDIR it binds the host's
    # /tmp at /tmp.
    export USER=${USER:-$(id -un)}
    local run=(env -u TMPDIR ch-run --unset-env='*' --env-no-expand --set-env="$env_file"
        "${binds[@]}" -c "$COURSE_ROOT" "$CHARLIECLOUD_IMAGE" --)
    local found
    found=$(python3 -c 'import importlib.util as u; s = u.find_spec("torch"); print(s.origin if s else "none")' 2>/dev/null || echo none)
    echo "$host: host: $(command -v python3), torch: $found"
    run_or_print "${run[@]}" python3 -c 'import sys, torch
print(f"{sys.argv[1]}: image: {sys.executable}, torch {torch.__version__}: {torch.__file__}")' "$host"
    run_or_print "${run[@]}" bash "$LESSON_DIR/torchrun.sh" "$TORCHRUN_FORM"
}

# start_on_this_node: take this node's rank from SLURM on the host (where the SLURM
# variables exist), then run torchrun.sh inside the container if the container runtime
# (enroot, apptainer or ch-run) is installed here, or on the host if not.
start_on_this_node() {
    # The node rank torchrun's static form needs is this node's position in the
    # job's node list. SLURM hands it to every task as SLURM_NODEID, and the node's
    # SLURM name as SLURMD_NODENAME: no lookup, and right where a node's SLURM name
    # is not its `hostname -s` (FQDNs, aliases on cloud clusters).
    local host=$SLURMD_NODENAME
    NODE_RANK=$SLURM_NODEID
    export NODE_RANK
    echo "$host: node rank $NODE_RANK (SLURM_NODEID)"

    if ! command -v "$CONTAINER_COMMAND" >/dev/null; then
        echo "$host: $CONTAINER_COMMAND is not installed on this node; running torchrun.sh on the host"
        course_require_host_torch "$host: torchrun.sh on the host"
        bash "$LESSON_DIR/torchrun.sh" "$TORCHRUN_FORM"
        return
    fi

    # The container starts with none of the host's environment: name every variable it needs
    # (enroot --env NAME takes the host's value; Apptainer reads NAME='value' lines from
    # --env-file, since its --env splits values at commas). PYTHONPATH is set to the course
    # only: the host's venv is not used inside, the image brings its own Python and torch.
    local name names
    mapfile -t names < <(container_env_names)

    if [[ $CONTAINER_RUNTIME == apptainer ]]; then
        # --cleanenv: the host's venv, modules and conda stay out (without it Apptainer passes
        # every host variable but PATH, HOME and LD_LIBRARY_PATH); --nv binds the host's NVIDIA
        # driver and devices where the node has them; --bind mounts the course at its own
        # path; --pwd starts in it.
        local env_file=$LOG_DIR/$host.apptainer.env nv=()
        [[ -e /dev/nvidiactl ]] && nv=(--nv)
        mkdir -p "$LOG_DIR"
        {
            echo "PYTHONPATH='$COURSE_ROOT'"
            for name in "${names[@]}"; do
                printf "%s='%s'\n" "$name" "${!name//\'/\'\\\'\'}"
            done
        } >"$env_file"
        echo "$host: apptainer environment ($env_file): PYTHONPATH ${names[*]}"
        run_or_print apptainer exec --cleanenv --env-file "$env_file" "${nv[@]}" \
            --bind "$COURSE_ROOT:$COURSE_ROOT" --pwd "$COURSE_ROOT" "$APPTAINER_IMAGE" \
            bash "$LESSON_DIR/torchrun.sh" "$TORCHRUN_FORM"
        return
    fi

    if [[ $CONTAINER_RUNTIME == charliecloud ]]; then
        start_charliecloud "$host" "${names[@]}"
        return
    fi

    # Create the container once: later jobs find it in the cache by name.
    # ENROOT_DATA_PATH may be shared by all nodes (it defaults to a directory
    # in $HOME), so the check and the creation happen under a lock.
    mkdir -p "$CONTAINER_DATA_PATH"
    (
        flock 9
        ensure_enroot_container "$host"
    ) 9>"$CONTAINER_DATA_PATH/.$CONTAINER_NAME.lock"

    local envs=(--env "PYTHONPATH=$COURSE_ROOT")
    for name in "${names[@]}"; do
        envs+=(--env "$name")
    done
    run_or_print enroot start --mount "$CONTAINER_MOUNT" "${envs[@]}" "$CONTAINER_NAME" \
        bash "$LESSON_DIR/torchrun.sh" "$TORCHRUN_FORM"
}

# ---- Import the image once per job, on this (the first) node ----------------
# The .sqsh file is on a shared filesystem, so one import serves every node.
# (Compute nodes without internet access: run the import on a login node.)
# Apptainer's image is one .sif file, built beforehand (see the README).
if [[ $CONTAINER_RUNTIME == enroot ]] && command -v enroot >/dev/null; then
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
    bash -c "set -euo pipefail; $(declare -f run_or_print course_require_host_torch container_env_names ensure_enroot_container start_charliecloud start_on_this_node); start_on_this_node"

if [[ $ENROOT_DRY_RUN != 1 ]]; then
    echo "torchrun's per-worker logs:"
    (cd "$LOG_DIR" 2>/dev/null && find . -name '*.log' | sort) || echo "(none in $LOG_DIR)"
fi
