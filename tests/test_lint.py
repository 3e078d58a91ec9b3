"""ruff on every Python file and shellcheck on every shell script of the course."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUFF = Path(sys.executable).parent / "ruff"


def shell_scripts():
    """Tracked and untracked (but not ignored) *.sh files, so new scripts are checked too."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", "*.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    paths = {p for p in listed.split("\0") if p and not p.startswith(".venv/")}
    return sorted(p for p in paths if (ROOT / p).is_file())


@pytest.mark.timeout(120)
def test_ruff():
    proc = subprocess.run(
        [str(RUFF), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True,
        timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(120)
def test_shellcheck():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not installed (apt-get install shellcheck)"
    scripts = shell_scripts()
    assert scripts, "no *.sh files found"
    # -x follows `source` lines; `# shellcheck source=common/job_env.sh` is relative to the root.
    proc = subprocess.run(
        [shellcheck, "-x", *scripts], cwd=ROOT, capture_output=True, text=True, timeout=110
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
