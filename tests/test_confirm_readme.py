"""The records of a run (tests/records.py) and what they confirm (tests/confirm_readme.py).

A pytest of its own runs small test files with this suite's conftest loaded, as a README
command's test would: each starts a real process (a real job, on the cluster), and the records
it leaves are what confirm_readme reads. A test that returns before its command, is skipped,
runs another command or fails confirms nothing; nor does a command that exited with another
status, a job that ended otherwise than its README shows, a command behind another in a
``bash -c`` line, an sbatch that is not the machine's, a COURSE_ROOT elsewhere or a variable
that picks another model.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import confirm_readme
import pytest
from confirm_readme import confirm, load, same_command, typed
from conftest import LOCK_PATH, LOCK_TIMEOUT_S, _ancestor_holds_lock
from readme_commands import ROOT, Command, all_commands

ACTIVATE = next(c for c in all_commands() if c.text == "source .venv/bin/activate")
BUSY = next(c for c in all_commands() if c.text == "sbatch lessons/00_slurm_basics/busy.sh")
FIT = next(c for c in all_commands() if c.text == "sbatch lessons/10_fit_and_keep/fit.sh")
TIMEOUT_S = 240

TESTS = '''
import subprocess
import pytest

def run(line, cwd={root!r}):
    return subprocess.run(["bash", "-c", line], cwd=cwd, capture_output=True, timeout=60)

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
    # The test passes, but the command failed: run where there is no .venv, it exits 1.
    ("run('source .venv/bin/activate', cwd='/')", "it exited 1, not 0"),
    # The command behind another in one bash -c line: the line exits 0, the command never ran.
    ("run('exit 0; source .venv/bin/activate')", "started no such process"),
], ids=["returns-first", "skipped", "another-line", "fails", "failed-status",
        "prefix-command"])  # fmt: skip
def test_a_test_that_does_not_run_it_or_fails_confirms_nothing(tmp_path, body, why):
    records, out = recorded_run(tmp_path, body)
    verdict = confirm(ACTIVATE, load([records]))
    assert not verdict.confirmed and why in verdict.why, (verdict, out)


# Jobs of the README's commands, each ended at once: lesson 00's busy.sh (the README shows it
# CANCELLED) and lesson 10's fit.sh (submitted, then cancelled: what is checked here is its
# variables). @ROOT@, @OUT@, @STUB@ and @COPY@ are filled in.
JOB_TESTS = '''
import os
import subprocess
from pathlib import Path

import pytest
from conftest import cluster_lock, job_environ, wait_for, wait_job


def submit(script, env):
    proc = subprocess.run(["sbatch", "--parsable", "--output=@OUT@/%x-%j.out", script],
                          cwd="@ROOT@", env=job_environ(env), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip().split(";")[0]


def end(job, kill=False):
    """Cancelled (scancel), or its batch shell killed while it runs: the job FAILED."""
    if kill:
        # Its step's first line, not JobState=RUNNING: slurmctld says RUNNING before the node's
        # batch shell exists, and a signal sent then is lost (the job ran its 60 s, COMPLETED).
        def working():
            return any("working: " in p.read_text(errors="replace")
                       for p in Path("@OUT@").glob(f"*-{job}.out"))
        wait_for("the job's step to work", working, 120)
        subprocess.run(["scancel", "--batch", "--signal=KILL", job], timeout=30)
    else:
        subprocess.run(["scancel", job], timeout=30)
    return wait_job(job, timeout=120)[0]
'''
BUSY_TEST = JOB_TESTS + '''

@pytest.mark.parametrize("how", ["as-written", "failed-job", "stub-sbatch", "course-elsewhere"])
def test_busy_job_overlap_step_and_scancel(how):
    env = {"stub-sbatch": {"PATH": "@STUB@:" + os.environ["PATH"]},
           "course-elsewhere": {"COURSE_ROOT": "@COPY@"}}.get(how, {})
    with cluster_lock():
        state = end(submit("lessons/00_slurm_basics/busy.sh", env), kill=how == "failed-job")
    assert state == ("FAILED" if how == "failed-job" else "CANCELLED")
'''
FIT_TEST = JOB_TESTS + '''

@pytest.mark.parametrize("how", ["model-tiny"])
def test_fit_job(how):
    with cluster_lock():
        assert end(submit("lessons/10_fit_and_keep/fit.sh", {"MODEL": "tiny"})) == "CANCELLED"
'''


@pytest.mark.timeout(LOCK_TIMEOUT_S + 2 * TIMEOUT_S)
def test_a_job_is_confirmed_as_written_ended_as_shown_with_the_machines_sbatch(cluster, tmp_path):
    """Real jobs of lesson 00's `sbatch lessons/00_slurm_basics/busy.sh`, which the README
    cancels: confirmed when cancelled; not when it FAILED (its batch shell killed), nor when
    submitted by a stub sbatch first on PATH (which runs the real one), nor with COURSE_ROOT a
    copy of the course elsewhere. Lesson 10's fit.sh with MODEL=tiny (the tests' model, not the
    README's) is not its README command."""
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "sbatch").write_text(f'#!/bin/sh\nexec {shutil.which("sbatch")} "$@"\n')
    (stub / "sbatch").chmod(0o755)
    # Elsewhere, but a course a job can run from: the nodes see /var/tmp, not the tests' /tmp.
    copy = Path(tempfile.mkdtemp(prefix="course-elsewhere-", dir="/var/tmp"))
    out = Path(tempfile.mkdtemp(prefix="confirm-jobs-", dir="/var/tmp"))
    fill = {"@ROOT@": str(ROOT), "@OUT@": str(out), "@STUB@": str(stub), "@COPY@": str(copy)}
    tests = tmp_path / "tests"
    tests.mkdir()
    for name, text in (("test_lesson00.py", BUSY_TEST), ("test_lesson10.py", FIT_TEST)):
        for key, value in fill.items():
            text = text.replace(key, value)
        (tests / name).write_text(text)
    try:
        for part in ("common", "lessons/00_slurm_basics"):
            shutil.copytree(ROOT / part, copy / part,
                            ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        records = tmp_path / "records"
        env = {**os.environ, "COURSE_RECORDS_DIR": str(records), "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        # The cluster's lock for the whole run (its tests' own cluster_lock() then waits for
        # nothing): the jobs of others come before or after, not between these.
        lock = [] if _ancestor_holds_lock() else ["flock", "-w", str(LOCK_TIMEOUT_S), LOCK_PATH]
        proc = subprocess.run(
            [*lock, sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider",
             "-q", "--rootdir", str(tmp_path), "tests"],
            cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=LOCK_TIMEOUT_S + TIMEOUT_S)  # fmt: skip
    finally:
        shutil.rmtree(copy, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    output = proc.stdout + proc.stderr
    assert "5 passed" in output, output
    runs = load([records])

    def verdict(command, how):
        return confirm(command, [r for r in runs if r.test.endswith(f"[{how}]")])

    as_written = verdict(BUSY, "as-written")
    assert as_written.confirmed and as_written.why.endswith(" CANCELLED)"), as_written
    for how, why in (("failed-job", "ended FAILED, not CANCELLED"),
                     ("stub-sbatch", f"its sbatch was {stub}/sbatch, not the course's own"),
                     ("course-elsewhere", f"COURSE_ROOT={copy} (elsewhere than the course)")):
        broken = verdict(BUSY, how)
        assert not broken.confirmed and why in broken.why, (how, broken, output)
    model = verdict(FIT, "model-tiny")
    assert not model.confirmed and "(other variables: MODEL=tiny)" in model.why, model


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
    student's copy), sbatch's output options aside (--chdir only into the course); variables:
    the command's own, the harness's (those naming the course only naming it) and the script's
    SHORTER ones, to at most its default; a bash -c line only when it is the command alone."""
    tp = "sbatch lessons/09_beyond_data_parallel/tp.sh"
    script = str(ROOT / "lessons/09_beyond_data_parallel/tp.sh")
    submitted = ["sbatch", "--parsable", "--output=/var/tmp/x/tp-%j.out", script]
    ((env, words),) = typed(submitted, {"STEPS": "20", "COURSE_DIST_TIMEOUT": "30"}, "/var/tmp")
    assert same_command(tp, env, words, "/var/tmp") == ""
    ((env, words),) = typed(submitted, {"STEPS": "20", "TP": "4"}, str(ROOT))
    assert same_command(tp, env, words) == "other variables: TP=4"
    ((env, words),) = typed(submitted, {"STEPS": "1000"}, str(ROOT))  # more than its 100
    assert same_command(tp, env, words) == "other variables: STEPS=1000"
    ((env, words),) = typed([*submitted, "--steps", "1"], {}, str(ROOT))
    assert same_command(tp, env, words) == "other options or arguments"
    ((env, words),) = typed([*submitted[:2], f"--chdir={ROOT}", script], {}, str(ROOT))
    assert same_command(tp, env, words) == ""
    ((env, words),) = typed([*submitted[:2], "--chdir=/var/tmp", script], {}, str(ROOT))
    assert same_command(tp, env, words) == "--chdir=/var/tmp: elsewhere than the course"
    exitfast = f"{ROOT}/tests/exitfast:{ROOT}"
    for name, value, same in (("PYTHONPATH", exitfast, True), ("PYTHONPATH", "/opt/x", False),
                              ("COURSE_ROOT", str(ROOT), True), ("COURSE_ROOT", "/opt", False),
                              ("COURSE_VENV", "/opt/venv", False)):  # fmt: skip
        ((env, words),) = typed(submitted, {name: value}, str(ROOT))
        assert (same_command(tp, env, words) == "") == same, (name, value)
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
    job = "CHECKPOINT=c.pt sbatch lessons/03_ddp_mnist/job.sh"
    for line in (f'{job}; echo "exit $?"', f"false && {job}", f"exit 0; {job}", f"{job} &",
                 f"{job} | cat", f"{job}\ntrue"):  # fmt: skip
        assert typed(["bash", "-c", line], {}, str(ROOT)) == [({}, ["<line>", line])], line
    alone = typed(["bash", "-c", f"{job};"], {}, str(ROOT))
    assert [same_command(job, *t) for t in alone] == ["another line", ""]
    for env, words in typed(["bash", "-c", ACTIVATE.text], {"PYTHONPATH": "/opt/x"}, str(ROOT)):
        assert same_command(ACTIVATE.text, env, words) == (
            "other variables: PYTHONPATH=/opt/x (elsewhere than the course)"), words
    # NOT_RUN's commands: <jobid>, $name and the job id the README shows stand for the run's.
    sacct = "sacct -j <jobid> --format=JobID,State,ExitCode,Elapsed,MaxRSS"
    ((env, words),) = typed(["sacct", "-j", "41", "--format=JobID,State,ExitCode,Elapsed,"
                             "MaxRSS"], {}, str(ROOT))  # fmt: skip
    assert same_command(sacct, env, words, placeholders=True) == ""
    assert same_command(sacct, env, words) == "other words"
    report = "sbatch --dependency=afterok:$sweep lessons/00_slurm_basics/report.sh $sweep"
    ((env, words),) = typed(["sbatch", "--parsable", "--dependency=afterok:7",
                             "lessons/00_slurm_basics/report.sh", "7"], {}, str(ROOT))
    assert same_command(report, env, words, placeholders=True) == ""
    ((env, words),) = typed(["scancel", "12"], {}, str(ROOT))
    assert same_command("scancel 987", env, words, placeholders=True) == ""


def test_a_make_target_confirms_the_job_its_recipe_submits(tmp_path):
    """make demo's job: confirmed by the test's `make demo` (the recipe's sbatch, which must be
    the machine's on make's PATH; make exits with the job's status)."""
    test = "tests/test_demo.py::test_make_demo"
    demo = Command("README.md", 1, "make demo")
    job = Command("lessons/03_ddp_mnist/README.md", 1, "sbatch lessons/03_ddp_mnist/job.sh")
    other = Command("lessons/03_ddp_mnist/README.md", 1, "sbatch lessons/03_ddp_mnist/job.sh 1")

    def records(name, status=0, sbatch=None):
        sbatch = sbatch or shutil.which("sbatch")
        folder = tmp_path / name
        folder.mkdir()
        lines = [{"event": "start", "n": 1, "test": test, "phase": "call", "argv": ["make", "demo"],
                  "cwd": str(ROOT), "set": {}, "which": [["make", shutil.which("make")]],
                  "on_path": [["sbatch", sbatch]]},
                 {"event": "end", "n": 1, "status": status},
                 {"event": "outcome", "test": test, "phase": "call", "outcome": "passed"}]
        (folder / "a.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        return load([folder])

    ran = records("ran")
    assert confirm(demo, ran).confirmed and confirm(job, ran).confirmed
    assert not confirm(other, ran).confirmed
    failed = records("failed", status=1)  # the job failed: make demo exits with its status
    assert "it exited 1, not 0" in confirm(job, failed).why
    stub = records("stub", sbatch=str(tmp_path / "bin" / "sbatch"))
    assert "its sbatch was " in confirm(job, stub).why
    assert confirm(demo, stub).confirmed  # make itself was the machine's
