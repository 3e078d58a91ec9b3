"""tests/lock_report.py, which .ci/run runs on the cluster lock's log: held time, gaps, and one
line for a log it cannot read. Run as CI runs it, on logs written here in conftest's format."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT

REPORT = ROOT / "tests" / "lock_report.py"


def report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPORT), *args], capture_output=True, text=True,
                          timeout=60)  # fmt: skip


# (the log's lines: taken, released, waited, test), what the summary line must say
CASES = [
    ([(100.0, 130.0, 0.0, "a"), (130.5, 150.5, 12.0, "b"), (160.0, 170.0, 3.0, "c")],
     "3 holds, 60 s held of 70 s from the first to the last (86 %), 10 s free in 2 gaps"),
    ([(5.0, 25.0, 0.0, "only")],
     "1 holds, 20 s held of 20 s from the first to the last (100 %), 0 s free in 0 gaps"),
]


@pytest.mark.parametrize("holds,summary", CASES, ids=["three", "one"])
def test_summary_of_a_log(tmp_path, holds, summary):
    log = tmp_path / "lock.log"
    # Written out of order: two lanes append as their holds end, not as they begin.
    log.write_text("".join(f"{t:.1f} {r:.1f} {w:.1f} {test}\n" for t, r, w, test in holds[::-1]))
    proc = report(str(log))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"cluster lock: {summary}", proc.stdout
    longest = max(holds, key=lambda h: h[1] - h[0])
    held = proc.stdout.split("longest holds (s):\n")[1].splitlines()[0].split()
    assert held[:2] == [f"{longest[1] - longest[0]:.1f}", longest[3]], proc.stdout


def test_gaps_name_the_tests_around_them(tmp_path):
    log = tmp_path / "lock.log"
    log.write_text("0.0 10.0 0.0 first\n25.0 30.0 0.0 second\n31.0 32.0 0.0 third\n")
    gaps = report(str(log)).stdout.split("before -> after:\n")[1].splitlines()
    assert [g.split() for g in gaps] == [["15.0", "first", "->", "second"],
                                         ["1.0", "second", "->", "third"]]


def test_unreadable_or_empty_log_is_one_line(tmp_path):
    missing = report(str(tmp_path / "none.log"))
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1, missing.stderr
    assert "cannot read" in missing.stderr and "none.log" in missing.stderr
    (tmp_path / "empty.log").write_text("")
    empty = report(str(tmp_path / "empty.log"))
    assert empty.returncode == 0 and "no test took the cluster lock" in empty.stdout
    assert report().returncode == 2
