"""Lesson 08: lesson 03's DDP training, fed from files by a DataLoader.

Lesson 03 kept MNIST as two tensors in memory. Here each rank reads its share from files (the
folder form or the packed form, see mnist_files.py), through DataLoader workers that decode and
augment while the model trains, and the step is split into the time spent waiting for data,
computing and communicating. From the course root, with PYTHONPATH=.:
    python lessons/08_data_pipeline/train.py --max-steps 50
    torchrun --standalone --nproc-per-node 2 lessons/08_data_pipeline/train.py --form folder
On the cluster: sbatch lessons/08_data_pipeline/job.sh (stages the data to node-local /tmp).
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
from mnist_files import DEFAULT_OUT, DataFormError, RandomShift, open_dataset, seed_worker
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from common.env import LaunchError, resolve_launch_env
from common.launch import (
    check_cuda_usable,
    check_launch,
    cuda_device_index,
    dist_timeout,
    init_error_message,
    process_cpus,
)
from common.mnist import build_model, build_optimizer, normalize


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only, in one write (the ranks share the job's output)."""
    if dist.get_rank() == 0:
        print(" ".join(map(str, args)) + "\n", end="", flush=True, **kwargs)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", type=Path, default=DEFAULT_OUT, help="holds folder/ and packed/")
    p.add_argument("--form", choices=("packed", "folder"), default="packed")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=128, help="global batch, split over ranks")
    p.add_argument("--per-rank-batch", type=int, default=0,
                   help="fix the batch of each rank instead (weak scaling)")  # fmt: skip
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, help="DataLoader workers per rank (default: CPUs - 1)")
    p.add_argument("--prefetch-factor", type=int, default=2, help="batches ready per worker")
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch after N steps")
    p.add_argument("--no-eval", action="store_true", help="skip the test set (scaling runs)")
    p.add_argument("--profile", type=Path, help="trace steps 3-5 with torch.profiler to DIR")
    args = p.parse_args(argv)
    if min(args.epochs, args.batch_size, args.prefetch_factor) < 1 or args.per_rank_batch < 0:
        p.error("--epochs, --batch-size and --prefetch-factor must be at least 1")
    if args.workers is not None and args.workers < 0:
        p.error("--workers must be 0 (load in the training process) or more")
    return args


def make_loader(dataset, sampler, batch: int, workers: int, args, device, rank: int):
    return DataLoader(
        dataset,
        batch_size=batch,
        sampler=sampler,
        num_workers=workers,
        # Workers stay alive from one epoch to the next: no new processes, no reopened files.
        persistent_workers=workers > 0,
        prefetch_factor=args.prefetch_factor if workers > 0 else None,
        # Page-locked batches: the copy to the GPU can run while the GPU computes.
        pin_memory=device.type == "cuda",
        # A generator of its own per worker (seed_worker), and a base seed per rank: else the
        # ranks, which all ran torch.manual_seed(seed), augment their images identically.
        worker_init_fn=seed_worker,
        generator=torch.Generator().manual_seed(args.seed * 1000 + rank),
        # A worker stuck for good (a read from a hung filesystem) would hold this rank, and the
        # job, forever: the other ranks give up at the collective timeout and exit, this one
        # waits for its batch. With a timeout it raises too (0: wait forever, the default).
        timeout=loader_timeout(workers),
    )


def loader_timeout(workers: int) -> float:
    """Seconds a rank waits for one batch from its workers: the collectives' own timeout."""
    return dist_timeout().total_seconds() if workers > 0 else 0


def evaluate_exact(model, dataset, env, device, workers: int) -> tuple[float, float, int]:
    """Every test image scored exactly once: (loss, accuracy %, images scored).

    DistributedSampler pads its indices with repeats so that every rank gets the same number
    (10,000 images on 3 ranks: 3 x 3,334 = 10,002 scored). Evaluation has no collective per
    step, so the ranks may take different numbers of images: rank r takes r, r + W, r + 2W...
    """
    # Every rank scores with rank 0's BatchNorm statistics (lesson 03 says why they differ).
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    shard = Subset(dataset, range(env.rank, len(dataset), env.world_size))
    loader = DataLoader(shard, batch_size=500, num_workers=min(workers, 2),
                        timeout=loader_timeout(min(workers, 2)))
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    with torch.no_grad():
        for images, labels in loader:
            images = normalize(images.to(device))
            labels = labels.to(device)
            logits = model(images)
            sums[0] += F.cross_entropy(logits, labels, reduction="sum").double()
            sums[1] += (logits.argmax(1) == labels).sum()
            sums[2] += len(labels)
    model.train()
    dist.all_reduce(sums)
    count = int(sums[2].item())
    return (sums[0] / count).item(), 100.0 * (sums[1] / count).item(), count


