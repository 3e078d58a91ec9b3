"""Lesson 07: what one rank holds under DDP and under FSDP2, read from the live tensors.

Every process of a world runs this file (memory.sh runs it at 1, 2 and 4 ranks). For each of
DDP, FSDP2 in fp32 and FSDP2 with bf16 parameters it builds lesson 07's model at a size where
the figures matter (width 1024, depth 8: 34 M parameters), takes one AdamW step so that
gradients and optimizer state exist, and prints, per rank, the bytes of the parameters,
gradients and AdamW state this rank holds (a DTensor counts its local shard only), the bytes of
one block while FSDP has gathered it for its forward, and the time of a training step.

    srun --ntasks 2 python lessons/07_fsdp_sharding/memory.py        # in an allocation
    torchrun --standalone --nproc-per-node 2 lessons/07_fsdp_sharding/memory.py --width 256
"""

from __future__ import annotations

import argparse
import gc
import re
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

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
from train import Net, local_bytes, shard_model  # noqa: E402  (this lesson's train.py)

MIB = 2**20
ROW = re.compile(
    r"^memory \| world (?P<world>\d+) \| (?P<wrap>ddp|fsdp) (?P<precision>fp32|bf16) \| "
    r"params (?P<params>[\d.]+) MiB \| grads (?P<grads>[\d.]+) MiB \| "
    r"optimizer (?P<optimizer>[\d.]+) MiB \| total (?P<total>[\d.]+) MiB \| "
    r"gathered block (?P<gathered>[\d.]+) MiB \| step (?P<step>[\d.]+) s$"
)


def parse_rows(text: str) -> list[dict]:
    """The memory lines of an output, as dicts of numbers (for the notebook and the tests)."""
    rows = []
    for m in map(ROW.match, text.splitlines()):
        if m:
            row = {k: float(v) for k, v in m.groupdict().items() if k not in ("wrap", "precision")}
            row.update(world=int(row["world"]), wrap=m["wrap"], precision=m["precision"])
            rows.append(row)
    return rows


def build(wrap: str, precision: str, width: int, depth: int, device: torch.device):
    if wrap == "ddp":
        # DDP needs the whole model on every rank before it starts: that is its memory floor.
        torch.manual_seed(0)
        model = Net(width, depth).to(device)
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # A model that does not fit one rank is never built whole: on the meta device its
    # parameters have shapes but no storage, fully_shard turns them into DTensor shards, and
    # to_empty allocates this rank's shards only, which are then initialised in place.
    with torch.device("meta"):
        model = Net(width, depth)
    shard_model(model, precision)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        # On CPU each rank fills its shards from its own generator ("DTensor random operators
        # may not have complete support on cpu"): fine for measuring memory; on GPUs DTensor's
        # RNG tracker gives each shard its slice of one random stream (lesson README, pitfalls).
        warnings.simplefilter("ignore")
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model


def measure(wrap, precision, args, env, device) -> dict:
    model = build(wrap, precision, args.width, args.depth, device)
    net = model.module if wrap == "ddp" else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gathered = []
    # While the block's forward runs, FSDP2 has replaced its shards by the full (unsharded)
    # parameters in the compute dtype: what every rank holds for that moment.
    block = net.blocks[0]
    hook = block.fc1.register_forward_hook(  # inside the block's forward
        lambda mod, inp, out: gathered.append(local_bytes(block.parameters()))
    )
    x = torch.randn(args.batch, 28 * 28, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)
    times = []
    for i in range(args.steps + 1):  # the first step allocates gradients and AdamW's state
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if i < args.steps:
            optimizer.zero_grad(set_to_none=False)  # keep the gradients to count them
    hook.remove()
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    held = torch.tensor(
        [local_bytes(params), local_bytes(p.grad for p in params if p.grad is not None),
         local_bytes(state), gathered[-1] if wrap == "fsdp" else 0, min(times[1:])],
        dtype=torch.float64, device=device,
    )  # fmt: skip
    dist.all_reduce(held, op=dist.ReduceOp.MAX)  # the rank that holds the most (shards differ)
    del model, net, optimizer, params, state
    gc.collect()
    return dict(zip(("params", "grads", "optimizer", "gathered", "step"), held.tolist(),
                    strict=True))  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--batch", type=int, default=32, help="images per rank in a step")
    p.add_argument("--steps", type=int, default=2, help="timed steps after the first")
    args = p.parse_args(argv)
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
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except dist.DistError as exc:
        print(f"error: {init_error_message(env, exc)}", file=sys.stderr, flush=True)
        return 2
    try:
        n = sum(p.numel() for p in Net(args.width, args.depth).parameters())
        if env.rank == 0:
            print(f"world size {env.world_size} ({env.num_nodes} node(s) x "
                  f"{env.local_world_size}), model width {args.width} depth {args.depth}: "
                  f"{n / 1e6:.1f} M parameters, {n * 4 / MIB:.1f} MiB in fp32; AdamW; "
                  f"device {device}, backend {dist.get_backend()}", flush=True)  # fmt: skip
        for wrap, precision in (("ddp", "fp32"), ("fsdp", "fp32"), ("fsdp", "bf16")):
            m = measure(wrap, precision, args, env, device)
            total = m["params"] + m["grads"] + m["optimizer"]
            if env.rank == 0:
                print(f"memory | world {env.world_size} | {wrap} {precision} | params "
                      f"{m['params'] / MIB:.1f} MiB | grads {m['grads'] / MIB:.1f} MiB | "
                      f"optimizer {m['optimizer'] / MIB:.1f} MiB | total {total / MIB:.1f} MiB "
                      f"| gathered block {m['gathered'] / MIB:.1f} MiB | step "
                      f"{m['step']:.3f} s", flush=True)  # fmt: skip
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
