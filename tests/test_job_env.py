"""common/job_env.sh and the first lines of every job script: finding the course, the site
file, the Python environment. Real bash runs of the real scripts; one real job on the cluster.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOB_ENV = ROOT / "common" / "job_env.sh"
VENV_BIN = Path(sys.executable).parent


def job_scripts():
    """Every lesson script that sources common/job_env.sh."""
    return sorted(
        p.relative_to(ROOT).as_posix()
        for p in ROOT.glob("lessons/*/*.sh")
        if "common/job_env.sh" in p.read_text(errors="replace")
    )


def bash(script: str, env: dict, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


def base_env(**extra) -> dict:
    drop = ("SLURM_", "COURSE_", "VIRTUAL_ENV", "CONDA_", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


@pytest.mark.parametrize("script", job_scripts())
def test_submitting_from_outside_the_course_is_one_clear_line(script, tmp_path):
    """sbatch from another directory: SLURM_SUBMIT_DIR has no course in it."""
    env = base_env(SLURM_SUBMIT_DIR=str(tmp_path))
    proc = subprocess.run(["bash", str(ROOT / script)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "COURSE_ROOT" in lines[0] and "course root" in lines[0], lines[0]
    assert "No such file" not in proc.stderr


def fake_course(tmp_path) -> Path:
    """A course directory without .venv (common/ linked from this checkout)."""
    course = tmp_path / "course"
    course.mkdir()
    (course / "common").symlink_to(ROOT / "common")
    return course


def test_site_file_settings_are_exported(tmp_path):
    """A plain NAME=value in site.sh must reach the processes the job starts."""
    site = tmp_path / "site.sh"
    site.write_text("NCCL_SOCKET_IFNAME=ib0\nCOURSE_SITE_PROBE='from site'\n")
    proc = bash(f'source "{JOB_ENV}"; bash -c \'echo "$NCCL_SOCKET_IFNAME|$COURSE_SITE_PROBE"\'',
                base_env(COURSE_ROOT=str(ROOT), COURSE_SITE_FILE=str(site)))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "ib0|from site"


def test_python_on_path_is_used_when_there_is_no_venv(tmp_path):
    """`module load pytorch` puts a python with torch on PATH: accepted, and said once."""
    course = fake_course(tmp_path)
    env = base_env(COURSE_ROOT=str(course), PATH=f"{VENV_BIN}:{os.environ['PATH']}")
    proc = bash(f'source "{JOB_ENV}"; command -v python3; python3 -c "import torch"', env)
    assert proc.returncode == 0, proc.stderr
    said, found = proc.stdout.strip().splitlines()
    assert said.startswith("using ") and "no .venv" in said and found.startswith(str(VENV_BIN))


def test_a_conda_environment_is_accepted(tmp_path):
    conda = tmp_path / "conda-env"
    (conda / "conda-meta").mkdir(parents=True)
    (conda / "bin").mkdir()
    (conda / "bin" / "python3").symlink_to(sys.executable)
    env = base_env(COURSE_ROOT=str(ROOT), COURSE_VENV=str(conda))
    proc = bash(f'source "{JOB_ENV}"; command -v python3; echo "$CONDA_PREFIX"', env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(conda / "bin" / "python3"), str(conda)]


def test_a_python_older_than_3_10_is_one_line(tmp_path):
    """RHEL 8's own python3 is 3.6: the host side of a container job (COURSE_TORCH_IN_CONTAINER)
    would otherwise fail inside common/ in the middle of the job. Stand-in: a python3 that says
    3.6.8 and fails what 3.6 fails, the version check."""
    old = tmp_path / "conda-env"
    (old / "conda-meta").mkdir(parents=True)
    (old / "bin").mkdir()
    python3 = old / "bin" / "python3"
    python3.write_text('#!/bin/sh\n[ "$1" = -V ] && { echo "Python 3.6.8"; exit 0; }\nexit 1\n')
    python3.chmod(0o755)
    env = base_env(COURSE_ROOT=str(ROOT), COURSE_VENV=str(old), COURSE_TORCH_IN_CONTAINER="1")
    proc = bash(f'source "{JOB_ENV}"; echo reached', env)
    assert proc.returncode == 2 and "reached" not in proc.stdout, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {python3} is Python 3.6.8, and "
                                                  "common/ needs Python 3.10 or newer"), lines


@pytest.mark.parametrize(
    "setting,needle",
    [
        ({"COURSE_VENV": "/nonexistent/venv"}, "COURSE_VENV='/nonexistent/venv' is neither"),
        ({"PATH": "/usr/bin:/bin"}, "no Python environment with torch"),
    ],
    ids=["bad-COURSE_VENV", "no-torch-anywhere"],
)
def test_no_usable_python_is_one_line(tmp_path, setting, needle):
    env = base_env(COURSE_ROOT=str(fake_course(tmp_path)), **setting)
    proc = bash(f'source "{JOB_ENV}"; echo reached', env)
    assert proc.returncode == 2 and "reached" not in proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1 and needle in proc.stderr, proc.stderr


def test_local_cluster_gets_the_short_timeout():
    script = f'source "{JOB_ENV}"; echo "${{COURSE_DIST_TIMEOUT-unset}}"'
    on_course = bash(script, base_env(COURSE_ROOT=str(ROOT), SLURM_CLUSTER_NAME="course"))
    elsewhere = bash(script, base_env(COURSE_ROOT=str(ROOT), SLURM_CLUSTER_NAME="bigiron"))
    assert on_course.stdout.split()[-1] == "60" and elsewhere.stdout.split()[-1] == "unset"


JOB = """#!/bin/bash
#SBATCH --job-name=site-probe
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --time=00:02:00
set -euo pipefail
source "$COURSE_ROOT/common/job_env.sh"
srun --label bash -c 'echo "$(hostname) $COURSE_SITE_PROBE"'
"""


@pytest.mark.timeout(400)
def test_site_file_reaches_every_srun_task(sbatch_wait, tmp_path):
    site = tmp_path / "site.sh"
    site.write_text("COURSE_SITE_PROBE=reached\n")
    script = tmp_path / "probe.sh"
    script.write_text(JOB)
    job = sbatch_wait(script, env={"COURSE_ROOT": str(ROOT), "COURSE_SITE_FILE": str(site)},
                      timeout=300)  # fmt: skip
    assert job.returncode == 0, job.output + job.stderr
    said = sorted(re.findall(r"^\d+: (\S+) reached$", job.output, re.MULTILINE))
    assert said == ["node1", "node2"], job.output
