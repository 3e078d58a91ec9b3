"""Sites that make --export=NONE the default (SBATCH_EXPORT=NONE in the login profile).

Such a job starts with the SLURM_* variables and a login shell's environment only: no venv on
PATH, no PYTHONPATH, nothing of the submitting shell; and sbatch sets SLURM_EXPORT_ENV=NONE in it,
which every srun step inside takes as its --export. common/job_env.sh sets up what the job needs
from the submit directory and hands it to the steps (SLURM_EXPORT_ENV=ALL), saying so in one line.
Lessons 01 and 03's job scripts, submitted as on such a site, run to the end.
"""

import re
from pathlib import Path

import pytest
from conftest import ROOT, submit_job

pytestmark = pytest.mark.sites
NONE = {"SBATCH_EXPORT": "NONE"}  # what such a site's login profile sets
NOTE = "note: this job was submitted with --export=NONE (a site default?)"


@pytest.mark.timeout(300)
def test_lesson01_job_runs_with_export_none(cluster, tmp_path):
    status, out = submit_job(tmp_path, ROOT / "lessons/01_hello_allreduce/job.sh", env=NONE,
                             timeout=240)  # fmt: skip
    assert status == 0, out
    assert out.startswith(NOTE) and out.count("note:") == 1, out
    # Every step found the venv's python and the course (PYTHONPATH): sysinfo, common.env, the
    # 4 ranks of the all_reduce.
    assert "execve()" not in out and "Traceback" not in out, out
    assert "node1: torch " in out and "node2: torch " in out, out
    assert out.count('{"rank": ') == 2, out
    assert "all 4 ranks hold the expected sum" in out, out


@pytest.mark.timeout(360)
def test_lesson03_job_runs_with_export_none(cluster, tmp_path):
    # Under --export=NONE a variable set at submission (EPOCHS=1) would not reach the job: the
    # arguments do.
    status, out = submit_job(tmp_path, ROOT / "lessons/03_ddp_mnist/job.sh", "1",
                             "--train-subset", "2048", "--test-subset", "1000",
                             env=NONE, timeout=300)  # fmt: skip
    saved = re.search(r"^epochs 1, checkpoint (\S+)$", out, re.M)
    if saved:  # the job's own checkpoint, in the course's checkpoints/
        Path(saved[1]).unlink(missing_ok=True)
    assert status == 0, out
    assert out.startswith(NOTE), out
    assert "execve()" not in out and "Traceback" not in out, out
    assert "world size 4 (2 node(s) x 2)" in out, out
    assert "done: test_acc " in out and " after 1 epochs" in out, out
