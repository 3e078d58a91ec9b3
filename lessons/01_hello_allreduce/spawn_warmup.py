"""Warm-up: a distributed world on one machine, without SLURM.

Run it from the course root:

    python lessons/01_hello_allreduce/spawn_warmup.py --nprocs 2

`torch.multiprocessing.spawn` starts `--nprocs` copies of `worker`, each with its own index.
Each copy joins a process group, wraps the same toy model in DistributedDataParallel (DDP),
trains a few steps on its own random data, and checks that every copy ended with the same
weights. Nothing here needs a GPU: on CPU the processes talk through the gloo backend.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.multiprocessing.spawn import ProcessException
from torch.nn.parallel import DistributedDataParallel as DDP

from common.env import LaunchError, find_free_port, resolve_launch_env
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


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def weights_checksum(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def worker(index: int, nprocs: int, steps: int) -> None:
    # A spawned child knows only its index; common/ turns it into rank, world size and the
    # address of the process that hosts the rendezvous. Then the set-up every DDP script
    # starts with: this process's threads and device, and the process group.
    try:
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
        print(f"spawn_warmup: {exc}", file=sys.stderr, flush=True)
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

    # Seed differently on purpose: every process builds *different* initial weights.
    # Wrapping in DDP broadcasts rank 0's weights, so all replicas start equal anyway.
    torch.manual_seed(rank)
    model = ToyModel().to(device)
    say(f"rank {rank}/{world}: weights before DDP {weights_checksum(model):+.6f}")
    device_ids = [device.index] if device.type == "cuda" else None
    ddp_model = DDP(model, device_ids=device_ids)
    say(f"rank {rank}/{world}: weights after DDP  {weights_checksum(model):+.6f}")

    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()
    for step in range(steps):
        # Each rank sees its own batch (as it would with a DistributedSampler)...
        inputs = torch.randn(20, 10, device=device)
        targets = torch.randn(20, 5, device=device)
        optimizer.zero_grad()
        loss = loss_fn(ddp_model(inputs), targets)
        # ...and backward() averages the gradients over all ranks, so every replica
        # takes the same optimizer step.
        loss.backward()
        optimizer.step()
        say(f"rank {rank}/{world}: step {step} local loss {loss.item():.4f}")

    # Check what DDP promised: same weights everywhere after training on different data.
    checksums = [0.0] * world
    dist.all_gather_object(checksums, weights_checksum(model))
    same = max(checksums) - min(checksums) < 1e-9
    if rank == 0:
        say(f"weights after {steps} steps on {world} ranks: "
            + ("identical on every rank" if same else f"DIFFERENT: {checksums}"))
    dist.destroy_process_group()  # frees the group (it is not a barrier)
    gc.collect()  # DDP's reducer points at the destroyed group: free it before exit (exit -6)
    if not same:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="processes to spawn (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    args = parser.parse_args(argv)
    if args.nprocs < 1:
        parser.error("--nprocs must be at least 1")
    # The children must agree on a rendezvous port before they exist: the parent picks a
    # free one and passes it down through the environment they inherit.
    os.environ.setdefault("MASTER_PORT", str(find_free_port()))
    try:
        # join=True: wait for every child; if one fails, the others are stopped and this raises.
        mp.spawn(worker, args=(args.nprocs, args.steps), nprocs=args.nprocs, join=True)
    except ProcessException as exc:
        print(f"spawn_warmup: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
