"""Lesson 09: pipeline parallelism with torch.distributed.pipelining, and its bubble.

Every process of the job runs this file (srun starts one per task, see pp.sh). The model's
layers are cut into stages, one per rank (two per rank with --schedule interleaved); a batch
is cut into microbatches that flow through the stages, rank to rank, by point-to-point
sends. No rank holds the whole model, and only activations at the cuts cross the network.
The price is the bubble: while the first microbatch travels down the pipeline (and its
gradient back up) the other stages wait. With p stages and m microbatches each rank is idle
for about (p-1)/(m+p-1) of the step; this script measures it for several m.

Without SLURM, on one machine (CPU, gloo), from the course root with the venv active:
    torchrun --standalone --nproc-per-node 2 lessons/09_beyond_data_parallel/pp.py
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tinylm import TinyLM, batch, corpus, loss_fn  # noqa: E402

from common.env import LaunchError, resolve_launch_env  # noqa: E402
from common.launch import check_launch, cuda_device_index, dist_timeout  # noqa: E402

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", type=lambda s: s.split(","), default=["gpipe", "1f1b"],
                   help="comma-separated: gpipe, 1f1b, interleaved (2 stages a rank)")  # fmt: skip
    p.add_argument("--microbatches", type=int_list, default=[4, 8, 16],
                   help="comma-separated microbatch counts to run and time")  # fmt: skip
    p.add_argument("--microbatch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed steps per (schedule, count)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--compute-ms", type=float, default=0,
                   help="fixed work per microbatch and stage, in ms (2x in backward)")  # fmt: skip
    return p.parse_args(argv)


def check_args(args, world_size: int) -> str:
    """Why this pipeline cannot run, as one line (empty when it can)."""
    if unknown := [s for s in args.schedule if s not in SCHEDULES]:
        return (f"--schedule {unknown[0]} is not one of {', '.join(SCHEDULES)}: pass e.g. "
                "--schedule gpipe,1f1b")  # fmt: skip
    for s in args.schedule:
        stages = world_size * (2 if s == "interleaved" else 1)
        if stages > args.layers:
            return (f"--schedule {s} on {world_size} ranks needs {stages} stages but the model "
                    f"has --layers {args.layers}: a stage needs at least one layer; pass "
                    f"--layers {stages} or more, or run on fewer ranks")  # fmt: skip
        # Fewer microbatches than stages is a valid pipeline (every microbatch still passes
        # through every stage; the bubble grows): GPipe and interleaved 1F1B run it. Only
        # Schedule1F1B's constructor raises a ValueError for it, so only 1f1b is refused here.
        if s == "1f1b" and (short := min(args.microbatches)) < stages:
            return (f"--schedule 1f1b with --microbatches {short} on {stages} stages: torch's "
                    "Schedule1F1B needs at least one microbatch per stage; pass --microbatches "
                    f"{stages} or more, or --schedule gpipe, which runs fewer")  # fmt: skip
    return ""


def build_stage(args, stage_index: int, num_stages: int, device) -> TinyLM:
    """The whole model on every rank (same seed, so the same weights as one process would
    have), then everything that is not this stage's is dropped: a manual split."""
    torch.manual_seed(0)
    model = TinyLM(args.dim, args.heads, args.hidden, args.layers, args.seq_len)
    first = stage_index * args.layers // num_stages
    last = (stage_index + 1) * args.layers // num_stages
    for i in range(args.layers):
        if not first <= i < last:
            del model.layers[str(i)]
    if stage_index > 0:
        model.tok_embeddings = model.pos_embeddings = None
    if stage_index < num_stages - 1:
        model.norm = model.output = None
    return model.to(device)


