"""MNIST files a user may not read are said to be unreadable, with the reason, not "missing".

Run as the ordinary user ``student`` (cluster/up.sh creates it; the ``cluster`` fixture makes
sure of that), against root-owned files: common.mnist's check (Debian's python3: common.mnist
needs no torch to check files), common.mnist_prepare's command line and the job scripts' shell
check in common/job_env.sh.
"""

import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
USER = "student"
NAME = "train-images-idx3-ubyte"


def as_student(*cmd, timeout=60):
    return subprocess.run(["runuser", "-u", USER, "--", *cmd], cwd="/", capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.fixture
def places(cluster):
    """{case: path}: a file only root may read, a file in a folder only root may enter, and a
    file that does not exist, under a folder everyone may enter (not pytest's tmp_path, which
    only its owner may enter; tempfile's folder is the suite's shared one, tests/conftest.py)."""
    base = Path(tempfile.mkdtemp(prefix="course-mnist-access-"))
    base.chmod(0o755)
    yield from _places(base)
    shutil.rmtree(base)


def _places(base):
    (base / "open").mkdir(mode=0o755)
    (base / "closed").mkdir()
    (base / "closed").chmod(0o700)
    private = base / "open" / NAME
    private.write_bytes(b"\0")
    private.chmod(0o600)
    (base / "closed" / NAME).write_bytes(b"\0")
    yield {"file": private, "folder": base / "closed" / NAME, "missing": base / "none" / NAME}


CHECK = ("import sys; sys.path.insert(0, sys.argv[2]); from common.mnist import "
         "MnistDataError, check_file\ntry:\n    check_file(sys.argv[1])\n"
         "except MnistDataError as e:\n    print(e)")  # fmt: skip
SAID = {
    "file": ["cannot be read: the file (-rw------- root:root) may not be read by student"],
    "folder": ["cannot be read: the folder", "(drwx------ root:root) may not be entered by"],
    "missing": ["does not exist"],
}


@pytest.mark.parametrize("case", ["file", "folder", "missing"])
def test_check_file_says_why(places, case):
    proc = as_student("/usr/bin/python3", "-c", CHECK, str(places[case]), str(ROOT))
    assert proc.returncode == 0, proc.stderr
    (line,) = proc.stdout.splitlines()
    assert line.startswith(f"MNIST file {places[case]} "), line
    assert all(part in line for part in SAID[case]), line
    assert ("does not exist" in line) == (case == "missing"), line


def test_prepare_into_a_folder_one_may_not_enter_is_one_line(places):
    proc = as_student("env", f"PYTHONPATH={ROOT}", "/usr/bin/python3", "-m", "common.mnist_prepare",
                      "--data-dir", str(places["folder"].parent), "--no-download")  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert "cannot be read: the folder" in line, line


SHELL_SAID = {
    "file": "cannot be read: the file (-rw------- root:root) may not be read by student",
    "folder": "(drwx------ root:root) may not be entered by student",
    "missing": "is missing: prepare it",
}


@pytest.mark.parametrize("case", ["file", "folder", "missing"])
def test_job_scripts_shell_check_says_why(places, case):
    script = (f'COURSE_ROOT={ROOT} COURSE_VENV= source {ROOT}/common/job_env.sh >/dev/null; '
              f'course_need_file "{places[case]}" "prepare it"; echo "rc=$?"')  # fmt: skip
    proc = as_student("bash", "-c", script)
    assert proc.stdout.strip() == "rc=2", proc.stdout + proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"error: {places[case]} ") and SHELL_SAID[case] in line, line


def test_shell_check_passes_a_readable_file(places):
    readable = places["file"]
    readable.chmod(0o644)
    script = (f'COURSE_ROOT={ROOT} COURSE_VENV= source {ROOT}/common/job_env.sh >/dev/null; '
              f'course_need_file "{readable}" "prepare it" && echo ok')  # fmt: skip
    proc = as_student("bash", "-c", script)
    assert proc.stdout.strip() == "ok" and proc.stderr == "", proc.stdout + proc.stderr
