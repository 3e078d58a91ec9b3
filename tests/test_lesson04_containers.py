"""Lesson 04's container branches on the local cluster, with stand-in runtimes on PATH.

The local cluster has no enroot and no Apptainer (no Debian package); a stand-in `enroot` or
`apptainer` on PATH records its arguments and environment, and does what the job relies on
(`enroot create` leaves a directory), so the job script itself is what is tested:
- the host needs python3 only: a course without .venv and a python3 without torch on PATH goes
  on to `enroot start`; without a container runtime it stops with one line;
- what reaches the container: the fixed list, every variable site.sh set (not the host's search
  paths), and the COURSE_/NCCL_/TORCH_/GLOO_/FI_/UCX_ families, OMP_NUM_THREADS, MNIST_DIR;
- the container cache: reused when its marker names the image, made again (--force) when the
  image changed, refused with one line when the directory is not this lesson's;
- Apptainer: `apptainer exec --cleanenv --env-file ... --bind ... IMAGE bash torchrun.sh`.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "lessons" / "04_torchrun_enroot"
JOB_TIMEOUT = 120
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's: no torch

# A stand-in runtime: one file per call (node, subcommand) with argv and environment.
FAKE = """#!/bin/bash
rec={record}/$SLURMD_NODENAME.$(basename "$0").$1.$$
{{ printf '%s\\n' "$@"; echo ==env; env; }} > "$rec"
if [[ $(basename "$0") == enroot && $1 == create ]]; then
    name=${{@: -2:1}}
    mkdir -p "$ENROOT_DATA_PATH/$name"
fi
exit 0
"""

SITE = """\
NCCL_SOCKET_IFNAME=hsn0
FI_PROVIDER=cxi
MY_SITE_SETTING='from site.sh'
PATH=/opt/site/bin:$PATH
LD_LIBRARY_PATH=/opt/site/lib
"""


def system_python_without_torch():
    if not Path(SYSTEM_PYTHON).exists():
        pytest.fail(f"{SYSTEM_PYTHON} is missing (Debian's python3 package)")
    assert os.system(f"{SYSTEM_PYTHON} -c 'import torch' 2>/dev/null") != 0, (
        f"{SYSTEM_PYTHON} imports torch: this test needs a python3 without it")


def setup(tmp_path, runtime: str | None):
    """A course without .venv (common/ and lessons/ linked from this checkout), a bin folder
    with the stand-in runtime and Debian's python3 first on PATH, a site file, and the
    environment to submit with."""
    system_python_without_torch()
    course = tmp_path / "course"
    course.mkdir()
    for part in ("common", "lessons"):
        (course / part).symlink_to(ROOT / part)
    record = tmp_path / "record"
    record.mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(SYSTEM_PYTHON)
    if runtime:
        (bin_dir / runtime).write_text(FAKE.format(record=record))
        (bin_dir / runtime).chmod(0o755)
    site = tmp_path / "site.sh"
    site.write_text(SITE)
    data = tmp_path / "enroot-data"
    env = {
        "COURSE_ROOT": str(course),
        "COURSE_SITE_FILE": str(site),
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "TORCHRUN_LOG_ROOT": str(tmp_path / "logs"),
        "ENROOT_DATA_PATH": str(data),
        "COURSE_CONTAINER_NAME": "l04-ct",
        "COURSE_CONTAINER_IMAGE": str(tmp_path / "torch.sqsh"),
        "COURSE_APPTAINER_IMAGE": str(tmp_path / "torch.sif"),
        "COURSE_CHECKPOINT_EVERY": "77",  # any COURSE_* variable
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "GLOO_SOCKET_IFNAME": "eth0",
        "UCX_TLS": "rc,sm",
        "OMP_NUM_THREADS": "3",
        "MNIST_DIR": "/data/mnist",
    }
    for name in list(os.environ):
        if name.startswith(("COURSE_", "ENROOT_", "TORCHRUN_", "VIRTUAL_ENV")) and name not in env:
            env[name] = ""  # the suite's own settings must not leak into the job
    return course, record, data, env


def calls(record: Path, node: str, prog: str, sub: str):
    """[(argv, env)] of the stand-in's calls on NODE with subcommand SUB."""
    found = []
    for path in sorted(record.glob(f"{node}.{prog}.{sub}.*")):
        argv_text, env_text = path.read_text().split("==env\n", 1)
        env = dict(line.split("=", 1) for line in env_text.splitlines() if "=" in line)
        found.append((argv_text.splitlines(), env))
    return found


PASSED = ["NCCL_SOCKET_IFNAME", "FI_PROVIDER", "MY_SITE_SETTING", "COURSE_CHECKPOINT_EVERY",
          "COURSE_DIST_TIMEOUT", "TORCH_DISTRIBUTED_DEBUG", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
          "GLOO_SOCKET_IFNAME", "UCX_TLS", "OMP_NUM_THREADS", "MNIST_DIR", "MASTER_ADDR",
          "NODE_RANK", "SLURM_NODEID"]  # fmt: skip
