"""Lesson 03: MNIST on n nodes x n GPUs with DistributedDataParallel, checkpoints and requeue.

Every process of the job runs this file (srun starts them, see job.sh). Each one learns its place
in the job (rank, world size, GPU, where rank 0 listens) from common/, trains a replica of the
same small CNN on its own share of the data, and DDP averages the gradients so that all replicas
take the same step. Rank 0 alone prints and writes the checkpoint.

Without SLURM, on one machine (CPU, gloo):
    python lessons/03_ddp_mnist/train.py --epochs 1 --train-subset 2048
    torchrun --standalone --nproc-per-node 2 lessons/03_ddp_mnist/train.py --epochs 1

Progress lines are meant to be read in a log file and parsed (see ``parse_log``):
    step  epoch 1/3 | batch 100/469 | loss 0.1612 | lr 3.09e-03 | 3010 samples/s
    epoch 1/3 | train_loss 0.2437 | test_loss 0.0523 | test_acc 98.34% | 3012 samples/s | ...
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.dist import cleanup, init_distributed, print0
from common.mnist import load_mnist, normalize

# Exit status that tells job.sh "stopped on request, checkpoint written, please requeue me".
# 75 is EX_TEMPFAIL from sysexits.h: a temporary failure, the caller is invited to retry.
REQUEUE_EXIT_CODE = 75
# How often (in steps) the ranks compare their stop flags: an all_reduce is cheap but not free.
STOP_CHECK_EVERY = 10


# --------------------------------------------------------------------------- model and recipe


def build_model() -> nn.Module:
    """A small CNN: three conv blocks (28 -> 14 -> 7 -> 3 pixels) and one linear layer.

    About 29k parameters and 2 million multiply-adds per image, a sixth of pytorch/examples'
    MNIST Net, and batch normalisation lets it train with a large learning rate: above 99 % in
    2-3 epochs.
    """

    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [
            nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
            nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        ]

    return nn.Sequential(
        *block(1, 16), *block(16, 32), *block(32, 64), nn.Flatten(), nn.Linear(64 * 3 * 3, 10)
    )


def build_optimizer(model: nn.Module, lr: float, total_steps: int):
    """AdamW with a one-cycle schedule: warm up to ``lr``, then anneal to almost zero."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total_steps)
    return optimizer, scheduler


def load_data(device: torch.device, train_subset: int = 0, test_subset: int = 0):
    """The whole of MNIST as tensors on ``device``: it is small enough (200 MB as float32).

    With data this small a batch is just an index into a tensor; for data on disk you would use
    a DataLoader with workers, fed by the same DistributedSampler.
    """
    train_x, train_y = load_mnist(train=True)
    test_x, test_y = load_mnist(train=False)
    if train_subset:
        train_x, train_y = train_x[:train_subset], train_y[:train_subset]
    if test_subset:
        test_x, test_y = test_x[:test_subset], test_y[:test_subset]
    return (
        normalize(train_x).to(device),
        train_y.to(device),
        normalize(test_x).to(device),
        test_y.to(device),
    )


# --------------------------------------------------------------------------- preemption


class StopRequest:
    """Remembers that SLURM (through job.sh) asked us to stop.

    A signal handler runs between two Python bytecodes, possibly in the middle of an all_reduce
    or of writing a checkpoint, so it only sets a flag. The training loop looks at the flag at
    safe points, between two optimizer steps.
    """

    def __init__(self, signum: int = signal.SIGUSR1):
        self.signum = signum
        self.requested = False
        signal.signal(signum, self._handler)

    def _handler(self, signum, frame) -> None:
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """True on every rank as soon as any rank got the signal.

        The signal does not reach all ranks at the same moment. If one rank stopped while the
        others went on, they would wait forever for its gradients; so the ranks take the
        decision together: a MAX over the flags.
        """
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


# --------------------------------------------------------------------------- checkpoints


