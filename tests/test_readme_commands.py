"""Every command a README shows a student, checked as written.

tests/readme_commands.py finds the commands (the fenced code blocks of README.md, cluster/README.md
and lessons/*/README.md, and the conventions that mark them) and tests/readme_tables.py puts each
in one class (one test id per README line). A command passes only where it ran here; every other
one is skipped with its reason, and pytest's summary counts them (``summary()``, printed by
tests/lanes.py):

* ``quick``: finishes in seconds: run (marked ``readme``, ``make test-readme``) from the course
  root with only the venv active (``VIRTUAL_ENV``, ``.venv/bin`` first on ``PATH``; no
  ``PYTHONPATH``, no ``COURSE_*``, ``SLURM_*``, ``SBATCH_*`` ...), expecting QUICK's exit status
  and what its README quotes of its output (tests/readme_output.py); a command marked ``# inside
  a job`` runs in ``salloc`` with lesson 01's shape (2 nodes x 2 tasks);
* ``job`` (``sbatch SCRIPT ARGS``, with ``NAME=value`` in front) and ``as written`` (another
  command, ``make demo``): AS_WRITTEN_BY names the test under tests/ that submits or runs it as
  written, in its own lane (submitting them all takes about 20 minutes). The test here checks
  that pytest collects that test (a test renamed or gone fails here), then skips, naming the test
  and its lane: whether that test ran the command as written is known only from a run. Every
  process a test starts is recorded (tests/records.py), and tests/confirm_readme.py, CI's last
  step, confirms each of these commands (and each quick one) from the records: a process of the
  command, started in that test's call phase, and the test passed;
* ``not run``: needs a job id or root, runs longer than a quick command or until stopped:
  NOT_RUN gives the reason and the test that runs the same with what it needs (checked to be
  collected, as above), if any; skipped;
* ``skip``: marked GPU only, at your site, or a job script's lines: skipped, the mark the reason.

A command in no class fails with one line naming its README, line and text. Everything but the
quick runs reads files and collects the tests named (a few seconds, in make test); the quick runs
take about a minute (make test-readme, a CI lane), besides any wait for the cluster lock.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import cluster_lock
from readme_commands import (
    READMES,
    ROOT,
    Command,
    Job,
    all_commands,
    classify,
    commands_in,
    job_of,
    make_recipe_jobs,
)
from readme_output import check_output
from readme_tables import (
    AS_WRITTEN_BY,
    GPU_ONLY,
    INSIDE_JOB,
    LONG_RUN,
    MAKE_TARGETS,
    NEEDS_JOB,
    NEEDS_ROOT,
    NOT_RUN,
    OTHER_SITE,
    QUICK,
    QUICK_TMP_ENV,
    SHORTER,
    UNTIL_STOPPED,
)

# A hang guard, not a time limit: the slowest quick command (lesson 03's one epoch, 17 s of CPU)
# took 50 s beside CI's lanes and ran past 120 s beside the 32-node scale lane.
QUICK_TIMEOUT_S = 480
LOCK_WAIT_S = 900


def _param(command: Command):
    kind, detail = classify(command)
    name = {"skip": detail.replace(" ", "-"), "": "unclassified"}.get(kind, kind.replace(" ", "-"))
    marks = []
    if kind == "skip":
        marks.append(pytest.mark.skip(reason=f"{detail}: {command.text}"))
    elif kind == "quick":
        # The command's own limit, after a wait for the cluster lock that jobs of others hold.
        marks += [pytest.mark.readme, pytest.mark.timeout(QUICK_TIMEOUT_S + LOCK_WAIT_S)]
    return pytest.param(command, marks=marks, id=f"{command.where}-{name}")


def test_collection_finds_every_readme_command():
    commands = all_commands()
    counts = {readme: sum(c.readme == readme for c in commands) for readme in READMES}
    assert counts == {
        "README.md": 10, "cluster/README.md": 9, "lessons/00_slurm_basics/README.md": 10,
        "lessons/01_hello_allreduce/README.md": 9, "lessons/02_launch_vs_srun/README.md": 2,
        "lessons/03_ddp_mnist/README.md": 11, "lessons/04_torchrun_enroot/README.md": 18,
        "lessons/05_fault_tolerance/README.md": 11, "lessons/06_diagnosing_hangs/README.md": 6,
        "lessons/07_fsdp_sharding/README.md": 5, "lessons/08_data_pipeline/README.md": 7,
        "lessons/09_beyond_data_parallel/README.md": 7, "lessons/10_fit_and_keep/README.md": 8,
        "lessons/11_torchft/README.md": 15,
        "lessons/12_sick_node/README.md": 11,
    }, counts
    assert Command("lessons/03_ddp_mnist/README.md", 50, "sbatch lessons/03_ddp_mnist/job.sh") \
        in commands
    assert Command("lessons/03_ddp_mnist/README.md", 52,
                   "sbatch lessons/03_ddp_mnist/job.sh 2 --sync-bn", GPU_ONLY) in commands
    assert job_of("CHECKPOINT=checkpoints/mine.pt sbatch lessons/03_ddp_mnist/job.sh 3") == Job(
        (), "lessons/03_ddp_mnist/job.sh", ("3",), (("CHECKPOINT", "checkpoints/mine.pt"),))


def test_collection_reads_the_conventions():
    text = "\n".join([
        "```bash", "# at your site: all of them", "export A=1", "sbatch x.sh", "```",
        "```bash", "FOO=1 sbatch \\", "   --nodes=1 job.sh 2   # GPU only: why", "# a comment",
        "for i in 1 2; do", "  echo $i  # not a mark", "done", "echo 'a # b' # inside a job", "```",
        "  ```", "  $ srun hostname", "  node1", "  ```",
        "```python", "print(1)", "```", "```text", "$ not a command", "```",
    ])
    assert commands_in("R", text) == [
        Command("R", 3, "export A=1", OTHER_SITE), Command("R", 4, "sbatch x.sh", OTHER_SITE),
        Command("R", 7, "FOO=1 sbatch --nodes=1 job.sh 2", GPU_ONLY),
        Command("R", 10, "for i in 1 2; do\necho $i\ndone"),
        Command("R", 13, "echo 'a # b'", INSIDE_JOB), Command("R", 16, "srun hostname"),
    ]



def test_tables_name_readme_commands_only():
    """A command dropped from the READMEs goes from the tables too; a command is in one table."""
    texts = {c.text for c in all_commands()}
    tables = (QUICK, AS_WRITTEN_BY, NOT_RUN)
    stale = sorted((set().union(*tables) | set(QUICK_TMP_ENV)) - texts)
    assert not stale, stale
    assert sum(map(len, tables)) == len(set().union(*tables))
    assert all(why in (NEEDS_JOB, NEEDS_ROOT, LONG_RUN, UNTIL_STOPPED)
               for why, _, _ in NOT_RUN.values())


def test_every_readme_command_has_a_class():
    unclassified = [f"{c.where}: {c.text}" for c in all_commands() if not classify(c)[0]]
    assert not unclassified, (
        "README commands in no class (mark them, add them to QUICK, AS_WRITTEN_BY (and run them "
        "as written in that test) or NOT_RUN):\n" + "\n".join(unclassified))


# The skip of a command that another test runs: summary() counts them by these words.
SUBMITTED, RUN_BY = "submitted as written by ", "run as written by "
CONFIRMED_BY = "confirmed only by that run's records (tests/confirm_readme.py)"


@pytest.mark.parametrize("command", [_param(c) for c in all_commands()])
def test_readme_command(command):
    kind, detail = classify(command)
    if kind in ("job", "as written"):
        test = AS_WRITTEN_BY[command.text]
        lane = lane_of(test)
        job = job_of(command.text)
        target = MAKE_TARGETS.get(test)
        if job and target:  # the job is the one the make target's recipe submits
            assert job in make_recipe_jobs(target), f"`make {target}` does not submit `{job}`"
        pytest.skip(f"{SUBMITTED if job else RUN_BY}{test} ({lane}); {CONFIRMED_BY}")
    elif kind == "not run":
        why, what, tests = NOT_RUN[command.text]
        ran = " and ".join(f"{t} ({lane_of(t)})" for t in tests.split())
        pytest.skip(f"{why}: {what}" + (f"; the same run by {ran}" if ran else ""))
    elif kind == "quick":
        proc = run_quick(command.text, inside_job=command.mark == INSIDE_JOB)
        output = proc.stdout + proc.stderr
        assert proc.returncode == QUICK[command.text], (
            f"{command.where}: `{command.text}` exited with {proc.returncode}, "
            f"not {QUICK[command.text]}:\n{output[-3000:]}")
        problems = check_output(command, proc.stdout, proc.stderr)
        assert not problems, (f"{command.where}: `{command.text}` printed other lines than its "
                              "README quotes:\n" + "\n".join(problems) + f"\n--- it printed:\n"
                              f"{output[-3000:]}")
    else:
        pytest.fail(f"{command.where}: {command.text}", pytrace=False)


# --------------------------------------------------------------------------- the other tests

# Which `make` lane runs a test, by its marks (tests/lanes.py); the rest run in make test.
LANES = (("lesson09", "make test-lesson09"), ("lesson10", "make test-lesson10"),
         ("lesson11", "make test-lesson11"), ("lesson12", "make test-lesson12"),
         ("scale", "make test-scale"),
         ("sites", "make test-sites"), ("long", "make test-long"), ("readme", "make test-readme"))
# Collects the files given (pytest --collect-only) and writes {test id: its marks} as JSON,
# a parametrized test under its function's id.
COLLECT = """
import json, sys
import pytest

