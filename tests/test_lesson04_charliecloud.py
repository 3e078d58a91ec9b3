"""Lesson 04 in a real container: run_charliecloud.sh on the local cluster with Charliecloud.

Charliecloud (`ch-run`) is a Debian package and runs here, so this job is not a stand-in: the
image built by `make container` (charliecloud_image.sh, part of `make setup`) brings Python and
torch, and the host side of the job has only Debian's python3, without torch. Checked: the host
had no torch, every node imported torch from the image (the path it printed exists in the image
directory and not on the host), 2 nodes x 2 workers = 4 ranks, the loss went down, `done:`.
Also: without the image the job stops in one line naming the command that builds it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from test_lesson04 import check_training, without_exit_barrier_race

ROOT = Path(__file__).resolve().parent.parent
LESSON = "lessons/04_torchrun_enroot"
IMAGE = Path(os.environ.get("COURSE_CHARLIECLOUD_IMAGE")
             or "/var/cache/course-charliecloud/bookworm-torch-2.14.1")  # env.sh's default
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's: no torch
JOB_TIMEOUT = 120
# The torch the image holds, as charliecloud_image.sh pins it (PyPI's wheel reports +cu130).
TORCH_IN_IMAGE = re.search(r"^TORCH_VERSION=(\S+)$", (ROOT / LESSON / "charliecloud_image.sh")
                           .read_text(), re.MULTILINE)[1]
IMAGE_LINE = re.compile(r"^\d+: (node\d+): image: (\S+), torch (\S+): (\S+)$", re.MULTILINE)


@pytest.fixture
def home_tmp():
    """A folder under /home: shared by the nodes (a job's /tmp is not, cluster/README.md), and
    ch-run can bind it, as the image keeps an empty /home for that (charliecloud_image.sh)."""
    path = Path(tempfile.mkdtemp(prefix="course-charliecloud-", dir="/home"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def course_without_torch(tmp_path):
    """A copy of the course without .venv (its common/ and this lesson: the job is submitted
    from it, as the README types it), a bin folder with Debian's python3 first on PATH, and the
    environment."""
    assert os.system(f"{SYSTEM_PYTHON} -c 'import torch' 2>/dev/null") != 0, (
        f"{SYSTEM_PYTHON} imports torch: this test needs a python3 without it")
    course = tmp_path / "course"
    skip = shutil.ignore_patterns("__pycache__", "*.ipynb", "slurm-*.out")
    shutil.copytree(ROOT / "common", course / "common", ignore=skip)
    shutil.copytree(ROOT / LESSON, course / LESSON, ignore=skip)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(SYSTEM_PYTHON)
    env = {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "TORCHRUN_LOG_ROOT": str(tmp_path / "logs"),
    }
    for name in list(os.environ):
        if name.startswith(("COURSE_", "ENROOT_", "TORCHRUN_", "VIRTUAL_ENV")) and name not in env:
            env[name] = ""  # the suite's own settings must not leak into the job
    env["COURSE_CHARLIECLOUD_IMAGE"] = str(IMAGE)
    return course, env


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_torchrun_in_charliecloud_with_torch_only_in_the_image(sbatch_wait, cluster, home_tmp):
    tmp_path = home_tmp
    if not (IMAGE / "usr/bin/python3").exists():
        pytest.fail(f"no Charliecloud image at {IMAGE}: build it with `make container` "
                    "(part of `make setup`)", pytrace=False)
    course, env = course_without_torch(tmp_path)
    job = sbatch_wait(f"{LESSON}/run_charliecloud.sh", env=env, timeout=JOB_TIMEOUT, cwd=course)
    out = job.output
    assert job.returncode == 0, out + job.stderr
    assert f"using {tmp_path}/bin/python3" in out, out  # job_env.sh: no venv, python3 on PATH
    for node in cluster["nodes"]:
        assert f": {node}: host: {tmp_path}/bin/python3, torch: none" in out, out
        assert f": {node}: ch-run environment (" in out, out
    images = {m[1]: m.groups()[1:] for m in IMAGE_LINE.finditer(out)}
    assert sorted(images) == cluster["nodes"], out
    for python, version, torch_file in images.values():
        assert python == "/usr/bin/python3" and version.split("+")[0] == TORCH_IN_IMAGE, out
        # a path inside the image: there in the image directory, not on the host
        assert (IMAGE / torch_file.lstrip("/")).is_file(), torch_file
        assert not Path(torch_file).exists(), torch_file
    check_training(out, nodes=2, per_node=2, hosts=cluster["nodes"])
    assert re.search(r"done: world_size 4 = 2 nodes x 2", out), out
    assert "Traceback" not in without_exit_barrier_race(out), out


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_without_the_image_the_job_says_how_to_build_it(sbatch_wait, tmp_path):
    course, env = course_without_torch(tmp_path)
    env["COURSE_ROOT"] = str(course)  # (submitted from the course root, the copy's job)
    env["COURSE_CHARLIECLOUD_IMAGE"] = str(tmp_path / "no-image")
    job = sbatch_wait(f"{LESSON}/run_charliecloud.sh", env=env, timeout=JOB_TIMEOUT)
    assert job.returncode == 2, job.output
    errors = [line for line in job.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "make container" in errors[0], job.output
    assert "charliecloud_image.sh" in errors[0] and str(tmp_path / "no-image") in errors[0]
    assert "srun" not in job.output and "Traceback" not in job.output, job.output


def test_sample_output_has_the_shape_of_a_run():
    """The capture kept in the lesson folder (charliecloud-<jobid>.out, quoted in the README)."""
    (sample,) = sorted((ROOT / LESSON).glob("charliecloud-*.out"))
    out = sample.read_text()
    assert re.search(r"^job \d+: form static, 2 nodes x 2 processes = world size 4", out,
                     re.MULTILINE), out  # fmt: skip
    images = {m[1]: m.groups()[1:] for m in IMAGE_LINE.finditer(out)}
    assert sorted(images) == ["node1", "node2"], out
    assert all(v[0] == "/usr/bin/python3" and v[1].split("+")[0] == TORCH_IN_IMAGE
               for v in images.values()), out
    assert len(re.findall(r"^\d+: node\d: host: \S+, torch: none$", out, re.MULTILINE)) == 2, out
    check_training(out, nodes=2, per_node=2, hosts=["node1", "node2"])


@pytest.mark.timeout(240)
def test_gpus_without_the_drivers_libraries_name_ch_fromhost(home_tmp):
    """On a GPU node the image has the CUDA runtime from the wheels but not the driver's
    libcuda.so, which belongs to the node, and ch-run injects nothing (`ch-fromhost --nvidia` is
    the step, README.md): torch in the image sees no GPU, and common/ says so in one line that
    names the step.  Run in the real image, where SLURM gave the node a GPU and an NVIDIA device
    file exists (a file here: the check reads the names, /dev/nvidia* on a GPU node)."""
    if not (IMAGE / "usr/bin/python3").exists():
        pytest.fail(f"no Charliecloud image at {IMAGE}: build it with `make container` "
                    "(part of `make setup`)", pytrace=False)
    libs = {p.name for p in IMAGE.glob("usr/local/lib/python3*/dist-packages/nvidia/**/lib*.so*")}
    assert any(n.startswith("libcudart.so") for n in libs), sorted(libs)  # the runtime: there
    assert not any(n.startswith("libcuda.so") for n in libs), sorted(libs)  # the driver's: not
    course = home_tmp / "course"
    shutil.copytree(ROOT / "common", course / "common",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    (home_tmp / "nvidia0").touch()
    code = ("import sys, torch\nfrom common.env import LaunchError\n"
            "from common.launch import check_cuda_usable\n"
            "try:\n    check_cuda_usable({'SLURM_GPUS_ON_NODE': '1'}, sys.argv[1])\n"
            "except LaunchError as exc:\n    sys.exit(f'error: {exc}')\n")  # fmt: skip
    proc = subprocess.run(
        ["ch-run", "-b", "/home:/home", "-c", str(course), str(IMAGE), "--",
         "python3", "-c", code, f"{home_tmp}/nvidia[0-9]*"],
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "USER": "root", "PYTHONPATH": str(course)},
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"but torch {TORCH_IN_IMAGE}+cu" in lines[0], proc.stderr
    assert "Charliecloud image needs the driver's libraries" in lines[0], lines[0]
    assert "ch-fromhost --nvidia <image>" in lines[0], lines[0]
