"""A GPU the installed torch has no kernels for (a V100 or P100 under the CUDA 13 wheel) stops
each rank in one line before its process group, naming the GPU, its compute capability, the
build's architectures and the build that runs it.

The rule is torch's own (torch/cuda/__init__.py: ``_check_capability``,
``_code_compatible_with_device``, ``DEVICE_REQUIREMENT``), tried here against the installed
torch's tables, with capabilities and arch lists as inputs: there is no GPU on this machine. The
lessons' path is tried in real processes whose torch reports a V100 (``is_available``,
``device_count``, ``get_device_capability``, ``get_device_name``: the check's inputs, nothing else).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import launch as cenv  # noqa: E402
from common.env import LaunchError  # noqa: E402
from tests.test_gpu_sharing_refusal import DRIVER, SCRIPTS  # noqa: E402

# torch 2.14.1+cu130's torch.cuda.get_arch_list() (PyPI's wheel, requirements.txt): no PTX.
CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
CU126 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


@pytest.mark.parametrize("arch, capability, cuda, runs", [
    ("sm_86", 89, (13, 0), True),    # same major, newer minor: an L40S runs Ampere's cubins
    ("sm_86", 90, (13, 0), False),   # cubins do not cross a major
    ("sm_80", 86, (13, 0), True),
    ("sm_75", 70, (13, 0), False),   # nor run on an older GPU: the V100 case
    ("sm_90", 100, (13, 0), False),
    ("sm_60", 61, (13, 0), True),    # a P40 runs the P100's cubins
    ("sm_120", 121, (13, 0), True),
    ("compute_90", 100, (13, 0), True),   # PTX: compiled by the driver for any newer GPU
    ("compute_120", 121, (13, 0), True),
    ("compute_120", 100, (13, 0), False),  # but not for an older one
    ("sm_90a", 90, (13, 0), True),   # arch-specific: that capability only
    ("sm_100a", 103, (13, 0), False),
    ("sm_100", 103, (13, 0), True),
    ("sm_100", 101, (13, 0), False),  # 10.1 is Thor, an integrated GPU
    ("sm_101", 110, (13, 0), True),   # 10.1 was renamed 11.0
    ("sm_80", 87, (13, 0), False),    # Jetson Orin: not before CUDA 13.2
    ("sm_80", 87, (13, 2), True),
    ("sm_87", 89, (13, 2), False),
    ("sm_60", 62, (13, 0), False),
    ("gfx90a", 90, (13, 0), False),   # not a CUDA architecture
])  # fmt: skip
def test_arch_runs_on(arch, capability, cuda, runs):
    assert cenv.arch_runs_on(arch, capability, cuda) is runs


CAPABILITIES = sorted({*range(50, 54), *range(60, 63), *range(70, 76), *range(80, 90),
                       90, *range(100, 104), 110, 120, 121, 130})  # fmt: skip


@pytest.mark.parametrize("table", ["DEVICE_REQUIREMENT",
                                   "DEVICE_REQUIREMENT_POST_JETSON_SBSA_UNIFICATION"])
def test_the_cubin_rule_is_torchs(table):
    """Every sm_XY torch knows, on every capability from 5.0 to 13.0: the same answer as the
    installed torch's table (torch/cuda/__init__.py) for CUDA before 13.2 and from 13.2 on."""
    requirement = getattr(torch.cuda, table, None)
    if requirement is None:
        pytest.skip(f"torch {torch.__version__} has no torch.cuda.{table}")
    cuda = (13, 2) if "POST" in table else (13, 0)
    differ = [(code, cc) for code in requirement for cc in CAPABILITIES
              if cenv.arch_runs_on(f"sm_{code}", cc, cuda) != (cc in requirement[code])]
    assert differ == [], f"(code, capability) where the course and torch disagree: {differ}"


def test_the_builds_are_torchs():
    """The builds the message names carry what torch 2.14's own table says they carry, and this
    machine's wheel is the cu130 row (torch.cuda.get_arch_list())."""
    releases = getattr(torch.cuda, "PYTORCH_RELEASES_CODE_CC", None)
    if releases is None or not torch.__version__.startswith(cenv.TORCH_CUDA_BUILDS_RELEASE):
        pytest.skip(f"torch {torch.__version__} has no 2.14 table to compare with")
    for machine, builds in cenv.TORCH_CUDA_BUILDS.items():
        for tag, _, codes in builds:
            assert set(codes) == releases[f"{tag[2:4]}.{tag[4:]}"][machine], (machine, tag)
    if torch.version.cuda == "13.0" and platform.machine() == "x86_64":
        assert torch.cuda.get_arch_list() == CU130


def error(name, capability, arch_list, version="2.14.1+cu130", cuda="13.0", **kw):
    return cenv.cuda_arch_error(name, capability, arch_list, torch_version=version,
                                     cuda=cuda, torchvision="0.29.1+cu130", **kw)  # fmt: skip


