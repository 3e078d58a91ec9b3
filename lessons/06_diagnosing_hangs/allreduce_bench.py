"""all_reduce bandwidth between the job's processes, message size by message size.

    srun python lessons/06_diagnosing_hangs/allreduce_bench.py            # 1 KiB .. 256 MiB
    torchrun --standalone --nproc-per-node 2 lessons/06_diagnosing_hangs/allreduce_bench.py \\
        --max-bytes 1M

Rank 0 prints one row per size, in the two bandwidths nccl-tests reports (its
doc/PERFORMANCE.md, https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

* algbw = size / time: how fast the collective finishes, seen from the program;
* busbw = algbw x 2(n-1)/n for an all_reduce of n ranks: the traffic each rank's link really
  carries (a ring all_reduce sends and receives 2(n-1)/n times the buffer per rank), so it can
  be compared with the hardware's bandwidth whatever n is.

Below it, this machine's memory-copy bandwidth (one process copying the largest buffer): on one
machine every byte that travels between processes is copied at least once, so no all_reduce
between processes here can beat it. Small messages measure latency (time is nearly constant);
large ones measure bandwidth (time grows with size).
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import time

import torch
import torch.distributed as dist

from common.env import LaunchError, resolve_launch_env
from common.launch import (
    check_cuda_usable,
    check_launch,
    cpu_threads,
    cuda_device_index,
    dist_timeout,
    init_error_message,
)

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s*$")


def parse_size(text: str) -> int:
    """'1K' -> 1024, '256M' -> 268435456, '4096' -> 4096 (powers of 1024, as nccl-tests)."""
    m = re.fullmatch(r"(\d+)\s*([KMG]?)i?B?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4096, 1K, 256M")
    return int(m[1]) * UNITS[m[2].upper()]


def sizes(min_bytes: int, max_bytes: int, factor: int = 4) -> list[int]:
    out, size = [], min_bytes
    while size <= max_bytes:
        out.append(size)
        size *= factor
    return out


def busbw(algbw: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth of an all_reduce: algbw x 2(n-1)/n, so 0 for one rank, whose
    all_reduce sends nothing (its all_reduce.cu, AllReduceGetBw)."""
    return algbw * 2 * (ranks - 1) / ranks


def iterations_for(size: int) -> int:
    """Many repetitions of small messages (microseconds each), a few of large ones."""
    return max(3, min(50, (64 << 20) // size))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_allreduce(buffer: torch.Tensor, iters: int) -> float:
    """Seconds per all_reduce, as the slowest rank saw it (one warm-up first)."""
    dist.all_reduce(buffer)
    _sync(buffer.device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buffer)
    _sync(buffer.device)
    per_call = (time.perf_counter() - start) / iters
    elapsed = torch.tensor([per_call], dtype=torch.float64, device=buffer.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the collective ends with its slowest rank
    return float(elapsed.item())


def memcpy_bandwidth(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Bytes per second of one tensor copy of ``nbytes`` (best of ``repeats``)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def parse_table(text: str) -> list[dict]:
    """The rows of a run's output, for plotting: size, count, time_us, algbw, busbw (GB/s)."""
    rows = []
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            rows.append({"size": int(m[1]), "count": int(m[2]), "time_us": float(m[3]),
                         "algbw": float(m[4]), "busbw": float(m[5])})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=parse_size, default=parse_size("1K"))
    parser.add_argument("--max-bytes", type=parse_size, default=parse_size("256M"))
    args = parser.parse_args(argv)
    if args.min_bytes < 4 or args.max_bytes < args.min_bytes:
        parser.error("--min-bytes must be at least 4 and not above --max-bytes")

    env = None
    try:
        env = resolve_launch_env()
        check_launch(env)
        torch.set_num_threads(cpu_threads(env))
        if torch.cuda.is_available():
            device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))
            torch.cuda.set_device(device)
        else:
            check_cuda_usable()
            device = torch.device("cpu")
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=dist_timeout(),
            device_id=device if device.type == "cuda" else None,
        )
    except LaunchError as exc:
        print(f"allreduce_bench: {exc}", file=sys.stderr, flush=True)
        return 2
    except dist.DistError as exc:
        print(f"allreduce_bench: {init_error_message(env, exc)}", file=sys.stderr, flush=True)
        return 2
    n, is_main = env.world_size, env.rank == 0
    if is_main:
        print(f"# all_reduce, {dist.get_backend()}, {n} ranks on {env.num_nodes} node(s), float32, "
              f"sum; time per call as the slowest rank saw it", flush=True)
        print(f"# {'size (B)':>12} {'count':>10} {'time (us)':>11} {'algbw (GB/s)':>13} "
              f"{'busbw (GB/s)':>13}", flush=True)
        if n == 1:
            print("# 1 rank: nothing leaves this process, so busbw is 0 (as nccl-tests counts "
                  "it) and the times are the call's own cost; run 2 or more ranks", flush=True)
    for size in sizes(args.min_bytes, args.max_bytes):
        buffer = torch.ones(size // 4, dtype=torch.float32, device=device)
        seconds = time_allreduce(buffer, iterations_for(size))
        algbw = size / seconds / 1e9
        if is_main:
            print(f"  {size:>12} {size // 4:>10} {seconds * 1e6:>11.1f} {algbw:>13.3f} "
                  f"{busbw(algbw, n):>13.3f}", flush=True)
        del buffer
    if is_main:
        copy = memcpy_bandwidth(args.max_bytes, device) / 1e9
        limit = ("the ceiling for gloo's traffic between processes of one machine"
                 if device.type == "cpu" else "for scale: between GPUs the links (NVLink, "
                 "InfiniBand) set the limit")  # fmt: skip
        print(f"# memory copy on {env.hostname} ({device.type}, {args.max_bytes} B, one "
              f"process): {copy:.3f} GB/s, {limit}", flush=True)
    dist.destroy_process_group()  # frees the group (it is not a barrier)
    gc.collect()  # what still points at the group goes now, not at exit (lesson 03's train.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
