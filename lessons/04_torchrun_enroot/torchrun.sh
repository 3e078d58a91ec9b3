#!/bin/bash
# torchrun.sh FORM: start torchrun on this node; torchrun then starts NPROC_PER_NODE
# copies of train.py and tells each its rank.
#
# The job script starts this once per node (through srun), on the host or inside
# the enroot container. Everything it needs arrives in the environment, worked
# out by the job script beforehand: it runs no SLURM command itself, because
# inside a container `scontrol` and friends are usually not installed.
#
# FORM is one of
#   static            every node is told the node count, its node rank and the master
#   rdzv              nodes meet at a rendezvous endpoint and get their ranks there
#   standalone        the misuse: --standalone on a multi-node job (see README)
#   standalone-1node  the other misuse: --standalone --nnodes 1 on every node
set -euo pipefail

form=${1:-${TORCHRUN_FORM:-static}}

need() {
    local name
    for name in "$@"; do
        if [[ -z ${!name:-} ]]; then
            echo "torchrun.sh: $name is not set. Submit a job script of this lesson" \
                "(e.g. sbatch lessons/04_torchrun_enroot/run_script.sh), which sets it." >&2
            exit 2
        fi
    done
}
need COURSE_ROOT NNODES NPROC_PER_NODE MASTER_ADDR MASTER_PORT RDZV_TIMEOUT LOG_DIR

# The node's SLURM name (in a pyxis or enroot container too, where the job script passes it).
host=${SLURMD_NODENAME:-$(hostname -s)}
train=$COURSE_ROOT/lessons/04_torchrun_enroot/train.py

# Logs: --tee 3 copies every worker's stdout and stderr into
# $LOG_DIR/<host>/<run id>/attempt_<n>/<local rank>/{stdout,stderr}.log and still
# prints them, prefixed with [default<local rank>]. The job script's `srun --label`
# adds the node's task number in front, so "1: [default0]:" is local rank 0 on the
# second node. (--local-ranks-filter 0 would keep only local rank 0 on the console
# of a big job; the files still get every rank.)
logs=(--log-dir "$LOG_DIR/$host" --tee 3)

case $form in
static)
    # Under pyxis (srun --container-image) every SLURM variable is in the task's environment.
    NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-}}
    need NODE_RANK
    # Static rendezvous: the node count, this node's rank and the master address
    # are fixed up front. Node 0 hosts the store on MASTER_ADDR:MASTER_PORT; the
    # others connect to it. timeout bounds the wait for missing nodes.
    cmd=(torchrun
        --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
        --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
        --rdzv-conf "timeout=$RDZV_TIMEOUT")
    ;;
rdzv)
    need RDZV_ID
    # Elastic (c10d) rendezvous: every node names the same endpoint and run id;
    # the agent on MASTER_ADDR hosts the store. Once all have joined, torch gives
    # out the node ranks in the sorted order of the nodes' host names (not by
    # arrival, not by SLURM_NODEID: node10 sorts before node2), so nobody has to
    # compute a node rank. join_timeout bounds the wait for the missing ones.
    cmd=(torchrun
        --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
        --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID"
        --rdzv-conf "join_timeout=$RDZV_TIMEOUT")
    ;;
standalone)
    need NODE_RANK
    # The misuse, as it is often copied: --standalone plus the multi-node flags.
    # --standalone replaces the rendezvous with a private one on localhost at a
    # free port, on every node; --master-addr/--master-port are then ignored, and
    # torchrun warns that --node-rank is only used for static rendezvous. Each node
    # waits there for NNODES nodes that can never arrive.
    cmd=(torchrun --standalone
        --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
        --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
        --rdzv-conf "join_timeout=$RDZV_TIMEOUT")
    ;;
standalone-1node)
    # The "fix" that makes the error go away: every node is its own one-node job.
    cmd=(torchrun --standalone --nnodes 1 --nproc-per-node "$NPROC_PER_NODE")
    ;;
*)
    echo "torchrun.sh: unknown form '$form' (use static, rdzv, standalone or standalone-1node)" >&2
    exit 2
    ;;
esac

cmd+=("${logs[@]}" "$train")
echo "$host: ${cmd[*]}"
exec "${cmd[@]}"
