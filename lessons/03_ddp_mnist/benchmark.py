"""Lesson 03 benchmark: what DDP costs, and how fast our recipe reaches 99 % on MNIST.

Prints figures (it checks nothing). On one machine, with the same model and global batch:

1. training throughput (samples/s) of a plain single-process loop and of DDP with world size
   1, 2 and 4 (gloo, processes started with torch.multiprocessing.spawn, one CPU thread per
   process by default, as one GPU per process); DDP at world size 1 should cost almost nothing
   over the plain loop, and more processes help only as long as there are cores for them;
2. time to 99.0 % test accuracy, single process, for this lesson's recipe and for the reference
   recipe of pytorch/examples' mnist (its Net, Adadelta lr 1.0, StepLR gamma 0.7, batch 64),
   both measured in this run, evaluating on the full test set after every epoch.

    python lessons/03_ddp_mnist/benchmark.py              # everything (about 10 minutes on 2 cores)
    python lessons/03_ddp_mnist/benchmark.py --skip-accuracy --steps 30   # throughput only, quick
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # the course root (common/)
from common.env import find_free_port, resolve_launch_env  # noqa: E402
from common.launch import check_launch, dist_timeout  # noqa: E402
from common.mnist import build_model, build_optimizer, load_data, load_mnist  # noqa: E402

GLOBAL_BATCH = 128  # train.py's default


# --------------------------------------------------------------------------- throughput


def timed_steps(model, optimizer, x, y, batch, warmup, steps, sync=None) -> float:
    """samples/s of `steps` optimizer steps (after `warmup` untimed ones) on this process."""
    g = torch.Generator().manual_seed(0)
    for i in range(warmup + steps):
        if i == warmup:
            if sync:
                sync()
            t0 = time.perf_counter()
        idx = torch.randint(len(x), (batch,), generator=g)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    if sync:
        sync()
    return steps * batch / (time.perf_counter() - t0)


def join_group(index: int, nprocs: int):
    """train.py's set-up, on the CPU with gloo (the benchmark measures this machine)."""
    env = resolve_launch_env(spawn_index=index, spawn_nprocs=nprocs)
    check_launch(env)
    dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size, timeout=dist_timeout())
    return env


def _worker(index, nprocs, use_ddp, threads, warmup, steps, results):
    if use_ddp:
        env = join_group(index, nprocs)
    torch.set_num_threads(threads)
    x, y, _, _ = load_data(torch.device("cpu"), train_subset=8192, test_subset=1)
    torch.manual_seed(0)
    model = build_model()
    optimizer, _ = build_optimizer(model, 1e-2, total_steps=warmup + steps + 1)
    batch = GLOBAL_BATCH // nprocs
    if use_ddp:
        rate = timed_steps(DDP(model), optimizer, x, y, batch, warmup, steps, sync=dist.barrier)
        if env.rank == 0:
            results.put(rate * nprocs)  # every rank processed `batch` samples per step
        dist.destroy_process_group()
    else:
        results.put(timed_steps(model, optimizer, x, y, batch, warmup, steps))


def _paired_worker(index, threads, warmup, steps, rounds, results):
    """Plain loop and DDP (world size 1) in one process, timed in alternating blocks.

    On a shared machine the speed changes from minute to minute; alternating short blocks
    exposes both variants to the same conditions, so their ratio is what DDP itself costs.
    """
    join_group(index, 1)
    torch.set_num_threads(threads)
    x, y, _, _ = load_data(torch.device("cpu"), train_subset=8192, test_subset=1)
    variants = {}
    for name in ("plain", "ddp"):
        torch.manual_seed(0)
        model = build_model()
        optimizer, _ = build_optimizer(model, 1e-2, total_steps=10**6)
        model = DDP(model) if name == "ddp" else model
        timed_steps(model, optimizer, x, y, GLOBAL_BATCH, 0, warmup)
        variants[name] = (model, optimizer)
    seconds = dict.fromkeys(variants, 0.0)
    for r in range(rounds):
        for name in list(variants)[:: 1 if r % 2 == 0 else -1]:
            rate = timed_steps(*variants[name], x, y, GLOBAL_BATCH, 0, steps)
            seconds[name] += steps * GLOBAL_BATCH / rate
    results.put({name: rounds * steps * GLOBAL_BATCH / t for name, t in seconds.items()})
    dist.destroy_process_group()


def _spawn(fn, nprocs, *args):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(find_free_port())
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(fn, args=(*args, results), nprocs=nprocs)
    return results.get()


def throughput(nprocs: int, use_ddp: bool, threads: int, warmup: int, steps: int) -> float:
    """Global samples/s, measured in fresh processes (all configurations start alike)."""
    return _spawn(_worker, nprocs, nprocs, use_ddp, threads, warmup, steps)


def plain_vs_ddp1(threads: int, warmup: int, steps: int, rounds: int) -> dict:
    return _spawn(_paired_worker, 1, threads, warmup, steps, rounds)


# --------------------------------------------------------------------------- time to 99 %