class Found:
    tests = {}

    def pytest_collection_finish(self, session):
        for item in session.items:
            marks = self.tests.setdefault(item.nodeid.split("[")[0], [])
            marks += [m.name for m in item.iter_markers() if m.name not in marks]

found = Found()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[2:]],
                   plugins=[found])
with open(sys.argv[1], "w") as out:
    json.dump(found.tests, out)
sys.exit(code)
"""


@functools.cache
def collected() -> dict[str, list[str]]:
    """{test id: marks} of the tests the tables name, as pytest collects them (once, about two
    seconds): a test renamed or gone is not there."""
    files = sorted({t.split("::")[0] for t in [*AS_WRITTEN_BY.values(),
                                               *(t for _, _, ts in NOT_RUN.values()
                                                 for t in ts.split())]})
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        proc = subprocess.run([sys.executable, "-c", COLLECT, out.name, *files], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        found = json.loads(Path(out.name).read_text() or "{}")
    assert proc.returncode == 0 and found, proc.stdout[-3000:] + proc.stderr[-3000:]
    return found


def lane_of(test: str) -> str:
    """The make lane that runs TEST (file::function, or a file: its first test's lane); fails
    when pytest does not collect it."""
    marks = collected().get(test) or next(
        (m for t, m in collected().items() if t.startswith(f"{test}::")), None)
    assert marks is not None, f"pytest collects no {test}"
    if "lesson11" in marks and "every_slurm" in marks:  # lesson 11's cluster test (tests/lanes.py)
        return "make test-slurm"
    return next((lane for mark, lane in LANES if mark in marks), "make test")



def test_a_test_renamed_is_caught_and_a_make_target_read():
    """The checks behind the skips can fail: a test pytest does not collect; a make target's
    recipe is read for the job it submits."""
    with pytest.raises(AssertionError, match="pytest collects no"):
        lane_of("tests/test_lesson09.py::test_renamed")
    assert lane_of("tests/test_lesson09.py::test_tp_job") == "make test-lesson09"
    assert lane_of("tests/test_lesson01.py::test_job_script_on_local_cluster") == "make test"
    demo = job_of("sbatch lessons/03_ddp_mnist/job.sh")
    assert make_recipe_jobs("demo") == {demo}
    assert make_recipe_jobs("demo2") == set()


# --------------------------------------------------------------------------- the summary

def summary(stats: dict) -> list[str]:
    """Lines for pytest's summary (tests/lanes.py): how many README commands ran here, how
    are left to other tests (by lane: only their records say whether they ran them), how many
    were skipped, by reason."""
    def ours(key):
        return [r for r in stats.get(key, [])
                if getattr(r, "nodeid", "").split("@")[0].startswith(PARAM_ID)]

    skipped, by_lane, tests = {}, {}, set()
    for report in ours("skipped"):
        reason = report.longrepr[2] if isinstance(report.longrepr, (tuple, list)) else ""
        reason = reason.removeprefix("Skipped: ")
        if reason.startswith((SUBMITTED, RUN_BY)):
            test, lane = re.match(r".*? by (\S+) \(([^)]+)\)", reason).groups()
            kind = "jobs" if reason.startswith(SUBMITTED) else "commands"
            by_lane.setdefault(lane, {}).setdefault(kind, 0)
            by_lane[lane][kind] += 1
            tests.add(test)
        else:
            why = reason.split(":")[0]
            skipped[why] = skipped.get(why, 0) + 1
    counts = {k: len(ours(k)) for k in ("passed", "failed", "error", "skipped")}
    commands = all_commands()  # the total and the quick ones: a worker's deselection is not here
    quick = sum(classify(c)[0] == "quick" for c in commands)
    jobs = sum(k.get("jobs", 0) for k in by_lane.values())
    others = sum(k.get("commands", 0) for k in by_lane.values())
    lanes = ", ".join(f"{lane}: " + " + ".join(f"{n} {k[:-1] if n == 1 else k}"
                                               for k, n in sorted(kinds.items()))
                      for lane, kinds in sorted(by_lane.items()))  # fmt: skip
    parts = [f"{counts['passed']} ran here (of {quick} quick ones: make test-readme)"]
    if tests:
        parts.append(f"{jobs} jobs and {others} commands left to {len(tests)} other tests "
                     f"({lanes}; not counted as run: tests/confirm_readme.py confirms them from "
                     "those tests' records)")
    parts += [f"{n} {what}" for n, what in (
        (sum(skipped.values()), "skipped"), (counts["failed"] + counts["error"], "failed"),
        (len(commands) - sum(counts.values()), "not in this run")) if n]  # fmt: skip
    lines = [f"README commands ({len(commands)}): " + ", ".join(parts)]
    lines += [f"  skipped, {why}: {n}" for why, n in sorted(skipped.items(), key=lambda x: -x[1])]
    return lines


PARAM_ID = f"tests/{Path(__file__).name}::test_readme_command["


def test_summary_counts_what_ran_what_is_left_to_others_and_why_skipped():
    def report(n, reason=None):
        longrepr = None if reason is None else ("f.py", 1, f"Skipped: {reason}")
        return SimpleNamespace(nodeid=f"{PARAM_ID}R.md:{n}-x]", longrepr=longrepr)

    stats = {
        "passed": [report(1), SimpleNamespace(nodeid="tests/test_other.py::test_x")],
        "skipped": [report(2, f"{SUBMITTED}t.py::a (make test); {CONFIRMED_BY}"),
                    report(3, f"{SUBMITTED}t.py::a (make test); {CONFIRMED_BY}"),
                    report(4, f"{RUN_BY}t.py::b (make test-long); {CONFIRMED_BY}"),
                    report(5, "needs a job id: x; the same run by t.py::c (make test)"),
                    report(6, "GPU only: y"), report(7, "GPU only: z")],
        "failed": [report(8)],
    }
    total, quick = len(all_commands()), sum(classify(c)[0] == "quick" for c in all_commands())
    assert summary(stats) == [
        f"README commands ({total}): 1 ran here (of {quick} quick ones: make test-readme), 2 "
        "jobs and 1 commands left to 2 other tests (make test: 2 jobs, make test-long: 1 "
        "command; not counted as run: tests/confirm_readme.py confirms them from those tests' "
        "records), 3 skipped, 1 failed, "
        f"{total - 8} not in this run",
        "  skipped, GPU only: 2", "  skipped, needs a job id: 1"]


# --------------------------------------------------------------------------- running


def student_environ() -> dict[str, str]:
    """This environment as a student's shell has it: the venv active and nothing else."""
    drop = ("COURSE_", "SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PYTHON", "VIRTUAL_ENV",
            "MNIST_", "TORCHELASTIC_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "OMP_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    venv = ROOT / ".venv"
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != venv / "bin"]
    env.update(VIRTUAL_ENV=str(venv), PATH=os.pathsep.join([str(venv / "bin"), *path]))
    return env


# Commands that use the cluster or read its state, run holding the cluster lock: the lane runs
# beside others whose tests restart the cluster in another shape or site (.ci/run).
NEEDS_CLUSTER = ("srun ", "salloc ", "sbatch ", "sinfo", "scontrol ", "squeue", "sacct",
                 "tail -n 50 /var/lib/course-cluster/")  # fmt: skip


def run_quick(text: str, inside_job: bool = False) -> subprocess.CompletedProcess:
    """Run a README command with bash from the course root, holding the cluster lock when it
    uses the cluster; ``inside_job``: within an allocation of 2 nodes x 2 tasks."""
    cmd = ["bash", "-c", text]
    if inside_job:
        cmd = ["salloc", "--nodes=2", "--ntasks-per-node=2", "--time=2", *cmd]
    needs_cluster = inside_job or text.startswith(NEEDS_CLUSTER)
    lock = cluster_lock(timeout=LOCK_WAIT_S) if needs_cluster else contextlib.nullcontext()
    env = student_environ()
    if text in QUICK_TMP_ENV:
        env[QUICK_TMP_ENV[text]] = tempfile.mkdtemp(prefix="readme-command-")
    with lock:  # the wait for the lock (someone else's jobs) is not the command's time
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=QUICK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    print(f"{time.monotonic() - start:.1f} s: {text}")
    return proc


def test_shorter_variables_are_the_scripts_own():
    """Each SHORTER variable is one its script's header shows in front of sbatch, and its
    ceiling is the default the script gives it (``${NAME:-default}``)."""
    for script, names in SHORTER.items():
        text = (ROOT / script).read_text()
        header = [line for line in text.splitlines() if line.startswith("#")]
        shown = {name for line in header if "sbatch" in line
                 for name in re.findall(r"\b([A-Z_]+)=\S+", line.split("sbatch")[0])}
        assert set(names) <= shown, (script, sorted(set(names) - shown))
        for name, most in names.items():
            assert most is None or f"${{{name}:-{most}}}" in text, (script, name, most)

