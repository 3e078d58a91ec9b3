"""A few steps of "training" that can be made to fail the classic ways.

Every step all_reduces a gradient-sized tensor, which is what DDP does in backward(). The
options break one rank on purpose, so the lesson's job scripts can show what each failure looks
like in a job's output:

    --crash-rank R      rank R dies before joining the process group (a file missing on its node)
    --hang-rank R       rank R never reaches step 2's all_reduce (a deadlock, a stuck reader)
    --mismatch-rank R   rank R calls broadcast at step 2 where the others call all_reduce

Every rank registers faulthandler on SIGUSR1: `scancel --signal=USR1 <job>.<step>` (or
`kill -USR1 <pid>`) prints the Python stack of every thread of every rank, without stopping
them. `--watchdog S` also prints them by itself when the run has not finished after S seconds.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import signal
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


def say(env, text: str) -> None:
    # One write per line: every rank writes into the same job output file.
    print(f"rank {env.rank}/{env.world_size} on {env.hostname}: {text}\n", end="", flush=True)


def load_shard(rank: int, crash_rank: int | None) -> torch.Tensor:
    """Stands for reading this rank's data; the crash is an error only one rank meets."""
    if rank == crash_rank:
        raise FileNotFoundError(f"/data/shard-{rank}.pt (missing on this node)")
    return torch.ones(1024)


def wait_for_lock_forever() -> None:
    """A rank stuck in its own code (a lock never released, a reader waiting on a dead pipe)."""
    while True:
        time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--crash-rank", type=int, default=None)
    parser.add_argument("--hang-rank", type=int, default=None)
    parser.add_argument("--mismatch-rank", type=int, default=None)
    parser.add_argument("--watchdog", type=float, default=None,
                        help="dump every thread's stack after this many seconds")
    parser.add_argument("--pid-dir", help="write <host>-rank<R>.pid here, for py-spy on each node")
    args = parser.parse_args(argv)

    # Ask for stacks from outside (kill -USR1 / scancel --signal=USR1), or after a deadline.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.watchdog:
        faulthandler.dump_traceback_later(args.watchdog, exit=False)

    try:
        env = resolve_launch_env()
        check_launch(env)
    except LaunchError as exc:
        print(f"step: {exc}", file=sys.stderr, flush=True)
        return 2
    say(env, f"pid {os.getpid()}")
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, f"{env.hostname}-rank{env.rank}.pid"), "w") as f:
            f.write(f"{os.getpid()}\n")
    shard = load_shard(env.rank, args.crash_rank)  # the crash happens here, before the group

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
        print(f"step: {exc}", file=sys.stderr, flush=True)
        return 2
    except dist.DistError as exc:  # the others did not all arrive within the timeout
        print(f"step: {init_error_message(env, exc)}", file=sys.stderr, flush=True)
        return 2
    for step in range(args.steps):
        grad = shard.to(device) * (env.rank + 1)  # on the GPU with NCCL, else the CPU
        if step == 2 and env.rank == args.hang_rank:
            say(env, f"step {step}: stuck before the all_reduce")
            wait_for_lock_forever()
        if step == 2 and env.rank == args.mismatch_rank:
            dist.broadcast(grad, src=0)  # the others are in all_reduce: a different collective
        else:
            dist.all_reduce(grad)  # sums every rank's gradient; waits for all of them
        # On a GPU (NCCL) a collective returns as soon as it is queued on the device, not
        # when it is done: reading a value back waits for it, as the next real step would.
        total = grad[0].item()
        say(env, f"step {step}: all_reduce done ({total:g})")
    dist.destroy_process_group()  # frees the group (it is not a barrier)
    gc.collect()  # what still points at the group goes now, not at exit (lesson 03's train.py)
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main())
