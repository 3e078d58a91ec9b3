"""Lesson 03: MNIST on n nodes x n GPUs with DistributedDataParallel.

Every process of the job runs this file (srun starts one per GPU, see job.sh). Each one asks
common/env.py who it is (rank, world size, rank 0's address), joins the process group, trains a
replica of the same small CNN on its own share of the data, and DDP averages the gradients so
that all replicas take the same step. Rank 0 alone prints and writes the checkpoint.

To carry it into your project: this file and the four files of common/ it imports: env.py
(who am I in the job), launch.py (the checks before the group), mnist.py (the data, the model,
the evaluation) and checkpoint.py.
Without SLURM, on one machine (CPU, gloo), from the course root with the venv active:
    python lessons/03_ddp_mnist/train.py --epochs 1 --train-subset 2048
    torchrun --standalone --nproc-per-node 2 lessons/03_ddp_mnist/train.py --epochs 1
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from common.env import LaunchError, resolve_launch_env
from common.launch import (
    check_cuda_usable,
    check_launch,
    cpu_threads,
    cuda_device_index,
    dist_timeout,
    init_error_message,
)
from common.mnist import MnistDataError, build_model, build_optimizer, evaluate, load_data


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only, in one write: the ranks (and torchrun's log prefixes) share the
    job's output, and a newline written on its own could land among another process's lines."""
    if dist.get_rank() == 0:
        print(" ".join(map(str, args)) + "\n", end="", flush=True, **kwargs)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128, help="global batch, split over ranks")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of the one-cycle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", type=Path, help="saved every epoch; resumed if it exists")
    p.add_argument("--sync-bn", action="store_true", help="BatchNorm over the global batch (GPU)")
    p.add_argument("--log-every", type=int, default=100, help="a progress line every N steps")
    p.add_argument("--train-subset", type=int, default=0, help="use only the first N images")
    p.add_argument("--test-subset", type=int, default=0, help="evaluate on the first N images")
    p.add_argument("--log-order", type=Path, metavar="DIR",
                   help="each epoch's image indices of rank N, in DIR/rank<N>.txt")  # fmt: skip
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        p.error("--epochs and --batch-size must be at least 1")
    return args


