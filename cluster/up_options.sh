#!/bin/bash
# shellcheck disable=SC2034  # the settings are read by cluster/up.sh and its other pieces
# cluster/up.sh's command line: the defaults, --help, and the flags that change them (sourced by
# up.sh, not run).

NODES=2
GPUS=2
CPUS=64
MEM=256000
WAIT_S=${COURSE_CLUSTER_WAIT_S:-60}
CHECK_ONLY=0
# The site the cluster plays (--site): strict (per-job /tmp, sbatch's own --export=ALL default),
# export-none (sbatch defaults to --export=NONE), shared-tmp (no per-job /tmp), rank0-elsewhere
# (topology/tree, the upper half of the nodes on the first switch), pyxis (every srun task gets
# RANK and LOCAL_RANK as pyxis sets them for an NGC PyTorch image), pyxis-hook (and WORLD_SIZE,
# MASTER_ADDR, MASTER_PORT as enroot's 50-slurm-pytorch.sh hook adds them), no-requeue
# (JobRequeue=0: only a job submitted with --requeue goes back to the queue). cluster/README.md.
SITE=${COURSE_CLUSTER_SITE:-strict}
SITES="strict export-none shared-tmp rank0-elsewhere pyxis pyxis-hook no-requeue"
# The version: --slurm, else COURSE_SLURM_VERSION (a test run or a shell that works with one
# version throughout), else the default.
SLURM_VERSION=${COURSE_SLURM_VERSION:-$SLURM_DEFAULT}

usage() {
    # shellcheck disable=SC2153  # SLURM_VERSIONS: cluster/lib.sh's, sourced by up.sh first
    cat <<EOF
Usage: bash cluster/up.sh [--slurm VERSION] [--site SITE] [--nodes N] [--gpus-per-node G] [--cpus-per-node C] [--mem-per-node MB]

Start the local SLURM cluster (nodes node1..nodeN) and return once every node is idle.
Running it again with the same shape changes nothing; another shape restarts the cluster.

  --slurm VERSION      Slurm version: ${SLURM_VERSIONS// /, } (default \$COURSE_SLURM_VERSION, else
                       $SLURM_DEFAULT, this machine's own packages; another runs from a Debian root
                       made once, see cluster/README.md)
  --site SITE          the site it plays: strict (default: a private /tmp per job), export-none
                       (sbatch defaults to --export=NONE), shared-tmp (one /tmp for every job),
                       rank0-elsewhere (a topology plugin: from Slurm 26.05 task 0 of a block
                       distribution runs on the job's last node), pyxis (each srun task gets
                       RANK and LOCAL_RANK as pyxis sets them), pyxis-hook (also WORLD_SIZE,
                       MASTER_ADDR, MASTER_PORT, as enroot's 50-slurm-pytorch.sh hook),
                       no-requeue (JobRequeue=0: only a job that asks, --requeue, is requeued);
                       \$COURSE_CLUSTER_SITE sets the default (cluster/README.md, "Site profiles")
  --nodes N            number of nodes (default $NODES, at most 200)
  --gpus-per-node G    "GPUs" per node, bookkeeping only (default $GPUS, at most 16)
  --cpus-per-node C    CPUs each node declares (default $CPUS)
  --mem-per-node MB    memory each node declares, in MB (default $MEM)
  --check              change nothing: exit 0 if the cluster is up in this shape, else 1
  -h, --help           show this help

Logs: $LOG_DIR   Stop: bash cluster/down.sh
EOF
}

# set_int FLAG VALUE MIN MAX: validate an integer flag value.
set_int() {
    local flag=$1 value=$2 min=$3 max=$4
    [[ $value =~ ^[0-9]+$ ]] || die "$flag needs a whole number, got '$value' (see --help)"
    value=$((10#$value))
    ((value >= min && value <= max)) || die "$flag must be between $min and $max, got $value"
    REPLY=$value
}

# parse_args ARG...: set the settings above from the command line, or stop with one line that
# names the flag (--help prints the usage and exits 0).
parse_args() {
    local arg flag value
    slurm_suite "$SLURM_VERSION" >/dev/null ||
        die "COURSE_SLURM_VERSION must be one of ${SLURM_VERSIONS// /, }, got '$SLURM_VERSION'"
    while [[ $# -gt 0 ]]; do
        arg=$1
        case $arg in
        -h | --help)
            usage
            exit 0
            ;;
        --check)
            CHECK_ONLY=1
            shift
            continue
            ;;
        --slurm=* | --site=* | --nodes=* | --gpus-per-node=* | --cpus-per-node=* | --mem-per-node=*)
            flag=${arg%%=*}
            value=${arg#*=}
            shift
            ;;
        --slurm | --site | --nodes | --gpus-per-node | --cpus-per-node | --mem-per-node)
            flag=$arg
            [[ $# -ge 2 ]] || die "$flag needs a value (see --help)"
            value=$2
            shift 2
            ;;
        *)
            die "unknown option '$arg' (known: --slurm --site --nodes --gpus-per-node --cpus-per-node --mem-per-node --check --help)"
            ;;
        esac
        case $flag in
        --slurm)
            slurm_suite "$value" >/dev/null ||
                die "--slurm must be one of ${SLURM_VERSIONS// /, }, got '$value' (see --help)"
            SLURM_VERSION=$value
            ;;
        --site) SITE=$value ;;
        --nodes) set_int "$flag" "$value" 1 200 && NODES=$REPLY ;;
        --gpus-per-node) set_int "$flag" "$value" 0 16 && GPUS=$REPLY ;;
        --cpus-per-node) set_int "$flag" "$value" 1 4096 && CPUS=$REPLY ;;
        --mem-per-node) set_int "$flag" "$value" 1 100000000 && MEM=$REPLY ;;
        esac
    done
    [[ " $SITES " == *" $SITE "* ]] || die "--site (or COURSE_CLUSTER_SITE) must be one of ${SITES// /, }, got '$SITE' (see --help)"
}
