"""Set-up on an old login node: common/check_python.sh, which `make venv` runs first, stops in
one line naming the Python or the glibc found and what to do, before pip would fail with "No
matching distribution found for torch==2.14.1".

Each Python here is a real process: a small script that answers the check's two questions
(its version, its C library) as a Python of that age would, so every case runs without that
Python; the limits are read from the installed torch wheel's own metadata.  A real old Python
(Debian 11's 3.9.2, in a debootstrapped root) gets the same line, from the check and from
`make venv` alike.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "common" / "check_python.sh"


def wheel_limits() -> tuple[tuple[int, int], tuple[int, int]]:
    """(oldest Python, oldest glibc) that the installed torch wheel accepts: its Requires-Python
    and its manylinux platform tag."""
    dist = metadata.distribution("torch")
    python = re.fullmatch(r">=\s*(\d+)\.(\d+)", dist.metadata["Requires-Python"].strip())
    tags = [line for line in (dist.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")]  # fmt: skip
    glibc = re.search(r"manylinux_(\d+)_(\d+)_", " ".join(tags))
    assert python and glibc, (dist.metadata["Requires-Python"], tags)
    return (int(python[1]), int(python[2])), (int(glibc[1]), int(glibc[2]))


PY_MIN, GLIBC_MIN = wheel_limits()


def fake_python(tmp_path: Path, version: str, libc: str) -> Path:
    """An executable that answers as a Python of VERSION on LIBC would (whatever it is asked)."""
    path = tmp_path / f"python{version}"
    path.write_text(f"#!/bin/sh\necho '{version}'\necho '{libc}'\n")
    path.chmod(0o755)
    return path


def check(python: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CHECK), str(python)], capture_output=True, text=True,
                          timeout=30, cwd=ROOT)  # fmt: skip


def minor_before(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1] - 1}"


@pytest.mark.parametrize("version, libc, refused", [
    (f"{PY_MIN[0]}.{PY_MIN[1]}.0", f"glibc {GLIBC_MIN[0]}.{GLIBC_MIN[1]}", None),
    (f"{minor_before(PY_MIN)}.18", f"glibc {GLIBC_MIN[0]}.{GLIBC_MIN[1]}", "python"),
    ("3.6.8", "glibc 2.28", "python"),      # RHEL 8's /usr/bin/python3
    ("2.7.5", "glibc 2.17", "python"),      # CentOS 7's python: the Python is named first
    ("3.11.2", f"glibc {minor_before(GLIBC_MIN)}", "glibc"),
    ("3.11.2", "glibc 2.17", "glibc"),      # CentOS 7 with a newer Python loaded
    ("3.11.2", "glibc 2.36", None),         # Debian 12: this machine
    ("3.12.1", "", None),                   # no glibc to ask (musl): left to pip
    ("4.0.0", "glibc 3.0", None),
])  # fmt: skip
def test_the_check_for_each_python(tmp_path, version, libc, refused):
    proc = check(fake_python(tmp_path, version, libc))
    lines = proc.stderr.splitlines()
    if refused is None:
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        return
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    if refused == "python":
        assert f"is Python {version} (" in lines[0], lines[0]
        assert f"needs Python {PY_MIN[0]}.{PY_MIN[1]} or newer" in lines[0], lines[0]
        assert "module load python/3.11" in lines[0] and "conda" in lines[0], lines[0]
    else:
        assert f"C library is {libc} " in lines[0], lines[0]
        assert f"need glibc {GLIBC_MIN[0]}.{GLIBC_MIN[1]} or newer" in lines[0], lines[0]


def test_this_venvs_python_passes():
    proc = check(sys.executable)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("python, says", [
    ("no-such-python3", "no Python 'no-such-python3' on PATH"),
    ("/bin/true", "did not answer as a Python does (it printed: nothing)"),
])
def test_no_python_or_not_a_python(python, says):
    proc = check(python)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert says in proc.stderr, proc.stderr


def test_make_venv_stops_before_making_the_venv(tmp_path):
    """`make venv PYTHON=<a Python 3.6>`: the one line, and no venv, no pip."""
    venv = tmp_path / "venv"
    python = fake_python(tmp_path, "3.6.8", "glibc 2.28")
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}
    proc = subprocess.run(["make", "-C", str(ROOT), "venv", f"PYTHON={python}", f"VENV={venv}"],
                          capture_output=True, text=True, timeout=60, env=environ)  # fmt: skip
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert not venv.exists()
    assert "-m venv" not in proc.stdout, proc.stdout  # make echoes each command it starts
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"'{python}' is Python 3.6.8" in errors[0], proc.stderr
