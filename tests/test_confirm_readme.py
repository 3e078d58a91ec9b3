"""The records of a run (tests/records.py) and what they confirm (tests/confirm_readme.py).

A pytest of its own runs small test files with this suite's conftest loaded, as a README
command's test would: each starts a real process, and the records it leaves are what
confirm_readme reads. A test that returns before its command, is skipped, runs another command
or fails confirms nothing.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import confirm_readme
import pytest
from confirm_readme import confirm, load, same_command, typed
from readme_commands import ROOT, Command, all_commands

ACTIVATE = next(c for c in all_commands() if c.text == "source .venv/bin/activate")
TIMEOUT_S = 240

TESTS = '''
import subprocess
import pytest

def run(line):
    return subprocess.run(["bash", "-c", line], cwd={root!r}, capture_output=True, timeout=60)

@pytest.mark.parametrize("command", [pytest.param(1, id="{ran}"), pytest.param(2, id="{other}")])
def test_readme_command(command):
    {body}
'''


def recorded_run(tmp_path: Path, body: str, *options: str) -> tuple[Path, str]:
    """Run a tests/test_readme_commands.py of BODY under tmp_path, recording into tmp_path /
    "records"; returns that folder and pytest's output."""
    (tmp_path / "tests").mkdir()
    where = ACTIVATE.where
    (tmp_path / "tests" / "test_readme_commands.py").write_text(TESTS.format(
        root=str(ROOT), ran=f"{where}-quick", other="other", body=textwrap.indent(
            textwrap.dedent(body), "    ").strip()))  # fmt: skip
    records = tmp_path / "records"
    env = {**os.environ, "COURSE_RECORDS_DIR": str(records),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q",
         "--rootdir", str(tmp_path), *options, "tests"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)  # fmt: skip
    return records, proc.stdout + proc.stderr


def test_a_run_of_the_command_in_a_passing_test_confirms_it(tmp_path):
    """Two xdist workers, each its own record file; the command is confirmed by its test only."""
    records, out = recorded_run(tmp_path, """
        line = "source .venv/bin/activate" if command == 1 else "true"
        assert run(line).returncode == 0
    """, "-n", "2")
    assert "2 passed" in out, out
    assert len(list(records.glob("*.jsonl"))) == 2, out
    verdict = confirm(ACTIVATE, load([records]))
    assert verdict.confirmed, verdict
    assert verdict.why.endswith("(exit 0)"), verdict
    starts = [json.loads(line) for path in records.glob("*.jsonl")
              for line in path.read_text().splitlines() if '"start"' in line]  # fmt: skip
    mine = [s for s in starts if s["argv"] == ["bash", "-c", ACTIVATE.text]]
    assert [(s["phase"], s["cwd"]) for s in mine] == [("call", str(ROOT))], starts


@pytest.mark.parametrize("body, why", [
    ("return\nrun('source .venv/bin/activate')", "started no such process"),
    ("pytest.skip('later')\nrun('source .venv/bin/activate')", "started no such process"),
    ("run('. .venv/bin/activate')", "started no such process"),
    ("assert run('source .venv/bin/activate').returncode == 1", "ran it but did not pass"),
], ids=["returns-first", "skipped", "another-line", "fails"])  # fmt: skip
def test_a_test_that_does_not_run_it_or_fails_confirms_nothing(tmp_path, body, why):
    records, out = recorded_run(tmp_path, body)
    verdict = confirm(ACTIVATE, load([records]))
    assert not verdict.confirmed and why in verdict.why, (verdict, out)


def test_not_in_the_records_and_the_count(tmp_path, capsys):
    """Run alone on records without the tests, it names every command and counts none as run."""
    (tmp_path / "empty").mkdir()
    assert confirm_readme.main([str(tmp_path / "empty")]) == 1
    out = capsys.readouterr().out
    assert "confirmed by a run: 0 of " in out, out
    assert "is not in the records" in out, out
    assert confirm_readme.main([str(tmp_path / "missing")]) == 2
    assert "no records folder" in capsys.readouterr().err


