"""Lesson 06's healthy case, `sbatch lessons/06_diagnosing_hangs/preflight.sh`, submitted as its
README shows it (from the course root; the script names its output `preflight-<jobid>.out`
there): the preflight passes on 2 nodes x 2 tasks, then the job it protects runs its three
all_reduce steps on every rank. The stored sample (preflight-380.out) has the same lines.
"""

import re

import pytest
from conftest import ROOT, slurm, wait_job

LESSON = ROOT / "lessons" / "06_diagnosing_hangs"


def shape(text: str) -> list[str]:
    """The lines without their numbers (times, pids, ports, addresses, ids), sorted: the ranks
    print in any order."""
    return sorted(re.sub(r"[-+]?\d+(\.\d+)?", "N", line) for line in text.splitlines())


@pytest.mark.long
@pytest.mark.timeout(360)
def test_preflight_sh_passes_then_runs_the_job(cluster, cluster_lock):
    with cluster_lock():
        job = slurm("sbatch", "--parsable", LESSON / "preflight.sh")
        try:
            _, status, _ = wait_job(job, 150)
        finally:
            slurm("scancel", job)
    out = ROOT / f"preflight-{job}.out"
    try:
        text = out.read_text()
    finally:
        out.unlink(missing_ok=True)
    assert status == 0, text
    assert re.search(r"^preflight: 4/4 tasks on 2 node\(s\) \(node1,node2\) met rank 0", text, re.M)
    assert re.search(r"^preflight: all checks passed", text, re.M), text
    for rank in range(4):
        assert f"rank {rank}/4 on node{rank // 2 + 1}: step 2: all_reduce done (10)" in text, text
    sample = (LESSON / "preflight-380.out").read_text()
    assert shape(text) == shape(sample), text
