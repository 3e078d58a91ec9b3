"""Sites without job_container/tmpfs: /tmp is one folder for every job and user of a node.

Lesson 08 stages its data to the node's local disk. Under a fixed name (/tmp/mnist-files) two
jobs on one node would overwrite or delete each other's copy, another user's job would be refused
the folder, and a copy would stay behind after the job. The local cluster gives each job a
/tmp of its own (cluster/job_container.conf.in), so these tests point the staging root,
SLURM_TMPDIR (what sites with a per-job folder set, read by the job scripts), at one folder that
every job and node sees: the shared /tmp of such a site. Two jobs on the same two nodes at once
both train and leave nothing there; a job cancelled after staging leaves nothing either.
"""

import os
import re
import subprocess
import sys
import time

import pytest
from conftest import ROOT, cluster_lock, slurm, wait_for, wait_job

pytestmark = pytest.mark.sites
JOB = ROOT / "lessons" / "08_data_pipeline" / "job.sh"
# Two such jobs fit on the two nodes side by side: one task and one GPU per node each.
SMALL = ["--nodes=2", "--ntasks-per-node=1", "--gres=gpu:1", "--cpus-per-task=2", "--mem=6G"]


@pytest.fixture(scope="module")
def data_ready():
    """The files lesson 08 stages (`make data`; mnist_files.py), made here if missing."""
    if not (ROOT / "data" / "mnist-files" / "folder.tar").is_file():
        proc = subprocess.run([sys.executable, str(JOB.parent / "mnist_files.py")], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr


@pytest.fixture
def shared_tmp(tmp_path):
    """A /tmp that every node and every job sees (sticky and open to all, as /tmp is)."""
    root = tmp_path / "node-tmp"
    root.mkdir()
    root.chmod(0o1777)
    return root


def submit(out, shared_tmp, *train_args):
    return slurm("sbatch", "--parsable", *SMALL, f"--output={out}",
                 f"--export=ALL,SLURM_TMPDIR={shared_tmp},FORM=packed", JOB,
                 *train_args)  # fmt: skip


def left_in(root):
    return sorted(os.listdir(root))


@pytest.mark.timeout(840)
def test_two_jobs_on_the_same_nodes_stage_apart_and_leave_nothing(data_ready, cluster,
                                                                  shared_tmp, tmp_path):
    outs = [tmp_path / "a.out", tmp_path / "b.out"]
    with cluster_lock():
        jobs = [submit(out, shared_tmp, "--max-steps", "8", "--workers", "1") for out in outs]
        try:
            wait_for("both jobs running at once on the same nodes",
                     lambda: slurm("squeue", "-h", "-t", "R", "-j", ",".join(jobs), "-o", "%N")
                     .split() == ["node[1-2]"] * 2, 240)  # fmt: skip
            ends = [wait_job(job, timeout=300)[:2] for job in jobs]
        finally:
            slurm("scancel", *jobs)
    texts = [out.read_text() if out.exists() else "" for out in outs]
    for job, (state, status), text in zip(jobs, ends, texts, strict=True):
        assert (state, status) == ("COMPLETED", 0), text
        # Each job its own folder, named after it, on both nodes of the same pair.
        folder = f"{shared_tmp}/mnist-files-{job}"
        assert re.search(rf"^staged packed \(\d+ MB\) from .* to {folder} on 2 node\(s\)",
                         text, re.M), text  # fmt: skip
        assert f"data packed from {folder}: 60000 train, 10000 test images; world size 2" in text
        assert "10000 images scored once each" in text, text
    assert left_in(shared_tmp) == [], texts


@pytest.mark.timeout(600)
def test_cancelled_job_leaves_nothing(data_ready, cluster, shared_tmp, tmp_path):
    out = tmp_path / "c.out"

    def log():
        return out.read_text() if out.exists() else ""

    with cluster_lock():
        job = submit(out, shared_tmp, "--max-steps", "100000", "--workers", "1")
        try:
            wait_for("the job's first training line", lambda: "data packed from" in log(), 360)
            folder = shared_tmp / f"mnist-files-{job}"
            assert folder.is_dir() and (folder.stat().st_mode & 0o777) == 0o700, log()
            slurm("scancel", job)
            state, _, _ = wait_job(job, timeout=240)
        finally:
            slurm("scancel", job)
    assert state == "CANCELLED", log()
    # The idle step's task epilogs run while the job completes: give them a moment.
    deadline = time.monotonic() + 30
    while left_in(shared_tmp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left_in(shared_tmp) == [], log()
