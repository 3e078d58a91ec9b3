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

The cancel's SIGTERM is followed by SIGKILL after KillWait, and two waits can outlast it: the
tasks' own exit, which srun waits for, and slurmctld's answers on a loaded controller. The job
says the command to go on as soon as it knows: at the SIGTERM, from the state check it starts
then in the background, or, if slurmctld has not answered by srun's end, first thing after srun,
before asking again. The second test plays the slow controller (an `scontrol` first on the job's
PATH that answers `show job` after a minute) and finds the command in the output of a batch
shell killed while it waited; before, the advice came after three `scontrol show job` calls (the
first in the SIGTERM handler), and that job ended with none (measured on 22.05). The third plays
tasks that outlive KillWait (a `python` that stays 30 s after train.py's exit): the batch shell
is killed with srun still waiting, and the command is in the log, from the check at the SIGTERM;
before, it came only after srun (a lesson 07 job on 26.05 under load ended so with none).
"""

import os
import shutil
import subprocess

import pytest
from conftest import ROOT, slurm, slurm_version, wait_for, wait_job

VENV_BIN = ROOT / ".venv" / "bin"

SCRIPTS = {
    # lesson: (script, its arguments, the variable naming the checkpoint, file or folder)
    "05": ("lessons/05_fault_tolerance/requeue.sh", ["1", "--log-every", "10"], "CHECKPOINT",
           "ckpt.pt"),
    "07": ("lessons/07_fsdp_sharding/job.sh", ["1", "--log-every", "10"], "CHECKPOINT_DIR",
           "ckpt"),
}  # fmt: skip


def cancel_once_training(cluster_lock, script, args, env, out):
    """Submit SCRIPT as the README does (output to OUT), scancel it once it trains, wait for its
    end: (its state, its last record, the batch step's ExitCode in sacct, its log)."""

    def log():
        return out.read_text() if out.exists() else ""

    with cluster_lock():
        job = slurm("sbatch", "--parsable", f"--output={out}", ROOT / script, *args, env=env)
        try:
            wait_for("a progress line", lambda: "batch 10/" in log(), 240)
            slurm("scancel", job)
            state, _, record = wait_job(job, timeout=240)
            # How the batch shell ended, as slurmdbd has it once the step's end reaches it.
            batch = wait_for("the batch step's end in sacct", lambda: slurm(
                "sacct", "-n", "-P", "-j", f"{job}.batch", "-o", "ExitCode"), 60)  # fmt: skip
        finally:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
    return state, record, batch, log()


@pytest.mark.long
@pytest.mark.timeout(600)
@pytest.mark.parametrize("lesson", sorted(SCRIPTS))
def test_plain_scancel_saves_and_the_job_stays_cancelled(cluster, cluster_lock, tmp_path, lesson):
    if lesson == "07" and slurm_version() == (22, 5):
        pytest.skip("the same stop rules (common/job_env.sh) as lesson 05's job, which runs "
                    "here on 22.05; lesson 07's runs on 26.05 (make test-slurm)")
    script, args, variable, name = SCRIPTS[lesson]
    out, ckpt = tmp_path / "job.out", tmp_path / name
    state, record, batch, text = cancel_once_training(
        cluster_lock, script, args, {"SUBSET": "12800", variable: str(ckpt)}, out)
    try:
        assert state == "CANCELLED", text
        # A requeue accepted after the cancel counts a restart at once (_job_requeue_op).
        assert record.get("Restarts") == "0", (record, text)
        assert "requeueing job" not in text and text.count("=== job ") == 1, text
        assert ckpt.is_file() or any(ckpt.rglob("*.distcp")), text  # saved, to go on from
        # How to go on, said once, as soon as it was known: by the check at the SIGTERM
        # (common/job_env.sh, course_stop_check), or, if slurmctld had not answered it by
        # srun's end, first thing after srun.
        lines = text.splitlines()
        first = [line for line in lines if "go on later with:" in line]
        assert len(first) == 1, text
        assert first[0].endswith(f"go on later with: {variable}={ckpt} sbatch {script} 1"), first
        # The state-dependent line comes after srun, from a batch shell that got to its end:
        # sacct's ExitCode (status:signal) says whether it did (exit 75, no signal), or was
        # killed at KillWait before srun ended (once under a load of 20, without the exit freeze,
        # lesson 07 on 26.05: saved 0.8 s after the SIGTERM, its 4 ranks leaving for over 10 s).
        if batch.splitlines()[-1].endswith(":0"):
            said = [line for line in lines if "saved, not requeued" in line]
            assert len(said) == 1, text
            assert f"To go on later: {variable}={ckpt} sbatch {script} 1" in said[0], said[0]
            assert lines.index(first[0]) < lines.index(said[0]), text
        else:
            assert "finished with status" not in text, (batch, text)
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

    state, record, _, text = cancel_once_training(
        cluster_lock, script, args, {"SUBSET": "12800", variable: str(ckpt),
                                     "PATH": f"{bin_dir}:{os.environ['PATH']}"}, out)  # fmt: skip
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


# python as a task that outlives KillWait: the training gets the signals Slurm sends the task
# (slurmstepd signals the task's own process, this shell: passed on), saves and exits as always,
# then the task stays 30 s more, so srun has not returned when the SIGKILL comes. Only
# train.py's runs stay; the batch script's own python calls run as they are.
SLOW_EXIT_PYTHON = """#!/bin/bash
case " $* " in *train.py*) ;; *) exec {real} "$@" ;; esac
{real} "$@" &
child=$!
trap 'kill -USR1 $child 2>/dev/null' USR1
trap 'kill -TERM $child 2>/dev/null' TERM
while :; do
    wait $child && rc=0 || rc=$?
    if ((rc > 128)) && kill -0 $child 2>/dev/null; then continue; fi
    break
done
for _ in $(seq 30); do sleep 1; done
exit $rc
"""


@pytest.mark.long
@pytest.mark.timeout(600)
def test_a_cancelled_job_whose_tasks_outlive_killwait_says_how_to_go_on(cluster, cluster_lock,
                                                                        tmp_path):  # fmt: skip
    """A plain scancel of lesson 05's job whose tasks end only after KillWait: the batch shell
    is killed while srun still waits for them, and the log says how to go on all the same (the
    check at the SIGTERM said it; before, the advice came only after srun's end, and such a job
    ended with none)."""
    script, args, variable, name = SCRIPTS["05"]
    out, ckpt, bin_dir = tmp_path / "job.out", tmp_path / name, tmp_path / "venv" / "bin"
    # The job activates a venv (common/job_env.sh): this one is the course's, with the stub
    # first on PATH (COURSE_VENV, as a student points the jobs at a venv of their own).
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f"source {VENV_BIN}/activate\nexport PATH={bin_dir}:$PATH\n")
    stub = bin_dir / "python"
    stub.write_text(SLOW_EXIT_PYTHON.format(real=VENV_BIN / "python"))
    stub.chmod(0o755)

    state, record, batch, text = cancel_once_training(
        cluster_lock, script, args, {"SUBSET": "12800", variable: str(ckpt),
                                     "COURSE_VENV": str(bin_dir.parent)}, out)  # fmt: skip
    try:
        assert state == "CANCELLED" and record.get("Restarts") == "0", (record, text)
        assert "checkpoint saved" in text and "requeueing job" not in text, text
        # Killed at KillWait with srun still waiting: nothing after srun was written.
        assert not batch.splitlines()[-1].endswith(":0"), (batch, text)
        assert "saved, not requeued" not in text and "finished with status" not in text, text
        said = [line for line in text.splitlines() if "go on later with:" in line]
        assert len(said) == 1, text
        assert said[0].endswith(f"go on later with: {variable}={ckpt} sbatch {script} 1"), said
        assert "not requeued: once the training has saved" in said[0], said
        assert ckpt.is_file(), text
    finally:
        ckpt.unlink(missing_ok=True)
