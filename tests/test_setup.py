"""The set-up every lesson script does itself, and what common/env.py answers for it: threads
per process, the timeout, the GPU a process drives, GPUs that torch cannot use, the one line a
rank prints when the group cannot be joined.

The process tests start real gloo groups (plain processes on this machine), set up exactly as
lesson 03's train.py does.
"""

import datetime
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import env as cenv  # noqa: E402
from common.env import LaunchEnv, LaunchError  # noqa: E402
from tests.helpers import clean_environ  # noqa: E402

# The lessons' set-up, as lesson 03's train.py writes it (a test below checks that it does).
SETUP = """
    import sys, torch, torch.distributed as dist
    from common.env import (LaunchError, check_cuda_usable, cpu_threads, cuda_device_index,
                            dist_timeout, init_error_message, resolve_launch_env)
    env = None
    try:
        env = resolve_launch_env()
        torch.set_num_threads(cpu_threads(env))
        if torch.cuda.is_available():
            device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))
            torch.cuda.set_device(device)
        else:
            check_cuda_usable()
            device = torch.device("cpu")
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=dist_timeout(),
            device_id=device if device.type == "cuda" else None,
        )
    except LaunchError as exc:
        sys.exit(f"error: {exc}")
    except dist.DistError as exc:
        sys.exit(f"error: {init_error_message(env, exc)}")
"""


def test_lesson_03_sets_up_as_these_tests_do():
    """The set-up lines tested here are the ones lesson 03 teaches, not a copy that drifted."""
    text = (ROOT / "lessons" / "03_ddp_mnist" / "train.py").read_text()
    for line in textwrap.dedent(SETUP).splitlines()[5:-5]:
        if line.strip() and not line.strip().startswith("env = None"):
            assert line.strip() in text, line


def run_ranks(code: str, world: int, timeout: float, **extra) -> list[subprocess.CompletedProcess]:
    """Run SETUP + ``code`` as ranks 0..world-1 (plain env:// variables), each bounded."""
    port = str(cenv.find_free_port())
    procs = []
    script = textwrap.dedent(SETUP) + textwrap.dedent(code)
    for rank in range(world):
        environ = clean_environ(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=port)  # fmt: skip
        environ.update(extra)
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=environ,
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


# --------------------------------------------------------------------------- timeout


@pytest.mark.parametrize(
    "value,seconds",
    [(None, cenv.DEFAULT_TIMEOUT_S), ("5", 5), ("1800", 1800), ("0.5", 0.5)],
)
def test_dist_timeout(value, seconds):
    environ = {} if value is None else {cenv.TIMEOUT_VAR: value}
    assert cenv.dist_timeout(environ) == datetime.timedelta(seconds=seconds)


@pytest.mark.parametrize("bad", ["soon", "0", "-3", "nan", "inf", ""])
def test_bad_timeout_names_the_variable(bad):
    with pytest.raises(LaunchError, match=f"{cenv.TIMEOUT_VAR}=.*positive number of seconds"):
        cenv.dist_timeout({cenv.TIMEOUT_VAR: bad})


@pytest.mark.timeout(60)
def test_a_late_rank_is_waited_for():
    """Rank 1 reaches the barrier 4 s late (rank 0 saving a checkpoint, say): the barrier
    waits for it, within the timeout."""
    code = """
        import time
        if env.rank == 1:
            time.sleep(4)
        t0 = time.monotonic()
        dist.barrier()
        print(f"waited {time.monotonic() - t0:.1f}")
        dist.destroy_process_group()
    """
    results = run_ranks(code, 2, 45, COURSE_DIST_TIMEOUT="30")
    for r in results:
        assert r.returncode == 0, r.stderr
    assert float(results[0].stdout.split()[-1]) >= 3


@pytest.mark.timeout(60)
def test_a_rendezvous_that_cannot_complete_is_one_line():
    """Rank 1 of 2 alone, rank 0 never comes: it gives up after COURSE_DIST_TIMEOUT with one
    line naming the address and the fix, and no traceback."""
    start = time.monotonic()
    (result,) = run_ranks("", 1, 45, RANK="1", WORLD_SIZE="2", COURSE_DIST_TIMEOUT="3")
    assert time.monotonic() - start < 30
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank 1: could not join the process group"), line
    assert "MASTER_ADDR=127.0.0.1" in line and "COURSE_DIST_TIMEOUT" in line, line


