"""What the suite's exit freeze (tests/exitfast, COURSE_TEST_EXITFAST) changes, shown on a real
process: a finaliser that only the interpreter's last garbage-collector pass reaches does not run
under it. Such a finaliser that fails (here: exits 3) fails a process without the freeze and not
with it, so the suite's processes can end 0 where a student's would not: why `make test-slurm`
runs its last pass with COURSE_TEST_EXITFAST=0 (tests/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXITFAST = str(ROOT / "tests" / "exitfast")
SCRIPT = """
import json
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


# A cell that fails (nbval --nbval-lax) if its kernel, or a process it starts, loaded the freeze.
PROBE_CELL = """
import subprocess, sys
def loaded():
    return "exitfast" in str(getattr(sys.modules.get("sitecustomize"), "__file__", ""))
assert not loaded(), "the kernel loaded the exit freeze"
child = "import sys; sys.exit('exitfast' in str(sys.modules.get('sitecustomize')))"
assert subprocess.run([sys.executable, "-c", child]).returncode == 0, "its process loaded it"
"""
PROBE_NOTEBOOK = {
    "nbformat": 4, "nbformat_minor": 5, "metadata": {},
    "cells": [{"cell_type": "code", "execution_count": None, "id": "probe", "metadata": {},
               "outputs": [], "source": PROBE_CELL}],
}  # fmt: skip


def test_a_notebooks_kernel_and_its_processes_run_without_it(tmp_path):
    """Under the freeze (COURSE_TEST_EXITFAST=1), a notebook that nbval runs beside a test of
    this folder gets a kernel without it, and so does a process its cell starts: every notebook
    is run as an instructor runs it (tests/conftest.py, _NotebookKernelsWithoutTheFreeze)."""
    notebook = tmp_path / "probe.ipynb"
    notebook.write_text(json.dumps(PROBE_NOTEBOOK))
    env = dict(os.environ, COURSE_TEST_EXITFAST="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         "--nbval-lax", "--nbval-current-env", "--rootdir", str(ROOT),
         f"{__file__}::test_the_switch_decides_whether_the_suite_loads_it", str(notebook)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout, proc.stdout[-3000:]
