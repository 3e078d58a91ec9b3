"""Hello all_reduce by hand: read SLURM's variables, join the process group, add up the ranks.

The one script of the course that does not ask common/: everything a distributed program needs
to know is worked out here, in plain sight, so that it can be carried into any project.
Run by `by_hand.sh`, one SLURM task per GPU (srun starts every process):

    srun python lessons/01_hello_allreduce/by_hand.py --init env
    srun python lessons/01_hello_allreduce/by_hand.py --init tcp
    srun python lessons/01_hello_allreduce/by_hand.py --init file --dist-file <shared path>

The job script exports MASTER_ADDR (the job's first node) and MASTER_PORT before srun.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist


def slurm_int(name: str) -> int:
    """An integer that srun gives every task; a clear stop when the script is not under srun."""
    value = os.environ.get(name)
    if value is None:
        raise SystemExit(f"by_hand.py: {name} is not set: start this script with srun inside a "
                         f"job (sbatch lessons/01_hello_allreduce/by_hand.sh)")
    return int(value)


def check_srun_step() -> None:
    """Stop in the batch script itself, which looks like rank 0 and would wait for the others.

    sbatch gives the batch script the job's SLURM_NTASKS and SLURM_NNODES, and SLURM_PROCID,
    SLURM_LOCALID and SLURM_NODEID all 0: the formula below agrees, and the script would join as
    rank 0 of 4 and wait for three ranks nobody started. What tells it apart is the step id:
    srun numbers its steps 0, 1, 2, ... and gives every task SLURM_STEP_ID; the batch script has
    none up to Slurm 25.11, and from 26.05 the batch step's own id, SLURM_STEP_ID=-5 (salloc's
    interactive shell likewise: none, or -6).
    """
    step = os.environ.get("SLURM_STEP_ID")
    if step is None or not step.isdigit():
        raise SystemExit(f"by_hand.py: SLURM_STEP_ID={step or '<not set>'}: not a task of an srun "
                         f"step (the batch script itself?): start this script with srun")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init", choices=["env", "tcp", "file"], default="env",
                        help="how the processes find each other (default env)")
    parser.add_argument("--dist-file", metavar="PATH",
                        help="for --init file: a path on a filesystem every node mounts; it must "
                             "not exist yet")
    parser.add_argument("--timeout", type=float, default=60, metavar="SECONDS",
                        help="bound on the rendezvous and on every collective (default 60)")
    args = parser.parse_args(argv)
    if args.init == "file" and not args.dist_file:
        parser.error("--init file needs --dist-file PATH (on a filesystem every node mounts)")

    # 1. Who am I? We number the processes node by node, as torchrun does, from the node's
    #    index in the job's host list and the task's index on its node. Not SLURM_PROCID: srun
    #    numbers tasks in the order it placed them (--distribution cyclic, arbitrary, or a
    #    topology plugin's order from Slurm 26.05), and task 0 can then run on another node
    #    than the first, where by_hand.sh points MASTER_ADDR. Rank 0 is on that node here.
    node = slurm_int("SLURM_NODEID")  # index of this node in the step: 0, 1, ...
    check_srun_step()  # sbatch sets these variables in the batch script too
    local = slurm_int("SLURM_LOCALID")  # index of this task on its node: 0 .. per node - 1
    world = slurm_int("SLURM_NTASKS")  # tasks in the step = processes in the world
    nodes = slurm_int("SLURM_NNODES")
    per_node = world // nodes  # one task per GPU: GPUs per node
    if per_node * nodes != world:
        # The formula needs the same number of tasks on every node (--ntasks-per-node).
        raise SystemExit(f"by_hand.py: SLURM_NTASKS={world} over SLURM_NNODES={nodes} nodes is "
                         f"not the same number of tasks on every node; ask for --ntasks-per-node")
    rank = node * per_node + local

    # 2. Where do we meet? Rank 0's node, on a port every task computes alike.
    master_addr = os.environ.get("MASTER_ADDR")
    master_port = os.environ.get("MASTER_PORT")
    if not master_addr or not master_port:
        raise SystemExit("by_hand.py: MASTER_ADDR and MASTER_PORT must be set: the job script "
                         "exports them before srun (see by_hand.sh)")
    init_method = {
        # env://: torch reads MASTER_ADDR and MASTER_PORT from the environment itself.
        "env": "env://",
        # tcp://: the same rendezvous, with the address written into the URL.
        "tcp": f"tcp://{master_addr}:{master_port}",
        # file://: no network rendezvous at all; the processes meet in a file that every node
        # sees. It must not exist before the job starts (a stale file from an earlier run would
        # make this world meet the old one's entries).
        "file": f"file://{os.path.abspath(args.dist_file or '')}",
    }[args.init]

    # 3. Which backend, which device? NCCL between GPUs, gloo on CPU.
    if torch.cuda.is_available():
        backend = "nccl"
        # With --gpus-per-task=1 a task sees a single GPU, cuda:0; otherwise cuda:<local>.
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")

    # 4. Join. Every rank blocks here until all `world` ranks arrived, at most `timeout`; the
    #    same timeout then bounds every collective of the group.
    #    device_id (GPUs only) makes NCCL build its communicator on this GPU at once.
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if device.type == "cuda" else None)
    if rank == 0:
        print(f"init_method={init_method}: {world} processes, backend {backend}", flush=True)

    # 5. Talk: every rank hands in its rank; every rank gets back the sum 0 + 1 + ... + (W-1).
    tensor = torch.tensor([float(rank)], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    expected = world * (world - 1) / 2
    ok = tensor.item() == expected
    print(f"rank {rank}/{world} on {socket.gethostname()} (node {node}, local {local}): "
          f"sum {tensor.item():g} expected {expected:g} {'OK' if ok else 'WRONG'}\n",
          end="", flush=True)

    # 6. Leave: destroy the group, which frees its resources. It is no barrier: a rank that
    #    must not go on before the others are done would call dist.barrier() first.
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