def test_duplicate_gpu_from_nccl_is_said_plainly():
    env = LaunchEnv(1, 1, 2, 2, 0, 1, "n1", 29500, "slurm", "n1", "7")
    exc = RuntimeError("NCCL error: invalid usage, NCCL version 2.21.5\nDuplicate GPU detected :"
                       " rank 1 and rank 0 both on CUDA device 1000")  # fmt: skip
    message = cenv.init_error_message(env, exc)
    assert message.startswith("rank 1: two ranks drive one GPU") and "\n" not in message
    assert "--gpus-per-task=1" in message


# --------------------------------------------------------------------------- threads


def launch_env(launcher, local_world_size):
    return LaunchEnv(0, 0, local_world_size, local_world_size, 0, 1, "n1", 29500, launcher,
                     "n1", None)  # fmt: skip


@pytest.mark.parametrize(
    "launcher,procs,cpus,whole,environ,threads",
    [
        # srun, no binding (the set is the whole 64-CPU node): the node's tasks share it
        ("slurm", 4, 64, True, {}, 16),
        ("slurm", 4, 64, True, {"SLURM_CPUS_PER_TASK": "8"}, 8),  # capped by --cpus-per-task
        ("slurm", 2, 4, False, {"SLURM_CPUS_PER_TASK": "4"}, 4),  # bound: the 4 are its own
        # torchrun's (or mp.spawn's) 2 workers inherit their task's 8 bound CPUs and share them
        ("torchrun", 2, 8, False, {"SLURM_CPUS_PER_TASK": "8"}, 4),
        ("mp.spawn", 4, 8, False, {}, 2),
        ("torchrun", 2, 64, True, {"SLURM_CPUS_PER_TASK": "8"}, 4),  # unbound, capped per worker
        ("slurm", 4, 2, True, {}, 1),  # more processes than CPUs: at least one thread
        ("single", 1, 2, True, {}, 2),  # a laptop, one process: all of them
        # OMP_NUM_THREADS wins (torchrun sets 1 unless it is set; a job script may set it)
        ("torchrun", 2, 8, False, {"OMP_NUM_THREADS": "3"}, 3),
        ("slurm", 4, 64, True, {"OMP_NUM_THREADS": "1"}, 1),
    ],
)
def test_cpu_threads(launcher, procs, cpus, whole, environ, threads):
    assert cenv.cpu_threads(launch_env(launcher, procs), environ, (cpus, whole)) == threads


@pytest.mark.parametrize("bad", ["0", "four", "-1"])
def test_bad_omp_num_threads_names_the_variable(bad):
    with pytest.raises(LaunchError, match="OMP_NUM_THREADS"):
        cenv.cpu_threads(launch_env("slurm", 1), {"OMP_NUM_THREADS": bad}, (4, True))


def test_usable_cpus_without_linux_affinity(monkeypatch):
    """macOS has no os.sched_getaffinity: every CPU is usable."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert cenv.usable_cpus() == (os.cpu_count(), True)


def test_usable_cpus_sees_a_narrowed_affinity():
    code = """
        import os
        from common.env import usable_cpus
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        print(*usable_cpus())
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=clean_environ(),
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    cpus, whole = proc.stdout.split()
    assert cpus == "1" and whole == str((os.cpu_count() or 1) == 1)


# --------------------------------------------------------------------------- GPUs


def test_gpus_given_but_no_nvidia_device_goes_on_with_the_cpu(tmp_path):
    """The local cluster: SLURM's GPUs are bookkeeping, there is no /dev/nvidia*."""
    cenv.check_cuda_usable({"SLURM_GPUS_ON_NODE": "2"}, str(tmp_path / "nvidia[0-9]*"))


def test_no_gpus_given_says_nothing(tmp_path):
    (tmp_path / "nvidia0").touch()
    cenv.check_cuda_usable({}, str(tmp_path / "nvidia[0-9]*"))


