"""Real job sizes: 34 and 64 ranks on the local cluster started with 32 nodes.

At 4 ranks host lists have two entries and every sum is small. Here the lessons meet what real
jobs are: a node list such as node[1-17], a rendezvous of 64 processes, and 34 ranks, the
smallest world size whose sums a float32 check gets wrong (34 = 2 x 17; see common/preflight.py).
For each size, on 17 and 32 nodes x 2 tasks: the preflight (srun, as lesson 06 runs it), lesson
01's job script and lesson 03's job script (a 1,024-image epoch), each checked by what it prints.

On 2 cores most of the time is 34 or 64 processes importing torch, one after another: about
5 minutes for the lane. Marked ``scale``: make test-scale (CI), outside make test.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, cluster_lock, job_environ, run_up, submit_job

pytestmark = pytest.mark.scale

SIZES = [(17, 34), (32, 64)]  # (nodes, ranks): 2 tasks per node
JOB_TIMEOUT = 420


@pytest.fixture(scope="module")
def cluster32(cluster):
    """The cluster restarted with 32 nodes for this module, under the lock; back to 2 after."""
    with cluster_lock():
        run_up("--nodes", "32")
        try:
            yield
        finally:
            run_up()


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize("nodes,ranks", SIZES, ids=[f"{r}-ranks" for _, r in SIZES])
def test_preflight_at_scale(cluster32, nodes, ranks):
    env = job_environ({"COURSE_DIST_TIMEOUT": "120"})
    cmd = ["srun", f"--nodes={nodes}", "--ntasks-per-node=2", "--cpus-per-task=1",
           "python", "-m", "common.preflight"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=JOB_TIMEOUT)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"preflight: {ranks}/{ranks} tasks on {nodes} node(s)" in out, out[-3000:]
    assert re.search(rf"all_reduce \(gloo, {ranks} ranks", out), out[-3000:]
    assert "preflight: all checks passed" in out, out[-3000:]


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize("nodes,ranks", SIZES, ids=[f"{r}-ranks" for _, r in SIZES])
def test_lesson01_at_scale(cluster32, tmp_path, nodes, ranks):
    script = ROOT / "lessons/01_hello_allreduce/job.sh"
    status, out = submit_job(tmp_path, script, sbatch_args=[f"--nodes={nodes}"],
                             timeout=JOB_TIMEOUT)  # fmt: skip
    assert status == 0, out[-3000:]
    assert f"on nodes node[1-{nodes}]: {nodes} node(s)" in out, out[-3000:]
    assert f"all {ranks} ranks hold the expected sum" in out, out[-3000:]


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize("nodes,ranks", SIZES, ids=[f"{r}-ranks" for _, r in SIZES])
def test_lesson03_at_scale(cluster32, tmp_path, nodes, ranks):
    script = ROOT / "lessons/03_ddp_mnist/job.sh"
    status, out = submit_job(tmp_path, script, "1", "--train-subset", "1024", "--test-subset",
                             "256", sbatch_args=[f"--nodes={nodes}"],
                             timeout=JOB_TIMEOUT)  # fmt: skip
    saved = re.search(r"^epochs 1, checkpoint (\S+)$", out, re.M)
    if saved:
        Path(saved[1]).unlink(missing_ok=True)
    assert status == 0, out[-3000:]
    assert f"world size {ranks} ({nodes} node(s) x 2)" in out, out[-3000:]
