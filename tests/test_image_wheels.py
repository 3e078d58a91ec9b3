"""Lesson 04's image wheels (image_wheels.sh): the host's pip, however it is set up, gathers the
wheels the Charliecloud image installs offline.

One table row per shape of pip set-up a host can have; each row runs the real script with a real
pip configuration (a config file named by PIP_CONFIG_FILE, or PIP_* variables), then installs
what it gathered the way the image does (--isolated --no-index --find-links) and imports it.
The rows that must not touch the network read from a wheel folder and indexes the test makes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "lessons/04_torchrun_enroot/image_wheels.sh"
PACKAGES = ["numpy", "python-hostlist==2.3.0"]
IMAGE_PYTHON = "3.11"  # charliecloud_image.sh's IMAGE_PYTHON (Debian 12)


def clean_env(**extra):
    """This process's environment without any PIP_* variable, no config file, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # pip reads no config file at all
    env.update(extra)
    return env


def gather(dest, env, packages=PACKAGES):
    return subprocess.run(["bash", str(SCRIPT), str(dest), *packages], env=env, text=True,
                          capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    """The wheels, gathered once with the machine's own pip set-up: the source for the rows
    that must not reach any index."""
    dest = tmp_path_factory.mktemp("wheelhouse")
    result = gather(dest, dict(os.environ))
    assert result.returncode == 0, result.stdout + result.stderr
    return dest


def simple_index(root: Path, wheels: list[Path]) -> str:
    """A PEP 503 index of ``wheels`` under ``root``; returns its file:// URL."""
    for wheel in wheels:
        project = wheel.name.split("-")[0].lower().replace("_", "-")
        page = root / "simple" / project
        page.mkdir(parents=True, exist_ok=True)
        shutil.copy(wheel, page / wheel.name)
        (page / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')
    return (root / "simple").as_uri()


def numpy_wheel(folder: Path) -> Path:
    (wheel,) = folder.glob("numpy-*.whl")
    return wheel


def setups(tmp: Path, house: Path) -> dict[str, dict]:
    """{shape: env} for each shape of pip set-up."""
    numpy_version = numpy_wheel(house).name.split("-")[1]
    constraints = tmp / "constraints.txt"
    constraints.write_text(f"numpy=={numpy_version}\n")
    cert = tmp / "site-ca.pem"  # a CA bundle outside /etc/ssl/certs, as some sites have
    cert.write_bytes(Path("/etc/ssl/certs/ca-certificates.crt").read_bytes())
    one = simple_index(tmp / "index-one", [numpy_wheel(house)])
    two = simple_index(tmp / "index-two", list(house.glob("python_hostlist-*.whl")))
    files_conf = tmp / "files.conf"
    files_conf.write_text(
        "[global]\n"
        f"no-index = true\nfind-links = {house}\nconstraint = {constraints}\ncert = {cert}\n")
    indexes_conf = tmp / "indexes.conf"
    indexes_conf.write_text(f"[global]\nindex-url = {one}\nextra-index-url = {two}\n"
                            f"constraint = {constraints}\n")
    return {
        "files and folders in a config file": clean_env(PIP_CONFIG_FILE=str(files_conf)),
        "several index URLs": clean_env(PIP_CONFIG_FILE=str(indexes_conf)),
        "PIP_* variables, no config file": clean_env(
            PIP_NO_INDEX="1", PIP_FIND_LINKS=str(house), PIP_CONSTRAINT=str(constraints),
            PIP_CERT=str(cert)),
    }


SHAPES = ["files and folders in a config file", "several index URLs",
          "PIP_* variables, no config file"]  # setups()'s keys, known before any test runs


@pytest.mark.parametrize("shape", SHAPES)
def test_the_host_pip_set_up_gathers_wheels_the_image_installs_offline(shape, wheelhouse,
                                                                       tmp_path):
    env = setups(tmp_path, wheelhouse)[shape]
    dest = tmp_path / "wheels"
    result = gather(dest, env)
    assert result.returncode == 0, result.stdout + result.stderr
    names = sorted(p.name for p in dest.glob("*.whl"))
    assert numpy_wheel(dest).name == numpy_wheel(wheelhouse).name, names
    assert f"-cp{IMAGE_PYTHON.replace('.', '')}-" in numpy_wheel(dest).name, names
    assert any(n.startswith("python_hostlist-2.3.0-py3-none-any") for n in names), names
    if f"{sys.version_info.major}.{sys.version_info.minor}" != IMAGE_PYTHON:
        pytest.skip(f"the wheels are for Python {IMAGE_PYTHON}; this is {sys.version}")
    # as the image's pip does: no index, no configuration, no PIP_* variable
    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--isolated", "-q", "--no-index",
         "--find-links", str(dest), "--target", str(target), *PACKAGES],
        env=clean_env(), text=True, capture_output=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    check = subprocess.run([sys.executable, "-c", "import numpy, hostlist; print(numpy.__file__)"],
                           env=clean_env(PYTHONPATH=str(target)), cwd=tmp_path, text=True,
                           capture_output=True, timeout=60)
    assert check.returncode == 0 and str(target) in check.stdout, check.stdout + check.stderr


def test_no_pip_configuration_at_all(tmp_path):
    """A host whose pip has no configuration: pip's default index (the package registry)."""
    result = gather(tmp_path / "wheels", clean_env(), packages=["python-hostlist==2.3.0"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert [p.name for p in (tmp_path / "wheels").glob("*.whl")] == [
        "python_hostlist-2.3.0-py3-none-any.whl"]


@pytest.mark.parametrize("case, env, args, says", [
    ("a version no index has", {"PIP_NO_INDEX": "1"}, ["numpy==0.0.1"], "pip download of numpy"),
    ("no requirement", {}, [], "usage: image_wheels.sh"),
    ("a wrong image Python", {"COURSE_IMAGE_PYTHON": "eleven"}, ["numpy"], "COURSE_IMAGE_PYTHON"),
])
def test_bad_input_is_one_line(case, env, args, says, tmp_path):
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "w"), *args],
                            env=clean_env(**env), text=True, capture_output=True, timeout=120)
    assert result.returncode == 2, case
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], result.stderr
    assert "Traceback" not in result.stderr
