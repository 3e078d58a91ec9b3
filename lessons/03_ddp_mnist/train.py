"""Lesson 03: MNIST on n nodes x n GPUs with DistributedDataParallel.

Every process of the job runs this file (srun starts them, see job.sh). Each one learns its place
in the job (rank, world size, GPU) from common/, trains a replica of the same small CNN on its own
share of the data, and DDP averages the gradients so that all replicas take the same step.
Rank 0 alone prints and writes the checkpoint.

Without SLURM, on one machine (CPU, gloo), from the course root with PYTHONPATH=.:
    python lessons/03_ddp_mnist/train.py --epochs 1 --train-subset 2048
    torchrun --standalone --nproc-per-node 2 lessons/03_ddp_mnist/train.py --epochs 1
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from common.dist import cleanup, init_distributed, print0
from common.env import LaunchError
from common.mnist import MnistDataError, load_mnist, normalize


def build_model(sync_bn: bool = False) -> nn.Module:
    """A small CNN: three conv blocks (28 -> 14 -> 7 -> 3 pixels) and one linear layer, 29k
    parameters. BatchNorm lets it train fast: above 99 % test accuracy in 2-3 epochs."""

    def block(c_in: int, c_out: int) -> list[nn.Module]:
        conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        return [conv, nn.BatchNorm2d(c_out), nn.ReLU(inplace=True), nn.MaxPool2d(2)]

    model = nn.Sequential(
        *block(1, 16), *block(16, 32), *block(32, 64), nn.Flatten(), nn.Linear(64 * 3 * 3, 10)
    )
    if sync_bn:
        # BatchNorm normalises over the batch it sees: under DDP, each rank's share (32 of 128
        # on 4 ranks), so the recipe changes with the number of ranks. SyncBatchNorm computes
        # the statistics over the global batch instead (one more all-reduce per layer; GPUs only).
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def build_optimizer(model: nn.Module, lr: float, total_steps: int):
    """AdamW with a one-cycle schedule: warm up to ``lr``, then anneal to almost zero."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total_steps)
    return optimizer, scheduler


def load_data(device: torch.device, train_subset: int = 0, test_subset: int = 0):
    """All of MNIST as tensors on ``device`` (200 MB): a batch is an index into a tensor.
    With data on disk you would give the same DistributedSampler to a DataLoader."""
    train_x, train_y = load_mnist(train=True)
    test_x, test_y = load_mnist(train=False)
    train_x, train_y = train_x[: train_subset or None], train_y[: train_subset or None]
    test_x, test_y = test_x[: test_subset or None], test_y[: test_subset or None]
    return [t.to(device) for t in (normalize(train_x), train_y, normalize(test_x), test_y)]


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000):
    """Loss and accuracy on the whole test set, the work shared by all ranks.

    Each rank scores its own slice; summing the counts over the ranks gives the exact figure
    for the full set (averaging per-rank accuracies would weigh unequal slices wrongly).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor_split(torch.arange(len(x), device=x.device), world_size)[rank]
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=x.device)  # loss sum, correct, count
    for idx in mine.split(batch_size):
        logits = model(x[idx])
        totals[0] += F.cross_entropy(logits, y[idx], reduction="sum").double()
        totals[1] += (logits.argmax(dim=1) == y[idx]).sum()
        totals[2] += len(idx)
    model.train()
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, 100.0 * correct / count


EPOCH_LINE = re.compile(
    r"^epoch (?P<epoch>\d+)/(?P<epochs>\d+) \| train_loss (?P<train_loss>[\d.]+) \| "
    r"test_loss (?P<test_loss>[\d.]+) \| test_acc (?P<test_acc>[\d.]+)% \| "
    r"(?P<samples_per_s>[\d.]+) samples/s \| epoch_time (?P<epoch_time>[\d.]+)s"
)


def parse_log(text: str) -> list[dict]:
    """The epoch lines of a job's output as dicts (the last copy of an epoch wins)."""
    rows = {}
    for match in map(EPOCH_LINE.match, text.splitlines()):
        if match:
            row = {k: float(v) for k, v in match.groupdict().items()}
            row["epoch"], row["epochs"] = int(row["epoch"]), int(row["epochs"])
            rows[row["epoch"]] = row
    return [rows[k] for k in sorted(rows)]


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
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        p.error("--epochs and --batch-size must be at least 1")
    return args


def train(args: argparse.Namespace, ctx) -> None:
    env, device = ctx.env, ctx.device
    if args.sync_bn and device.type != "cuda":
        raise LaunchError("--sync-bn needs GPUs (SyncBatchNorm runs on CUDA only); drop it on CPU")
    train_x, train_y, test_x, test_y = load_data(device, args.train_subset, args.test_subset)

    # The global batch is split over the ranks; DDP averages the ranks' gradients, which gives
    # the gradient of the whole batch. DistributedSampler hands every rank a different, equal
    # share of a shuffle that all ranks agree on (same seed), padded so that every rank runs the
    # same number of steps: each step waits for the gradients of all ranks.
    per_rank_batch = max(1, args.batch_size // env.world_size)
    sampler = DistributedSampler(range(len(train_x)), env.world_size, env.rank, seed=args.seed)
    steps_per_epoch = -(-len(sampler) // per_rank_batch)

    torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also copies rank 0's)
    model = build_model(args.sync_bn).to(device)
    optimizer, scheduler = build_optimizer(model, args.lr, args.epochs * steps_per_epoch)

    start_epoch = 0
    if args.checkpoint and args.checkpoint.exists():
        # Every rank reads the same file, so all start from the same state.
        keys = ("model", "optimizer", "scheduler", "epoch")
        ckpt = load_checkpoint(args.checkpoint, keys, expect={"epochs": args.epochs})
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start_epoch = ckpt["epoch"]
        print0(f"resumed from {args.checkpoint} after epoch {start_epoch}")

    # DDP all-reduces the gradients during backward(). On a GPU each process drives the device
    # common/ chose for it (cuda:<local rank>); on the CPU there is no device to name.
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    print0(
        f"training {args.epochs} epochs on {len(train_x)} images, world size "
        f"{env.world_size} ({env.num_nodes} node(s) x {env.local_world_size}), global batch "
        f"{per_rank_batch * env.world_size} = {env.world_size} x {per_rank_batch}, "
        f"{steps_per_epoch} steps per epoch, device {device}, backend {ctx.backend}"
    )
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        batches = torch.tensor(list(sampler), device=device).split(per_rank_batch)
        loss_sum = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, samples
        t0 = time.perf_counter()
        for step, idx in enumerate(batches, 1):
            loss = F.cross_entropy(ddp_model(train_x[idx]), train_y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here, overlapped with backward
            optimizer.step()
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
        # Each rank's BatchNorm running statistics follow its own batches; evaluate (and save)
        # rank 0's everywhere, so that all ranks score the same model.
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
            # Rank 0 writes (the replicas are identical); the others wait at the barrier so
            # that nobody exits, or reads the file, before it is complete.
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
    try:
        ctx = init_distributed()
    except LaunchError as exc:  # no process group, so no rank 0 to leave it to: each says it
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        train(args, ctx)
    except (LaunchError, MnistDataError, CheckpointError) as exc:
        # Every rank meets the same problem; rank 0 alone says it (all ranks exit with 2). The
        # others wait until it has: torchrun stops every rank as soon as one of them exits.
        print0(f"error: {exc}", file=sys.stderr)
        dist.barrier()
        return 2
    finally:
        cleanup()  # destroy the process group, so every rank leaves cleanly
    return 0


if __name__ == "__main__":
    sys.exit(main())
