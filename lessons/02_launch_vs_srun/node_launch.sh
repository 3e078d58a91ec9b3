#!/bin/bash
# Start a per-node launcher (torchrun or torch.distributed.launch) on this node of a job.
#
# srun runs this script once per node: a plain srun in a job of one task per node (job.sh),
# else a step of that shape, which names both counts (lesson 00, section 1):
#     srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 bash lessons/02_launch_vs_srun/node_launch.sh torchrun hello.py
# and the launcher it starts spawns one worker process per GPU of the node.
#
# A per-node launcher is not part of SLURM: it has to be told what SLURM already knows.
#   --master_addr     first host of the job step   (every node must name the same host)
#   --master_port     derived from the job id      (same on every node, different per job)
#   --nnodes          number of nodes in the step
#   --node_rank       SLURM_NODEID                 (0 on the first node, 1 on the next, ...)
#   --nproc_per_node  GPUs SLURM gave this node
# common/ works all of these out (`python -m common.env --export`), so the rules live in one place.
set -euo pipefail

if [[ $# -lt 2 || ( $1 != torchrun && $1 != launch ) ]]; then
    echo "usage: node_launch.sh torchrun|launch SCRIPT [ARGS...]" >&2
    echo "       (launch = python -m torch.distributed.launch)" >&2
    exit 2
fi
launcher=$1
shift

# Sets MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK, NPROC_PER_NODE (exits non-zero with a
# message naming the variable if this is not a proper srun task).
exports=$(python -m common.env --export)
eval "$exports"

echo "node_launch: $(hostname) is node $NODE_RANK of $NNODES, starting $NPROC_PER_NODE process(es) with $launcher, master $MASTER_ADDR:$MASTER_PORT"

if [[ $launcher == torchrun ]]; then
    command=(torchrun)
else
    command=(python -m torch.distributed.launch)
fi
exec "${command[@]}" \
    --nnodes "$NNODES" \
    --node_rank "$NODE_RANK" \
    --nproc_per_node "$NPROC_PER_NODE" \
    --master_addr "$MASTER_ADDR" \
    --master_port "$MASTER_PORT" \
    "$@"
