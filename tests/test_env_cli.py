"""``python -m common.env`` (common/env_cli.py): each task's view as JSON, and ``--export`` lines
a shell evaluates; bad arguments exit 2 with one line.
"""

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from test_env_resolution import BATCH_SCRIPT, slurm_step  # noqa: E402

from common.env import master_port_for_job  # noqa: E402


def clean_environ(**extra):
    """This process's environment without any launcher variables, plus ``extra``."""
    drop = ("SLURM_", "TORCHELASTIC_", "RANK", "LOCAL_", "WORLD_SIZE", "GROUP_", "MASTER_")
    environ = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    environ["PYTHONPATH"] = str(ROOT)
    environ.update(extra)
    return environ


def run_cli(*args, **extra):
    return subprocess.run(
        [sys.executable, "-m", "common.env", *args],
        env=clean_environ(**extra),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_cli_json_for_an_srun_task():
    step = slurm_step(3, 1, 1, 4, "192.0.2.1,node2", "2(x2)", job_id="4242")
    proc = run_cli(**step)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    info = json.loads(lines[0])
    expected = {"rank": 3, "local_rank": 1, "world_size": 4, "local_world_size": 2,
                "node_rank": 1, "num_nodes": 2, "master_addr": "192.0.2.1",
                "master_port": master_port_for_job(4242), "launcher": "slurm",
                "backend": "gloo", "hostname": socket.gethostname(), "job_id": "4242"}  # fmt: skip
    assert info == expected


def test_cli_export_feeds_a_shell():
    step = slurm_step(1, 0, 1, 2, "192.0.2.1,node2", "1(x2)", SLURM_GPUS_ON_NODE="2")
    script = (
        'eval "$(python -m common.env --export)"; '
        'echo "$MASTER_ADDR $MASTER_PORT $NNODES $NODE_RANK $NPROC_PER_NODE ${RANK-unset}"'
    )
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    proc = subprocess.run(
        ["bash", "-c", script],
        env={**clean_environ(**step), "PATH": path},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["192.0.2.1", str(15000 + 1234), "2", "1", "2", "unset"]


def test_cli_export_quotes_values():
    proc = run_cli("--export", MASTER_ADDR="localhost", MASTER_PORT="23002")
    assert proc.returncode == 0, proc.stderr
    exports = dict(shlex.split(line)[1].split("=", 1) for line in proc.stdout.splitlines())
    assert exports["MASTER_ADDR"] == "localhost" and exports["MASTER_PORT"] == "23002"
    assert set(exports) == {"MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC_PER_NODE"}


def test_cli_export_in_the_batch_script():
    """The batch script is one process, but what it exports serves the whole job: MASTER_ADDR
    is the job's first host (an address here, so that it resolves on any machine)."""
    batch = {**BATCH_SCRIPT, "SLURM_JOB_NODELIST": "192.0.2.1,node2",
             "SLURMD_NODENAME": "192.0.2.1", "SLURM_GPUS_ON_NODE": "2"}  # fmt: skip
    proc = run_cli("--export", **batch)
    assert proc.returncode == 0, proc.stderr
    exports = dict(shlex.split(line)[1].split("=", 1) for line in proc.stdout.splitlines())
    assert exports == {"MASTER_ADDR": "192.0.2.1", "MASTER_PORT": str(master_port_for_job(77)),
                       "NNODES": "2", "NODE_RANK": "0", "NPROC_PER_NODE": "2"}  # fmt: skip


@pytest.mark.parametrize(
    "args,extra,needle",
    [
        ((), {"RANK": "0", "WORLD_SIZE": "zwei"}, "WORLD_SIZE"),
        (("--export",), {"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5"),
        ((), slurm_step(0, 0, 0, 2, "node[1-", "1(x2)"), "SLURM_STEP_NODELIST"),
        ((), {"MASTER_ADDR": "no-such-host.invalid"}, "MASTER_ADDR"),
        (("--bogus",), {}, "--bogus"),
        # --export feeds one per-node launcher; two srun tasks on this node would start two.
        (("--export",), slurm_step(1, 1, 0, 4, "192.0.2.1,node2", "2(x2)"),
         "double spawn: srun started 2 tasks on this node (SLURM_STEP_TASKS_PER_NODE)"),
    ],
)
def test_cli_bad_input_exits_2(args, extra, needle):
    proc = run_cli(*args, **extra)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert needle in proc.stderr and "Traceback" not in proc.stderr
