"""common/mnist.py's evaluate() across ranks: each rank scores its slice of the test set, and
the counts summed over the ranks give one process's figures for the same weights, exactly.

Real gloo groups on this machine (tests/workers/evaluate.py, one process per rank): 1,999 test
images on 2 ranks (slices of 1,000 and 999, so that averaging the ranks' accuracies would weigh
them wrongly), compared with 1 rank scoring all of them.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import run_ranks

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.mnist import build_model, load_mnist, normalize  # noqa: E402
from common.mnist_prepare import prepare  # noqa: E402

WORKER = str(ROOT / "tests" / "workers" / "evaluate.py")
TIMEOUT = 120
IMAGES = 1999  # evaluate()'s batches of 1,000: one process's are the two ranks' slices


def trained_weights(path: Path) -> None:
    """30 steps of the lessons' model on 1,920 training images: weights that score far above
    chance, and differently on the two slices."""
    prepare(log=lambda *_: None)
    x, y = load_mnist(train=True)
    x, y = normalize(x[:1920]), y[:1920]
    torch.manual_seed(0)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for idx in torch.randperm(1920).split(64):
        optimizer.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()
    torch.save(model.state_dict(), path)


def scores(nprocs: int, weights: Path) -> list[dict]:
    proc = run_ranks(nprocs, [sys.executable, WORKER, str(weights), str(IMAGES)], TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = sorted((json.loads(line) for line in proc.stdout.splitlines()),
                  key=lambda r: r["rank"])  # fmt: skip
    assert [r["rank"] for r in rows] == list(range(nprocs)), proc.stdout
    return rows


@pytest.mark.timeout(TIMEOUT * 2 + 60)
def test_two_ranks_score_the_test_set_as_one_process_does(tmp_path):
    weights = tmp_path / "weights.pt"
    trained_weights(weights)
    (one,) = scores(1, weights)
    two = scores(2, weights)
    correct = round(one["acc"] * IMAGES / 100)
    assert correct > IMAGES // 2, one  # trained: far above chance (10 %)
    for rank in two:
        # the same count of correct predictions out of the same 1,999 images, on every rank
        assert round(rank["acc"] * IMAGES / 100) == correct, (rank, one)
        assert rank["acc"] == one["acc"], (rank, one)
        # the same loss: the same batches, the same sums, added in another process
        assert rank["loss"] == pytest.approx(one["loss"], rel=1e-9), (rank, one)
