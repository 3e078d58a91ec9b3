"""The GPU samples (lessons/*/gpu-<card>-*.out, written by tests/gpu_capture.sh on a GPU machine)
say where they ran, are the ones README.md lists, and the script that wrote them still runs.

The runs themselves need a GPU, which the test machines do not have: what is checked here is
what the files say (NCCL, the card, an exit status that matches the run) and that the capture
script still works end to end on this CPU (one of its runs, gloo, nothing stored)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = sorted(ROOT.glob("lessons/*/gpu-*-*.out"))
# The runs that must fail: two ranks on one GPU, refused by the course, then by NCCL itself.
REFUSED = {"two-ranks-one-gpu", "nccl-two-ranks-one-gpu"}
# The run whose rank crashes on purpose (lesson 05) and is started again by torchrun.
CRASHED = "ft-crash-restart"


def test_there_are_gpu_samples():
    assert len(SAMPLES) >= 10, SAMPLES


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_a_gpu_sample_says_where_it_ran_and_how_it_ended(path):
    lines = path.read_text().splitlines()
    card, run = re.fullmatch(r"gpu-([a-z0-9]+)-(.*)\.out", path.name).groups()
    assert lines[0].startswith("# GPU capture: NVIDIA ") and card.upper() in lines[0], lines[0]
    assert "torch " in lines[0] and "NCCL 2." in lines[0] and "requirements.txt" in lines[0]
    assert lines[2].startswith("# $ "), lines[2]
    status = re.fullmatch(r"# exit (\d+) after \d+ s", lines[-1])
    assert status, lines[-1]
    assert (status.group(1) != "0") == (run in REFUSED), lines[-1]
    text = "\n".join(lines)
    if run == CRASHED:  # the one traceback is the deliberate crash; then the resumed run ends
        assert text.count("RuntimeError: deliberate crash of rank 0") == 1, text
        assert "resumed from " in text and "done: test_acc " in text, text
    else:  # torchrun prints its own traceback when a worker fails; none may come from the course
        assert not re.search(r'File "[^"]*/(lessons|common)/', text), text
    if run == "two-ranks-one-gpu":
        assert text.count("two ranks would share a GPU") == 2, text  # one line from each rank
    if "backend" in text:
        assert "backend gloo" not in text, "a GPU sample that ran on gloo"


def test_readme_lists_every_gpu_sample_and_no_other():
    readme = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"`(gpu-[a-z0-9]+-[\w-]+\.out)`", readme))
    assert listed == {p.name for p in SAMPLES}


def test_capture_script_runs_here(tmp_path):
    """One run of tests/gpu_capture.sh on this machine's CPU (gloo): the script itself works."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join((venv_bin, env.get("PATH", "")))
    proc = subprocess.run(
        ["bash", "tests/gpu_capture.sh", str(tmp_path), "hello-allreduce"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = (tmp_path / "hello-allreduce.out").read_text().splitlines()
    assert out[0].startswith("# GPU capture: ") and out[-1].startswith("# exit 0 after"), out
    assert "all 1 ranks hold the expected sum" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hello-allreduce.out"]
