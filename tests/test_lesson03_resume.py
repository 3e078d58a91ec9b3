"""Lesson 03: a checkpoint resumed at another world size keeps the run's recipe.

A job of 4 ranks is killed after its first epoch; the next one gets 3 GPUs (a node fewer, a
smaller allocation). Each rank of 3 takes a bigger share of the data, so an epoch has more steps
(66 instead of 64 here). The one-cycle schedule saved in the checkpoint counts the first run's
steps: stepped once per step of the new run, it would end before the last epoch does (torch:
"Tried to step 129 times. The specified number of total steps is 128"). The resumed run must
finish the cycle exactly at its last step instead. Real processes, one per rank (as srun starts
them), each with a timeout.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import kill_once_written, run_ranks, start_ranks

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "lessons" / "03_ddp_mnist"
sys.path.insert(0, str(ROOT))
from common.mnist import build_model, build_optimizer  # noqa: E402
from common.mnist_prepare import prepare  # noqa: E402
from common.notebook import parse_log  # noqa: E402

TIMEOUT = 120
# 8192 images: 64 steps per epoch on 4 ranks (4 x 32), 66 on 3 (3 x 42, 2731 images each).
ARGS = ["--epochs", "2", "--train-subset", "8192", "--test-subset", "1000", "--log-every", "1000"]


@pytest.fixture(scope="module", autouse=True)
def mnist_ready():
    prepare(log=lambda *_: None)


def command(*args):
    return [sys.executable, str(LESSON / "train.py"), *args]


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def killed_after_first_epoch(nprocs, ckpt, log):
    """Start NPROCS ranks and kill them (SIGKILL) as soon as the epoch-1 checkpoint exists."""
    with open(log, "w") as out:
        ranks = start_ranks(nprocs, command(*ARGS, "--checkpoint", str(ckpt)), stdout=out,
                            stderr=subprocess.STDOUT)  # fmt: skip
        kill_once_written(ranks, ckpt, log, TIMEOUT)
    state = load(ckpt)
    assert state["epoch"] == 1, log.read_text()
    return state


@pytest.mark.sites  # about a minute on 2 busy cores: outside the main suite
@pytest.mark.timeout(TIMEOUT * 2 + 30)
def test_four_rank_checkpoint_resumed_on_three_ranks_ends_the_cycle(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    saved = killed_after_first_epoch(4, ckpt, tmp_path / "killed.log")
    total = saved["scheduler"]["total_steps"]
    assert total == 2 * 64 and saved["scheduler"]["last_epoch"] == 64

    resumed = run_ranks(3, command(*ARGS, "--checkpoint", str(ckpt)), timeout=TIMEOUT)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out
    assert "Traceback" not in out, out
    assert f"resumed from {ckpt} after epoch 1" in resumed.stdout, out
    assert "world size 3 (1 node(s) x 3), global batch 126 = 3 x 42, 66 steps per epoch" in out
    assert ("the schedule counts 64 steps per epoch (the run that started it), this run takes "
            "66: its steps are mapped onto that count") in resumed.stdout, out
    assert [r["epoch"] for r in parse_log(resumed.stdout)] == [2], out
    # The recipe of the run that started: the same 128-step cycle, ended at its last step with
    # the learning rate an uninterrupted run ends with, not cut short and not stretched.
    done = load(ckpt)
    assert done["epoch"] == 2
    assert done["scheduler"]["total_steps"] == total, done["scheduler"]
    assert done["scheduler"]["last_epoch"] == total, done["scheduler"]
    optimizer, scheduler = build_optimizer(build_model(), 1e-2, total)
    for _ in range(total):
        optimizer.step()
        scheduler.step()
    assert done["scheduler"]["_last_lr"] == pytest.approx(scheduler.get_last_lr())
