"""Lesson 11's checkpoint (ft_checkpoint.py) refuses what it cannot resume in one line: a
checkpoint of another run (its recipe differs) and one of the same recipe whose model has other
shapes (a student who changed the model and kept FT_DIR). In one process, as a group of one
process saves and resumes (DCP with no process group); the Manager's part is a stand-in holding
the step, which is all save() and resume() ask of it. A resume into the same shapes loads the
step and the weights, so the refusals are not of every checkpoint.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT
from torch import nn

from common.checkpoint import CheckpointError

spec = importlib.util.spec_from_file_location(
    "ft_checkpoint", ROOT / "lessons/11_torchft/ft_checkpoint.py")  # fmt: skip
ft_checkpoint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ft_checkpoint)


class Steps:
    """What save() and resume() use of torchft's Manager: its step and its state_dict."""

    def __init__(self, step: int = 0):
        self.step = step

    def current_step(self) -> int:
        return self.step

    def state_dict(self) -> dict:
        return {"step": self.step, "batches_committed": self.step * 2}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def recipe(**changed) -> SimpleNamespace:
    args = dict(group=0, groups=2, steps=100, batch_size=64, lr=1e-3, seed=0, train_subset=None)
    return SimpleNamespace(**{**args, **changed})


def trainer(width: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()  # AdamW's state exists, as after a step
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=100)
    return model, optimizer, scheduler


@pytest.fixture
def saved(tmp_path):
    model, optimizer, scheduler = trainer(8)
    path = ft_checkpoint.save(tmp_path, recipe(), Steps(40), model, optimizer, scheduler)
    assert path == tmp_path / "step-00000040" and (path / ".metadata").is_file()
    return tmp_path, model


def test_the_same_model_resumes_at_the_saved_step(saved):
    root, before = saved
    model, optimizer, scheduler = trainer(8)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    steps = Steps()
    assert ft_checkpoint.resume(root, recipe(), steps, model, optimizer, scheduler)
    assert steps.step == 40
    for a, b in zip(model.parameters(), before.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("args, width, says", [
    (recipe(lr=3e-3), 8, r"is from another run: lr=0\.001 \(this run: 0\.003\); delete "),
    (recipe(), 16, r"cannot load checkpoint \S+step-00000040 into this model \(.*\); delete "),
])  # fmt: skip
def test_what_cannot_be_resumed_is_one_line(saved, args, width, says):
    root, _ = saved
    with pytest.raises(CheckpointError, match=says) as caught:
        ft_checkpoint.resume(root, args, Steps(), *trainer(width))
    message = str(caught.value)
    assert "\n" not in message and "another --ckpt-dir (FT_DIR)" in message, message
