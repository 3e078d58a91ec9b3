"""Jobs submitted by an ordinary user, as on a real cluster where nobody is root.

cluster/up.sh creates the user ``student``. The tests copy the course into a folder the student
owns and submit lessons from there as that user. The student's own ``.venv`` in the copy reads
the packages of this checkout's venv (a .pth file: this venv's python may sit where the student
cannot go), and MNIST comes from this checkout's data folder (MNIST_DIR): both read only.
"""

import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, wait_job
from test_lesson03 import check_job_output, load

USER = "student"
COPY_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "data", "runs", "checkpoints", "__pycache__", ".pytest_cache", ".ruff_cache"
)


@pytest.fixture
def course_copy(cluster):
    """A copy of the course owned by the student, removed afterwards."""
    try:
        user = pwd.getpwnam(USER)
    except KeyError:
        pytest.fail(f"no user {USER}: cluster/up.sh creates it", pytrace=False)
    home = Path(user.pw_dir)
    dest = Path(
        subprocess.run(
            ["runuser", "-u", USER, "--", "mktemp", "-d", f"{home}/course-XXXXXX"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip()
    )  # fmt: skip
    shutil.copytree(ROOT, dest, ignore=COPY_IGNORE, dirs_exist_ok=True)
    subprocess.run(["chown", "-R", f"{USER}:", str(dest)], check=True, timeout=60)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base = shutil.which(version, path="/usr/local/bin:/usr/bin:/bin")
    if base is None:
        pytest.fail(f"no system {version} for the student's venv", pytrace=False)
    venv = dest / ".venv"
    proc = subprocess.run(
        ["runuser", "-u", USER, "--", base, "-m", "venv", "--without-pip", str(venv)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shared = ROOT / ".venv" / "lib" / version / "site-packages"
    (venv / "lib" / version / "site-packages" / "course.pth").write_text(f"{shared}\n")
    yield dest
    shutil.rmtree(dest, ignore_errors=True)


def as_student(course, *cmd, timeout=60):
    """Run CMD as the student from the course copy, with a login-like environment."""
    env = [
        "env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", f"HOME=/home/{USER}", f"USER={USER}",
        f"LOGNAME={USER}", "LANG=C.UTF-8", f"MNIST_DIR={ROOT / 'data' / 'mnist'}",
    ]  # fmt: skip
    return subprocess.run(
        ["runuser", "-u", USER, "--", *env, *cmd], cwd=course, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def sbatch_as_student(course, script, *args, env=None) -> str:
    """Submit SCRIPT as the student from the course copy, ``NAME=value`` of ENV in front (as a
    README shows them); returns the job id.  The output goes to ``slurm-<jobid>.out`` there."""
    assignments = [f"{name}={value}" for name, value in (env or {}).items()]
    proc = as_student(course, *assignments, "sbatch", "--parsable", "--output=slurm-%j.out",
                      script, *args)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().split(";")[0]


def submit_as_student(cluster_lock, course, script, *args, env=None, timeout=240):
    with cluster_lock():
        job = sbatch_as_student(course, script, *args, env=env)
        try:
            state, code, record = wait_job(job, timeout=timeout)
        except TimeoutError:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
            raise
    out = course / f"slurm-{job}.out"
    return job, state, code, record, out


@pytest.mark.timeout(600)
def test_student_runs_lesson03_from_own_copy(cluster_lock, course_copy):
    """Lesson 03's job on the cluster: the one run of it under `make test` is the student's,
    the README's `sbatch lessons/03_ddp_mnist/job.sh 1` on 8,000 images (SUBSET)."""
    job, state, code, record, out = submit_as_student(
        cluster_lock, course_copy, "lessons/03_ddp_mnist/job.sh", "1", env={"SUBSET": "8000"})
    text = out.read_text()
    assert (state, code) == ("COMPLETED", 0), text
    assert record["UserId"].startswith(f"{USER}("), record
    assert out.stat().st_uid == pwd.getpwnam(USER).pw_uid  # written by the student's job
    check_job_output(text, epochs=1, min_acc=95.0)  # 97 % on these 8000 images
    assert "training 1 epochs on 8000 images" in text, text
    ckpt = course_copy / "checkpoints" / f"ddp_mnist-{job}.pt"
    assert f"epochs 1, checkpoint {ckpt}" in text, text
    assert ckpt.stat().st_uid == pwd.getpwnam(USER).pw_uid
    assert load(ckpt)["epoch"] == 1


@pytest.mark.long  # about 30 s: two runs of lesson 03 (make test-long)
@pytest.mark.timeout(600)
def test_student_runs_lesson03_readme_then_stops_and_resumes(cluster_lock, course_copy):
    """Lesson 03's README as a student types it, §4 on the first 6,000 images (SUBSET): a run
    saved in checkpoints/mine.pt, stopped after an epoch (scancel) and resumed by the same
    command. (The default job runs as README.md's `make demo`: tests/test_demo.py.)"""
    ckpt = course_copy / "checkpoints" / "mine.pt"
    env = {"SUBSET": "6000", "CHECKPOINT": "checkpoints/mine.pt"}
    with cluster_lock():
        first = sbatch_as_student(course_copy, "lessons/03_ddp_mnist/job.sh", env=env)
        try:
            deadline = time.monotonic() + 180
            while not ckpt.exists() and time.monotonic() < deadline:
                time.sleep(0.1)  # written by a rename: there whole, or not at all
        finally:
            subprocess.run(["scancel", first], capture_output=True, timeout=30)
        state, _, _ = wait_job(first, timeout=240)
    assert state == "CANCELLED", (course_copy / f"slurm-{first}.out").read_text()
    saved = load(ckpt)["epoch"]
    assert 1 <= saved < 3, saved
    _, state, code, _, out = submit_as_student(
        cluster_lock, course_copy, "lessons/03_ddp_mnist/job.sh", env=env)
    text = out.read_text()
    assert (state, code) == ("COMPLETED", 0), text
    assert f"resumed from checkpoints/mine.pt after epoch {saved}" in text, text
    assert "done: test_acc" in text and load(ckpt)["epoch"] == 3, text


@pytest.mark.timeout(600)
def test_student_runs_lesson00_and_cannot_touch_root_files(cluster_lock, course_copy):
    job, state, code, record, out = submit_as_student(
        cluster_lock, course_copy, "lessons/00_slurm_basics/anatomy.sh"
    )
    text = out.read_text()
    assert (state, code) == ("COMPLETED", 0), text
    assert record["UserId"].startswith(f"{USER}("), record
    # Step 3 wrote one file per task (srun --output) into the student's copy, as the student.
    logs = sorted((course_copy / "runs" / f"anatomy-{job}").glob("*.out"))
    assert [p.name for p in logs] == ["node1-0.out", "node1-1.out", "node2-2.out",
                                      "node2-3.out"], text  # fmt: skip
    assert {p.stat().st_uid for p in logs} == {pwd.getpwnam(USER).pw_uid}
    # The student's tasks are not root: the checkout's own files stay out of reach.
    probe = ROOT / ".student-write-probe"
    with cluster_lock():
        proc = as_student(course_copy, "srun", "-N2", "bash", "-c", f"id -un; touch {probe}")
    probe.unlink(missing_ok=True)
    assert proc.returncode != 0 and proc.stdout.split() == [USER, USER], proc.stdout
    assert "Permission denied" in proc.stderr, proc.stderr
