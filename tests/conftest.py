"""Shared fixtures: the local SLURM cluster (cluster/up.sh) and helpers to run jobs on it.

Tests that use the ``cluster`` fixture (directly or through ``sbatch_wait`` / ``srun``) are
marked ``cluster`` and run after every other test, so a quick run of the unit tests is not held
up by starting daemons: ``pytest -m "not cluster"`` skips them altogether.

``make test`` runs two lanes (pytest-xdist, ``-n 2 --dist loadgroup``): every cluster test is
in one group, so they run one after another on one worker, in collection order, from the start
of the run, while the other worker takes the rest a file at a time (a notebook's cells stay in
order, in one kernel). A cluster test's worker mostly waits for its job; the other worker's
tests run meanwhile. Only the worker that runs the cluster group starts the ``cluster`` fixture.
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

CLUSTER_GROUP = "cluster"  # the xdist_group of every test that uses the cluster
LESSON09_NOTEBOOK = "lessons/09_beyond_data_parallel/"  # nbval items: marked lesson09 below
LESSON10_NOTEBOOK = "lessons/10_fit_and_keep/"  # nbval items: marked lesson10 below

# The cluster tests that `make test-slurm` runs again on the second Slurm version (cluster/up.sh
# --slurm 24.11; CI runs it after `make test`), marked `every_slurm`: the cluster's own checks
# (clients, jobs, accounting, limits, users, down.sh), every test whose expectation differs
# between versions, and job scripts of every lesson. Ids or id prefixes, as pytest prints them.
EVERY_SLURM = (
    "tests/test_cluster.py::test_sinfo_shows_two_nodes_with_two_gpus",
    "tests/test_cluster.py::test_srun_two_nodes_two_tasks_each",
    "tests/test_cluster.py::test_gres_and_gpus_per_node_mix_until_26_05",
    "tests/test_cluster.py::test_sbatch_wait_returns_the_job_exit_code",
    "tests/test_cluster.py::test_srun_takes_cpus_per_task_from_the_job_from_23_11",
    "tests/test_cluster.py::test_gloo_all_reduce_between_nodes",
    "tests/test_cluster.py::test_nodes_are_separate_hosts_on_a_network",
    "tests/test_cluster.py::test_up_is_idempotent_and_down_leaves_nothing",
    "tests/test_cluster.py::test_check_changes_nothing",
    "tests/test_cluster_accounting.py::",
    "tests/test_cluster_limits.py::test_task_over_its_memory_is_killed",
    "tests/test_cluster_preempt.py::",
    "tests/test_cluster_student.py::test_student_runs_lesson00",
    "tests/test_env_on_cluster.py::",
    "tests/test_lesson00.py::test_anatomy_job_steps_and_tasks",
    "tests/test_lesson00.py::test_memory_job_over_its_mem",
    "tests/test_lesson00.py::test_salloc_srun_and_task_placement",
    "tests/test_lesson01.py::test_job_script_on_local_cluster[job.sh]",
    "tests/test_lesson02.py::test_job_script_on_local_cluster[job.sh]",
    "tests/test_lesson02.py::test_job_script_on_local_cluster[torchrun_multinode.sh]",
    "tests/test_lesson03.py::test_carried_train_py_runs_under_srun_on_two_nodes",
    "tests/test_lesson04.py::test_static_job",
    "tests/test_lesson04_charliecloud.py::test_torchrun_in_charliecloud",
    # (lesson 05's preemption job takes 80 s on 24.11; test_cluster_preempt above asserts each
    # version's preemption and requeue counts, and this job script runs the lesson's training)
    "tests/test_lesson05.py::test_chain_of_array_links_and_a_dependent_job",
    # (both scripts share the stop rules of common/job_env.sh: lesson 07's job on every version)
    "tests/test_lesson05_cancel.py::test_plain_scancel_saves_and_the_job_stays_cancelled[07]",
    "tests/test_slurm_requeue.py::test_a_job_slurm_requeued_says_so_and_comes_back_once[07-",
    "tests/test_slurm_requeue.py::test_a_cancel_between_the_state_check_and_the_requeue_wins",
    "tests/test_lesson06.py::test_wrong_interface",
    "tests/test_lesson06.py::test_world_size_exported_wrong",
    "tests/test_lesson07.py::test_job_saves_on_2_nodes_requeues_and_resumes_on_1",
    "tests/test_lesson08.py::test_job_sh_stages_the_folder_form_with_srun_and_trains",
    # (the lighthouse, two groups and a node set DOWN: 22.05 in make test-sites, 26.05 here)
    "tests/test_lesson11_cluster.py::",
)


# The lessons' own job scripts (lessons 01 to 08 and 11; lesson 00's tests check what differs
# between versions): make test-slurm runs them on the newest version only, the rest on every
# version.
LESSON_JOBS = (*(f"tests/test_lesson0{n}" for n in range(1, 9)), "tests/test_lesson11")

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


# Every process the suite starts (jobs, tasks, notebook kernels) skips the garbage collector's
# last pass at exit: tests/exitfast/sitecustomize.py says why, tests/README.md what it saves.
# COURSE_TEST_EXITFAST=0 runs them without it, exactly as students run them.
_EXITFAST = str(ROOT / "tests" / "exitfast")
if (os.environ.get("COURSE_TEST_EXITFAST", "1") == "1"
        and _EXITFAST not in os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_EXITFAST, os.environ.get("PYTHONPATH")) if p)


def _loadgroup(config) -> bool:
    """Is this run split over pytest-xdist workers by xdist_group (``--dist loadgroup``)?
    (A worker sees ``dist`` as "no" and xdist's own ``loadgroup`` flag set.)"""
    return config.getoption("dist", None) == "loadgroup" or config.getoption("loadgroup", False)


def pytest_configure(config):
    if os.environ.get("COURSE_TEST_EXITFAST", "1") not in ("0", "1"):
        raise pytest.UsageError(f"COURSE_TEST_EXITFAST={os.environ['COURSE_TEST_EXITFAST']!r}: set "
                                "it to 0 (processes as students run them) or 1 (the default)")
    config.addinivalue_line(
        "markers", "every_slurm: also run on the second Slurm version (make test-slurm, CI)",
    )
    config.addinivalue_line(
        "markers", "lesson_job: a lesson's job script among the every_slurm tests (make "
        "test-slurm runs these on the newest version of its lane only)",
    )
    config.addinivalue_line(
        "markers", "cluster: needs the local SLURM cluster (cluster/up.sh); runs after the rest "
        "(under --dist loadgroup: in a lane of its own)",
    )
    config.addinivalue_line(
        "markers", "lesson09: lesson 09's tests and notebook, a lane of their own (make "
        "test-lesson09); `make test` leaves them out",
    )
    config.addinivalue_line(
        "markers", "lesson10: lesson 10's tests and notebook, a lane of their own (make "
        "test-lesson10); `make test` leaves them out",
    )
    config.addinivalue_line(
        "markers", "lesson11: lesson 11's tests on this machine (groups on loopback), a lane of "
        "their own (make test-lesson11); `make test` leaves them out",
    )
    config.addinivalue_line(
        "markers", "long: a cluster job of a minute or more that waits on Slurm's timers (grace "
        "time, requeues); a lane of its own (make test-long), left out of make test",
    )
    config.addinivalue_line(
        "markers", "computes: a long job whose minutes go to computing, not to Slurm's timers "
        "(make demo's full job): .ci/run runs it apart from the rest of the long lane "
        "(LONG_MARKS)",
    )
    config.addinivalue_line(
        "markers", "scale: real job sizes, 34 and 64 ranks on 17 and 32 nodes; a lane of its "
        "own (make test-scale), left out of make test",
    )
    config.addinivalue_line(
        "markers", "sites: what other sites do to the jobs (--export=NONE, a shared /tmp, rank 0 "
        "elsewhere, GPU binding, a resume on fewer GPUs); a lane of its own (make test-sites), "
        "left out of make test",
    )
    config.addinivalue_line(
        "markers", "readme: a README's command run as written (tests/test_readme_commands.py); "
        "a lane of its own (make test-readme), left out of make test",
    )
    if _loadgroup(config):
        # Hand out the groups in collection order (cluster group first, see below), not
        # largest group first: the cluster group is the longest lane, so it starts at once.
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(session, config, items):
    """Mark tests that need the cluster and move them to the end (order otherwise kept).

    Under ``--dist loadgroup`` they move to the front instead, all in one xdist_group; every
    other test gets the group of its file (a notebook's cells, a module's fixtures stay on
    one worker, in order).
    """
    lanes = _loadgroup(config)
    uses_cluster = []
    for item in items:
        if item.nodeid.startswith(LESSON09_NOTEBOOK):  # nbval's cells carry no marks of their own
            item.add_marker(pytest.mark.lesson09)
        if item.nodeid.startswith(LESSON10_NOTEBOOK):  # the same for lesson 10's notebook
            item.add_marker(pytest.mark.lesson10)
        needs = "cluster" in getattr(item, "fixturenames", ())
        if needs:
            item.add_marker(pytest.mark.cluster)
            if item.nodeid.startswith(EVERY_SLURM):
                item.add_marker(pytest.mark.every_slurm)
                if item.nodeid.startswith(LESSON_JOBS):
                    item.add_marker(pytest.mark.lesson_job)
        if lanes:
            group = CLUSTER_GROUP if needs else item.nodeid.split("::", 1)[0]  # the file
            item.add_marker(pytest.mark.xdist_group(group))
        uses_cluster.append(needs)
    rest = [i for i, n in zip(items, uses_cluster, strict=True) if not n]
    cluster = [i for i, n in zip(items, uses_cluster, strict=True) if n]
    items[:] = cluster + rest if lanes else rest + cluster


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist
def pytest_xdist_node_collection_finished(node, ids):
    """xdist hands a group to one worker by the suffix it adds to each test's id
    ("...::test@group"), and every test here has a group. With some pytest releases it cannot
    add it (pytest-xdist#1386), and the groups would be split silently: notebook cells out of
    order, cluster tests side by side. Stop instead."""
    ungrouped = [i for i in ids if i.rfind("@") <= i.rfind("]")]
    if _loadgroup(node.config) and ungrouped:
        pytest.exit(
            f"--dist loadgroup: {len(ungrouped)} test(s) have no group, e.g. {ungrouped[0]} "
            f"(pytest {pytest.__version__} with this pytest-xdist): install the versions in "
            "requirements.txt",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


def pytest_terminal_summary(terminalreporter):
    """The READMEs' commands in a few lines, when this run had them: how many ran, how many
    other tests submit or run as written, how many were skipped and why
    (tests/test_readme_commands.py)."""
    stats, ours = terminalreporter.stats, "tests/test_readme_commands.py::test_readme_command["
    if any(getattr(r, "nodeid", "").startswith(ours)
           for reports in stats.values() for r in reports):  # fmt: skip
        from test_readme_commands import summary

        terminalreporter.section("README commands")
        for line in summary(stats):
            terminalreporter.write_line(line)


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


def wait_for(what: str, predicate, timeout: float, poll: float = 0.3):
    """Poll ``predicate`` until it returns something true (returned), or fail after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"timed out after {timeout} s waiting for {what}", pytrace=False)


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

    ``sbatch_wait(script, *sbatch_args, env=None, timeout=600, script_args=())`` runs from the
    repository root (``script_args`` go to the script);
    the job's output goes to a temporary ``slurm-<jobid>.out`` unless ``--output`` is given on
    the command line or in the script. ``returncode`` is what ``sbatch --wait`` would return
    (the job's exit status), found by polling the job's state every 0.3 s instead of sbatch's
    2, 10, 42 s. On timeout the job is cancelled and the test fails.
    """

    def submit(script, *sbatch_args, env=None, timeout=600, script_args=()) -> JobResult:
        args = tuple(str(a) for a in sbatch_args)
        script_path = Path(script) if Path(script).is_absolute() else ROOT / script
        extra = []
        if _given_output(args) is None and not _script_sets_output(script_path):
            extra = [f"--output={tmp_path}/slurm-%j.out"]
        cmd = ["sbatch", "--parsable", *extra, *args, str(script), *map(str, script_args)]
        with cluster_lock():
            proc = subprocess.run(
                cmd, cwd=ROOT, capture_output=True, text=True, timeout=60,
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
            path = path if path.is_absolute() else ROOT / path
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
