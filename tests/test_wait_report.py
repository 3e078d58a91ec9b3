"""A guard that runs out says where things stood (tests/README.md): a ``wait_for`` inside
``on_timeout(jobs_report(...))`` fails with the end of each output in the test's folder and the
Python stacks of the processes it names, here a probe that waits in a function of its own. Runs
without Slurm too: the report says that sinfo could not answer, and goes on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import jobs_report, on_timeout, wait_for

PROBE = "import time\ndef waiting_in_the_probe():\n    time.sleep(120)\nwaiting_in_the_probe()\n"
SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")


@pytest.mark.skipif(os.geteuid() != 0 and SCOPE.exists() and SCOPE.read_text().strip() != "0",
                    reason="py-spy may read another process's stack only as root here "
                           "(kernel.yama.ptrace_scope)")  # fmt: skip
def test_a_wait_that_runs_out_shows_the_outputs_and_the_stacks(tmp_path):
    (tmp_path / "job-1.out").write_text("the job's first line\nthe job's last line\n")
    probe = subprocess.Popen([sys.executable, "-c", PROBE, "wait-report-probe"])
    try:
        with (on_timeout(lambda: jobs_report([], tmp_path, "wait-report-probe")),
              pytest.raises(pytest.fail.Exception) as failed):  # fmt: skip
            wait_for("a thing that never comes", lambda: False, 3)
    finally:
        probe.kill()
        probe.wait(timeout=30)
    text = str(failed.value)
    assert text.startswith("timed out after 3 s waiting for a thing that never comes"), text
    assert "--- job-1.out (last 25 lines)\nthe job's first line\nthe job's last line" in text, text
    assert f"--- pid {probe.pid} (state S)" in text and "waiting_in_the_probe" in text, text
