"""Hello world from every process of a distributed job, whoever started it.

Prints one line per process:

    [<master_addr>:<port>] hello from <host>:<backend> process <rank>/<world>

The same file runs under every launcher of this lesson (see README.md):

    python -m torch.distributed.launch --nproc_per_node 2 lessons/02_launch_vs_srun/hello.py
    torchrun --standalone --nproc_per_node 2 lessons/02_launch_vs_srun/hello.py
    srun --ntasks-per-node 2 python lessons/02_launch_vs_srun/hello.py
    python lessons/02_launch_vs_srun/hello.py          # alone: process 0/1
"""

from __future__ import annotations

import argparse
import gc
import sys

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


def say(text: str) -> None:
    # One write per line: the processes share one output file, and print()'s separate write
    # of the newline would let their lines run into each other.
    print(text + "\n", end="", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # torch.distributed.launch (without --use-env) appends `--local-rank=N` to our command
    # line; torchrun and srun never do. Accept both spellings so the script runs under all of
    # them, but take the rank from common/, which reads LOCAL_RANK from the environment.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None,
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    try:
        env = resolve_launch_env()
        check_launch(env)
    except LaunchError as exc:
        print(f"hello: {exc}", file=sys.stderr, flush=True)
        return 2
    if args.local_rank is not None and args.local_rank != env.local_rank:
        print(f"hello: --local-rank={args.local_rank} but LOCAL_RANK={env.local_rank}",
              file=sys.stderr)
        return 2

    # init_process_group returns once all `world_size` processes reached the master's store.
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
            timeout=dist_timeout(),
            device_id=device if device.type == "cuda" else None,
        )
    except LaunchError as exc:
        print(f"hello: {exc}", file=sys.stderr, flush=True)
        return 2
    except dist.DistError as exc:  # the rendezvous did not complete: one line, no traceback
        print(f"hello: {init_error_message(env, exc)}", file=sys.stderr, flush=True)
        return 2
    # Make sure the world is really connected: everybody contributes 1, the sum is the size.
    count = torch.ones(1, device=device)
    dist.all_reduce(count)
    if int(count.item()) != env.world_size:
        print(f"hello: all_reduce counted {int(count.item())} processes, "
              f"expected {env.world_size}", file=sys.stderr)
        dist.destroy_process_group()
        return 1
    say(f"[{env.master_addr}:{env.master_port}] hello from {env.hostname}:{dist.get_backend()} "
        f"process {env.rank}/{env.world_size}")
    dist.destroy_process_group()  # frees the group (it is not a barrier)
    gc.collect()  # what still points at the group goes now, not at exit (lesson 03's train.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
