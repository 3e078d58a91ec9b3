"""Lesson 08: MNIST as files on a shared filesystem, in the two forms datasets come in.

    # once, on the login node, from the course root (a few seconds):
    PYTHONPATH=. python lessons/08_data_pipeline/mnist_files.py

writes, under ``data/mnist-files`` (or ``--out DIR``), from the idx files of ``common.mnist``:

* ``folder/``: one small file per image, ``<split>/<label>/<n>.pgm``, the layout of torchvision's
  ImageFolder: 70,000 files. Most datasets arrive like this, and each file costs an open, a read
  and a close, which a parallel filesystem (Lustre, GPFS) serves from its metadata server;
* ``packed/``: each split in two array files, ``<split>-images.npy`` and ``<split>-labels.npy``:
  four files in all, read through a memory map (one open per worker, then plain page reads);
* ``folder.tar``: the folder form as one archive, for copying to a node's local disk.

The datasets below read either form; ``RandomShift`` is the augmentation whose random draws the
lesson follows from the workers to the ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from common.mnist import MnistDataError, load_mnist  # the idx files, checked against their MD5

COURSE_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = COURSE_ROOT / "data" / "mnist-files"
SPLITS = {"train": True, "test": False}
PGM_HEADER = b"P5\n28 28\n255\n"  # binary greymap: any image library reads it


class DataFormError(RuntimeError):
    """A dataset folder is missing or incomplete; the message names it and the fix."""


def prepare(out: Path) -> None:
    for split, train in SPLITS.items():
        images, labels = load_mnist(train=train)
        images, labels = images.numpy(), labels.numpy()
        packed = out / "packed"
        packed.mkdir(parents=True, exist_ok=True)
        # Written under a temporary name and renamed: a job never sees half a file.
        for name, array in ((f"{split}-images.npy", images), (f"{split}-labels.npy", labels)):
            np.save(packed / f".{name}.part.npy", array)
            os.replace(packed / f".{name}.part.npy", packed / name)
        folder = out / "folder" / split
        for label in range(10):
            (folder / str(label)).mkdir(parents=True, exist_ok=True)
        for n, (image, label) in enumerate(zip(images, labels, strict=True)):
            (folder / str(label) / f"{n:05d}.pgm").write_bytes(PGM_HEADER + image.tobytes())
        print(f"{split}: {len(images)} images -> {folder}/<label>/*.pgm and {packed}/{split}-*.npy")
    # The folder form in one file as well: what stage.sh copies to each node's disk (one file to
    # send instead of 70,000), unpacked there.
    with tarfile.open(out / ".folder.tar.part", "w") as tar:
        tar.add(out / "folder", arcname="folder")
    os.replace(out / ".folder.tar.part", out / "folder.tar")
    print(f"folder form packed for staging: {out / 'folder.tar'}")


def _missing(path: Path, what: str) -> DataFormError:
    return DataFormError(
        f"{what} not found at {path}: prepare the files once, on the login node: "
        f"PYTHONPATH=. python lessons/08_data_pipeline/mnist_files.py --out {path.parents[1]}"
    )


class FolderMNIST(Dataset):
    """One .pgm file per image under ``root/<split>/<label>/``, read on every access."""

    def __init__(self, root: Path, split: str, transform=None):
        top = Path(root) / split
        if not top.is_dir():
            raise _missing(top, f"the folder form's '{split}' images")
        # Sorted: every rank must map index i to the same image (DistributedSampler hands out
        # indices), and a directory's listing order may differ from one node to another.
        self.samples = sorted(
            (entry.path, int(label))
            for label in os.listdir(top)
            for entry in os.scandir(top / label)
        )
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        with open(path, "rb") as f:
            image = torch.frombuffer(bytearray(f.read()[len(PGM_HEADER) :]), dtype=torch.uint8)
        image = image.view(28, 28)
        return (self.transform(image) if self.transform else image), label


class PackedMNIST(Dataset):
    """A split as two .npy arrays, opened as a memory map in each process that reads it."""

    def __init__(self, root: Path, split: str, transform=None):
        self.images_path = Path(root) / f"{split}-images.npy"
        if not self.images_path.is_file():
            raise _missing(self.images_path, "the packed form's images")
        self.labels = torch.from_numpy(np.load(Path(root) / f"{split}-labels.npy"))
        self.images = None  # opened on first access: in the worker that reads, not its parent
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        if self.images is None:
            self.images = np.load(self.images_path, mmap_mode="r")
        image = torch.from_numpy(np.array(self.images[i]))
        return (self.transform(image) if self.transform else image), int(self.labels[i])


def open_dataset(form: str, root: Path, split: str, transform=None) -> Dataset:
    """``form`` is "folder" or "packed"; ``root`` the folder that holds both forms."""
    if form == "folder":
        return FolderMNIST(Path(root) / "folder", split, transform)
    return PackedMNIST(Path(root) / "packed", split, transform)


class RandomShift:
    """Move the digit by up to ``pixels`` in x and y, a draw per image from ``self.rng``.

    The generator is the point of the lesson. Made here, in the parent process, it is copied
    into every DataLoader worker when they start (fork, or pickling under spawn), and every
    worker of every rank then draws the same shifts: the bug of pytorch#31246. ``seed_worker``
    gives each worker a generator of its own.
    """

    def __init__(self, pixels: int = 2, seed: int = 0):
        self.pixels = pixels
        self.rng = np.random.default_rng(seed)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        dy, dx = self.rng.integers(-self.pixels, self.pixels + 1, size=2)
        return torch.roll(image, shifts=(int(dy), int(dx)), dims=(0, 1))


def seed_worker(worker_id: int) -> None:
    """DataLoader's worker_init_fn: a generator per worker, different on every rank too.

    torch gives worker k the seed base_seed + k, and base_seed comes from the loader's
    ``generator``; seed that generator with the rank (train.py does), else every rank that ran
    ``torch.manual_seed(s)`` draws the same base_seed, and worker k repeats on every rank.
    """
    info = get_worker_info()
    shift = getattr(info.dataset, "transform", None)
    if isinstance(shift, RandomShift):
        shift.rng = np.random.default_rng(info.seed)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default {DEFAULT_OUT}")
    p.add_argument("--force", action="store_true", help="write the files again")
    args = p.parse_args(argv)
    if (args.out / "folder.tar").is_file() and not args.force:  # written last
        print(f"already prepared in {args.out} (--force writes it again)")
        return 0
    t0 = time.perf_counter()
    try:
        prepare(args.out)
    except (MnistDataError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
