"""Lesson 10, parts 1 and 2: the step fit.py estimates, run for real, the estimate beside the
measured peak on every rank; with --ac, activation checkpointing per block.

Every process of a world runs this file (fit.sh: 1 rank, then FSDP2 over 2 and 4 ranks). Each
rank first asks fit.py's estimate for its own world (under FakeTensorMode, on the real mesh:
nothing is allocated and the collectives are faked), then builds the model and runs the same
two training steps under torch.profiler with profile_memory=True, which records every
allocation and free of torch's allocator: their running sum's maximum is the measured peak.

    srun --ntasks 4 python lessons/10_fit_and_keep/step.py --ac       # in an allocation
    torchrun --standalone --nproc-per-node 2 lessons/10_fit_and_keep/step.py --model tiny
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from common.env import LaunchError, resolve_launch_env
from common.launch import (
    check_cuda_usable,
    check_launch,
    cpu_threads,
    cuda_device_index,
    dist_timeout,
    init_error_message,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fit import DEFAULT_BATCH, MIB, build, count, estimate, parse_or_why  # noqa: E402
from model import CONFIGS, loss_fn, random_batch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], exit_on_error=False)
    p.add_argument("--model", default="lesson", help=f"one of {', '.join(CONFIGS)}")
    p.add_argument("--batch", type=count("--batch", "sequences per rank", "the model's"),
                   help="sequences per rank (default: the model's)")  # fmt: skip
    p.add_argument("--seq-len", type=count("--seq-len", "tokens per sequence", "the model's"),
                   help="tokens per sequence (default: the model's)")  # fmt: skip
    p.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    return parse_or_why(p, argv)  # a refused value: args.why, said by rank 0 (main)


def check_args(args) -> str:
    """Why the arguments cannot be run, in one line; empty when they can."""
    if args.why:
        return args.why
    if args.model not in CONFIGS:
        return f"--model {args.model} is not one of {', '.join(CONFIGS)}: pass e.g. --model tiny"
    if args.model == "llama3-8b":
        return ("--model llama3-8b does not fit this machine (fit.py says how many GPUs it "
                "needs): pass --model lesson or tiny")  # fmt: skip
    batch, seq_len = DEFAULT_BATCH[args.model]
    args.batch = batch if args.batch is None else args.batch
    args.seq_len = seq_len if args.seq_len is None else args.seq_len
    limit = CONFIGS[args.model].seq_len
    if args.seq_len > limit:
        return f"--seq-len {args.seq_len}: pass a --seq-len from 1 to {limit}"
    return ""


def measured_peak(prof, device) -> int:
    """The allocator's peak, from the profiler's memory events: each allocation (+bytes) and
    free (-bytes) in time order, summed; the largest sum. Counted from the profiler's start,
    which is before the model is built: everything the step holds is in it."""
    kind = device.type.upper()  # the events of this device only (CPU, or CUDA)
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type().name == kind]  # fmt: skip
    held = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        held += e.nbytes()
        peak = max(peak, held)
    return peak


def digest(tensors) -> str:
    """A fingerprint of these bytes: equal digests, bitwise equal tensors."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def run(args, env, device) -> int:
    c = CONFIGS[args.model]
    world = env.world_size
    # One rank: the plain model. More: FSDP2 over a 1-D mesh of all of them.
    mesh = init_device_mesh(device.type, (world,)) if world > 1 else None
    t0 = time.perf_counter()
    est = estimate(c, mesh, args.batch, args.seq_len, args.ac, bf16=False, device=device)
    t_est = time.perf_counter() - t0
    grads, losses = "", []
    # The profiler's own log lines (started, stopped, no GPU found) would bury the results.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        model, optimizer = build(c, mesh, args.ac, False, device)
        x, y = random_batch(c, args.batch, args.seq_len, 1000 + env.rank, device)
        t0 = time.perf_counter()
        for _ in range(2):  # the two steps the estimate ran
            loss = loss_fn(model(x), y)
            loss.backward()
            # The gradients this rank holds (its shards under FSDP2), before the update.
            grads = digest(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                           for p in model.parameters())  # fmt: skip
            losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        t_step = (time.perf_counter() - t0) / 2
    measured = measured_peak(prof, device)
    if env.rank == 0:
        form = f"FSDP2 over {world} ranks" if world > 1 else "1 process, no FSDP"
        print(f"model {args.model}, {form} on {env.num_nodes} node(s), batch {args.batch} x "
              f"{args.seq_len}, activation checkpointing {'on' if args.ac else 'off'}; "
              f"estimate {est['peak'] / MIB:.1f} MiB (params {est['params'] / MIB:.1f}, "
              f"gathered {est['gathered'] / MIB:.1f}, grads {est['grads'] / MIB:.1f}, optimizer "
              f"{est['optimizer'] / MIB:.1f}, activations saved by the forward "
              f"{est['saved'] / MIB:.1f}), in {t_est:.1f} s", flush=True)  # fmt: skip
    line = (f"rank {env.rank}: estimate {est['peak'] / MIB:.1f} MiB | measured "
            f"{measured / MIB:.1f} MiB | {est['peak'] / measured - 1:+.1%} | step {t_step:.2f} s "
            f"| losses {' '.join(v.hex() for v in losses)} | grads {grads}")
    # One line per rank, each in its turn (srun merges the nodes' outputs as they come, so the
    # lines of two nodes may still arrive out of rank order).
    for r in range(world):
        if r == env.rank:
            print(line, flush=True)
        dist.barrier()
    del model, optimizer
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
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
        # Bad arguments are refused before the process group, by every rank, in one line.
        if why := check_args(args):
            raise LaunchError(why)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=dist_timeout(),
            device_id=device if device.type == "cuda" else None,
        )
    except LaunchError as exc:
        if env is None or env.rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except dist.DistError as exc:
        print(f"error: {init_error_message(env, exc)}", file=sys.stderr, flush=True)
        return 2
    try:
        return run(args, env, device)
    finally:
        dist.destroy_process_group()
        gc.collect()  # the mesh and the DTensors go now, not at exit (lesson 09's tp.py)


if __name__ == "__main__":
    sys.exit(main())