@pytest.mark.parametrize("name, capability, arch_list, build, runs_with", [
    ("Tesla V100-SXM2-32GB", (7, 0), CU130, "cu126", "sm_70"),
    ("Tesla P100-PCIE-16GB", (6, 0), CU130, "cu126", "sm_60"),
    ("Tesla P40", (6, 1), CU130, "cu126", "sm_60"),
    ("Tesla K80", (3, 7), CU130, None, None),            # no build of 2.14 has Kepler
    ("Tesla T4", (7, 5), CU130, "", None),
    ("NVIDIA A100-SXM4-80GB", (8, 0), CU130, "", None),
    ("NVIDIA L40S", (8, 9), CU130, "", None),             # by sm_86's cubins
    ("NVIDIA H100 80GB HBM3", (9, 0), CU130, "", None),
    ("NVIDIA B200", (10, 0), CU130, "", None),
    ("NVIDIA GB10", (12, 1), CU130, "", None),
    ("Tesla V100-SXM2-32GB", (7, 0), CU126, "", None),    # the cu126 build runs it
    ("NVIDIA H100 80GB HBM3", (9, 0), ["sm_80", "compute_80"], "", None),  # by PTX
    ("NVIDIA H100 80GB HBM3", (9, 0), ["sm_80", "sm_86"], "cu126", "sm_90"),
])  # fmt: skip
def test_the_line_for_each_gpu(name, capability, arch_list, build, runs_with):
    line = error(name, capability, arch_list)
    if build == "":
        assert line is None, line
        return
    cc = f"{capability[0]}.{capability[1]}"
    assert line.startswith(f"GPU 0 ({name}) has compute capability {cc} (sm_"), line
    assert f"it was built for {' '.join(arch_list)} (torch.cuda.get_arch_list())" in line, line
    assert "\n" not in line
    if build:
        assert (f"{sys.executable} -m pip install torch==2.14.1+{build} torchvision==0.29.1+"
                f"{build} --index-url https://download.pytorch.org/whl/{build} ") in line, line
        assert f"which has {runs_with} kernels and needs driver 525 or newer" in line, line
    else:
        assert "no CUDA build of torch 2.14 has kernels for it" in line, line
        assert "cu126: sm_50 to sm_90, cu130: sm_75 to sm_120" in line, line


@pytest.mark.parametrize("capability, arch_list, cuda, version, expect", [
    ((7, 0), [], "13.0", "2.14.1+cu130", None),          # no arch list: torch does not judge
    ((7, 0), CU130, None, "2.14.1+cpu", None),           # a CPU or ROCm build: not this check
    ((7, 0), CU130, "13.0", "2.11.0+cu130", "a build of torch 2.11.0 that has sm_70 kernels"),
])  # fmt: skip
def test_what_the_check_leaves_alone_or_cannot_name(capability, arch_list, cuda, version, expect):
    line = error("Tesla V100", capability, arch_list, version=version, cuda=cuda)
    assert (line is None) if expect is None else (expect in line), line


def test_aarch64_names_its_own_builds():
    """On an aarch64 host (GH200) the cu126 build has only sm_80 and sm_90: a V100 has none."""
    line = error("Tesla V100", (7, 0), ["sm_80", "sm_90"], machine="aarch64")
    assert "(cu126: sm_80 to sm_90, cu130: sm_80 to sm_120)" in line, line


def fake_gpu(monkeypatch, capability, name="Tesla V100-SXM2-32GB"):
    """torch reports one GPU of this capability; reading it warns as torch's first CUDA use does."""
    def read_capability(device=None):
        warnings.warn("torch's own capability warning", UserWarning, stacklevel=2)
        return capability

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", read_capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: CU130)


def test_check_stops_a_v100_and_holds_torchs_warning(monkeypatch):
    fake_gpu(monkeypatch, (7, 0))
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with pytest.raises(LaunchError, match=r"^GPU 0 \(Tesla V100-SXM2-32GB\) has compute "):
            cenv.check_cuda_arch(0)
    assert [str(w.message) for w in shown] == []  # the one line says it all


def test_check_passes_an_h100_and_shows_torchs_warning(monkeypatch):
    fake_gpu(monkeypatch, (9, 0), "NVIDIA H100 80GB HBM3")
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        cenv.check_cuda_arch(0)
        cenv.check_cuda_arch(3)  # not a GPU of this process: cuda_device_index's refusals
    assert [str(w.message) for w in shown] == ["torch's own capability warning"]


# The lessons' own __main__ as rank 0 of two on one node, torch reporting two V100s (the
# check's inputs only): each must stop before torch.cuda.set_device, which would raise here,
# having no GPU, and before its group, which would wait for rank 1.  (Two ranks: lesson 09's
# compare.py refuses to run alone before it picks a GPU.)
V100 = """
import torch
torch.cuda.get_device_capability = lambda device=None: (7, 0)
torch.cuda.get_device_name = lambda device=None: "Tesla V100-SXM2-32GB"
"""


@pytest.fixture(scope="module")
def v100_runs(tmp_path_factory) -> dict[str, list]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
        ROLE_RANK="0", ROLE_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
        TORCHELASTIC_RUN_ID="none", CUDA_VISIBLE_DEVICES="0,1",
        MNIST_DIR=str(tmp_path_factory.mktemp("nomnist")),  # never read: the refusal comes first
    )
    two_gpus = DRIVER.replace("device_count = lambda: 1", "device_count = lambda: 2")
    assert two_gpus != DRIVER
    proc = subprocess.run(
        [sys.executable, "-c", V100 + two_gpus, json.dumps(SCRIPTS)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", [s for s, _ in SCRIPTS])
def test_every_lesson_stops_a_v100_before_its_group(v100_runs, script):
    code, stderr = v100_runs[script]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2, f"{script}: exit {code!r}\n{stderr[-2000:]}"
    assert "Traceback" not in stderr, stderr[-2000:]
    assert len(lines) == 1, stderr[-2000:]
    assert "GPU 0 (Tesla V100-SXM2-32GB) has compute capability 7.0 (sm_70)" in lines[0], lines[0]
    assert f"built for {' '.join(torch.cuda.get_arch_list())} (" in lines[0], lines[0]
    if torch.__version__.startswith("2.14") and torch.version.cuda.startswith("13"):
        assert "--index-url https://download.pytorch.org/whl/cu126" in lines[0], lines[0]
