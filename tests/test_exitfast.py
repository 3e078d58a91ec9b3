"""What the suite's exit freeze (tests/exitfast, COURSE_TEST_EXITFAST) changes, shown on a real
process: a finaliser that only the interpreter's last garbage-collector pass reaches does not run
under it. Such a finaliser that fails (here: exits 3) fails a process without the freeze and not
with it, so the suite's processes can end 0 where a student's would not: why `make test-slurm`
runs its last pass with COURSE_TEST_EXITFAST=0 (tests/README.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXITFAST = str(ROOT / "tests" / "exitfast")
SCRIPT = """
import os


class Last:
    def __del__(self):
        os._exit(3)  # a finaliser that fails the process


last = Last()
last.self = last  # a cycle: only the garbage collector frees it, at the latest on exit
del last
"""


def status(with_freeze: bool) -> int:
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != EXITFAST]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([EXITFAST] * with_freeze + paths))
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, timeout=60).returncode


def test_the_exit_freeze_hides_a_failing_finaliser():
    assert status(with_freeze=False) == 3  # as a student's process ends
    assert status(with_freeze=True) == 0  # as the suite's processes end under the freeze


def test_the_switch_decides_whether_the_suite_loads_it():
    """conftest.py puts tests/exitfast on PYTHONPATH (for every process it starts) unless
    COURSE_TEST_EXITFAST=0."""
    on = os.environ.get("COURSE_TEST_EXITFAST", "1") == "1"
    assert (EXITFAST in os.environ.get("PYTHONPATH", "").split(os.pathsep)) == on
