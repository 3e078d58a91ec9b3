"""common/job_env.sh: a site file written for an interactive shell, and a host without torch.

Real bash, sourcing the real file under the job scripts' `set -euo pipefail`.
"""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOB_ENV = ROOT / "common" / "job_env.sh"
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's: no torch


def bash(script: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"set -euo pipefail\n{script}"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def base_env(**extra) -> dict:
    drop = ("SLURM_", "COURSE_", "VIRTUAL_ENV", "CONDA_", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


def test_a_failing_site_file_is_reported_in_one_line_and_the_job_goes_on(tmp_path):
    """conda's activate.d scripts read unset variables and `module load` may fail: neither
    may end the job inside job_env.sh; the failure is named, the rest of the file runs, and
    the job script's own `set -euo pipefail` is back afterwards."""
    site = tmp_path / "site.sh"
    site.write_text('x=$PROJ_LIB_UNSET; false\nAFTER="still ran"\n')
    proc = bash(f'source "{JOB_ENV}"\necho "after=$AFTER opts=$-"\n'
                "shopt -qo pipefail && echo pipefail\n"
                'echo "$COURSE_SITE_VARS"\nfalse\necho not-reached',
                base_env(COURSE_ROOT=str(ROOT), COURSE_SITE_FILE=str(site)))  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line]
    assert len(warnings) == 1, proc.stderr
    assert f"site file {site}: line 1: false (exit 1)" in warnings[0], warnings[0]
    assert "unbound variable" not in proc.stderr
    out = proc.stdout.splitlines()
    assert out[0].startswith("after=still ran opts=") and {"e", "u"} <= set(out[0].split("=")[-1])
    assert out[1] == "pipefail" and set(out[2].split()) == {"x", "AFTER"}, out
    assert "not-reached" not in proc.stdout


def test_a_clean_site_file_prints_nothing(tmp_path):
    site = tmp_path / "site.sh"
    site.write_text("NCCL_SOCKET_IFNAME=ib0\n")
    proc = bash(f'source "{JOB_ENV}"; echo "$COURSE_SITE_VARS"',
                base_env(COURSE_ROOT=str(ROOT), COURSE_SITE_FILE=str(site)))  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.split() == ["NCCL_SOCKET_IFNAME"]


@pytest.fixture
def torchless(tmp_path):
    """A course without .venv, and Debian's python3 (no torch) first on PATH."""
    assert Path(SYSTEM_PYTHON).exists(), "Debian's python3 is needed"
    assert subprocess.run([SYSTEM_PYTHON, "-c", "import torch"], capture_output=True).returncode
    course = tmp_path / "course"
    course.mkdir()
    (course / "common").symlink_to(ROOT / "common")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(SYSTEM_PYTHON)
    return base_env(COURSE_ROOT=str(course), PATH=f"{bin_dir}:/usr/bin:/bin")


def test_torch_in_the_container_only_needs_python3_on_the_host(torchless):
    proc = bash(f'source "{JOB_ENV}"\npython3 -c "from common.env import master_port_for_job; '
                'print(master_port_for_job(\'42\'))"',
                dict(torchless, COURSE_TORCH_IN_CONTAINER="1"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].startswith("using ") and proc.stdout.split()[-1].isdigit()


def test_without_the_container_a_torchless_host_is_one_line(torchless):
    proc = bash(f'source "{JOB_ENV}"; echo reached', torchless)
    assert proc.returncode == 2 and "reached" not in proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    assert "no Python environment with torch" in line and "cannot import torch" in line


def test_the_host_fallback_checks_torch_where_it_needs_it(torchless):
    proc = bash(f'source "{JOB_ENV}"; course_require_host_torch "node9: torchrun.sh on the host"'
                "; echo reached", dict(torchless, COURSE_TORCH_IN_CONTAINER="1"))  # fmt: skip
    assert proc.returncode == 2 and "reached" not in proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: node9: torchrun.sh on the host needs torch on the host")
