"""The set-up's helpers on their own: the threads each process takes (common.launch.cpu_threads,
from the CPUs SLURM bound and OMP_NUM_THREADS), and what the set-up does where SLURM gave GPUs
that torch cannot use (check_cuda_usable), run as tests/test_setup.py's SETUP runs.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from test_setup import SETUP  # noqa: E402

from common import launch  # noqa: E402
from common.env import LaunchEnv, LaunchError  # noqa: E402
from tests.helpers import clean_environ  # noqa: E402

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
    assert launch.cpu_threads(launch_env(launcher, procs), environ, (cpus, whole)) == threads


@pytest.mark.parametrize("bad", ["0", "four", "-1"])
def test_bad_omp_num_threads_names_the_variable(bad):
    with pytest.raises(LaunchError, match="OMP_NUM_THREADS"):
        launch.cpu_threads(launch_env("slurm", 1), {"OMP_NUM_THREADS": bad}, (4, True))


def test_usable_cpus_without_linux_affinity(monkeypatch):
    """macOS has no os.sched_getaffinity: every CPU is usable."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    assert launch.usable_cpus() == (os.cpu_count(), True)


def test_usable_cpus_sees_a_narrowed_affinity():
    code = """
        import os
        from common.launch import usable_cpus
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
    launch.check_cuda_usable({"SLURM_GPUS_ON_NODE": "2"}, str(tmp_path / "nvidia[0-9]*"))


def test_no_gpus_given_says_nothing(tmp_path):
    (tmp_path / "nvidia0").touch()
    launch.check_cuda_usable({}, str(tmp_path / "nvidia[0-9]*"))


def test_gpus_given_and_present_but_unusable_stops(tmp_path):
    """A node with NVIDIA devices, GPUs from SLURM, and a torch that sees no CUDA (no driver
    here): stop instead of training on the CPU, and say why for the torch installed: the CUDA
    wheel (requirements.txt) names the driver, a CPU-only build says so."""
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidia1").touch()
    with pytest.raises(LaunchError) as info:
        launch.check_cuda_usable({"SLURM_GPUS_ON_NODE": "2"}, str(tmp_path / "nvidia[0-9]*"))
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


@pytest.mark.timeout(120)
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


@pytest.mark.timeout(120)
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
