"""common/checkpoint.py: atomic saves, and one clear error for every kind of damaged file;
lesson 05's random generator states across a restart."""

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.checkpoint import CheckpointError, load_checkpoint, save_checkpoint  # noqa: E402

# lesson 05's train.py, under a name of its own (other lessons have a train.py too)
_spec = importlib.util.spec_from_file_location(
    "lesson05_train", ROOT / "lessons" / "05_fault_tolerance" / "train.py")
_lesson05 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_lesson05)
rng_states, set_rng_states = _lesson05.rng_states, _lesson05.set_rng_states


def state():
    return {"model": {"w": torch.arange(6.0)}, "epoch": 2, "world_size": 4}


def test_round_trip_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "sub" / "ckpt.pt"
    save_checkpoint(path, state())
    got = load_checkpoint(path, required=("model", "epoch"), expect={"world_size": 4})
    assert torch.equal(got["model"]["w"], torch.arange(6.0)) and got["epoch"] == 2
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, state())
    before = path.read_bytes()
    with pytest.raises(Exception):  # noqa: B017  (pickling a lambda fails midway)
        save_checkpoint(path, {"model": lambda: None})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def damaged(tmp_path, kind):
    path = tmp_path / f"{kind}.pt"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        save_checkpoint(path, state())
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif kind == "garbage":
        path.write_bytes(b"this is not a checkpoint\n" * 10)
    elif kind == "keyless":
        save_checkpoint(path, {"weights": 1})
    elif kind == "not_a_dict":
        torch.save([1, 2, 3], path)
    return path


@pytest.mark.parametrize("kind", ["empty", "truncated", "garbage", "keyless", "not_a_dict"])
def test_damaged_checkpoint_is_one_line_naming_file_and_fix(tmp_path, kind):
    path = damaged(tmp_path, kind)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, required=("model", "epoch"))
    message = str(info.value)
    assert "\n" not in message, message
    assert str(path) in message and f"rm {path}" in message and "CHECKPOINT" in message, message


def test_missing_file_and_other_shape(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read checkpoint .*No such file"):
        load_checkpoint(tmp_path / "none.pt")
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, state())
    with pytest.raises(CheckpointError, match="world_size=4, this run has world_size=2"):
        load_checkpoint(path, expect={"world_size": 2})


def test_rng_states_round_trip_and_extra_gpu_states_are_ignored():
    saved = rng_states()
    a = (torch.rand(3), random.random())
    # A checkpoint from a node with 4 GPUs, one CUDA state each: resuming where fewer (or no)
    # GPUs are visible restores what fits and does not fail.
    set_rng_states({**saved, "cuda": [torch.ByteTensor(16)] * 4})
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
