"""`make demo`, README.md's first command, run as written from the course root (make test-long):
lesson 03's default job on the local cluster, 3 epochs of 60,000 images (a minute or two),
waited for by cluster/wait.sh. And the answer of the course's one job-wait (common/jobwait.py)
for a job that a signal ended, set against `sbatch --wait`'s own.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, job_environ, wait_job
from test_lesson03 import check_job_output, load

from common.notebook import job_state


def plain_shell_environ() -> dict[str, str]:
    """A shell's environment without the venv active (as README.md's two commands are typed):
    no venv on PATH, no PYTHONPATH, nothing from the make that runs this test."""
    env = job_environ()
    venv_bin = (ROOT / ".venv" / "bin").resolve()
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() != venv_bin)  # fmt: skip
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"):
        env.pop(name, None)
    return env


@pytest.mark.long  # about 70 s on 2 cores alone: the full default job
@pytest.mark.computes
@pytest.mark.timeout(900)
def test_make_demo(cluster, cluster_lock):
    with cluster_lock():  # make demo finds the cluster up (the fixture): it only submits
        proc = subprocess.run(["make", "demo"], cwd=ROOT, env=plain_shell_environ(),
                              capture_output=True, text=True, timeout=840)  # fmt: skip
    shown = re.search(r"^== runs/slurm-(\d+)\.out$", proc.stdout, re.M)
    assert proc.returncode == 0 and shown, proc.stdout + proc.stderr
    job = shown[1]
    out = ROOT / "runs" / f"slurm-{job}.out"
    ckpt = ROOT / "checkpoints" / f"ddp_mnist-{job}.pt"
    try:
        text = out.read_text()
        assert proc.stdout.endswith(text), proc.stdout  # make demo prints the job's output
        assert "training 3 epochs on 60000 images" in text, text
        assert "global batch 128 = 4 x 32, 469 steps per epoch" in text, text
        check_job_output(text, epochs=3, min_acc=99.0)  # the README's "done: test_acc 99.xx%"
        assert f"epochs 3, checkpoint {ckpt}" in text, text
        assert load(ckpt)["epoch"] == 3
        assert not ckpt.with_name(ckpt.name + ".old").exists()  # a new job id: nothing moved
    finally:
        ckpt.unlink(missing_ok=True)
        out.unlink(missing_ok=True)


@pytest.mark.long  # about 4 s: sbatch --wait looks at the job after 2 s
def test_a_job_ended_by_a_signal_gives_1_as_sbatch_wait_does(cluster, cluster_lock, tmp_path):
    """sbatch --wait returns 1 for a job whose batch script a signal ended (sbatch.c,
    _job_wait); cluster/wait.sh, the notebooks' job_state and the tests' wait_job say the same
    (common/jobwait.py), while the job's ExitCode keeps the signal."""
    killed = tmp_path / "killed.sh"
    killed.write_text("#!/bin/bash\necho about to be killed\nkill -KILL $$\n")
    with cluster_lock():
        waited = subprocess.run(["sbatch", "--wait", "--parsable", f"--output={tmp_path}/%j.out",
                                 str(killed)], cwd=ROOT, capture_output=True, text=True,
                                timeout=120, env=job_environ())  # fmt: skip
        job = waited.stdout.strip().split(";")[0]
        assert job.isdigit(), waited.stdout + waited.stderr
        script = subprocess.run(["bash", "cluster/wait.sh", job], cwd=ROOT, capture_output=True,
                                text=True, timeout=60, env=job_environ())  # fmt: skip
        state, status, record = wait_job(job, timeout=120)
        notebook = job_state(job)
    assert record["ExitCode"] == "0:9" and state == "FAILED", record
    assert (tmp_path / f"{job}.out").read_text() == "about to be killed\n"
    assert (waited.returncode, script.returncode, status, notebook) == (1, 1, 1, (state, 1)), (
        waited.stderr, script.stderr)  # fmt: skip

    bad = subprocess.run(["bash", "cluster/wait.sh", "job.sh"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("usage: bash cluster/wait.sh JOBID"), (
        bad.stderr)  # fmt: skip
    assert len(bad.stderr.splitlines()) == 1, bad.stderr
