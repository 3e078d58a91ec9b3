"""A task whose CUDA_VISIBLE_DEVICES is empty was given no GPU: one line says that, not "a
container started without its GPUs" or "a driver too old".

Lesson 01's hello_allreduce.py runs as one process with the course's torch (which sees no CUDA
device here, as under CUDA_VISIBLE_DEVICES="" on a GPU node), SLURM_GPUS_ON_NODE=1 and an NVIDIA
device file made in a folder (common.launch.NVIDIA_DEVICE_GLOB pointed at it): the set-up stops
before its process group, and what it says depends on CUDA_VISIBLE_DEVICES alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "lessons" / "01_hello_allreduce" / "hello_allreduce.py"
DRIVER = """
import runpy, sys
import common.launch
common.launch.NVIDIA_DEVICE_GLOB = sys.argv.pop(1)  # this node's /dev/nvidia*, made by the test
sys.argv = sys.argv[1:]  # the script, as `python script` sees it
sys.path.insert(0, sys.argv[0].rpartition("/")[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(tmp_path: Path, **environ: str) -> subprocess.CompletedProcess:
    (tmp_path / "nvidia0").touch()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC", "CUDA_", "MASTER_"))}  # fmt: skip
    env.update(PYTHONPATH=str(ROOT), RANK="0", WORLD_SIZE="1", SLURM_GPUS_ON_NODE="1", **environ)
    return subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path / "nvidia[0-9]*"),
                           str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU-only torch: its own line comes first")
@pytest.mark.parametrize("visible", ["", " "])
@pytest.mark.timeout(150)
def test_an_empty_cuda_visible_devices_is_named(tmp_path, visible):
    proc = run(tmp_path, CUDA_VISIBLE_DEVICES=visible)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    line = lines[0]
    assert "SLURM gave this node 1 GPU(s) (SLURM_GPUS_ON_NODE)" in line, line
    assert "CUDA_VISIBLE_DEVICES is empty" in line and "given no GPU" in line, line
    assert "--gpus-per-task=1" in line, line  # the fix
    for wrong in ("container", "driver", "apptainer", "CPU-only"):
        assert wrong not in line, line


@pytest.mark.skipif(torch.version.cuda is None, reason="a CPU-only torch: its own line comes first")
@pytest.mark.parametrize("visible", [None, "0"])
@pytest.mark.timeout(150)
def test_a_gpu_given_but_unseen_is_still_the_container_or_driver(tmp_path, visible):
    proc = run(tmp_path, **({} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stdout + proc.stderr
    assert "apptainer --nv" in lines[0] and "driver is older" in lines[0], lines[0]
    assert "CUDA_VISIBLE_DEVICES" not in lines[0], lines[0]