def save_checkpoint(path: Path, state: dict) -> None:
    """Write atomically: a job killed while saving must not leave a half-written checkpoint
    where the next run will look for one. The rename either happens completely or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def settle_gradient_buckets(ddp_model: DDP, sample: torch.Tensor) -> None:
    """One throwaway backward pass (zero gradients, no optimizer step, no statistics updated).

    DDP sums gradients in buckets, and after the first backward pass it reorders its buckets to
    match the order in which gradients became ready. With more than two ranks, the position of a
    gradient in its bucket decides the order in which the ranks' values are added up, and so the
    last bit of the sum. A resumed run would make its first step with the initial layout where the
    uninterrupted run used the reordered one: close, but not the same weights. Settling the layout
    before the first real step, in every run, makes a resumed run repeat an uninterrupted one bit
    for bit.
    """
    ddp_model.eval()  # BatchNorm uses (and keeps) its running statistics
    ddp_model(sample).sum().mul(0.0).backward()
    ddp_model.train()
    for p in ddp_model.parameters():
        p.grad = None


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000):
    """Loss and accuracy on the whole test set, the work shared by all ranks.

    Each rank scores its own slice; summing the counts over ranks gives the exact figure for
    the full set (averaging per-rank accuracies would weigh unequal slices wrongly).
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


# --------------------------------------------------------------------------- the log


EPOCH_LINE = re.compile(
    r"^epoch (?P<epoch>\d+)/(?P<epochs>\d+) \| train_loss (?P<train_loss>[\d.]+) \| "
    r"test_loss (?P<test_loss>[\d.]+) \| test_acc (?P<test_acc>[\d.]+)% \| "
    r"(?P<samples_per_s>[\d.]+) samples/s \| epoch_time (?P<epoch_time>[\d.]+)s"
)


def parse_log(text: str) -> list[dict]:
    """The per-epoch lines of a job's output as dicts (for plotting loss/accuracy per epoch).

    A requeued job appends to the same file, so an epoch may appear twice; the last one wins.
    """
    rows: dict[int, dict] = {}
    for line in text.splitlines():
        match = EPOCH_LINE.match(line.strip())
        if match:
            row = {k: float(v) for k, v in match.groupdict().items()}
            row["epoch"], row["epochs"] = int(row["epoch"]), int(row["epochs"])
            rows[row["epoch"]] = row
    return [rows[k] for k in sorted(rows)]


def fmt_time(seconds: float) -> str:
    return f"{seconds:.1f}s"


# --------------------------------------------------------------------------- training


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument(
        "--batch-size",
        type=int,
        default=128,
        help="global batch: split over the ranks, so the recipe does not depend on their number",
    )
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of the one-cycle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=None,
        help="file to resume from (if it exists) and to save to every epoch; none: no checkpoints",
    )
    p.add_argument("--log-every", type=int, default=100, help="a progress line every N steps")
    p.add_argument("--train-subset", type=int, default=0, help="use only the first N images")
    p.add_argument("--test-subset", type=int, default=0, help="evaluate on the first N images")
    p.add_argument(
        "--stop-after-epoch",
        type=int,
        default=0,
        help="(for experiments) act as if a stop was requested after epoch N",
    )
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        p.error("--epochs and --batch-size must be at least 1")
    return args


