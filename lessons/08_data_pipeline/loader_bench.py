"""Lesson 08 benchmark: images per second that a DataLoader delivers, by form, place and workers.

No model and no process group: one process reads the training set through a DataLoader, the
way one rank does, and prints a line per case. Each case is read twice: "cold" after the
files were dropped from the page cache (posix_fadvise DONTNEED, which needs no root), as in
the first epoch on a freshly allocated node, and "warm" right after, as in the next epochs.

    python lessons/08_data_pipeline/loader_bench.py --shared data/mnist-files
    python .../loader_bench.py --shared <shared folder> --local /tmp/mnist-files --workers 0,2
(bench.sh runs it as a job, with the data staged to the node's disk first.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from mnist_files import DataFormError, RandomShift, open_dataset
from torch.utils.data import DataLoader, Subset

from common.launch import usable_cpus


def drop_from_page_cache(folder: Path) -> int:
    """Ask the kernel to forget the cached pages of every file under ``folder``. Pages not yet
    written to disk (a copy just made) cannot be dropped: fsync writes them first."""
    count = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            count += 1
    return count


def images_per_s(dataset, workers: int, batch: int) -> float:
    """Read ``dataset`` once in random order; time from the first batch on (the workers have
    started by then), as a training loop sees them after its first step."""
    loader = DataLoader(
        dataset,
        batch_size=batch,
        shuffle=True,  # as DistributedSampler does: reads jump around the files
        num_workers=workers,
    )
    batches = iter(loader)
    next(batches)
    seen, t = 0, time.perf_counter()
    for images, _ in batches:
        seen += len(images)
    return seen / (time.perf_counter() - t)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shared", type=Path, required=True, help="the copy on the shared filesystem")
    p.add_argument("--local", type=Path, help="the copy staged on this node's disk")
    p.add_argument("--forms", default="packed,folder")
    p.add_argument("--workers", default="0,1,2,4", help="comma-separated worker counts")
    p.add_argument("--images", type=int, default=20000, help="images timed per case")
    p.add_argument("--batch", type=int, default=128)
    args = p.parse_args(argv)
    try:
        workers = [int(w) for w in args.workers.split(",")]
    except ValueError:
        p.error(f"--workers {args.workers!r}: give whole numbers, e.g. 0,1,2")
    places = {"shared": args.shared} | ({"local": args.local} if args.local else {})
    print(f"{args.images} images per case, batch {args.batch}, host {os.uname().nodename}, "
          f"{usable_cpus()[0]} CPU(s) usable", flush=True)  # fmt: skip
    try:
        for form in args.forms.split(","):
            for place, root in places.items():
                dataset = open_dataset(form, root, "train", RandomShift())
                # The same images in every case (a fixed random choice), one batch more than
                # --images: the first batch is not timed.
                chosen = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))
                dataset = Subset(dataset, chosen[: args.images + args.batch].tolist())
                for w in workers:
                    files = drop_from_page_cache(root / form)
                    cold = images_per_s(dataset, w, args.batch)
                    warm = images_per_s(dataset, w, args.batch)
                    print(f"BENCH form={form} place={place} workers={w} cold={cold:.0f} "
                          f"warm={warm:.0f} images/s ({files} file(s))", flush=True)  # fmt: skip
    except DataFormError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
