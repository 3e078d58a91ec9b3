"""Shared fixtures: the local SLURM cluster (cluster/up.sh) and helpers to run jobs on it.

Tests that use the ``cluster`` fixture (directly or through ``sbatch_wait`` / ``srun``) are
marked ``cluster`` and run after every other test, so a quick run of the unit tests is not held
up by starting daemons: ``pytest -m "not cluster"`` skips them altogether.

Which tests run in which lane (the marks, pytest-xdist's groups) is tests/lanes.py's. Only the
worker that runs the cluster group starts the ``cluster`` fixture.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import records
from lanes import (  # noqa: F401  the marks and lanes' hooks (tests/lanes.py), registered here
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_terminal_summary,
    pytest_xdist_node_collection_finished,
)

from common import jobwait

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_LOG_DIR = Path("/var/lib/course-cluster/log")
UP_TIMEOUT_S = 900  # includes apt-get on a machine without the packages

# Everyone on this machine shares one cluster: jobs are submitted and the cluster is
# (re)started only while holding this lock (``flock /tmp/course-cluster.lock CMD`` in a shell).
LOCK_PATH = "/tmp/course-cluster.lock"
LOCK_TIMEOUT_S = 1800
# Where the time goes: with COURSE_LOCK_LOG set to a file, each hold of the lock appends a line
# "<taken> <released> <seconds waited for it> <test>" (epoch seconds); .ci/run sets it and sums
# the held time and the gaps between holds (tests/README.md, "Where the time goes").
LOCK_LOG = os.environ.get("COURSE_LOCK_LOG", "")

# Variables that would point the test's commands at another allocation or site.
_FOREIGN_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")


# A job's /tmp is private to the job and to its node (cluster/job_container.conf.in), as on a
# real cluster, so the files a test hands to a job, or reads back from one, cannot be under
# /tmp. Every temporary directory of the suite (tmp_path, tempfile) is made under SHARED_TMP,
# which every node of the local cluster sees, as a real cluster's nodes see a shared filesystem.
SHARED_TMP = Path("/var/tmp/course-tests")
SHARED_TMP.mkdir(exist_ok=True)
with contextlib.suppress(PermissionError):  # made by another user: already open to all
    SHARED_TMP.chmod(0o1777)
tempfile.tempdir = str(SHARED_TMP)

_slurm_version: tuple[int, int] | None = None


def slurm_version() -> tuple[int, int]:
    """(major, minor) of the Slurm the cluster runs, from its clients (``sinfo --version``:
    "slurm-wlm 24.11.5" or "slurm 22.05.8"), e.g. (24, 11): expectations that differ between
    versions are asserted for the version that runs."""
    global _slurm_version
    if _slurm_version is None:
        out = subprocess.run(["sinfo", "--version"], capture_output=True, text=True,
                             timeout=30).stdout  # fmt: skip
        found = re.search(r"(\d+)\.(\d+)\.\d+", out)
        assert found, f"sinfo --version printed {out!r}"
        _slurm_version = (int(found[1]), int(found[2]))
    return _slurm_version

def restarts_after_a_kill_at_the_end_of_grace_time() -> int:
    """How often Slurm requeues a job that was killed at the end of its GraceTime and whose
    resumed run then exits 0: once up to 23.11; twice from 24.05 on. Since 24.05 (NEWS: "For
    PreemptMode=CANCEL and PreemptMode=REQUEUE assume that job signalled for GraceTime was
    preempted", commit a689104d15) a batch job that ends while the GRACE_PREEMPT flag that its
    grace time's SIGTERM set is still on is requeued (proc_req.c,
    _slurm_rpc_complete_batch_script). Only a requeue through _job_complete clears that flag;
    the requeue at the end of the grace time (job_mgr.c, _job_requeue_op) does not, so the
    resumed run's own end requeues the job once more (slurmctld.log: "_job_complete: requeue
    JobId=... per user/system request"), and the third run ends it. Slurm 26.05 is back to
    once, measured on the local cluster (26.05.5: slurmctld.log has no requeue for the resumed
    run's end; its preemption requeues through job_requeue_internal, SchedMD commit 0f7d732cd0,
    while proc_req.c keeps the condition above). The versions the local cluster runs:"""
    return {(22, 5): 1, (24, 11): 2, (26, 5): 1}[slurm_version()]


# Every process the suite starts (jobs, tasks; not notebook kernels, below) skips the garbage
# collector's last pass at exit: tests/exitfast/sitecustomize.py says why, tests/README.md what
# it saves.
# COURSE_TEST_EXITFAST=0 runs them without it, exactly as students run them.
_EXITFAST = str(ROOT / "tests" / "exitfast")
if (os.environ.get("COURSE_TEST_EXITFAST", "1") == "1"
        and _EXITFAST not in os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_EXITFAST, os.environ.get("PYTHONPATH")) if p)


class _NotebookKernelsWithoutTheFreeze:
    """A notebook's kernel, and every process its cells start, never load the exit freeze: a
    notebook is run as an instructor runs it, in every lane (it costs make test about 20 s:
    tests/README.md). nbval starts the kernel, with this process's environment, when the
    notebook's first cell is set up; the environment is put back after."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        if type(item.parent).__name__ != "IPyNbFile":  # nbval's notebook
            yield
            return
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (saved or "").split(os.pathsep) if p and p != _EXITFAST)
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = saved