def train(args: argparse.Namespace, ctx, stop: StopRequest | None = None) -> int:
    """Train (or resume) until ``args.epochs``; return 0, or REQUEUE_EXIT_CODE if stopped."""
    env, device = ctx.env, ctx.device
    stop = stop or StopRequest(signal.SIGUSR1)

    train_x, train_y, test_x, test_y = load_data(device, args.train_subset, args.test_subset)

    # The global batch is split over the ranks: rank r computes the gradient of its part and
    # DDP averages the parts, which gives the gradient of the whole batch.
    per_rank_batch = max(1, args.batch_size // env.world_size)
    # Every rank must run the same number of steps (each step waits for all ranks' gradients).
    # DistributedSampler guarantees it: it pads the dataset to a multiple of the world size
    # and gives every rank an equal share, shuffled with a seed all ranks agree on.
    sampler = DistributedSampler(
        range(len(train_x)), num_replicas=env.world_size, rank=env.rank, shuffle=True,
        seed=args.seed,
    )  # fmt: skip
    steps_per_epoch = -(-len(sampler) // per_rank_batch)

    # Same seed on every rank; DDP also copies rank 0's weights to the others when it wraps.
    torch.manual_seed(args.seed)
    model = build_model().to(device)
    optimizer, scheduler = build_optimizer(model, args.lr, args.epochs * steps_per_epoch)

    start_epoch, start_step = 0, 0
    carried = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, samples (resumed)
    if args.checkpoint is not None and args.checkpoint.exists():
        # Every rank reads the same file, so all of them start from identical state.
        # (Loaded to the CPU: the RNG states must stay there; load_state_dict moves the rest.)
        ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
        shape = (env.world_size, steps_per_epoch, args.epochs)
        saved = (ckpt["world_size"], ckpt["steps_per_epoch"], ckpt["args"]["epochs"])
        if saved != shape:
            raise SystemExit(
                f"error: {args.checkpoint} was written by a run with world size {saved[0]}, "
                f"{saved[1]} steps per epoch and {saved[2]} epochs; this one has {shape[0]}, "
                f"{shape[1]} and {shape[2]}. Resume with the same number of processes, "
                f"--batch-size and --epochs, or pass another --checkpoint."
            )
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        set_rng_states(ckpt["rng"])
        start_epoch, start_step = ckpt["epoch"], ckpt["step"]
        if env.rank == 0:  # the partial epoch's loss was summed over all ranks when saved
            carried = ckpt["epoch_loss"].to(device)

    # Gradients are averaged across ranks during backward(). On a GPU each process drives the
    # device common/ chose for it (cuda:<local_rank>); on CPU there is no device to name.
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    settle_gradient_buckets(ddp_model, train_x[:2])

    def checkpoint(epoch: int, step: int, epoch_loss: torch.Tensor) -> None:
        if args.checkpoint is None:
            return
        # Only rank 0 writes: the replicas are identical, and four processes writing one file
        # would trip over each other. The others wait at the barrier so that nobody exits
        # (or reads the file) before it is complete.
        if env.rank == 0:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "epoch": epoch,  # completed epochs
                "step": step,  # completed steps of the current epoch (after a stop request)
                "epoch_loss": epoch_loss.cpu(),
                "rng": rng_states(),
                "world_size": env.world_size,
                "steps_per_epoch": steps_per_epoch,
                "args": vars(args),
            }
            save_checkpoint(args.checkpoint, state)
        dist.barrier()

    print0(
        f"training {args.epochs} epochs on {len(train_x)} images, world size {env.world_size} "
        f"({env.num_nodes} node(s) x {env.local_world_size}), global batch "
        f"{per_rank_batch * env.world_size} = {env.world_size} x {per_rank_batch}, "
        f"{steps_per_epoch} steps per epoch, device {device}, backend {ctx.backend}, "
        f"{torch.get_num_threads()} CPU thread(s) per rank"
    )
    if start_epoch or start_step:
        where = f"epoch {start_epoch + 1}, step {start_step}" if start_step else "the start of "
        where = where if start_step else f"{where}epoch {start_epoch + 1}"
        print0(f"resumed from {args.checkpoint} at {where}")
    epoch_times: list[float] = []
    for epoch in range(start_epoch, args.epochs):
        # A different shuffle every epoch, the same on every rank (so shards never overlap).
        sampler.set_epoch(epoch)
        batches = torch.tensor(list(sampler), device=device).split(per_rank_batch)
        first = start_step if epoch == start_epoch else 0  # skip what a stopped run already did
        epoch_loss = carried if epoch == start_epoch else torch.zeros_like(carried)
        t0 = tick = time.perf_counter()
        seen = seen_at_tick = 0  # samples this rank trained on since t0 / since the last line

        for step in range(first, steps_per_epoch):
            idx = batches[step]
            loss = F.cross_entropy(ddp_model(train_x[idx]), train_y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all_reduces the gradients here, overlapped with backward
            optimizer.step()
            scheduler.step()
            epoch_loss[0] += loss.detach().double() * len(idx)
            epoch_loss[1] += len(idx)
            seen += len(idx)

            if (step + 1) % args.log_every == 0:
                now = time.perf_counter()
                rate = (seen - seen_at_tick) * env.world_size / (now - tick)
                tick, seen_at_tick = now, seen
                print0(
                    f"step  epoch {epoch + 1}/{args.epochs} | batch {step + 1}/{steps_per_epoch} "
                    f"| loss {loss.item():.4f} | lr {scheduler.get_last_lr()[0]:.2e} "
                    f"| {rate:.0f} samples/s"
                )
            if (
                (step + 1) % STOP_CHECK_EVERY == 0
                and step + 1 < steps_per_epoch
                and stop.agreed(device)
            ):
                # Stop mid-epoch: save where we are, including the loss summed so far.
                dist.all_reduce(epoch_loss)
                checkpoint(epoch, step + 1, epoch_loss)
                print0(
                    f"stop requested (signal {stop.signum}): checkpoint saved at epoch "
                    f"{epoch + 1}, step {step + 1}; exiting with {REQUEUE_EXIT_CODE} to be requeued"
                )
                return REQUEUE_EXIT_CODE

        train_time = time.perf_counter() - t0
        # Each rank only saw its own shard: sum loss and sample counts over all ranks.
        dist.all_reduce(epoch_loss)
        rate_seen = torch.tensor([float(seen)], device=device)
        dist.all_reduce(rate_seen)
        # DDP broadcasts rank 0's BatchNorm statistics at every forward, but each rank then
        # updated its own copy with its own batch; evaluate with rank 0's, the ones we save.
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        test_loss, test_acc = evaluate(model, test_x, test_y)
        epoch_time = time.perf_counter() - t0
        epoch_times.append(epoch_time)
        left = (args.epochs - epoch - 1) * sum(epoch_times) / len(epoch_times)
        train_loss = (epoch_loss[0] / epoch_loss[1]).item()
        print0(
            f"epoch {epoch + 1}/{args.epochs} | train_loss {train_loss:.4f} "
            f"| test_loss {test_loss:.4f} | test_acc {test_acc:.2f}% "
            f"| {rate_seen.item() / train_time:.0f} samples/s | epoch_time {fmt_time(epoch_time)} "
            f"| time_left {fmt_time(left)}"
        )
        checkpoint(epoch + 1, 0, torch.zeros_like(epoch_loss))
        if epoch + 1 < args.epochs and (stop.agreed(device) or epoch + 1 == args.stop_after_epoch):
            print0(
                f"stop requested: checkpoint saved after epoch {epoch + 1}; "
                f"exiting with {REQUEUE_EXIT_CODE} to be requeued"
            )
            return REQUEUE_EXIT_CODE

    if start_epoch >= args.epochs:  # resumed a finished run: just report it
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        test_loss, test_acc = evaluate(model, test_x, test_y)
        print0(f"nothing to do: {args.checkpoint} has finished all {args.epochs} epochs")
    print0(f"done: test_acc {test_acc:.2f}% after {args.epochs} epochs")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    # Listen for the stop signal first: its default action would kill the process, even
    # while it is still waiting for the other ranks to start.
    stop = StopRequest(signal.SIGUSR1)
    ctx = init_distributed()
    try:
        return train(args, ctx, stop)
    finally:
        cleanup()  # destroy the process group so every rank leaves cleanly


if __name__ == "__main__":
    sys.exit(main())
