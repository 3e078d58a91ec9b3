"""requeue.sh when `scontrol requeue` is refused: one line, the checkpoint kept, and the job
ends FAILED with exit code 75, not COMPLETED as if the training had finished.

A real job on the local cluster, warned with `scancel --signal=USR1 --batch` as in
tests/test_lesson05.py; a stand-in `scontrol` first on PATH refuses `requeue` (as slurmctld does
for a job that may not be requeued) and passes every other command to the real one.
"""

import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import job_environ, job_record, wait_job

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "lessons" / "05_fault_tolerance"
SMALL = ["--train-subset", "14000", "--test-subset", "2000", "--log-every", "20"]

FAKE_SCONTROL = """#!/bin/sh
if [ "$1" = requeue ]; then
    echo "Requested operation is presently disabled for job $2" >&2
    exit 1
fi
exec /usr/bin/scontrol "$@"
"""


@pytest.mark.timeout(600)
def test_a_refused_requeue_fails_the_job_in_one_line(cluster, cluster_lock, tmp_path):
    out, ckpt = tmp_path / "job.out", tmp_path / "ckpt.pt"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    env = job_environ({"PATH": f"{bin_dir}:{os.environ['PATH']}", "CHECKPOINT": str(ckpt)})

    def log():
        return out.read_text() if out.exists() else ""

    with cluster_lock():
        job = subprocess.run(
            ["sbatch", "--parsable", "--nodes=1", f"--output={out}", LESSON / "requeue.sh", "1",
             *SMALL], cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
        ).stdout.strip().split(";")[0]  # fmt: skip
        assert job, "sbatch refused the job"
        try:
            deadline = time.monotonic() + 120
            while "batch 20/" not in log():
                assert time.monotonic() < deadline, log()
                time.sleep(0.3)
            subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True,
                           timeout=30, env=job_environ())  # fmt: skip
            state, code, _ = wait_job(job, timeout=240)
        finally:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
    text = log()
    assert (state, code) == ("FAILED", 75), text
    assert "exiting with 75 to be requeued" in text, text
    said = [line for line in text.splitlines() if line.startswith("error: scontrol requeue")]
    assert len(said) == 1, text
    refused = f"scontrol requeue {job} was refused (Requested operation is presently disabled"
    assert refused in said[0], said[0]
    assert f"CHECKPOINT={ckpt} sbatch" in said[0] and ckpt.exists(), said[0]
    record = job_record(job)
    assert not record or record.get("Restarts", "0") == "0", record
