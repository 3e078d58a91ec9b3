"""crash.sh never deletes a checkpoint it did not make for itself.

It used to `rm -f "$CHECKPOINT"` before starting, so a CHECKPOINT=<a real run's checkpoint>
lost that run. Now a named checkpoint is handed to train.py as it is (the run goes on from it,
or starts it when the file is not there yet); without CHECKPOINT the job uses its own
checkpoints/ft-crash-<jobid>.pt, and an old file under that name is moved aside to .old unless
Slurm restarted the job (then it is the job's own, and resumed).

The real script, run by bash as sbatch would run it on the first node (SLURM_* variables of a
one-node job, a course folder of its own whose common/ is this checkout's), with one stand-in:
`srun`, first on PATH, writes the arguments it was given instead of starting the step, so the
checkpoint the workers would get is read from there. The training itself under crash.sh is
tests/test_lesson05.py's (on the cluster).
"""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CRASH = ROOT / "lessons" / "05_fault_tolerance" / "crash.sh"
JOB_ID = "4242"

STAND_IN_SRUN = """#!/bin/sh
printf '%s\\n' "$@" > "$SRUN_ARGS"
"""

SAVED = b"a real run's checkpoint"


@pytest.fixture
def job(tmp_path):
    """run(env) -> (the checkpoint train.py was given, the CompletedProcess); the course."""
    course = tmp_path / "course"
    course.mkdir()
    (course / "common").symlink_to(ROOT / "common")
    (tmp_path / "bin").mkdir()
    srun = tmp_path / "bin" / "srun"
    srun.write_text(STAND_IN_SRUN)
    srun.chmod(0o755)
    args = tmp_path / "srun-args"
    keep = ("HOME", "LANG", "TMPDIR")
    base = {k: os.environ[k] for k in keep if k in os.environ}
    base.update({
        "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "COURSE_VENV": str(ROOT / ".venv"),
        "SLURM_SUBMIT_DIR": str(course), "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NAME": "ft-crash",
        "SLURM_JOB_NODELIST": "node1", "SLURM_NNODES": "1", "SLURM_CPUS_PER_TASK": "2",
        "SRUN_ARGS": str(args),
    })  # fmt: skip

    def run(**env):
        proc = subprocess.run(["bash", str(CRASH), "1"], cwd=tmp_path, env={**base, **env},
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        given = args.read_text().splitlines()
        return Path(given[given.index("--checkpoint") + 1]), proc

    return run, course


def test_a_named_checkpoint_that_exists_is_kept_and_continued(job, tmp_path):
    run, _ = job
    mine = tmp_path / "runs" / "mnist.pt"
    mine.parent.mkdir()
    mine.write_bytes(SAVED)
    given, _ = run(CHECKPOINT=str(mine))
    assert given == mine
    assert mine.read_bytes() == SAVED, "crash.sh deleted or changed the named checkpoint"
    assert sorted(p.name for p in mine.parent.iterdir()) == ["mnist.pt"]


def test_a_named_checkpoint_not_there_yet_is_started(job, tmp_path):
    run, _ = job
    given, _ = run(CHECKPOINT=str(tmp_path / "new.pt"))
    assert given == tmp_path / "new.pt" and not given.exists()


@pytest.mark.parametrize(("leftover", "restart_count", "kept_as"), [
    (False, None, None),  # the usual case: a fresh file of the job's own
    (True, None, ".old"),  # job ids start again on a new cluster: moved aside, not deleted
    (True, "1", ""),  # Slurm requeued this job: its own checkpoint, resumed
])  # fmt: skip
def test_without_checkpoint_the_job_uses_its_own(job, leftover, restart_count, kept_as):
    run, course = job
    own = course / "checkpoints" / f"ft-crash-{JOB_ID}.pt"
    if leftover:
        own.parent.mkdir()
        own.write_bytes(SAVED)
    given, _ = run(**({"SLURM_RESTART_COUNT": restart_count} if restart_count else {}))
    assert given == own
    if kept_as is None:
        assert not own.exists()
    else:
        assert Path(f"{own}{kept_as}").read_bytes() == SAVED
        assert own.exists() == (kept_as == "")
