"""Lesson 04: the training script that torchrun starts once per worker process.

torchrun (started once per node by torchrun.sh) sets RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT for every worker it starts; common/env.py reads them (as it reads
srun's variables in lesson 03), and the set-up below is lesson 03's, line for line. The model
and data are deliberately tiny (a small regression on synthetic data): this lesson is about
launching, not about the model.

Single node, no SLURM:
    torchrun --standalone --nproc-per-node 2 lessons/04_torchrun_enroot/train.py
"""

import argparse
import gc
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common.env import LaunchError, resolve_launch_env
from common.launch import (
    check_cuda_usable,
    check_launch,
    cpu_threads,
    cuda_device_index,
    dist_timeout,
    init_error_message,
)


def synthetic_regression(n_samples: int, n_features: int, seed: int) -> TensorDataset:
    """y = x @ w + noise, with a fixed seed so every rank builds the same dataset."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_samples, n_features, generator=g)
    w = torch.randn(n_features, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(n_samples, 1, generator=g)
    return TensorDataset(x, y)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    env = None
    try:
        env = resolve_launch_env()  # under torchrun: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*
        check_launch(env)
        torch.set_num_threads(cpu_threads(env))  # torchrun's OMP_NUM_THREADS, if it set one
        if torch.cuda.is_available():
            device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))
            torch.cuda.set_device(device)
        else:
            check_cuda_usable()
            device = torch.device("cpu")
        # Under torchrun the agent on the first node already hosts the store at MASTER_ADDR:
        # init_process_group connects to it (TORCHELASTIC_USE_AGENT_STORE) instead of opening it.
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=dist_timeout(),
            device_id=device if device.type == "cuda" else None,
        )
    except LaunchError as exc:  # a wrong launch: one line that names the fix, no traceback
        print(f"train.py: {exc}", file=sys.stderr, flush=True)
        return 2
    except dist.DistError as exc:
        print(f"train.py: {init_error_message(env, exc)}", file=sys.stderr, flush=True)
        return 2
    try:
        train(args, env, device)
    finally:
        dist.destroy_process_group()
        gc.collect()  # lesson 03's train.py says why
    return 0


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only, in one write: the ranks (and torchrun's log prefixes) share the
    job's output, and a newline written on its own could land among another process's lines."""
    if dist.get_rank() == 0:
        print(" ".join(map(str, args)) + "\n", end="", flush=True, **kwargs)


def train(args: argparse.Namespace, env, device: torch.device) -> None:

    # One line per process: a reader (or a test) can check that every rank
    # 0..WORLD_SIZE-1 turned up exactly once, and on which node. The processes
    # share one output, so the line goes out in a single write, newline included.
    print(
        f"rank {env.rank}/{env.world_size} local_rank {env.local_rank}/{env.local_world_size} "
        f"node_rank {env.node_rank}/{env.num_nodes} host {env.hostname} "
        f"launcher {env.launcher} backend {dist.get_backend()} device {device}\n",
        end="",
        flush=True,
    )

    torch.manual_seed(0)
    dataset = synthetic_regression(args.samples, args.features, seed=1234)
    # Every rank holds the same dataset; the sampler hands each rank a different
    # 1/WORLD_SIZE of it, so the ranks together see every sample once per epoch.
    sampler = DistributedSampler(dataset, num_replicas=env.world_size, rank=env.rank, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = nn.Sequential(nn.Linear(args.features, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    # DDP copies rank 0's weights to every rank now, and averages the gradients
    # across ranks in backward(), so all replicas take the same step.
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        total = torch.zeros(2, device=device)  # [sum of losses, number of samples]
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(ddp_model(x), y)
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach() * len(x), torch.tensor(len(x), device=device)])
        # Each rank only saw its own shard: sum over ranks for the loss of the whole epoch.
        dist.all_reduce(total)
        print0(f"epoch {epoch} train_loss {(total[0] / total[1]).item():.4f}")

    # If DDP did its job, every replica holds the same weights: compare checksums.
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    low, high = checksum.clone(), checksum.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    print0(f"weights identical on all {env.world_size} ranks: {bool(low == high)}")
    print0(f"done: world_size {env.world_size} = {env.num_nodes} nodes x {env.local_world_size}")


if __name__ == "__main__":
    sys.exit(main())
