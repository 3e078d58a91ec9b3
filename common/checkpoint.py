"""Checkpoints written atomically, and never read silently when damaged.

A job can be killed at any moment, also while it writes: ``save_checkpoint`` writes beside the
target and renames (atomic within one filesystem), so the next run finds the old checkpoint or
the new one, never half of one.  A damaged file raises :class:`CheckpointError`: one line naming
the file and the fix, instead of an unpickling traceback on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

FIX = "delete it (rm {path}) to start afresh, or pass another CHECKPOINT (--checkpoint PATH)"


class CheckpointError(RuntimeError):
    """The checkpoint cannot be used; the message names the file and what to do."""


def save_checkpoint(path: str | os.PathLike, state: Mapping) -> None:
    """Write ``state`` to ``path`` atomically (temporary file, flush to disk, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(dict(state), f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it visible
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_checkpoint(
    path: str | os.PathLike,
    required: Iterable[str] = ("model",),
    expect: Mapping[str, object] | None = None,
) -> dict:
    """Read a checkpoint written by :func:`save_checkpoint` onto the CPU; CheckpointError when
    the file is empty, truncated, not a checkpoint, lacks one of the ``required`` keys, or
    differs from ``expect`` (``{"world_size": 4}``: a run of another shape cannot continue it)."""
    path = Path(path)
    fix = FIX.format(path=path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}; {fix}") from None
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is empty; {fix}")
    try:
        # weights_only=False: the checkpoint holds Python objects (the RNG states, the run's
        # arguments). Only load checkpoints you wrote yourself.
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # truncated zip, garbage, pickle of something else, ...
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint {path} is damaged or not a checkpoint "
                              f"({reason[:120]}); {fix}") from None  # fmt: skip
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a "
                              f"checkpoint; {fix}")  # fmt: skip
    missing = [key for key in required if key not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} has no {', '.join(map(repr, missing))} "
                              f"(written by another program?); {fix}")  # fmt: skip
    for key, want in (expect or {}).items():
        if state.get(key) != want:
            raise CheckpointError(f"checkpoint {path} was written with {key}={state.get(key)!r}, "
                                  f"this run has {key}={want!r}: run with the same settings to "
                                  f"continue it, or {fix}")  # fmt: skip
    return state
