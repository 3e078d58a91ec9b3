"""Hello all_reduce: every process adds its rank into one tensor, and checks the sum.

Two ways to start it (see README.md):

* one task per node, spawning one process per GPU of the node (`job.sh`):
      srun python lessons/01_hello_allreduce/hello_allreduce.py --nprocs auto
* one SLURM task per GPU, no spawning (`job_task_per_gpu.sh`):
      srun python lessons/01_hello_allreduce/hello_allreduce.py

Without SLURM it runs as a single-node world, e.g. from a notebook cell:
      python lessons/01_hello_allreduce/hello_allreduce.py --nprocs 2

Every rank prints one line `rank R/W ...: holds [...] expected [...] OK|WRONG`; the exit status
is non-zero on every process if any rank holds the wrong sum.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from common.env import LaunchError, find_free_port, resolve_launch_env
from common.env_cli import nproc_per_node
from common.launch import (
    check_cuda_usable,
    check_launch,
    cpu_threads,
    cuda_device_index,
    dist_timeout,
)


def say(text: str) -> None:
    # One write per line: the processes share one output file, and print()'s separate write
    # of the newline would let their lines run into each other.
    print(text + "\n", end="", flush=True)


def expected_sum(world_size: int) -> list[float]:
    # Rank r contributes [r, 1]; the sum over ranks 0..W-1 is [W(W-1)/2, W].
    return [world_size * (world_size - 1) / 2, float(world_size)]


def worker(index: int | None, nprocs: int, break_rank: int | None) -> None:
    # Who am I? Under `job.sh` SLURM tells common/ the node index and we add the spawn
    # index: global rank = node index * processes per node + local index.
    # Under `job_task_per_gpu.sh` srun started every process: common/ counts ranks node by
    # node from SLURM_NODEID and SLURM_LOCALID, so rank 0 is on the step's first node.
    # The set-up every lesson script starts with: this process's share of the CPUs, its GPU
    # (set before the group, so NCCL builds its communicator there), and the process group:
    # rank 0 hosts a small key-value store at MASTER_ADDR:MASTER_PORT, every rank connects to
    # it, and the group is ready once all world_size ranks have (or the timeout has passed).
    try:
        if index is None:
            env = resolve_launch_env()
        else:
            env = resolve_launch_env(spawn_index=index, spawn_nprocs=nprocs)
        check_launch(env)
        torch.set_num_threads(cpu_threads(env))
        if torch.cuda.is_available():
            device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))
            torch.cuda.set_device(device)
        else:
            check_cuda_usable()
            device = torch.device("cpu")
    except LaunchError as exc:  # a launch mistake (two ranks on one GPU, say): one line each
        print(f"hello_allreduce: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=dist_timeout(),
        device_id=device if device.type == "cuda" else None,
    )
    rank, world = env.rank, env.world_size
    if rank == 0:
        say(f"world: {world} processes on {env.num_nodes} node(s), started by {env.launcher}, "
            f"master {env.master_addr}:{env.master_port}, backend {dist.get_backend()}")

    # Build a tensor that only this rank could have built...
    tensor = torch.tensor([float(rank), 1.0], device=device)
    # ...and let the collective add up everybody's: afterwards every rank holds the sum.
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    if rank == break_rank:
        tensor[0] += 1000  # pretend this rank received a corrupted result
    held = tensor.cpu().tolist()
    expected = expected_sum(world)
    ok = held == expected
    say(f"rank {rank}/{world} on {env.hostname} (node {env.node_rank}, local {env.local_rank}): "
          f"holds {held} expected {expected} {'OK' if ok else 'WRONG'}")

    # A rank that only checks itself cannot tell the job failed elsewhere. One more
    # all_reduce counts the wrong ranks, so every process exits with the same verdict.
    wrong = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(wrong, op=dist.ReduceOp.SUM)
    n_wrong = int(wrong.item())
    if rank == 0:
        say(f"all {world} ranks hold the expected sum" if n_wrong == 0
            else f"FAILED: {n_wrong} of {world} ranks hold a wrong sum")
    dist.destroy_process_group()  # frees the group (it is not a barrier)
    gc.collect()  # what still points at the group goes now, not at exit (lesson 03's train.py)
    if n_wrong:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nprocs", default="1",
        help="processes to start on this node: a number, or 'auto' for one per GPU that SLURM "
             "allocated to the node (default 1: do not spawn, the launcher already did)")
    parser.add_argument(
        "--break-rank", type=int, default=None, metavar="R",
        help="corrupt rank R's result after the all_reduce, to see how a failing job looks")
    args = parser.parse_args(argv)

    if args.nprocs == "auto":
        nprocs = nproc_per_node()  # GPUs SLURM gave this node, else visible GPUs, else 1
    else:
        try:
            nprocs = int(args.nprocs)
        except ValueError:
            parser.error(f"--nprocs must be a number or 'auto', not {args.nprocs!r}")
        if nprocs < 1:
            parser.error("--nprocs must be at least 1")

    # Ask common/ once before spawning, so a launch mistake (say, srun already started one
    # task per GPU and we would spawn more on top) fails here with one clear message.
    try:
        if nprocs == 1:
            preview = resolve_launch_env()
        else:
            preview = resolve_launch_env(spawn_index=0, spawn_nprocs=nprocs)
    except LaunchError as exc:
        print(f"hello_allreduce: {exc}", file=sys.stderr)
        return 2
    if nprocs > 1 and preview.job_id is None:
        # Outside a SLURM job nobody derived a port from a job id: pick a free one now, in
        # the parent, and hand it to the children through the environment they inherit.
        os.environ.setdefault("MASTER_PORT", str(find_free_port()))

    if nprocs == 1:
        worker(None, 1, args.break_rank)
        return 0
    try:
        # One process per GPU; each gets its index as the first argument.
        mp.spawn(worker, args=(nprocs, args.break_rank), nprocs=nprocs, join=True)
    except ProcessException as exc:
        print(f"hello_allreduce: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