def train(args: argparse.Namespace, env, device: torch.device) -> None:
    if args.sync_bn and device.type != "cuda":
        raise LaunchError("--sync-bn needs GPUs (SyncBatchNorm has no CPU kernel); drop it on CPU")
    train_x, train_y, test_x, test_y = load_data(device, args.train_subset, args.test_subset)

    # The global batch is split over the ranks; DDP averages the ranks' gradients, which gives
    # the gradient of the whole batch (keep the global batch, and so the learning rate, when
    # the number of GPUs changes). DistributedSampler hands every rank a different, equal
    # share of a shuffle that all ranks agree on (same seed), padded so that every rank runs
    # the same number of steps: each step waits for the gradients of all ranks.
    per_rank_batch = max(1, args.batch_size // env.world_size)
    sampler = DistributedSampler(range(len(train_x)), env.world_size, env.rank, seed=args.seed)
    steps_per_epoch = -(-len(sampler) // per_rank_batch)

    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also copies rank 0's)
    model = build_model(args.sync_bn).to(device)
    optimizer, scheduler = build_optimizer(model, args.lr, args.epochs * steps_per_epoch)

    # Rank 0 alone decides whether to resume, and tells the others: on a shared filesystem a
    # file that one node sees may not be visible yet on another (NFS caches lookups, nfs(5)),
    # and ranks that started at different epochs would pair their collectives across epochs.
    # Each rank then reads the (small) file itself.
    resume = torch.tensor(int(bool(args.checkpoint and args.checkpoint.exists())), device=device)
    dist.broadcast(resume, src=0)
    start_epoch = 0
    if resume.item():
        keys = ("model", "optimizer", "scheduler", "epoch")
        ckpt = load_checkpoint(args.checkpoint, keys, expect={"epochs": args.epochs})
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"]
        print0(f"resumed from {args.checkpoint} after epoch {start_epoch}")
    # The one-cycle schedule is a curve over the steps of the run that started it: their count
    # came back with the scheduler's state. A resume on another number of ranks has another
    # number of steps per epoch (each rank's share of the data changes), so stepping the
    # scheduler once per step would end the cycle early (torch stops with "Tried to step N
    # times") or late. Instead each step moves it to the same point of the epoch in the first
    # run's count: the learning rate follows the same curve, and the last step ends the cycle.
    schedule_steps = scheduler.total_steps // args.epochs  # per epoch, in the first run
    if schedule_steps != steps_per_epoch:
        print0(f"the schedule counts {schedule_steps} steps per epoch (the run that started it)"
               f", this run takes {steps_per_epoch}: its steps are mapped onto that count")

    # DDP all-reduces the gradients during backward(). On a GPU each process names the one
    # device it drives; on the CPU there is no device to name.
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    print0(
        f"training {args.epochs} epochs on {len(train_x)} images, world size "
        f"{env.world_size} ({env.num_nodes} node(s) x {env.local_world_size}), global batch "
        f"{per_rank_batch * env.world_size} = {env.world_size} x {per_rank_batch}, "
        f"{steps_per_epoch} steps per epoch, device {device}, backend {dist.get_backend()}"
    )
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        batches = torch.tensor(list(sampler), device=device).split(per_rank_batch)
        if args.log_order:  # the epoch, then this rank's image indices in the order it sees them
            args.log_order.mkdir(parents=True, exist_ok=True)
            with open(args.log_order / f"rank{env.rank}.txt", "a") as f:
                print(epoch + 1, *torch.cat(batches).tolist(), file=f)
        loss_sum = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, samples
        t0 = time.perf_counter()
        for step, idx in enumerate(batches, 1):
            loss = F.cross_entropy(ddp_model(train_x[idx]), train_y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here, overlapped with backward
            optimizer.step()
            # = one scheduler.step() per step when the world size has not changed.
            position = epoch * schedule_steps + step * schedule_steps // steps_per_epoch
            while scheduler.last_epoch < position:
                scheduler.step()
            loss_sum[0] += loss.detach().double() * len(idx)
            loss_sum[1] += len(idx)
            if step % args.log_every == 0:
                print0(
                    f"step  epoch {epoch + 1}/{args.epochs} | batch {step}/{steps_per_epoch} "
                    f"| loss {loss.item():.4f} | lr {scheduler.get_last_lr()[0]:.2e}"
                )
        train_time = time.perf_counter() - t0

        dist.all_reduce(loss_sum)  # each rank saw its own share: sum over all ranks
        # DDP copies rank 0's BatchNorm running statistics to every rank at each forward, and
        # each rank's forward then updates its copy with its own batch: after the last step the
        # copies differ by that one update. Copy rank 0's, so that all ranks score (and rank 0
        # saves) the same model.
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        test_loss, test_acc = evaluate(model, test_x, test_y)
        train_loss = (loss_sum[0] / loss_sum[1]).item()
        print0(
            f"epoch {epoch + 1}/{args.epochs} | train_loss {train_loss:.4f} "
            f"| test_loss {test_loss:.4f} | test_acc {test_acc:.2f}% "
            f"| {loss_sum[1].item() / train_time:.0f} samples/s "
            f"| epoch_time {time.perf_counter() - t0:.1f}s"
        )

        if args.checkpoint:
            # Rank 0 writes (the replicas are identical); the barrier keeps the others from
            # going on, or exiting, before the file is complete.
            if env.rank == 0:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                state.update(scheduler=scheduler.state_dict(), epoch=epoch + 1, epochs=args.epochs)
                save_checkpoint(args.checkpoint, state)
            dist.barrier()
    if start_epoch < args.epochs:
        print0(f"done: test_acc {test_acc:.2f}% after {args.epochs} epochs")
    else:
        print0(f"nothing to do: {args.checkpoint} has finished all {args.epochs} epochs")


def main(argv=None) -> int:
    args = parse_args(argv)
    env = None
    try:
        # Who am I? Rank, local rank, world size, rank 0's host and port: from srun's SLURM_*
        # variables or torchrun's RANK/WORLD_SIZE/MASTER_* (common/env.py).
        env = resolve_launch_env()
        check_launch(env)  # the address, the port, rank 0's node: one line now, not a hang
        torch.set_num_threads(cpu_threads(env))  # this process's share of its task's CPUs
        if torch.cuda.is_available():
            device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))
            torch.cuda.set_device(device)  # before the group: NCCL and CUDA use this GPU
        else:
            check_cuda_usable()  # GPUs that torch cannot see are an error, not a CPU run
            device = torch.device("cpu")
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",  # rank 0 hosts the store
            rank=env.rank,
            world_size=env.world_size,
            timeout=dist_timeout(),  # bounds the rendezvous and every collective: no silent hang
            device_id=device if device.type == "cuda" else None,  # NCCL binds to it at once
        )
    except LaunchError as exc:  # no process group, so no rank 0 to leave it to: each says it
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except dist.DistError as exc:  # the others never came, or rank 0's address did not answer
        print(f"error: {init_error_message(env, exc)}", file=sys.stderr, flush=True)
        return 2
    try:
        train(args, env, device)
    except (LaunchError, MnistDataError, CheckpointError) as exc:
        # Every rank meets the same problem; rank 0 alone says it (all ranks exit with 2). The
        # others wait until it has: torchrun stops every rank as soon as one of them fails.
        print0(f"error: {exc}", file=sys.stderr)
        dist.barrier()
        return 2
    finally:
        dist.destroy_process_group()  # frees the group's resources (it is not a barrier)
        # What still points at the destroyed group (DDP's reducer, in reference cycles) is
        # freed now: left to interpreter exit, gloo's threads can abort the process (exit -6).
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
