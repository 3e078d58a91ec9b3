"""Each job has a private /tmp on each of its nodes, as on a cluster that runs job_container/tmpfs
(cluster/job_container.conf.in): a file a job stages on node1 is not on node2, two jobs on one
node do not see each other's files, the job's /tmp is gone when it ends, and nothing of it is
left on the host's own /tmp. The shared filesystem (the course directory) is seen everywhere."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest
from conftest import ROOT, cluster_lock, job_environ, wait_for

# Where node1 keeps its jobs' /tmp: the job's folder under BasePath, which the plugin names
# BasePath/<node>/<job id> (cluster/up.sh writes BasePath).
NODE1_JOBS = Path("/var/lib/course-cluster/nodes/node1/node1")

pytestmark = pytest.mark.timeout(240)


def test_a_file_written_to_tmp_on_node1_is_not_on_node2(srun):
    name = f"course-tmp-{uuid.uuid4().hex[:8]}"
    shared = ROOT / "runs" / name
    shared.parent.mkdir(exist_ok=True)
    try:
        # Node 1 writes a file to /tmp and to the shared folder; then both nodes look for both.
        script = (
            f"if [[ $(hostname) == node1 ]]; then echo x > /tmp/{name}; echo x > {shared}; fi; "
            f'sleep 1; echo "$(hostname) tmp=$([[ -e /tmp/{name} ]] && echo yes || echo no) '
            f'shared=$([[ -e {shared} ]] && echo yes || echo no)"'
        )
        proc = srun("--nodes=2", "--ntasks-per-node=1", "bash", "-c", script, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert sorted(proc.stdout.split("\n")[:2]) == [
            "node1 tmp=yes shared=yes",
            "node2 tmp=no shared=yes",
        ], proc.stdout
        assert not Path(f"/tmp/{name}").exists()  # not the host's /tmp either
    finally:
        shared.unlink(missing_ok=True)


def test_two_jobs_on_one_node_do_not_share_tmp(cluster):
    name = f"course-tmp-{uuid.uuid4().hex[:8]}"
    # The first job holds a file in its /tmp while the second, on the same node, looks for it.
    first = None
    with cluster_lock():
        try:
            first = subprocess.run(
                ["sbatch", "--parsable", "--nodelist=node1", "--ntasks=1", "--output=/dev/null",
                 "--wrap", f"echo x > /tmp/{name}; sleep 30"],
                cwd=ROOT, capture_output=True, text=True, timeout=30, env=job_environ(),
            ).stdout.strip().split(";")[0]  # fmt: skip
            wait_for("the first job", lambda: subprocess.run(
                ["squeue", "-h", "-j", first, "-o", "%T"], capture_output=True, text=True,
                timeout=30).stdout.strip() == "RUNNING", 120)  # fmt: skip
            second = subprocess.run(
                ["srun", "--nodelist=node1", "--ntasks=1", "bash", "-c",
                 f"ls /tmp; [[ -e /tmp/{name} ]] && echo seen || echo private"],
                cwd=ROOT, capture_output=True, text=True, timeout=60, env=job_environ(),
            )  # fmt: skip
            assert (NODE1_JOBS / first).is_dir()
        finally:
            if first:
                subprocess.run(["scancel", first], capture_output=True, timeout=30)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "private", second.stdout
    # The job's /tmp goes with the job.
    wait_for("the first job's /tmp to go", lambda: not (NODE1_JOBS / first).exists(), 120)