def test_gpus_given_and_present_but_unusable_stops(tmp_path):
    """A node with NVIDIA devices, GPUs from SLURM, and a torch that sees no CUDA (no driver
    here): stop instead of training on the CPU, and say why for the torch installed: the CUDA
    wheel (requirements.txt) names the driver, a CPU-only build says so."""
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidia1").touch()
    with pytest.raises(LaunchError) as info:
        cenv.check_cuda_usable({"SLURM_GPUS_ON_NODE": "2"}, str(tmp_path / "nvidia[0-9]*"))
    message = str(info.value)
    assert "torch.version.cuda=" in message and "SLURM_GPUS_ON_NODE" in message
    assert "2 NVIDIA device(s)" in message
    if torch.version.cuda:
        assert f"torch.version.cuda={torch.version.cuda}" in message, message
        assert "the driver is older than this CUDA build needs" in message, message
        # each container runtime's way to hand in the GPUs: enroot, Apptainer, Charliecloud
        for way in ("apptainer --nv", "pyxis", "ch-fromhost --nvidia <image>"):
            assert way in message, message
    else:
        assert "CPU-only build" in message, message


@pytest.mark.timeout(60)
def test_hidden_gpus_stop_the_lesson_set_up_in_one_line(tmp_path):
    """CUDA_VISIBLE_DEVICES="" with SLURM's GPU variables on a node with NVIDIA devices (made
    here as files): the set-up stops before joining any group."""
    (tmp_path / "nvidia0").touch()
    script = textwrap.dedent(SETUP).replace(
        "check_cuda_usable()", "check_cuda_usable(nvidia_glob=sys.argv[1])")
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "nvidia[0-9]*")], cwd=ROOT,
        env=clean_environ(CUDA_VISIBLE_DEVICES="", SLURM_GPUS_ON_NODE="1"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().startswith("error: SLURM gave this node 1 GPU(s)"), proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(60)
def test_the_set_up_without_linux_only_calls():
    """As on an instructor's macOS laptop: no os.sched_getaffinity, no /proc to read."""
    code = """
        value = torch.ones(1)
        dist.all_reduce(value)
        print(env.launcher, dist.get_backend(), int(value.item()), torch.get_num_threads())
        dist.destroy_process_group()
        print(dist.is_initialized())
    """
    prelude = """
        import builtins, os
        del os.sched_getaffinity
        real_open = builtins.open
        def no_proc(path, *a, **k):
            if str(path).startswith("/proc"):
                raise FileNotFoundError(path)
            return real_open(path, *a, **k)
        builtins.open = no_proc
    """
    script = textwrap.dedent(prelude) + textwrap.dedent(SETUP) + textwrap.dedent(code)
    environ = clean_environ()
    environ.pop("OMP_NUM_THREADS")
    proc = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True,
                          text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    launcher, backend, total, threads, initialized = proc.stdout.split()
    assert (launcher, backend, total, initialized) == ("single", "gloo", "1", "False")
    assert int(threads) == (os.cpu_count() or 1)


# --------------------------------------------------------------------------- every lesson


def lesson_scripts_that_join_a_group():
    for path in sorted((ROOT / "lessons").glob("*/*.py")):
        text = path.read_text()
        if "init_process_group(" in text:
            yield path.relative_to(ROOT), text


@pytest.mark.parametrize("path,text", list(lesson_scripts_that_join_a_group()),
                         ids=lambda v: str(v) if isinstance(v, Path) else "")  # fmt: skip
def test_every_lesson_script_shows_its_own_set_up(path, text):
    """A lesson script calls torch.distributed itself, with a timeout, with device_id on GPUs
    (benchmark.py measures this machine's CPU and joins gloo only), and leaves the group."""
    assert "common.dist" not in text and "init_distributed" not in text, path
    assert "timeout=" in text and "destroy_process_group()" in text, path
    if "nccl" in text:
        assert "torch.cuda.set_device(device)" in text, path
        assert "device_id=device if device.type == \"cuda\" else None" in text, path