def test_commands_are_compared_as_typed():
    """Wrappers off, the venv's python as `python`, paths relative to the course (or to the
    student's copy), sbatch's output options aside; variables: the command's own, the harness's
    and the script's SHORTER ones only."""
    tp = "sbatch lessons/09_beyond_data_parallel/tp.sh"
    script = str(ROOT / "lessons/09_beyond_data_parallel/tp.sh")
    submitted = ["sbatch", "--parsable", "--output=/var/tmp/x/tp-%j.out", script]
    ((env, words),) = typed(submitted, {"STEPS": "20", "COURSE_DIST_TIMEOUT": "30"}, "/var/tmp")
    assert same_command(tp, env, words) == ""
    ((env, words),) = typed(submitted, {"STEPS": "20", "TP": "4"}, str(ROOT))
    assert same_command(tp, env, words) == "other variables: TP=4"
    ((env, words),) = typed([*submitted, "--steps", "1"], {}, str(ROOT))
    assert same_command(tp, env, words) == "other options or arguments"
    student = ["runuser", "-u", "student", "--", "env", "-i", "PATH=/usr/bin", "HOME=/home/s",
               "SUBSET=8000", "sbatch", "--parsable", "--output=slurm-%j.out",
               "lessons/03_ddp_mnist/job.sh", "1"]  # fmt: skip
    ((env, words),) = typed(student, {}, "/home/student/course-x")
    assert env == {"PATH": "/usr/bin", "HOME": "/home/s", "SUBSET": "8000"}
    assert same_command("sbatch lessons/03_ddp_mnist/job.sh 1", env, words) == ""
    assert same_command("sbatch lessons/03_ddp_mnist/job.sh", env, words) != ""
    fit = "python lessons/10_fit_and_keep/fit.py --model llama3-8b --world 8,16,64"
    run = [str(ROOT / ".venv/bin/python"), str(ROOT / "lessons/10_fit_and_keep/fit.py"),
           "--model", "llama3-8b", "--world", "8,16,64"]
    ((env, words),) = typed(run, {"PYTHONPATH": str(ROOT)}, "/tmp")
    assert same_command(fit, env, words) == ""
    ((env, words),) = typed([*run[:3], "tiny", "--world", "1"], {}, "/tmp")
    assert same_command(fit, env, words) == "other words"
    sysinfo = 'srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 python -m common.sysinfo'
    inside = typed(["salloc", "--nodes=2", "--time=2", "bash", "-c", sysinfo], {}, str(ROOT))
    assert [words[0] for _, words in inside] == ["salloc", "<line>", "srun"]
    assert same_command(sysinfo, *inside[1]) == "" == same_command(sysinfo, *inside[2])
    line = 'CHECKPOINT=c.pt sbatch lessons/03_ddp_mnist/job.sh; echo "exit $?"'
    typed_line = typed(["bash", "-c", line], {}, str(ROOT))
    assert typed_line[0] == ({}, ["<line>", line])
    assert same_command("CHECKPOINT=c.pt sbatch lessons/03_ddp_mnist/job.sh",
                        *typed_line[1]) == ""  # fmt: skip


def test_a_make_target_confirms_the_job_its_recipe_submits(tmp_path):
    """make demo's job: confirmed by the test's `make demo` (the recipe's sbatch)."""
    records = tmp_path / "records"
    records.mkdir()
    test = "tests/test_demo.py::test_make_demo"
    lines = [{"event": "start", "n": 1, "test": test, "phase": "call", "argv": ["make", "demo"],
              "cwd": str(ROOT), "set": {}},
             {"event": "end", "n": 1, "status": 0},
             {"event": "outcome", "test": test, "phase": "call", "outcome": "passed"}]
    (records / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    demo = Command("README.md", 1, "make demo")
    job = Command("lessons/03_ddp_mnist/README.md", 1, "sbatch lessons/03_ddp_mnist/job.sh")
    assert confirm(demo, load([records])).confirmed
    assert confirm(job, load([records])).confirmed
    other = Command("lessons/03_ddp_mnist/README.md", 1, "sbatch lessons/03_ddp_mnist/job.sh 1")
    assert not confirm(other, load([records])).confirmed
