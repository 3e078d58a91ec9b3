"""MNIST for lesson 03 (and 05, 07, 08): the data, the model, the optimizer, the evaluation.

:func:`load_mnist` reads the four idx files in ``DIR/MNIST/raw/``, torchvision's layout (DIR:
``$MNIST_DIR``, else ``<course>/data/mnist``), once their MD5 is checked (:func:`check_file`).
Compute nodes often have no internet: prepare the files once, on the login node
(common/mnist_prepare.py). Not ``torchvision.datasets.MNIST``: importing torchvision imports
``torch._dynamo`` (through ``torchvision.ops``) and doubles the start of every rank (3.3
CPU-seconds instead of 1.7 on a 2-core machine), for a format :func:`read_idx` reads in a few
lines; :func:`normalize` is torchvision's ``ToDtype(scale=True)`` then ``Normalize``, the same
float32 operations in the same order: the same tensors, to the bit.
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

COURSE_ROOT = Path(__file__).resolve().parent.parent
MEAN, STD = 0.1307, 0.3081  # of the training images scaled to [0, 1]
PREPARE_CMD = "python -m common.mnist_prepare"


class MnistDataError(RuntimeError):
    """The MNIST files are missing or damaged; the message says which file and what to do."""


def default_data_dir() -> Path:
    """torchvision's ``root``: ``$MNIST_DIR`` if set, else ``<course>/data/mnist``."""
    return Path(os.environ.get("MNIST_DIR") or COURSE_ROOT / "data" / "mnist")


def raw_dir(root: Path | str) -> Path:
    """Where ``torchvision.datasets.MNIST(root)`` reads the idx files."""
    return Path(root) / "MNIST" / "raw"


# MD5 of the uncompressed original files (http://yann.lecun.com/exdb/mnist/).
MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}

# --------------------------------------------------------------------------- the checks
# load_mnist runs check_file on every file it reads; common/mnist_prepare.py on what it makes.


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

    def name(lookup, number: int) -> str:
        try:
            return lookup(number)[0]
        except KeyError:
            return str(number)

    st = path.stat()
    user, group = name(pwd.getpwuid, st.st_uid), name(grp.getgrgid, st.st_gid)
    return f"{stat.filemode(st.st_mode)} {user}:{group}"


def access_problem(path: Path | str) -> str | None:
    """Why this user cannot read ``path``: a folder on the way it may not enter (no x), or a
    file it may not read (no r); None when readable or simply missing.  (A file in a folder one
    cannot enter looks missing to ``Path.is_file``: stat fails with EACCES.)"""
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


def check_split(raw: Path, train: bool) -> None:
    """check_file on both files of the training (or the test) split in the raw folder ``raw``."""
    for name in MD5:
        if name.startswith("train" if train else "t10k"):
            check_file(raw / name)


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


# --------------------------------------------------------------------------- the data, the model


def read_idx(path: Path) -> np.ndarray:
    """An idx file of unsigned bytes as a numpy array of its shape: the magic ``00 00 08 <ndim>``
    (08: uint8), ``ndim`` big-endian 32-bit sizes, then the data (MNIST's format)."""
    import numpy as np

    data = Path(path).read_bytes()
    ndim = data[3] if len(data) >= 4 else 0
    start = 4 + 4 * ndim
    shape = struct.unpack(f">{ndim}I", data[4:start]) if len(data) >= start else ()
    if data[:3] != b"\0\0\x08" or not shape or len(data) != start + math.prod(shape):
        raise MnistDataError(f"MNIST file {path} is not a whole idx file of bytes; prepare it "
                             f"again: {_prepare_hint(Path(path).parent)} --force")  # fmt: skip
    return np.frombuffer(data, np.uint8, offset=start).reshape(shape)


def load_mnist(
    train: bool = True, data_dir: Path | str | None = None, verify: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, labels)``: uint8 ``[N, 28, 28]`` and int64 ``[N]``, the whole split as
    ``torchvision.datasets.MNIST`` holds it (``.data``, ``.targets``).  ``verify``: the MD5 of
    both files first (a tenth of a second), and who may read them (:func:`check_split`)."""
    import numpy as np
    import torch

    root = Path(data_dir) if data_dir is not None else default_data_dir()
    raw = raw_dir(root)
    if verify:
        check_split(raw, train)
    prefix = "train" if train else "t10k"
    try:
        images = read_idx(raw / f"{prefix}-images-idx3-ubyte")
        labels = read_idx(raw / f"{prefix}-labels-idx1-ubyte")
    except OSError as exc:
        raise MnistDataError(f"MNIST is not in {raw} ({exc.strerror}: {exc.filename}); prepare "
                             f"it once, on the login node: {PREPARE_CMD}") from None  # fmt: skip
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))


def normalize(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, 28, 28]`` -> float32 ``[N, 1, 28, 28]`` with the training set's mean/std:
    torchvision's ``ToDtype(scale=True)`` then ``Normalize``, applied to the whole set at once."""
    import torch

    x = images.unsqueeze(1).to(torch.float32).mul_(1.0 / 255)
    mean = torch.tensor([MEAN], dtype=torch.float32, device=x.device).view(-1, 1, 1)
    std = torch.tensor([STD], dtype=torch.float32, device=x.device).view(-1, 1, 1)
    return x.sub_(mean).div_(std)


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
        # the statistics over the global batch instead: an all-gather per layer in forward, an
        # all-reduce in backward; on accelerators (CUDA, XPU, HPU), not on the CPU.
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
    """(loss, accuracy %) on the whole test set, each rank scoring its own slice: the counts
    summed over the ranks give the exact figure (averaging per-rank accuracies would weigh
    unequal slices wrongly, and DistributedSampler would pad a slice with repeated images)."""
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