HOST_ONLY = ["PATH", "LD_LIBRARY_PATH"]


@pytest.mark.timeout(3 * JOB_TIMEOUT + 60)
def test_enroot_without_torch_on_the_host_passes_the_environment(sbatch_wait, cluster, tmp_path):
    course, record, data, env = setup(tmp_path, "enroot")
    image = tmp_path / "torch.sqsh"
    image.write_text("image 1")
    job = sbatch_wait("lessons/04_torchrun_enroot/run_script.sh", env=env, timeout=JOB_TIMEOUT)
    assert job.returncode == 0, job.output + job.stderr
    assert f"using {tmp_path}/bin/python3" in job.output, job.output
    marker = data / ".l04-ct.image"
    st = image.stat()
    assert marker.read_text() == f"{image} {st.st_size} {int(st.st_mtime)}\n"
    # ENROOT_DATA_PATH is shared here: the node that takes the lock first creates, the other
    # finds it created.
    creates = [argv for node in cluster["nodes"] for argv, _ in calls(record, node, "enroot",
               "create")]  # fmt: skip
    assert creates == [["create", "--name", "l04-ct", str(image)]], creates
    assert job.output.count("container l04-ct already created") == 1, job.output
    for node in cluster["nodes"]:
        (argv, host_env), = calls(record, node, "enroot", "start")
        names = [argv[i + 1] for i, a in enumerate(argv) if a == "--env"]
        for name in PASSED:
            assert name in names, (name, argv)
            assert name in host_env, name  # --env NAME takes the host's value
        assert host_env["MY_SITE_SETTING"] == "from site.sh"
        assert not set(HOST_ONLY) & set(names), names
        assert f"PYTHONPATH={course}" in names and argv[-2:] == [
            str(course / "lessons/04_torchrun_enroot/torchrun.sh"), "static"], argv

    # The image was imported again (another size and time): the container is made again.
    image.write_text("image 2, another size")
    os.utime(image, (st.st_mtime + 5, st.st_mtime + 5))
    job = sbatch_wait("lessons/04_torchrun_enroot/run_script.sh", env=env, timeout=JOB_TIMEOUT)
    assert job.returncode == 0, job.output + job.stderr
    assert "creating it again" in job.output, job.output
    forced = [argv for node in cluster["nodes"] for argv, _ in calls(record, node, "enroot",
              "create") if "--force" in argv]  # fmt: skip
    assert len(forced) == 1, forced  # the first node under the lock; the second reuses it
    assert "already created" in job.output, job.output

    # A directory of that name that this lesson did not create: one line, nothing removed.
    marker.unlink()
    shutil.rmtree(record)
    record.mkdir()
    job = sbatch_wait("lessons/04_torchrun_enroot/run_script.sh", env=env, timeout=JOB_TIMEOUT)
    assert job.returncode != 0, job.output
    said = [line for line in job.output.splitlines() if "this lesson did not create it" in line]
    assert said and "enroot remove l04-ct" in said[0], job.output
    assert not list(record.glob("*.create.*")) and (data / "l04-ct").is_dir()


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_without_a_runtime_and_without_torch_the_host_fallback_says_so(sbatch_wait, tmp_path):
    _, _, _, env = setup(tmp_path, None)
    job = sbatch_wait("lessons/04_torchrun_enroot/run_script.sh", env=env, timeout=JOB_TIMEOUT)
    assert job.returncode != 0, job.output
    said = [line for line in job.output.splitlines() if "needs torch on the host" in line]
    assert said and "cannot import torch" in said[0], job.output
    assert "Traceback" not in job.output, job.output


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_apptainer_command_line_and_environment(sbatch_wait, cluster, tmp_path):
    course, record, _, env = setup(tmp_path, "apptainer")
    job = sbatch_wait("lessons/04_torchrun_enroot/run_apptainer.sh", env=env, timeout=JOB_TIMEOUT)
    assert job.returncode == 0, job.output + job.stderr
    for i, node in enumerate(cluster["nodes"]):
        (argv, _), = calls(record, node, "apptainer", "exec")
        env_file = Path(argv[argv.index("--env-file") + 1])
        assert argv[:3] == ["exec", "--cleanenv", "--env-file"], argv
        assert "--nv" not in argv  # no NVIDIA device on these nodes
        assert argv[argv.index("--bind") + 1] == f"{course}:{course}", argv
        assert argv[-4:] == [str(tmp_path / "torch.sif"), "bash",
                             str(course / "lessons/04_torchrun_enroot/torchrun.sh"), "static"]
        # The file as a shell reads it (Apptainer parses it as shell assignments).
        values = {}
        for line in env_file.read_text().splitlines():
            name, _, quoted = line.partition("=")
            (values[name],) = shlex.split(quoted)
        assert values["MY_SITE_SETTING"] == "from site.sh" and values["NODE_RANK"] == str(i)
        assert values["PYTHONPATH"] == str(course) and values["UCX_TLS"] == "rc,sm"
        assert set(PASSED) <= set(values) and not set(HOST_ONLY) & set(values), values
