"""cluster/bench.sh, as cluster/README.md runs it (one round): it restarts the cluster in three
shapes, prints one time per step, and leaves the cluster up in the default shape. It cancels
every job, so it runs under the cluster lock in make test-scale, the lane that restarts the
cluster anyway.
"""

import re
import subprocess

import pytest
from conftest import ROOT, cluster_lock, job_environ

STEPS = [
    "up.sh, already up (nothing to do)",
    "down.sh",
    "up.sh from stopped, until all nodes idle",
    "up.sh --nodes 3 --gpus-per-node 1 (restart)",
    "up.sh back to the default shape (restart)",
]


@pytest.mark.scale
@pytest.mark.timeout(600)
def test_bench_sh_times_each_step_and_leaves_the_default_shape(cluster):
    with cluster_lock():
        proc = subprocess.run(["bash", "cluster/bench.sh", "1"], cwd=ROOT, env=job_environ(),
                              capture_output=True, text=True, timeout=580)  # fmt: skip
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %G"], capture_output=True,
                               text=True, timeout=30, env=job_environ()).stdout  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    times = re.findall(r"^(.+?)\s+(\d+\.\d\d) s$", out, re.M)
    assert [label for label, _ in times] == STEPS, out
    assert all(float(t) > 0 for _, t in times), out
    # (sinfo -N lists a node once per partition: local and urgent)
    assert sorted(set(nodes.splitlines())) == ["node1 gpu:2", "node2 gpu:2"], nodes
    bad = subprocess.run(["bash", "cluster/bench.sh", "0"], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    assert bad.returncode == 1 and bad.stderr.startswith("usage: bash cluster/bench.sh"), bad
