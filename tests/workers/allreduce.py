"""Join the process group through common.dist, all_reduce the ranks, print one JSON line.

Started by tests/test_process_groups.py through torchrun, torch.distributed.launch, plain
environment variables or (with --spawn N) torch.multiprocessing.spawn.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from common.env import resolve_launch_env  # noqa: E402

# torch (and common.dist, which needs it) is imported where it is used, after the layout has
# been checked: a refusal (say, a double spawn) then costs no torch import (~2 s of CPU).


def work(env):
    import torch

    from common.dist import cleanup, init_distributed, print0

    ctx = init_distributed(env)  # timeout from COURSE_DIST_TIMEOUT
    try:
        print0(f"print0 from rank {ctx.env.rank}")
        value = torch.tensor([float(ctx.env.rank + 1)])
        torch.distributed.all_reduce(value)
        info = {"backend": ctx.backend, "sum": value.item(), "threads": torch.get_num_threads()}
        line = json.dumps({**ctx.env.as_dict(), **info})
        # One write per line: ranks share the pipe, so a separate newline could interleave.
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    finally:
        cleanup()


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
        resolve_launch_env(spawn_index=0, spawn_nprocs=args.spawn)
        import torch.multiprocessing as mp

        mp.spawn(spawned, args=(args.spawn,), nprocs=args.spawn, join=True)
    else:
        work(resolve_launch_env())


if __name__ == "__main__":
    main()
