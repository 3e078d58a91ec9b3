"""Two ranks on one GPU: every lesson script refuses in one line, exit 2, no traceback.

On a GPU machine (tests/gpu_capture.sh, an H200) `torchrun --nproc-per-node 2` with one GPU
stopped lesson 01's hello_allreduce.py with a traceback around common/env.py's LaunchError: its
GPU choice sat outside the script's `except LaunchError`. Here there is no GPU, so one Python
process makes torch report one CUDA device (``torch.cuda.is_available`` and ``device_count``,
nothing else) and runs each script's own ``__main__`` as torchrun's second worker would see it
(LOCAL_WORLD_SIZE=2, CUDA_VISIBLE_DEVICES=0). What is tested is the script's handling of the
refusal, which comes before any CUDA call; the refusal's rule itself is tests/test_env_*.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (script, its arguments): every lesson script that picks a GPU with cuda_device_index and is
# started once per rank. spawn_warmup.py picks it in spawned children, where the fake below does
# not reach; its worker's set-up is hello_allreduce.py's, line for line.
SCRIPTS = [
    ("lessons/01_hello_allreduce/hello_allreduce.py", []),
    ("lessons/02_launch_vs_srun/hello.py", []),
    ("lessons/03_ddp_mnist/train.py", []),
    ("lessons/04_torchrun_enroot/train.py", []),
    ("lessons/05_fault_tolerance/train.py", []),
    ("lessons/06_diagnosing_hangs/step.py", []),
    ("lessons/06_diagnosing_hangs/allreduce_bench.py", []),
    ("lessons/07_fsdp_sharding/train.py", []),
    ("lessons/07_fsdp_sharding/memory.py", []),
    ("lessons/08_data_pipeline/train.py", []),
    ("lessons/09_beyond_data_parallel/compare.py", []),
    ("lessons/09_beyond_data_parallel/tp.py", []),
    ("lessons/09_beyond_data_parallel/pp.py", []),
]

DRIVER = r"""
import contextlib, io, json, os, runpy, sys, tempfile
import torch
torch.cuda.is_available = lambda: True  # one GPU, as far as the scripts can tell
torch.cuda.device_count = lambda: 1
results, base_path, base_modules = {}, list(sys.path), set(sys.modules)
for script, args in json.loads(sys.argv[1]):
    err, code = tempfile.TemporaryFile("w+"), None  # a real file: faulthandler wants one
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))  # as `python script` does
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:  # a traceback is what this test is about
            code = f"raised {type(exc).__name__}: {exc}"
    err.seek(0)
    results[script] = [code, err.read()]
    sys.path[:] = base_path  # each script puts its own folder first
    for name in set(sys.modules) - base_modules:  # lessons' train.py, tp.py, ... are not shared
        if not name.startswith(("torch", "numpy", "common")):
            del sys.modules[name]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict[str, tuple]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
        # torchrun's second worker on a one-node, two-worker run:
        RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
        ROLE_RANK="1", ROLE_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
        TORCHELASTIC_RUN_ID="none", CUDA_VISIBLE_DEVICES="0",
        MNIST_DIR=str(tmp_path_factory.mktemp("nomnist")),  # never read: the refusal comes first
    )
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(SCRIPTS)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", [s for s, _ in SCRIPTS])
def test_two_ranks_on_one_gpu_is_refused_in_one_line(refusals, script):
    code, stderr = refusals[script]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, f"{script}: exit {code!r}\n{stderr[-2000:]}"
    assert "Traceback" not in stderr, stderr[-2000:]
    assert len(lines) == 1, stderr[-2000:]
    assert "two ranks would share a GPU" in lines[0] and "--nproc-per-node" in lines[0], lines[0]
