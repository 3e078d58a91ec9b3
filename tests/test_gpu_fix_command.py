"""The command both GPU refusals print installs the build they name into the existing venv.

After `make venv` the venv holds PyPI's torch 2.14.1 (or a 2.14.1+cpu build): a plain
`pip install torch==2.14.1 --index-url .../cu126` is satisfied by it and changes nothing, so the
job fails again with the same line. The refusals pin the label (`torch==2.14.1+cu126`). Played
with a real pip in a throwaway venv against a local folder of small wheels, one version with and
without the label, standing for torch and torchvision (PyPI's and PyTorch's index); the command's
requirements and options are taken from what common/env.py prints, only the index is swapped
for the folder and each package for its stand-in.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import launch as cenv  # noqa: E402
from common.env import LaunchError  # noqa: E402

CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # PyPI's 2.14.1 wheel
STAND_IN = {"torch": "faketorch", "torchvision": "faketorchvision"}
COMMAND = re.compile(r"(?:(\S+) -m )?pip install (.+?) --index-url (https://\S+?)(?=[ ,;)]|$)")


def arch_refusal(monkeypatch, tmp_path) -> str:
    """A V100 under PyPI's cu130 wheel (torch's inputs, as tests/test_gpu_arch.py gives them)."""
    line = cenv.cuda_arch_error("Tesla V100-SXM2-32GB", (7, 0), CU130,
                                torch_version="2.14.1+cu130", cuda="13.0",
                                torchvision="0.29.1+cu130")  # fmt: skip
    assert line, "no refusal for a V100 under the cu130 wheel"
    return line


def cpu_build_refusal(monkeypatch, tmp_path) -> str:
    """check_cuda_usable on a node with an NVIDIA device, under torch 2.14.1+cpu."""
    (tmp_path / "nvidia0").touch()
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch, "__version__", "2.14.1+cpu")
    with pytest.raises(LaunchError) as info:
        cenv.check_cuda_usable({"SLURM_GPUS_ON_NODE": "1"}, str(tmp_path / "nvidia[0-9]*"))
    return str(info.value)


# (the refusal, the label of the build the venv holds: "" for PyPI's)
REFUSALS = [pytest.param(arch_refusal, "", id="gpu-architecture"),
            pytest.param(cpu_build_refusal, "cpu", id="cpu-only-build")]  # fmt: skip


def wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A one-module wheel NAME-VERSION whose module says its version (BUILD)."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"BUILD = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                            + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }  # fmt: skip
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    target = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(target, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return target


class Venv:
    """A throwaway venv, with this machine's pip run for it (pip --python), none of pip's
    configuration (this machine's constraint file caps torch) and no index but a folder."""

    def __init__(self, folder: Path):
        self.python = folder / "bin" / "python"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True,
                       timeout=60)  # fmt: skip
        self.environ = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        self.environ.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1",
                            PIP_NO_INPUT="1")  # fmt: skip

    def pip(self, *args: str) -> str:
        pip = [sys.executable, "-m", "pip", "--python", str(self.python)]
        proc = subprocess.run([*pip, *args], env=self.environ, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    def build(self, name: str) -> str:
        proc = subprocess.run([str(self.python), "-c", f"import {name}; print({name}.BUILD)"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()


def the_command(line: str) -> tuple[str | None, list[str], str]:
    """(python, the arguments after `pip install` up to the index, the index) of LINE."""
    found = COMMAND.search(line)
    assert found, f"no 'pip install ... --index-url ...' in: {line}"
    return found[1], found[2].split(), found[3]


@pytest.mark.parametrize("refusal, installed_label", REFUSALS)
def test_the_printed_command_installs_the_labelled_build(refusal, installed_label, tmp_path,
                                                         monkeypatch):  # fmt: skip
    line = refusal(monkeypatch, tmp_path)
    assert "\n" not in line, line
    python, args, index = the_command(line)
    assert not {"--force-reinstall", "-U", "--upgrade"} & set(args), args  # gigabytes again
    pins = {}  # package -> (version, label) as the command pins it
    for arg in args:
        if not arg.startswith("-"):
            name, _, version = arg.partition("==")
            assert name in STAND_IN, f"{arg}: not a package the refusal should name ({line})"
            pins[name] = version.partition("+")[::2]
    assert "torch" in pins, line
    label = index.rstrip("/").rsplit("/", 1)[-1]  # .../whl/cu126: the build the index holds
    assert re.fullmatch(r"cu\d+", label), index

    # PyPI's folder (the venv's build) and the index's (the same versions, labelled).
    pypi, pytorch = tmp_path / "pypi", tmp_path / "pytorch"
    pypi.mkdir()
    pytorch.mkdir()
    base = {name: version for name, (version, _) in pins.items()}
    requires = {"torchvision": (f"{STAND_IN['torch']}=={base['torch']}",)}
    for name, version in base.items():
        installed = f"{version}+{installed_label}" if installed_label else version
        wheel(pypi, STAND_IN[name], installed, requires.get(name, ()))
        wheel(pytorch, STAND_IN[name], version, requires.get(name, ()))
        wheel(pytorch, STAND_IN[name], f"{version}+{label}", requires.get(name, ()))

    venv = Venv(tmp_path / "venv")
    venv.pip("install", "--no-index", "--find-links", str(pypi),
             *(f"{STAND_IN[n]}=={v}" for n, v in base.items()))  # fmt: skip
    before = {n: venv.build(STAND_IN[n]) for n in base}

    # What the refusal used to print, the versions without their label: pip keeps the build.
    plain = venv.pip("install", "--no-index", "--find-links", str(pytorch),
                     *(f"{STAND_IN[n]}=={v}" for n, v in base.items()))  # fmt: skip
    assert f"Requirement already satisfied: {STAND_IN['torch']}=={base['torch']}" in plain, plain
    assert {n: venv.build(STAND_IN[n]) for n in base} == before

    # The command as printed, with the folder for the index and the stand-ins for the packages.
    swapped = [re.sub(r"^(torch|torchvision)(?===)", lambda m: STAND_IN[m[1]], a) for a in args]
    venv.pip("install", *swapped, "--no-index", "--find-links", str(pytorch))
    after = {n: venv.build(STAND_IN[n]) for n in base}
    assert after == {n: f"{base[n]}+{label}" for n in base}, (line, after)


@pytest.mark.parametrize("refusal, installed_label", REFUSALS)
def test_the_command_is_for_the_jobs_own_python(refusal, installed_label, tmp_path, monkeypatch):
    """The Python that ran the job names the venv to install into (a `pip` on PATH may be
    another one); and the refusal stays one line naming the build."""
    python, args, index = the_command(refusal(monkeypatch, tmp_path))
    assert python == sys.executable, python
    assert index.startswith("https://download.pytorch.org/whl/cu"), index


def test_the_cpu_build_line_names_the_other_build_of_the_host():
    """x86_64 and aarch64 (GH200, GB200) have the same two builds with other architectures."""
    for machine, spans in [("x86_64", ("sm_75 to sm_120", "sm_50 to sm_90")),
                           ("aarch64", ("sm_80 to sm_120", "sm_80 to sm_90"))]:  # fmt: skip
        fix = cenv.cpu_build_fix("2.14.1+cpu", "0.29.1+cpu", machine, python="python")
        assert fix.startswith("python -m pip install torch==2.14.1+cu130 torchvision=="
                              "0.29.1+cu130 --index-url https://download.pytorch.org/whl/cu130 "
                              f"(driver 580 or newer, {spans[0]}; "), fix  # fmt: skip
        assert f"with cu126, driver 525, {spans[1]}:" in fix, fix
    # another release: no table here, the form of the command instead
    assert "torch==2.13.0+cu<version>" in cenv.cpu_build_fix("2.13.0+cpu", None, "x86_64")
