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

The cancel's SIGTERM is followed by SIGKILL after KillWait, and asking slurmctld whether the job
is to be requeued can take longer on a loaded controller: the job says the command to go on
first, then asks. The second test plays such a controller (an `scontrol` first on the job's
PATH that answers `show job` after a minute) and finds the command in the output of a batch
shell killed while it waited; before, the advice came after three `scontrol show job` calls (the
first in the SIGTERM handler), and that job ended with none (measured on 22.05).
"""

import os
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
            # How the batch shell ended, as slurmdbd has it once the step's end reaches it.
            batch = wait_for("the batch step's end in sacct", lambda: slurm(
                "sacct", "-n", "-P", "-j", f"{job}.batch", "-o", "ExitCode"), 60)  # fmt: skip
        finally:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
    text = log()
    try:
        assert state == "CANCELLED", text
        # A requeue accepted after the cancel counts a restart at once (_job_requeue_op).
        assert record.get("Restarts") == "0", (record, text)
        assert "requeueing job" not in text and text.count("=== job ") == 1, text
        assert ckpt.is_file() or any(ckpt.rglob("*.distcp")), text  # saved, to go on from
        # The lines below come once srun has ended: after the tasks' exit, which under a load of
        # 20 on 2 cores, with the interpreter's own exit (COURSE_TEST_EXITFAST=0), outlasted the
        # 10 s KillWait once (lesson 07 on 26.05: saved 0.79 s after the SIGTERM, then the
        # batch shell SIGKILLed with srun still waiting for its tasks). sacct's ExitCode
        # (status:signal) tells: a shell that got to its end exited 75, with no signal.
        if not batch.splitlines()[-1].endswith(":0"):
            pytest.skip(f"job {job}'s batch shell was killed ({batch}) before its tasks ended, "
                        "at KillWait on a loaded machine: the lines after srun were not written")
        lines = text.splitlines()
        said = [line for line in lines if "saved, not requeued" in line]
        assert len(said) == 1, text
        assert f"To go on later: {variable}={ckpt} sbatch {script} 1" in said[0], said[0]
        # The same command, said first, before slurmctld was asked (the test below).
        first = [line for line in lines if "go on later with:" in line]
        assert len(first) == 1 and lines.index(first[0]) < lines.index(said[0]), text
        assert first[0].endswith(f"go on later with: {variable}={ckpt} sbatch {script} 1"), first
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


# scontrol as a loaded slurmctld answers it: `show job` and `requeue` after a minute, longer than
# the KillWait (10 s here, 30 s by default) between the cancel's SIGTERM and its SIGKILL; every
# other call (scontrol show hostnames, in common.env) at once. First on the job's PATH.
SLOW_SCONTROL = """#!/bin/bash
case " $* " in *" show job "* | *" requeue "*) sleep 60 ;; esac
exec {real} "$@"
"""


@pytest.mark.long
@pytest.mark.timeout(600)
def test_a_cancelled_job_says_how_to_go_on_before_asking_slurm(cluster, cluster_lock, tmp_path):
    """A plain scancel, with every `scontrol show job` slower than KillWait: the batch shell is
    killed while it waits for slurmctld, and the command to go on was said before it asked.
    (Before: the resume command came after three `scontrol show job` calls, the first in the
    SIGTERM handler, and the job ended with no advice at all.)"""
    script, args, variable, name = SCRIPTS["05"]
    out, ckpt, bin_dir = tmp_path / "job.out", tmp_path / name, tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "scontrol"
    stub.write_text(SLOW_SCONTROL.format(real=shutil.which("scontrol")))
    stub.chmod(0o755)

    def log():
        return out.read_text() if out.exists() else ""

    with cluster_lock():
        job = slurm("sbatch", "--parsable", f"--output={out}", ROOT / script, *args,
                    env={"SUBSET": "12800", variable: str(ckpt),
                         "PATH": f"{bin_dir}:{os.environ['PATH']}"})  # fmt: skip
        try:
            wait_for("a progress line", lambda: "batch 10/" in log(), 240)
            slurm("scancel", job)
            state, _, record = wait_job(job, timeout=240)
        finally:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
    text = log()
    try:
        assert state == "CANCELLED" and record.get("Restarts") == "0", (record, text)
        assert "checkpoint saved" in text and "requeueing job" not in text, text
        # Killed while it waited for slurmctld: no state-dependent line, no end of the script.
        assert "saved, not requeued" not in text and "finished with status" not in text, text
        said = [line for line in text.splitlines() if "go on later with:" in line]
        assert len(said) == 1, text
        assert said[0].endswith(f"go on later with: {variable}={ckpt} sbatch {script} 1"), said
        assert ckpt.is_file(), text
    finally:
        ckpt.unlink(missing_ok=True)
