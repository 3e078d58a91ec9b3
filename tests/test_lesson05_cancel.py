"""A plain `scancel` of a requeueing job (lesson 05's requeue.sh, lesson 07's job.sh): the
training saves, and the job ends CANCELLED with Restarts=0; it does not come back.

Both scripts trap SIGTERM, which a preemption and a cancel both bring, and requeue a stopped
job (common/job_env.sh, course_requeue_or_end). Slurm accepts the requeue of a job that is
already cancelled and completing, so without the job-state check the cancelled job went back to
PENDING and ran again (measured on 22.05: RUNNING again 25 s later, Restarts=1). A real job on
the local cluster, as the README submits it (SUBSET for a shorter epoch), cancelled once it
trains. The two scripts share the rules (common/job_env.sh): lesson 05's runs on 22.05 (make
test-long), lesson 07's on the newest Slurm (make test-slurm, tests/lanes.py's EVERY_SLURM);
both came back before the fix (22.05).
"""

import shutil
import subprocess

import pytest
from conftest import ROOT, slurm, slurm_version, wait_for, wait_job

SCRIPTS = {
    # lesson: (script, its arguments, the variable naming the checkpoint, file or folder)
    "05": ("lessons/05_fault_tolerance/requeue.sh", ["1", "--log-every", "10"], "CHECKPOINT",
           "ckpt.pt"),
    "07": ("lessons/07_fsdp_sharding/job.sh", ["1", "--log-every", "10"], "CHECKPOINT_DIR",
           "ckpt"),
}  # fmt: skip


@pytest.mark.long
@pytest.mark.timeout(600)
@pytest.mark.parametrize("lesson", sorted(SCRIPTS))
def test_plain_scancel_saves_and_the_job_stays_cancelled(cluster, cluster_lock, tmp_path, lesson):
    if lesson == "07" and slurm_version() == (22, 5):
        pytest.skip("the same stop rules (common/job_env.sh) as lesson 05's job, which runs "
                    "here on 22.05; lesson 07's runs on 26.05 (make test-slurm)")
    script, args, variable, name = SCRIPTS[lesson]
    out, ckpt = tmp_path / "job.out", tmp_path / name

    def log():
        return out.read_text() if out.exists() else ""

    with cluster_lock():
        job = slurm("sbatch", "--parsable", f"--output={out}", ROOT / script, *args,
                    env={"SUBSET": "12800", variable: str(ckpt)})  # fmt: skip
        try:
            wait_for("a progress line", lambda: "batch 10/" in log(), 240)
            slurm("scancel", job)
            state, _, record = wait_job(job, timeout=240)
        finally:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
    text = log()
    try:
        assert state == "CANCELLED", text
        # A requeue accepted after the cancel counts a restart at once (_job_requeue_op).
        assert record.get("Restarts") == "0", (record, text)
        assert "requeueing job" not in text and text.count("=== job ") == 1, text
        said = [line for line in text.splitlines() if "saved, not requeued" in line]
        assert len(said) == 1, text
        assert f"To go on later: {variable}={ckpt} sbatch {script} 1" in said[0], said[0]
        # What was saved is there to go on from (a file, or DCP's folder of shards).
        assert ckpt.is_file() or any(ckpt.rglob("*.distcp")), text
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
