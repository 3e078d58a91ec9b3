"""common.dist: the two timeouts, threads per process, GPUs that torch cannot use.

The process-group tests start real gloo groups (plain processes on this machine).
"""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import dist as cdist  # noqa: E402
from common.env import LaunchError, find_free_port  # noqa: E402
from tests.helpers import clean_environ  # noqa: E402

# --------------------------------------------------------------------------- timeouts


@pytest.mark.parametrize(
    "rdzv,coll,expected",
    [
        (None, None, (cdist.DEFAULT_RDZV_TIMEOUT_S, cdist.DEFAULT_TIMEOUT_S)),
        (None, "5", (5, 5)),  # the fast setting bounds both (tests, the local cluster)
        ("30", None, (30, cdist.DEFAULT_TIMEOUT_S)),
        ("30", "1800", (30, 1800)),
        ("300", "60", (60, 60)),
    ],
)
def test_timeouts(monkeypatch, rdzv, coll, expected):
    for name, value in ((cdist.RDZV_TIMEOUT_VAR, rdzv), (cdist.TIMEOUT_VAR, coll)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert cdist._timeouts(None) == expected
    assert cdist._timeouts(7)[1] == 7


@pytest.mark.parametrize("name", [cdist.RDZV_TIMEOUT_VAR, cdist.TIMEOUT_VAR])
@pytest.mark.parametrize("bad", ["soon", "0", "-3", "nan"])
def test_bad_timeout_names_the_variable(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(LaunchError, match=name):
        cdist._timeouts(None)


def run_ranks(code: str, world: int, timeout: float, **extra) -> list[subprocess.CompletedProcess]:
    """Run ``code`` as ranks 0..world-1 (plain env:// variables), each bounded by ``timeout``."""
    port = str(find_free_port())
    procs = []
    for rank in range(world):
        environ = clean_environ(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=port)  # fmt: skip
        environ.update(extra)
        procs.append(subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=environ,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=ROOT))  # fmt: skip
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    return results


@pytest.mark.timeout(60)
def test_collectives_may_wait_longer_than_the_rendezvous():
    """Rank 1 reaches the barrier 6 s late (rank 0 saving a checkpoint, say): with a 3 s
    rendezvous bound and the collectives' own bound, the barrier still completes."""
    code = """
        import time, torch.distributed as dist
        from common.dist import init_distributed, cleanup
        ctx = init_distributed()
        if ctx.env.rank == 1:
            time.sleep(6)
        t0 = time.monotonic()
        dist.barrier()
        print(f"waited {time.monotonic() - t0:.1f}")
        cleanup()
    """
    results = run_ranks(code, 2, 45, COURSE_RDZV_TIMEOUT="3", COURSE_DIST_TIMEOUT="30")
    for r in results:
        assert r.returncode == 0, r.stderr
    assert float(results[0].stdout.split()[-1]) >= 4


@pytest.mark.timeout(60)
def test_a_rendezvous_that_cannot_complete_is_one_line():
    code = """
        import sys
        from common.dist import init_distributed
        from common.env import LaunchError
        try:
            init_distributed()
        except LaunchError as exc:
            sys.exit(f"error: {exc}")
    """
    start = time.monotonic()
    (result,) = run_ranks(code, 1, 45, RANK="1", WORLD_SIZE="2", COURSE_RDZV_TIMEOUT="3")
    assert time.monotonic() - start < 30
    assert result.returncode == 1
    # torch's C++ side logs its own socket timeout first; ours is the last line, no traceback
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank 1: the rendezvous"), line
    assert "MASTER_ADDR=127.0.0.1" in line and "COURSE_RDZV_TIMEOUT" in line and "3 s" in line


# --------------------------------------------------------------------------- threads


@pytest.mark.parametrize(
    "cpus,whole,procs,asked,threads",
    [
        (64, True, 4, 0, 16),  # unbound on a 64-CPU node: the node's CPUs are shared
        (64, True, 4, 8, 8),  # ... capped by --cpus-per-task
        (4, False, 2, 4, 4),  # SLURM bound the task to its 4 CPUs: all 4 are its own
        (2, True, 4, 4, 1),  # more processes than CPUs: at least one thread
        (2, True, 2, 0, 1),
    ],
)
def test_thread_share(cpus, whole, procs, asked, threads):
    assert cdist.thread_share(cpus, whole, procs, asked) == threads


def test_usable_cpus_without_linux_affinity(monkeypatch):
    """macOS and Windows have no os.sched_getaffinity: every CPU is usable."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert cdist.usable_cpus() == (os.cpu_count(), True)


def test_usable_cpus_sees_a_narrowed_affinity():
    code = """
        import os
        from common.dist import usable_cpus
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        print(*usable_cpus())
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=clean_environ(),
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    cpus, whole = proc.stdout.split()
    assert cpus == "1" and whole == str((os.cpu_count() or 1) == 1)


# --------------------------------------------------------------------------- GPUs


def test_gpus_given_but_no_nvidia_device_is_a_note(tmp_path):
    note = cdist.check_gpus_usable({"SLURM_GPUS_ON_NODE": "2"}, str(tmp_path / "nvidia[0-9]*"))
    assert note.startswith("note:") and "runs on the CPU" in note and "\n" not in note


def test_no_gpus_given_says_nothing(tmp_path):
    (tmp_path / "nvidia0").touch()
    assert cdist.check_gpus_usable({}, str(tmp_path / "nvidia[0-9]*")) is None


def test_gpus_given_and_present_but_unusable_stops(tmp_path):
    """A node with NVIDIA devices, GPUs from SLURM, and a torch that sees no CUDA (this
    machine's CPU wheel): stop instead of training on the CPU."""
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidia1").touch()
    with pytest.raises(LaunchError) as info:
        cdist.check_gpus_usable({"SLURM_GPUS_ON_NODE": "2"}, str(tmp_path / "nvidia[0-9]*"))
    message = str(info.value)
    assert "torch.version.cuda=" in message and "SLURM_GPUS_ON_NODE" in message
    assert "2 NVIDIA device(s)" in message


def test_a_process_group_without_linux_only_calls():
    """As on an instructor's macOS laptop: no os.sched_getaffinity, no /proc to read. Then
    cleanup() leaves the group and freezes the heap."""
    code = """
        import builtins, os, torch
        del os.sched_getaffinity
        real_open = builtins.open
        def no_proc(path, *a, **k):
            if str(path).startswith("/proc"):
                raise FileNotFoundError(path)
            return real_open(path, *a, **k)
        builtins.open = no_proc
        from common.dist import init_distributed, cleanup
        ctx = init_distributed()
        value = torch.ones(1)
        torch.distributed.all_reduce(value)
        print(ctx.env.launcher, ctx.backend, int(value.item()), torch.get_num_threads())
        import gc
        cleanup()
        # cleanup() leaves what is alive frozen, out of the collector's last pass at exit
        print(torch.distributed.is_initialized(), gc.get_freeze_count() > 1000)
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=clean_environ(),
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    launcher, backend, total, threads, initialized, frozen = proc.stdout.split()
    assert (launcher, backend, total) == ("single", "gloo", "1")
    assert (initialized, frozen) == ("False", "True"), proc.stdout
    assert int(threads) == (os.cpu_count() or 1)