def pytest_sessionstart(session):
    # Registered as a plugin of its own: a conftest's runtest hooks reach only the tests under
    # its folder, and the notebooks are under lessons/.
    session.config.pluginmanager.register(_NotebookKernelsWithoutTheFreeze(), "notebook-kernels")


def job_environ(env: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ without SLURM/SBATCH/SRUN/SALLOC variables, updated with ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN_PREFIXES)}
    clean.update(env or {})
    return clean


def _ancestor_holds_lock() -> bool:
    """Was this pytest started under ``flock LOCK_PATH ...`` (a parent has the lock file open)?"""
    pid = os.getppid()
    while pid > 1:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == LOCK_PATH:
                        return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


_lock_depth = 0


@contextlib.contextmanager
def cluster_lock(timeout: float = LOCK_TIMEOUT_S):
    """Hold the shared cluster lock (re-entrant; a no-op when pytest runs under ``flock``)."""
    global _lock_depth
    if _lock_depth > 0 or _ancestor_holds_lock():
        _lock_depth += 1
        try:
            yield
        finally:
            _lock_depth -= 1
        return
    # A blocking flock(1) child holds the lock for us: blocked waiters are served in turn by
    # the kernel, where polling with LOCK_NB would lose to them for ever on a busy machine.
    holder = subprocess.Popen(
        ["flock", "-w", str(int(timeout)), LOCK_PATH, "sh", "-c", "echo locked; exec cat"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    asked = time.time()
    taken = None
    try:
        if holder.stdout.readline().strip() != "locked":
            pytest.fail(f"{LOCK_PATH} stayed locked for {timeout} s", pytrace=False)
        taken = time.time()
        _lock_depth += 1
        try:
            yield
        finally:
            _lock_depth -= 1
    finally:
        holder.stdin.close()  # cat ends, flock releases the lock
        if LOCK_LOG and taken is not None:
            test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
            with open(LOCK_LOG, "a") as log:
                log.write(f"{taken:.1f} {time.time():.1f} {taken - asked:.1f} {test}\n")
        try:
            holder.wait(timeout=10)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()


def _log_tail(lines: int = 25) -> str:
    parts = []
    for path in sorted(CLUSTER_LOG_DIR.glob("*.log")):
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            continue
        parts.append(f"--- {path} (last {lines} lines)\n" + "\n".join(text))
    return "\n".join(parts) or f"(no logs in {CLUSTER_LOG_DIR})"


def run_up(*args: str, timeout: float = UP_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run ``bash cluster/up.sh ARGS``; fail the test with its output and the logs if it fails."""
    cmd = ["bash", str(ROOT / "cluster" / "up.sh"), *args]
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=job_environ()
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"{shlex.join(cmd)} did not finish in {timeout} s\n{exc.stdout or ''}"
            f"{exc.stderr or ''}\n{_log_tail()}",
            pytrace=False,
        )
    if proc.returncode != 0:
        pytest.fail(
            f"the local SLURM cluster did not start: {shlex.join(cmd)} exited "
            f"{proc.returncode}\n{proc.stdout}{proc.stderr}\n{_log_tail()}",
            pytrace=False,
        )
    return proc


@pytest.fixture(scope="session")
def cluster():
    """The local SLURM cluster in its default shape (2 nodes node1,node2 x 2 GPUs), started once.

    Fails (never skips) with the output of up.sh and the tail of the daemon logs when it cannot
    start. It is left running afterwards: other sessions on this machine may be using it.
    """
    # Already up in this shape: nothing to change, so no need to wait for the shared lock.
    try:
        check = subprocess.run(
            ["bash", str(ROOT / "cluster" / "up.sh"), "--check"],
            cwd=ROOT, capture_output=True, text=True, timeout=120, env=job_environ(),
        ).returncode  # fmt: skip
    except subprocess.TimeoutExpired:
        check = None
    if check != 0:
        with cluster_lock():
            run_up()
    return {"nodes": ["node1", "node2"], "gpus_per_node": 2}


@dataclass
class JobResult:
    job_id: str | None
    returncode: int
    output: str
    output_path: Path | None
    stdout: str
    stderr: str
    state: str = ""  # the job's final state (COMPLETED, FAILED, OUT_OF_MEMORY, ...)


def _given_output(args: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(args):
        if arg in ("-o", "--output") and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--output="):
            return arg.split("=", 1)[1]
        if arg.startswith("-o") and len(arg) > 2:
            return arg[2:]
    return None


def _script_sets_output(script: Path) -> bool:
    try:
        text = script.read_text(errors="replace")
    except OSError:
        return False
    for line in re.findall(r"^#SBATCH\s+(.*)$", text, re.MULTILINE):
        try:
            tokens = tuple(shlex.split(line, comments=True))
        except ValueError:
            continue
        if _given_output(tokens) is not None:
            return True
    return False


POLL_S = 0.3  # the tests hold the shared cluster: look a little more often than jobwait's 0.5


def job_record(job_id: str) -> dict[str, str] | None:
    """``scontrol show job -o ID`` as a dict (an array: its last line), or None once the record
    is gone (MinJobAge after the end); {} when the controller did not answer."""
    records = jobwait.job_records(job_id, env=job_environ())
    return None if records is None else (records[-1] if records else {})


def wait_job(job_id: str, timeout: float, poll: float = POLL_S) -> tuple[str, int, dict]:
    """Poll the job until it has finished (common/jobwait.py, the course's one job-wait);
    return (state, exit status as sbatch --wait gives it: 1 for a signal, last record seen).

    A requeued job is waited for until its last run ends. Raises TimeoutError after
    ``timeout`` seconds, RuntimeError when the job vanished before it was seen ending.
    """
    end = jobwait.wait(job_id, timeout, poll=poll, env=job_environ())
    return end.state, end.status, (end.records[-1] if end.records else {})


def slurm(*args, timeout: float = 30, env: dict[str, str] | None = None) -> str:
    """Run a SLURM command from the repository root, ENV added to its environment (as
    ``NAME=value sbatch ...``): its stdout, stripped (for `sbatch --parsable`, the job id
    alone); the test fails with the command's output if it fails."""
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env=job_environ(env))  # fmt: skip
    assert proc.returncode == 0, f"{' '.join(map(str, args))}: {proc.stdout}{proc.stderr}"
    out = proc.stdout.strip()
    return out.split(";")[0] if tuple(map(str, args[:2])) == ("sbatch", "--parsable") else out


_ON_TIMEOUT: list = []


@contextlib.contextmanager
def on_timeout(report):
    """Inside it, a wait_for that times out adds REPORT()'s text to its failure (what the jobs
    were doing: jobs_report), so that a wait that fails in CI says where things stood."""
    _ON_TIMEOUT.append(report)
    try:
        yield
    finally:
        _ON_TIMEOUT.remove(report)


def wait_for(what: str, predicate, timeout: float, poll: float = 0.3):
    """Poll ``predicate`` until it returns something true (returned), or fail after timeout,
    with the reports of the on_timeout blocks it runs in."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    reports = []
    for report in _ON_TIMEOUT:
        try:
            reports.append(report())
        except Exception as exc:  # a report must not hide the timeout it explains
            reports.append(f"(the report failed: {exc!r})")
    pytest.fail("\n".join([f"timed out after {timeout} s waiting for {what}", *reports]),
                pytrace=False)  # fmt: skip


def jobs_report(jobs: list[str], outputs: Path, processes: str) -> str:
    """JOBS' states and steps (squeue), the end of each output file in OUTPUTS, the stacks
    (py-spy) of the Python processes on this machine (the local cluster's nodes) whose
    command line matches the regular expression PROCESSES, the nodes' states and the cluster's
    logs."""
    from helpers import pid_stacks

    def run(*args: str) -> str:  # a report without Slurm's commands says so and goes on
        try:
            proc = subprocess.run(args, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"({args[0]}: {exc})"
        return (proc.stdout + proc.stderr).rstrip()

    parts = [f"jobs {' '.join(jobs)}:"]
    if jobs:
        parts.append(run("squeue", "--jobs", ",".join(jobs), "--format=%i %j %T %M %N %R"))
        parts.append(run("squeue", "--jobs", ",".join(jobs), "--steps", "--format=%i %M %N"))
    for path in sorted(outputs.glob("*.out")) + sorted(outputs.glob("*.log")):
        text = path.read_text(errors="replace").splitlines()[-25:]
        parts.append(f"--- {path.name} (last 25 lines)\n" + "\n".join(text))
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        python = Path(command.split(" ", 1)[0]).name.startswith("python")  # not srun's
        if python and re.search(processes, command) and "pytest" not in command:
            pids.append(int(cmdline.parent.name))
    parts.append(f"--- stacks of the processes matching {processes!r}:\n"
                 + (pid_stacks(sorted(pids), timeout=30) or "(none runs)"))  # fmt: skip
    nodes = run("sinfo", "-N", "-o", "%N %P %T %E")
    return "\n".join([*parts, f"--- the nodes:\n{nodes}", _log_tail(15)])


def submit_job(tmp_path: Path, script, *job_args, env=None, timeout: float = 300,
               sbatch_args=()):  # fmt: skip
    """Under the cluster lock: sbatch SBATCH_ARGS SCRIPT JOB_ARGS (the fixture sbatch_wait
    passes no arguments to the script), wait for the end polling faster than sbatch --wait,
    cancel what is left; returns (exit status, output)."""
    out = tmp_path / "job-%j.out"
    with cluster_lock():
        proc = subprocess.run(["sbatch", "--parsable", f"--output={out}", *sbatch_args,
                               str(script), *map(str, job_args)], cwd=ROOT, capture_output=True,
                              text=True, timeout=60, env=job_environ(env))  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        job = proc.stdout.strip().split(";")[0]
        try:
            _, status, _ = wait_job(job, timeout=timeout)
        except (TimeoutError, RuntimeError) as exc:
            report = _stuck_report(job, Path(str(out).replace("%j", job)))
            _cancel(job)
            pytest.fail(f"{exc} ({script} {shlex.join(map(str, job_args))}); cancelled.\n{report}",
                        pytrace=False)  # fmt: skip
        finally:
            _cancel(job)
    log = Path(str(out).replace("%j", job))
    return status, log.read_text() if log.exists() else ""


def _scontrol_stdout(job_id: str) -> Path | None:
    """The output file SLURM resolved for the job (its record stays MinJobAge after it ends)."""
    record = job_record(job_id)
    return Path(record["StdOut"]) if record and record.get("StdOut") else None


def _stuck_report(job_id: str, output: Path | None) -> str:
    """What a job that did not end in time was doing: its steps, the processes of its steps on
    this machine, its output so far and the cluster's log tails (what CI shows of a hang)."""
    steps = subprocess.run(["squeue", "--steps", "--jobs", job_id, "--format=%i %j %M %N"],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
    procs = subprocess.run(["ps", "-eo", "pid,ppid,etime,stat,args"], capture_output=True,
                           text=True, timeout=30).stdout.splitlines()  # fmt: skip
    mine = [line for line in procs if f"[{job_id}." in line or f"job {job_id}" in line
            or any(word in line for word in ("srun ", "sleep infinity", "train.py", "sbcast"))]
    text = output.read_text(errors="replace") if output and output.exists() else ""
    return (f"steps:\n{steps.stdout}{steps.stderr}\nprocesses:\n" + "\n".join(mine[:40])
            + f"\noutput so far ({output}):\n{text[-4000:]}\n{_log_tail(15)}")


def _cancel(job_id: str | None) -> None:
    if job_id:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)


@pytest.fixture(name="cluster_lock")
def cluster_lock_fixture():
    """The shared-cluster lock as a context manager factory: ``with cluster_lock(): ...``."""
    return cluster_lock


@pytest.fixture
def sbatch_wait(cluster, tmp_path):
    """A function that submits a job script, waits for it to end and returns a JobResult.

    ``sbatch_wait(script, *sbatch_args, env=None, timeout=600, script_args=(), cwd=ROOT)`` runs
    from the repository root, or from CWD (a copy of the course: ``script_args`` go to the
    script);
    the job's output goes to a temporary ``slurm-<jobid>.out`` unless ``--output`` is given on
    the command line or in the script. ``returncode`` is what ``sbatch --wait`` would return
    (the job's exit status), found by polling the job's state every 0.3 s instead of sbatch's
    2, 10, 42 s. On timeout the job is cancelled and the test fails.
    """

    def submit(script, *sbatch_args, env=None, timeout=600, script_args=(),
               cwd=ROOT) -> JobResult:  # fmt: skip
        args = tuple(str(a) for a in sbatch_args)
        script_path = Path(script) if Path(script).is_absolute() else Path(cwd) / script
        extra = []
        if _given_output(args) is None and not _script_sets_output(script_path):
            extra = [f"--output={tmp_path}/slurm-%j.out"]
        cmd = ["sbatch", "--parsable", *extra, *args, str(script), *map(str, script_args)]
        with cluster_lock():
            proc = subprocess.run(
                cmd, cwd=cwd, capture_output=True, text=True, timeout=60,
                env=job_environ(env),
            )  # fmt: skip
            first = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
            job_id = first.split(";")[0] or None
            if proc.returncode != 0 or not job_id:  # refused at submission
                return JobResult(None, proc.returncode or 1, "", None, proc.stdout, proc.stderr)
            try:
                state, returncode, record = wait_job(job_id, timeout)
            except (TimeoutError, RuntimeError) as exc:
                report = _stuck_report(job_id, _scontrol_stdout(job_id))
                _cancel(job_id)
                pytest.fail(f"{exc} ({shlex.join(cmd)}); cancelled.\n{report}", pytrace=False)
        path = Path(record["StdOut"]) if record.get("StdOut") else None
        given = _given_output(args) or (extra[0].split("=", 1)[1] if extra else None)
        if path is None and given:
            path = Path(given.replace("%j", job_id))
            path = path if path.is_absolute() else Path(cwd) / path
        output = path.read_text(errors="replace") if path and path.exists() else ""
        return JobResult(job_id, returncode, output, path, proc.stdout, proc.stderr, state)

    return submit


@pytest.fixture
def srun(cluster):
    """A function that runs ``srun ARGS`` from the repository root and returns CompletedProcess.

    ``srun(*args, env=None, timeout=240)``; on timeout srun is interrupted (which cancels its
    step) and the test fails with what it printed.
    """

    def run(*args, env=None, timeout=240) -> subprocess.CompletedProcess:
        with cluster_lock():
            return _srun(["srun", *(str(a) for a in args)], env, timeout)

    return run


def _srun(cmd, env, timeout) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=job_environ(env), start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # Two interrupts within a second make srun cancel the step and exit.
        for _ in range(2):
            proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(
            f"{shlex.join(cmd)} still running after {timeout} s; interrupted.\n{out}{err}",
            pytrace=False,
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# Every process a test starts, and how each test ended, recorded (tests/records.py): CI's last
# step confirms the READMEs' commands against these runs (tests/confirm_readme.py).
records.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    records.outcome(report.get_result())