class ReferenceNet(nn.Module):
    """The network of pytorch/examples' mnist/main.py (two convs, dropout, two linears)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


@torch.no_grad()
def accuracy(model, x, y) -> float:
    model.eval()
    correct = sum((model(xb).argmax(1) == yb).sum().item() for xb, yb in
                  zip(x.split(1000), y.split(1000), strict=True))  # fmt: skip
    model.train()
    return 100.0 * correct / len(x)


def time_to_target(name, model, optimizer, scheduler, per_batch_schedule, loss_fn, batch,
                   max_epochs, target, data) -> tuple[float | None, list]:  # fmt: skip
    """Train epoch by epoch; return the wall time (training + evaluations) to `target` %."""
    train_x, train_y, test_x, test_y = data
    g = torch.Generator().manual_seed(0)
    history, reached = [], None
    t0 = time.perf_counter()
    for epoch in range(1, max_epochs + 1):
        for idx in torch.randperm(len(train_x), generator=g).split(batch):
            loss = loss_fn(model(train_x[idx]), train_y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if per_batch_schedule:
                scheduler.step()
        if not per_batch_schedule:
            scheduler.step()
        acc = accuracy(model, test_x, test_y)
        elapsed = time.perf_counter() - t0
        history.append((epoch, acc, elapsed))
        print(f"  {name}: epoch {epoch} test_acc {acc:.2f}% at {elapsed:.1f}s", flush=True)
        if acc >= target:
            reached = elapsed
            break
    return reached, history


# --------------------------------------------------------------------------- main


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0))
    return (f"{cpu}, {cores} cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150, help="timed steps per throughput run")
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--repeats", type=int, default=3, help="runs per world size > 1")
    p.add_argument("--rounds", type=int, default=10, help="alternating plain/DDP blocks")
    p.add_argument("--world-sizes", default="1,2,4")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads per process (1: one core per process, as one GPU per process)",
    )
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-accuracy", action="store_true")
    p.add_argument("--target", type=float, default=99.0)
    p.add_argument("--epochs", type=int, default=3, help="our recipe's epochs (train.py default)")
    p.add_argument("--ref-max-epochs", type=int, default=14, help="pytorch/examples' default")
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"machine: {machine()}", flush=True)

    if not args.skip_throughput:
        print(f"\nthroughput, global batch {GLOBAL_BATCH}, {args.threads} thread(s) per process, "
              f"{cores} cores:", flush=True)  # fmt: skip
        block = max(1, args.steps // 5)
        pair = plain_vs_ddp1(args.threads, args.warmup, block, args.rounds)
        plain = pair["plain"]
        rows = [("plain loop, 1 process", plain), ("DDP, world size 1", pair["ddp"])]
        for n in map(int, args.world_sizes.split(",")):
            if n > 1:
                rates = [throughput(n, True, args.threads, args.warmup, args.steps)
                         for _ in range(args.repeats)]  # fmt: skip
                rows.append((f"DDP, world size {n}", max(rates)))
        for name, rate in rows:
            print(f"  {name:24s} {rate:8.0f} samples/s  {100 * rate / plain:5.1f} % of plain")
        print(f"  (plain and world size 1: one process, alternating blocks of {block} steps, "
              f"{block * args.rounds} steps each; larger worlds: best of "
              f"{args.repeats} runs of {args.steps} steps)")  # fmt: skip

    if not args.skip_accuracy:
        torch.set_num_threads(args.threads)
        device = torch.device("cpu")
        data = load_data(device)
        print(f"\ntime to {args.target} % test accuracy, 1 process, {args.threads} thread(s), "
              f"evaluated after every epoch:", flush=True)  # fmt: skip

        torch.manual_seed(0)
        ours = build_model()
        steps = -(-len(data[0]) // GLOBAL_BATCH)
        opt, sched = build_optimizer(ours, 1e-2, args.epochs * steps)
        t_ours, h_ours = time_to_target("ours", ours, opt, sched, True, F.cross_entropy,
                                        GLOBAL_BATCH, args.epochs, args.target, data)  # fmt: skip

        torch.manual_seed(1)  # pytorch/examples' default seed
        ref = ReferenceNet()
        opt = torch.optim.Adadelta(ref.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
        t_ref, h_ref = time_to_target("reference", ref, opt, sched, False, F.nll_loss, 64,
                                      args.ref_max_epochs, args.target, data)  # fmt: skip

        def show(label, t, history):
            epoch, acc, _ = history[-1]
            when = f"{t:7.1f} s (epoch {epoch}, {acc:.2f} %)" if t else "not reached"
            print(f"  {label:66s} {when}")

        print()
        show(f"ours: small CNN + BatchNorm, AdamW + one-cycle, batch {GLOBAL_BATCH}, "
             f"{args.epochs} ep.", t_ours, h_ours)  # fmt: skip
        show("reference: pytorch/examples Net, Adadelta lr 1.0, StepLR 0.7, batch 64",
             t_ref, h_ref)  # fmt: skip
        if t_ours and t_ref:
            print(f"  ratio ours / reference: {t_ours / t_ref:.2f} (1/{t_ref / t_ours:.1f})")


if __name__ == "__main__":
    # The loaded MNIST is not needed here; just fail early with the usual message if it is missing.
    load_mnist(train=False)
    main()
