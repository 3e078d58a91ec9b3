"""common.sysinfo: the software report a job prints (python -m common.sysinfo)."""

import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import clean_environ

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import sysinfo  # noqa: E402


def run_report(**extra):
    proc = subprocess.run([sys.executable, "-m", "common.sysinfo"], cwd=ROOT,
                          env=clean_environ(**extra), capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    host = socket.gethostname()
    assert all(line.startswith(f"{host}: ") for line in proc.stdout.splitlines()), proc.stdout
    return [line.removeprefix(f"{host}: ") for line in proc.stdout.splitlines()]


def test_report_names_this_torch_and_its_backends():
    lines = run_report()
    assert lines[0].startswith(f"python {sys.version.split()[0]} ")
    assert lines[1] == f"torch {torch.__version__} (git {torch.version.git_version[:12]})"
    expected = ", ".join(
        f"{name} {'yes' if getattr(dist, f'is_{name}_available', lambda: False)() else 'no'}"
        for name in ("gloo", "nccl", "mpi", "ucc", "xccl")
    )
    assert lines[-1] == f"backends: {expected}"
    assert "gloo yes" in lines[-1]  # every build the course uses has gloo
    if torch.cuda.is_available():
        gpus = [line for line in lines if line.startswith("GPU ")]
        assert len(gpus) == torch.cuda.device_count()
        assert lines[-2] == f"NCCL {sysinfo.nccl_version()}"
    else:
        assert lines[-2] == "NCCL: not usable here (needs CUDA)"
        assert lines[2].startswith("CUDA: ")


def test_report_shows_what_slurm_gave_next_to_what_torch_sees():
    lines = run_report(SLURM_GPUS_ON_NODE="2", CUDA_VISIBLE_DEVICES="0,1")
    cuda = next(line for line in lines if line.startswith("CUDA"))
    assert cuda.endswith("; SLURM gave this node 2 GPU(s), CUDA_VISIBLE_DEVICES=0,1"), cuda


def test_nccl_version_text_reads_every_encoding():
    assert sysinfo.nccl_version_text((2, 21, 5)) == "2.21.5"
    assert sysinfo.nccl_version_text(2708) == "2.7.8"  # NCCL before 2.9: major*1000 + ...
    assert sysinfo.nccl_version_text(21005) == "2.10.5"  # from 2.9: major*10000 + ...
    assert sysinfo.nccl_version_text(20903) == "2.9.3"


def test_cudnn_version_text_reads_both_encodings():
    assert sysinfo.cudnn_version_text(91900) == "9.19.0"  # cuDNN 9: major*10000 + ...
    assert sysinfo.cudnn_version_text(90100) == "9.1.0"
    assert sysinfo.cudnn_version_text(8902) == "8.9.2"  # cuDNN 8: major*1000 + ...
    assert sysinfo.cudnn_version_text(None) == "none"  # a build without cuDNN
