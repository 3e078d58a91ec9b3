"""Lesson 07: a sharded DCP checkpoint as one ordinary file, for inference without a cluster.

    python lessons/07_fsdp_sharding/export.py CHECKPOINT_DIR [--out model.pt] [--test-subset N]

One plain process (no process group, no GPU) reads the newest checkpoint in CHECKPOINT_DIR
(or the step-* folder given), takes the model's part only (never the optimizer's moments, twice
the model's size), and writes its state dict with torch.save. Then it does what a user of the
file would do: torch.load it into a fresh model in this process and score the test set.

Exporting afterwards, on one machine, keeps the gather of the full model out of the training
job, where gathering it on rank 0 is what runs out of memory (pytorch/pytorch#104143).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from common.checkpoint import CheckpointError, save_checkpoint
from common.mnist import MnistDataError, load_mnist, normalize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import RECIPE, Net, dcp_failure, latest_checkpoint  # noqa: E402  (lesson 07's train.py)


def export(path: Path, out: Path) -> dict:
    """Write the model of DCP checkpoint ``path`` to ``out``; returns the checkpoint's recipe."""
    progress = {"global_step": 0, "world_size": 0, "recipe": dict.fromkeys(RECIPE)}
    # no_dist: this one process reads the files of all the ranks that wrote the checkpoint.
    try:
        dcp.load({"progress": progress}, checkpoint_id=path, no_dist=True)
    except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
        raise CheckpointError(f"cannot read checkpoint {path} ({dcp_failure(exc)}): pass "
                              f"another checkpoint folder") from None  # fmt: skip
    recipe = progress["recipe"]
    model = Net(recipe["width"], recipe["depth"])
    state = {"model": model.state_dict()}  # the keys to read, and tensors to read them into
    dcp.load(state, checkpoint_id=path, no_dist=True)
    save_checkpoint(out, state["model"])  # temporary file, then rename
    return progress


def score(out: Path, width: int, depth: int, test_subset: int = 0) -> float:
    """What a user of the file does: a fresh model, torch.load, predict. map_location: the
    tensors come to this process's CPU whatever device they were saved from."""
    model = Net(width, depth)
    model.load_state_dict(torch.load(out, map_location="cpu", weights_only=True))
    model.eval()
    x, y = load_mnist(train=False)
    x, y = normalize(x[: test_subset or None]), y[: test_subset or None]
    with torch.no_grad():
        correct = sum((model(xb).argmax(1) == yb).sum().item()
                      for xb, yb in zip(x.split(1000), y.split(1000), strict=True))  # fmt: skip
    return 100.0 * correct / len(y)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path, help="a checkpoint folder (job.sh's CHECKPOINT_DIR)")
    p.add_argument("--out", type=Path, help="default: model.pt in the checkpoint folder")
    p.add_argument("--test-subset", type=int, default=0, help="score the first N test images")
    args = p.parse_args(argv)
    path = args.checkpoint
    if not (path / ".metadata").is_file():
        path = latest_checkpoint(path) if path.is_dir() else None
    if path is None:
        print(f"error: no DCP checkpoint in {args.checkpoint} (no .metadata there nor in a "
              f"step-* folder): pass the CHECKPOINT_DIR a training run wrote",
              file=sys.stderr)  # fmt: skip
        return 2
    out = args.out or path.parent / "model.pt"
    torch.set_num_threads(1)  # a short job beside others on the batch host
    # dcp.load warns that it runs in a single process even when asked to (no_dist=True).
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    t0 = time.perf_counter()
    try:
        progress = export(path, out)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    recipe = progress["recipe"]
    print(f"exported {path.name} (saved by {progress['world_size']} ranks) to {out}: "
          f"{out.stat().st_size / 2**20:.1f} MiB in {time.perf_counter() - t0:.2f} s")  # fmt: skip
    try:
        acc = score(out, recipe["width"], recipe["depth"], args.test_subset)
    except MnistDataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"plain process: torch.load({out.name}) into Net(width={recipe['width']}, "
          f"depth={recipe['depth']}), test_acc {acc:.2f}%")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
