"""Lesson 11's checkpoint: what keeps the run when every replica group ends at once.

A heal needs a live group. When none is left (the lighthouse's time limit, the groups' own,
a maintenance), the groups that start next read the newest checkpoint here, written with DCP as
lesson 07 writes its own. train_ft.py and train_ft_fsdp.py call save() after every --ckpt-every
steps (the quorum's first group) and when a group leaves on SIGTERM (every group that leaves),
resume() once, before the first quorum. In a group of several ranks (train_ft_fsdp.py) every
rank calls them: DCP writes each rank's shards over the group's process group, and rank 0 decides
what the ranks must agree on (the folder, whether to save) and renames the folder.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from common.checkpoint import CheckpointError

STEP_DIR = re.compile(r"step-(\d{8})")
RECIPE = ("groups", "steps", "batch_size", "lr", "seed", "train_subset")  # what a resume must match


def newest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint folder under ``root`` (DCP writes .metadata last)."""
    found = [(int(m[1]), p) for p in root.glob("step-*")
             if (m := STEP_DIR.fullmatch(p.name)) and (p / ".metadata").is_file()]  # fmt: skip
    return max(found)[1] if found else None


def agreed(value):
    """Rank 0's value, on every rank of the group: a shared folder may change between two ranks'
    looks (another group saving), and ranks that chose differently would wait on each other in
    DCP's collectives. In a group of one process (no process group), the value itself."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save(root: Path, args, manager, model, optimizer, scheduler) -> Path:
    """The groups hold the same state after a committed step, so one group's copy is the
    training's: a group writes it alone (no process group across the groups here: DCP sees none
    initialised and writes as one process), to a folder of its own that is renamed into place
    once complete; two groups saving the same step (both leaving on SIGTERM) write the same
    bytes, and the first rename wins. A group of several ranks writes one file per rank, and
    its rank 0 the metadata and the rename (DCP's last step waits for every rank's files)."""
    step = manager.current_step()
    final, tmp = root / f"step-{step:08d}", root / f".step-{step:08d}.group{args.group}"
    if agreed(final.exists()):  # saved already, by this group or another
        return final
    first = not dist.is_initialized() or dist.get_rank() == 0
    if first:  # before any rank writes: DCP's planning is collective, the writes come after
        shutil.rmtree(tmp, ignore_errors=True)  # this group's save killed half-way
    model_sd, optim_sd = get_state_dict(model, optimizer)  # keyed by parameter name
    progress = {"torchft": manager.state_dict(), "recipe": {k: getattr(args, k) for k in RECIPE}}
    dcp.save({"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(),
              "progress": progress}, checkpoint_id=tmp)  # fmt: skip
    if not first:
        return final
    try:
        tmp.rename(final)  # a folder rename is atomic: a group that resumes sees all or nothing
    except OSError:  # renamed meanwhile by another group (both leaving at this step)
        if not (final / ".metadata").is_file():
            raise
        shutil.rmtree(tmp)
    for old in sorted(p for p in root.glob("step-*") if STEP_DIR.fullmatch(p.name))[:-2]:
        shutil.rmtree(old, ignore_errors=True)  # keep the last two
    return final


def reason(exc: BaseException) -> str:
    """The first line of what DCP gives as the cause (a rank's failure, or the error itself)."""
    cause = next(iter(exc.failures.values()))[0] if hasattr(exc, "failures") else exc
    return (str(cause).strip().splitlines() or [type(cause).__name__])[0][:160]


def resume(root: Path, args, manager, model, optimizer, scheduler) -> Path | None:
    """Load the newest checkpoint, the Manager's step included: the first quorum then sees this
    group at that step. If a live group is further on, the quorum heals this one from it; if
    every group starts from here (all had ended), none heals and they go on from this step."""
    path = agreed(newest_checkpoint(root))
    if path is None:
        return None
    fix = f"delete {root} to start afresh, or give another --ckpt-dir (FT_DIR)"
    progress = {"torchft": {"step": 0, "batches_committed": 0}, "recipe": dict.fromkeys(RECIPE)}
    try:  # the small part first: another run's checkpoint is refused before any shape mismatch
        dcp.load({"progress": progress}, checkpoint_id=path)
    except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
        raise CheckpointError(f"cannot read checkpoint {path} ({reason(exc)}); {fix}") from None
    want = {k: getattr(args, k) for k in RECIPE}
    if progress["recipe"] != want:
        diff = ", ".join(f"{k}={progress['recipe'].get(k)} (this run: {want[k]})"
                         for k in RECIPE if progress["recipe"].get(k) != want[k])  # fmt: skip
        raise CheckpointError(f"checkpoint {path} is from another run: {diff}; {fix}")
    model_sd, optim_sd = get_state_dict(model, optimizer)  # to be filled in place
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict()}
    try:  # the same recipe, and still not this model (its shapes): one line, not a traceback
        dcp.load(state, checkpoint_id=path)
    except (Exception, dcp.CheckpointException) as exc:
        raise CheckpointError(f"cannot load checkpoint {path} into this model ({reason(exc)}); "
                              f"{fix}") from None  # fmt: skip
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])  # fmt: skip
    scheduler.load_state_dict(state["scheduler"])  # where the one-cycle was
    manager.load_state_dict(progress["torchft"])
    return path