class FixedWork(torch.autograd.Function):
    """A stand-in for compute that takes the same time however busy the machine is: sleep
    `seconds` in the forward and twice that in the backward (a backward costs about two
    forwards). Where the ranks share a few cores, real compute times mix the schedule's
    bubble with the ranks' contention for the cores; sleeping ranks do not contend."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        return grad, None


class WithFixedWork(torch.nn.Module):
    def __init__(self, stage: TinyLM, seconds: float):
        super().__init__()
        self.stage, self.seconds = stage, seconds

    def forward(self, x):
        return FixedWork.apply(self.stage(x), self.seconds)


def time_stage_alone(module: torch.nn.Module, args, device, is_first: bool, is_last: bool) -> float:
    """Seconds of one microbatch's forward and backward through this stage, with no waiting
    and no sends: the work a rank does per microbatch when the pipeline is full."""
    mb, t = args.microbatch_size, args.seq_len
    x = (torch.randint(128, (mb, t)) if is_first else torch.randn(mb, t, args.dim,
                                                                   requires_grad=True))  # fmt: skip
    x = x.to(device)
    times = []
    for _ in range(12):
        t0 = time.perf_counter()
        out = module(x)
        if is_last:
            loss_fn(out, torch.randint(128, (mb, t), device=device)).backward()
        else:
            out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - t0)
    module.zero_grad()
    return statistics.median(times[2:])  # the first runs warm up: not counted


def print0(*args) -> None:
    if dist.get_rank() == 0:
        print(" ".join(map(str, args)) + "\n", end="", flush=True)


def run(args, env, device) -> int:
    rank, world = env.rank, env.world_size
    data = corpus()
    gen = torch.Generator().manual_seed(1000)  # every rank draws the same batches
    print0(f"{world} ranks, {args.layers} layers, microbatch {args.microbatch_size} x "
           f"{args.seq_len} bytes; expected bubble (idle share of a rank): (p-1)/(m+p-1), "
           "interleaved (p-1)/(2m+p-1), or 1-2m/(2p+m-1) if m < p"
           + (f"; fixed work {args.compute_ms:g} ms per microbatch and stage" if args.compute_ms
              else ""))  # fmt: skip
    print0(f"{'schedule':>11} {'stages':>6} {'m':>3} {'step s':>7} {'busy s':>7} "
           f"{'bubble':>7} {'expected':>13} {'loss':>6}")  # fmt: skip
    for name in args.schedule:
        per_rank = 2 if name == "interleaved" else 1
        num_stages = world * per_rank
        # Interleaved: rank r holds stages r and r + world (a loop through the ranks twice).
        indices = [rank + k * world for k in range(per_rank)]
        modules = [build_stage(args, i, num_stages, device) for i in indices]
        if args.compute_ms:
            modules = [WithFixedWork(mod, args.compute_ms / 1000) for mod in modules]
        stages = [PipelineStage(m, i, num_stages, device) for m, i in zip(modules, indices,
                                                                          strict=True)]  # fmt: skip
        params = [p for m in modules for p in m.parameters()]
        optimizer = torch.optim.AdamW(params, lr=args.lr)
        for m in args.microbatches:
            schedule = (SCHEDULES[name](stages, m, loss_fn=loss_fn) if per_rank > 1
                        else SCHEDULES[name](stages[0], m, loss_fn=loss_fn))  # fmt: skip
            times, losses = [], []
            for step in range(args.steps + 2):  # the first 2 steps warm up: not timed
                x, y = (t.to(device) for t in batch(data, m * args.microbatch_size,
                                                    args.seq_len, gen))  # fmt: skip
                mb_losses: list[torch.Tensor] = []
                dist.barrier()  # every rank starts the step together: a fair clock
                t0 = time.perf_counter()
                # The batch goes in at stage 0 and the targets at the last stage; the schedule
                # cuts both into m microbatches. A rank with neither passes nothing.
                schedule.step(*([x] if 0 in indices else []),
                              **({"target": y, "losses": mb_losses}
                                 if num_stages - 1 in indices else {}))  # fmt: skip
                optimizer.step()
                optimizer.zero_grad()
                if step >= 2:
                    times.append(time.perf_counter() - t0)
                if mb_losses:
                    losses.append(torch.stack(mb_losses).mean().item())
            # This rank's work per microbatch, timed right after the steps (under the same load
            # from the other ranks on this machine), all ranks at once.
            dist.barrier()
            busy_one = sum(time_stage_alone(mod, args, device, i == 0, i == num_stages - 1)
                           for mod, i in zip(modules, indices, strict=True))  # fmt: skip
            # The slowest rank sets the step time; the busiest sets the work done.
            # On the device: NCCL reduces GPU tensors only (gloo takes either).
            stats = torch.tensor([statistics.median(times), m * busy_one, losses[-1]
                                  if losses else 0.0], device=device)  # fmt: skip
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            step_s, busy_s, loss = stats.tolist()
            # In slots of one piece of work (v pieces a microbatch, v = stages per rank): with
            # m >= p a rank works v·m slots after a fill of p - 1; with m < p (GPipe and
            # interleaved run it) a microbatch's loop through the p ranks ends before the rank's
            # next stage can start, so the step lasts v·p + m - 1. For v = 1 both are m + p - 1.
            p, v = world, per_rank
            expected = 1 - v * m / (v * max(m, p) + min(m, p) - 1)
            print0(f"{name:>11} {num_stages:>6} {m:>3} {step_s:7.3f} {busy_s:7.3f} "
                   f"{1 - busy_s / step_s:7.0%} {expected:13.0%} {loss:6.3f}")  # fmt: skip
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        # Who am I: rank, world size (by node from SLURM_NODEID, SLURM_LOCALID under srun; RANK,
        # WORLD_SIZE under torchrun), checked by common/env.py.
        env = resolve_launch_env()
        check_launch(env)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    # Bad shapes are refused before the process group, by every rank, in one line.
    if why := check_args(args, env.world_size):
        if env.rank == 0:
            print(f"error: {why}", file=sys.stderr, flush=True)
        return 2
    try:
        if torch.cuda.is_available():
            device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))
            torch.cuda.set_device(device)  # before the group: NCCL's sends use this GPU
        else:
            device = torch.device("cpu")
    except LaunchError as exc:  # two ranks on one GPU, say
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(1)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=dist_timeout(),  # bounds the rendezvous and every send and receive
        device_id=device if device.type == "cuda" else None,
    )
    try:
        return run(args, env, device)
    finally:
        dist.destroy_process_group()  # frees the group's resources (it is not a barrier)
        # What still points at the destroyed groups (the mesh, DTensors in reference cycles)
        # goes now: left to interpreter exit, gloo's threads can abort the process (exit -6).
        gc.collect()


if __name__ == "__main__":
    sys.exit(main())
