"""Lesson 08: do the DataLoader workers of every rank draw different random augmentations?

Each rank reads the same 8 indices through a DataLoader with 2 workers, three ways, and rank 0
prints which random shifts every (rank, worker) drew:

* held:       the augmentation's generator is made once, in the training process, and copied
              into every worker: all workers of all ranks draw the same shifts (pytorch#31246);
* torch-seed: a generator per worker from torch's worker seed (seed_worker), but every rank ran
              torch.manual_seed(0), so worker k draws the same shifts on every rank;
* right:      seed_worker, and the loader's generator seeded with the rank: all differ.

    srun --ntasks 2 python lessons/08_data_pipeline/augment_probe.py      # or torchrun, 2 procs
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from mnist_files import RandomShift, seed_worker
from torch.utils.data import DataLoader, Dataset, get_worker_info

from common.env import LaunchError, resolve_launch_env
from common.launch import check_launch, dist_timeout, init_error_message


class ShiftProbe(Dataset):
    """Item i: the shift the augmentation draws for it, and which worker drew it."""

    def __init__(self):
        self.transform = RandomShift(pixels=2, seed=0)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        dy, dx = self.transform.rng.integers(-2, 3, size=2)
        return torch.tensor([get_worker_info().id, dy, dx])


def draws(mode: str, rank: int) -> dict[int, list[tuple[int, int]]]:
    """{worker id: [(dy, dx), ...]} for this rank."""
    torch.manual_seed(0)  # as train.py does, for the same initial weights on every rank
    loader = DataLoader(
        ShiftProbe(),
        batch_size=1,
        num_workers=2,
        worker_init_fn=None if mode == "held" else seed_worker,
        generator=torch.Generator().manual_seed(1000 + rank) if mode == "right" else None,
    )
    out: dict[int, list[tuple[int, int]]] = {}
    for batch in loader:
        worker, dy, dx = batch[0].tolist()
        out.setdefault(worker, []).append((dy, dx))
    return out


def main() -> int:
    env = None
    try:
        env = resolve_launch_env()
        check_launch(env)
        dist.init_process_group(
            backend="gloo",  # only small Python objects travel: the CPU backend is enough
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=dist_timeout(),
        )
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except dist.DistError as exc:
        print(f"error: {init_error_message(env, exc)}", file=sys.stderr, flush=True)
        return 2
    try:
        for mode in ("held", "torch-seed", "right"):
            mine = draws(mode, env.rank)
            everyone = [None] * env.world_size
            dist.all_gather_object(everyone, mine)
            if env.rank != 0:
                continue
            streams = {}
            for rank, workers in enumerate(everyone):
                for worker, shifts in sorted(workers.items()):
                    streams[(rank, worker)] = tuple(shifts)
                    text = " ".join(f"({dy:+d},{dx:+d})" for dy, dx in shifts)
                    print(f"{mode:<10}  rank {rank} worker {worker}: {text}")
            distinct = len(set(streams.values()))
            print(f"{mode:<10}  {distinct} different sequence(s) of shifts among "
                  f"{len(streams)} (rank, worker) pairs\n", end="", flush=True)  # fmt: skip
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