def train(args: argparse.Namespace, env, device: torch.device, cpus: int) -> None:
    # The task's CPUs are shared: one for this process (which on a GPU mostly queues kernels),
    # the rest for workers that read and augment the next batches meanwhile.
    workers = max(cpus - 1, 0) if args.workers is None else args.workers
    torch.set_num_threads(max(cpus - workers, 1))
    train_set = open_dataset(args.form, args.data_dir, "train", RandomShift(seed=args.seed))
    test_set = open_dataset(args.form, args.data_dir, "test")

    per_rank_batch = args.per_rank_batch or max(1, args.batch_size // env.world_size)
    sampler = DistributedSampler(train_set, env.world_size, env.rank, seed=args.seed)
    loader = make_loader(train_set, sampler, per_rank_batch, workers, args, device, env.rank)
    steps = len(loader) if not args.max_steps else min(args.max_steps, len(loader))

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = build_model().to(device)
    optimizer, scheduler = build_optimizer(model, args.lr, args.epochs * steps)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    padded = len(DistributedSampler(test_set, env.world_size, env.rank)) * env.world_size
    print0(
        f"data {args.form} from {args.data_dir}: {len(train_set)} train, {len(test_set)} test "
        f"images; world size {env.world_size} ({env.num_nodes} node(s) x "
        f"{env.local_world_size}), global batch {per_rank_batch * env.world_size} = "
        f"{env.world_size} x {per_rank_batch}, {steps} steps per epoch; per rank {cpus} CPU(s): "
        f"{workers} loader worker(s) + {torch.get_num_threads()} torch thread(s); {device}"
    )

    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        waited = computed = passes = 0.0
        loss_sum = torch.zeros(2, dtype=torch.float64, device=device)
        profiler = start_profiler(args, env, device) if epoch == 0 else None
        batches = iter(loader)
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            if step == 6:  # the first steps start the workers and fill their queues
                t_steady = time.perf_counter()
                waited_before, computed_before, passes_before = waited, computed, passes
            t = time.perf_counter()
            images, labels = next(batches)  # waits only if the workers are behind
            images = normalize(images.to(device, non_blocking=True))  # uint8 over the bus
            labels = labels.to(device, non_blocking=True)
            t_data = time.perf_counter()
            loss = F.cross_entropy(ddp_model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP's all-reduces run here, overlapped with the backward pass
            sync()
            passes += time.perf_counter() - t_data  # forward + backward, all-reduces included
            optimizer.step()
            scheduler.step()
            sync()  # GPU work is queued: wait for it, or the timer measures the queueing
            waited += t_data - t
            computed += time.perf_counter() - t_data
            loss_sum[0] += loss.detach().double() * len(labels)
            loss_sum[1] += len(labels)
            if profiler:
                profiler.step()
        t_end = time.perf_counter()
        if profiler:
            stop_profiler(profiler, args, env)
        dist.all_reduce(loss_sum)
        train_loss = (loss_sum[0] / loss_sum[1]).item()
        line = f"epoch {epoch + 1}/{args.epochs} | train_loss {train_loss:.4f}"
        if steps > 5:
            n = steps - 5
            rate = n * per_rank_batch * env.world_size / (t_end - t_steady)
            ms_data = 1000 * (waited - waited_before) / n
            ms_step = 1000 * (computed - computed_before) / n
            ms_passes = 1000 * (passes - passes_before) / n  # forward + backward only
            line += (f" | {rate:.0f} images/s | per step: data {ms_data:.1f} ms, "
                     f"compute+communication {ms_step:.1f} ms")  # fmt: skip
            alone = compute_only_ms(ddp_model, model, images, labels, sync)
            line += f" (of which communication ~{max(ms_passes - alone, 0.0):.1f} ms)"
        line += f" | epoch_time {t_end - t0:.1f}s"
        print0(line)
        if steps > 5 and args.max_steps:
            print0(f"THROUGHPUT ranks={env.world_size} nodes={env.num_nodes} "
                   f"per_rank_batch={per_rank_batch} images_per_s={rate:.1f}")  # fmt: skip
    if not args.no_eval:
        test_loss, test_acc, count = evaluate_exact(model, test_set, env, device, workers)
        print0(f"test_loss {test_loss:.4f} | test_acc {test_acc:.2f}% | {count} images scored "
               f"once each (a DistributedSampler would have scored {padded})")  # fmt: skip


def compute_only_ms(ddp_model, model, images, labels, sync, repeat: int = 5) -> float:
    """The last step's forward and backward again, without DDP's gradient all-reduce
    (no_sync), in ms: the passes with (almost) no communication; the difference with the real
    step's passes is what communicating cost (not the optimizer's step, timed in neither).
    Gradients and BatchNorm statistics are put back after."""
    buffers = [b.clone() for b in model.buffers()]
    sync()
    t = time.perf_counter()
    for _ in range(repeat):
        with ddp_model.no_sync():  # DDP still broadcasts rank 0's buffers at each forward
            F.cross_entropy(ddp_model(images), labels).backward()
    sync()
    elapsed = time.perf_counter() - t
    ddp_model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for b, saved in zip(model.buffers(), buffers, strict=True):
            b.copy_(saved)
    return 1000 * elapsed / repeat


def start_profiler(args, env, device):
    if not args.profile:
        return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    # Steps 1-2 skipped (workers starting), step 3 warms the profiler up, steps 4-6 recorded.
    schedule = torch.profiler.schedule(wait=2, warmup=1, active=3, repeat=1)
    profiler = torch.profiler.profile(activities=activities, schedule=schedule)
    profiler.start()
    return profiler


def stop_profiler(profiler, args, env) -> None:
    profiler.stop()
    args.profile.mkdir(parents=True, exist_ok=True)
    trace = args.profile / f"rank{env.rank}.json"
    profiler.export_chrome_trace(str(trace))  # open in https://ui.perfetto.dev
    rows = profiler.key_averages()
    table = rows.table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=38)
    print0(f"profile of 3 steps on rank 0 (trace of every rank in {args.profile}):\n{table}")
    # The collectives by name, wherever they rank: on a busy machine they can fall below the
    # table's last row, and the communication is what this profile is read for.
    for row in rows:
        if row.key.startswith(("gloo:", "nccl:")):
            print0(f"collective {row.key}: {row.count} calls in 3 steps, "
                   f"{row.cpu_time_total / 1e3:.1f} ms in all, {row.cpu_time / 1e3:.1f} ms each")


def main(argv=None) -> int:
    args = parse_args(argv)
    env = None
    try:
        env = resolve_launch_env()  # rank, world size, rank 0's address: srun or torchrun
        check_launch(env)
        cpus = process_cpus(env)  # this rank's CPUs, for torch's threads and the loader
        if torch.cuda.is_available():
            device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))
            torch.cuda.set_device(device)  # before the group: NCCL and CUDA use this GPU
        else:
            check_cuda_usable()  # GPUs that torch cannot see are an error, not a CPU run
            device = torch.device("cpu")
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=dist_timeout(),  # bounds the rendezvous and every collective
            device_id=device if device.type == "cuda" else None,
        )
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except dist.DistError as exc:
        print(f"error: {init_error_message(env, exc)}", file=sys.stderr, flush=True)
        return 2
    try:
        train(args, env, device, cpus)
    except DataFormError as exc:  # every rank meets it; rank 0 says it, all exit with 2
        print0(f"error: {exc}", file=sys.stderr)
        dist.barrier()
        return 2
    finally:
        dist.destroy_process_group()
        gc.collect()  # frees DDP's reducer now: at exit, gloo's threads can abort the process
    return 0


if __name__ == "__main__":
    sys.exit(main())
