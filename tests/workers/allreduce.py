"""Join the process group as the lessons do, all_reduce the ranks, print one JSON line.

Started by tests/test_process_groups.py through torchrun, torch.distributed.launch, plain
environment variables or (with --spawn N) torch.multiprocessing.spawn.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from common.env import resolve_launch_env  # noqa: E402
from common.launch import check_launch  # noqa: E402

# torch is imported where it is used, after the layout has been checked: a refusal (say, a
# double spawn) then costs no torch import (~2 s of CPU).


def work(env):
    import torch
    import torch.distributed as dist

    from common.launch import cpu_threads, dist_timeout

    check_launch(env)
    torch.set_num_threads(cpu_threads(env))
    dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size,
                            timeout=dist_timeout())  # fmt: skip
    try:
        if env.rank == 0:
            print(f"rank 0 of {env.world_size} joined", flush=True)
        value = torch.tensor([float(env.rank + 1)])
        dist.all_reduce(value)
        info = {"backend": dist.get_backend(), "sum": value.item(),
                "threads": torch.get_num_threads()}  # fmt: skip
        line = json.dumps({**env.as_dict(), **info})
        # One write per line: ranks share the pipe, so a separate newline could interleave.
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()


def spawned(index, nprocs):
    work(resolve_launch_env(spawn_index=index, spawn_nprocs=nprocs))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--spawn", type=int, default=0, help="mp.spawn this many processes")
    # torch.distributed.launch (without --use-env) passes --local-rank=N.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None)
    args = parser.parse_args()
    if args.local_rank is not None:
        assert args.local_rank == int(os.environ["LOCAL_RANK"])
    if args.spawn:
        # Check the layout here first: a refusal (say, a double spawn) then costs one process,
        # not a spawned child per GPU, each importing torch only to fail the same way.
        check_launch(resolve_launch_env(spawn_index=0, spawn_nprocs=args.spawn))
        import torch.multiprocessing as mp

        mp.spawn(spawned, args=(args.spawn,), nprocs=args.spawn, join=True)
    else:
        work(resolve_launch_env())


if __name__ == "__main__":
    main()
