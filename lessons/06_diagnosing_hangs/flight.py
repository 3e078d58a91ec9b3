"""Which collective hung? step.py's steps, with torch's flight recorder dumped by every rank.

    --skip-rank R   rank R has no batch at step 2 and skips that step's all_reduce: a branch
                    only one rank takes (uneven data, an early stop decided per rank)

torch's flight recorder keeps each process's last TORCH_FR_BUFFER_SIZE collectives (2000 unless
set; 0 turns it off): group, sequence number, operation, sizes and the Python stack that called
it. Each rank writes its record to TORCH_FR_DUMP_TEMP_FILE<rank> as it ends, whatever happened,
and torch's analyser lines up all ranks' files and names the first collective not all joined:

    python -m torch.distributed.flight_recorder.fr_trace <folder of the files>

With NCCL torch writes these files itself when its watchdog times out
(TORCH_NCCL_DUMP_ON_TIMEOUT=1); with gloo nothing does, so this program asks for the record
(dump_flight_recorder below). On gloo the analyser first needs fr_gloo_fix.py (README).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from step import load_shard, say

from common.env import LaunchError, resolve_launch_env
from common.launch import (
    check_cuda_usable,
    check_launch,
    cpu_threads,
    cuda_device_index,
    dist_timeout,
    init_error_message,
)


def recorder_settings() -> str:
    """The dump file prefix, after checking that the recorder is on; LaunchError if not."""
    size = os.environ.get("TORCH_FR_BUFFER_SIZE", "2000")
    if not size.isdigit() or int(size) == 0:
        raise LaunchError(f"TORCH_FR_BUFFER_SIZE={size!r} turns the flight recorder off (or is not "
                          "a number): set it to the number of collectives to keep, e.g. "
                          "export TORCH_FR_BUFFER_SIZE=2000")  # fmt: skip
    prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", "")
    if not prefix or not os.path.isdir(os.path.dirname(prefix) or "."):
        raise LaunchError(f"TORCH_FR_DUMP_TEMP_FILE={prefix!r} is not a file prefix in an existing "
                          "folder: each rank writes <prefix><rank>; set it to a folder every node "
                          "sees, e.g. export TORCH_FR_DUMP_TEMP_FILE=$PWD/runs/fr/rank_ "
                          "(mkdir -p the folder first)")  # fmt: skip
    return prefix


def dump_flight_recorder(prefix: str, rank: int, backend: str | None = None) -> str:
    """Write BACKEND's (default: the group's) flight recorder to <prefix><rank>, pickled, as NCCL's
    dump on timeout names it (flight_recorder/components/loader.py:33). torch keeps one recorder
    per event type (torch/include/torch/csrc/distributed/c10d/FlightRecorder.hpp: get): NCCL's is
    read by dump_nccl_trace (ProcessGroupNCCL.hpp), gloo's by dump_fr_trace (FlightRecorder.hpp)."""
    c10d, path = torch._C._distributed_c10d, f"{prefix}{rank}"
    nccl = (backend or dist.get_backend()) == "nccl"
    with open(path, "wb") as f:
        f.write((c10d._dump_nccl_trace if nccl else c10d._dump_fr_trace)())
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip-rank", type=int, default=None)
    args = parser.parse_args(argv)

    try:
        prefix = recorder_settings()
        env = resolve_launch_env()
        check_launch(env)
    except LaunchError as exc:
        print(f"flight: {exc}", file=sys.stderr, flush=True)
        return 2
    shard = load_shard(env.rank, None)
    try:
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
            timeout=dist_timeout(),  # a collective nobody answers fails after this, not 30 min
            device_id=device if device.type == "cuda" else None,
        )
    except LaunchError as exc:
        print(f"flight: {exc}", file=sys.stderr, flush=True)
        return 2
    except dist.DistError as exc:  # the others did not all arrive within the timeout
        print(f"flight: {init_error_message(env, exc)}", file=sys.stderr, flush=True)
        return 2
    status = 0
    try:
        for step in range(args.steps):
            grad = shard.to(device) * (env.rank + 1)
            if step == 2 and env.rank == args.skip_rank:
                say(env, f"step {step}: no batch on this rank, skipping the all_reduce")
                continue  # the bug: the others all_reduce, and wait for this rank
            dist.all_reduce(grad)  # the flight recorder notes it: group, sequence number, sizes
            say(env, f"step {step}: all_reduce done ({grad[0].item():g})")
    except RuntimeError as exc:  # gloo: a time-out, or a peer that closed its connections
        say(env, f"step {step}: all_reduce failed: {str(exc).splitlines()[0]}")
        status = 1
    finally:
        # Whatever happened, leave the record behind: it is what the analyser compares.
        say(env, f"flight recorder written to {dump_flight_recorder(prefix, env.rank)}")
    dist.destroy_process_group()
    gc.collect()
    return status


if __name__ == "__main__":
    sys.exit(main())
