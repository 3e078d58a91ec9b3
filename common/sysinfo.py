"""What software a job runs with: Python, torch, CUDA, the GPUs, NCCL, the distributed backends.

Run it where the training will run, once per node, before blaming the code:

    srun --ntasks-per-node=1 python -m common.sysinfo

Every line starts with the host name, so the lines of several nodes can be told apart (and
sorted: ``... | sort -s -k1,1``). A node whose lines differ from the others' (another driver,
a CPU-only torch, one GPU missing) is the usual cause of a job that works on one node only.
"""

from __future__ import annotations

import os
import platform
import socket
import sys

# torch.distributed's backends, in the order the course discusses them.
BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def backends_available() -> dict[str, bool]:
    """Which process-group backends this torch build can create (``is_<name>_available``)."""
    import torch.distributed as dist

    if not dist.is_available():  # torch built without distributed support
        return dict.fromkeys(BACKENDS, False)
    found = {}
    for name in BACKENDS:
        check = getattr(dist, f"is_{name}_available", None)
        found[name] = bool(check()) if check is not None else False
    return found


def nccl_version() -> str | None:
    """The version of the libnccl this process loaded ("2.21.5"), None without CUDA.

    torch.cuda.nccl.version() asks the library at run time (ncclGetVersion, in
    torch::cuda::nccl::version, torch/csrc/cuda/nccl.cpp): the libnccl.so.2 found when torch
    was loaded (pip's nvidia-nccl package, a site module's LD_LIBRARY_PATH, an LD_PRELOAD), which
    need not be the one torch was built against.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    return nccl_version_text(torch.cuda.nccl.version())


def nccl_version_text(version: tuple[int, ...] | int) -> str:
    """torch.cuda.nccl.version() as "major.minor.patch".

    torch 1.x returned NCCL's integer code: major * 1000 + minor * 100 + patch up to NCCL 2.8,
    major * 10000 + minor * 100 + patch from NCCL 2.9 on; torch 2.x returns a tuple.
    """
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    return _code_text(version, 10000 if version >= 20900 else 1000)


def _code_text(code: int, major_unit: int) -> str:
    """An integer version code major * major_unit + minor * 100 + patch as "major.minor.patch"."""
    major, rest = divmod(code, major_unit)
    return f"{major}.{rest // 100}.{rest % 100}"


def cudnn_version_text(version: int | None) -> str:
    """torch.backends.cudnn.version() (an integer) as "major.minor.patch".

    cudnn.h's CUDNN_VERSION is major * 1000 + minor * 100 + patch up to cuDNN 8 (8902 is
    8.9.2) and major * 10000 + minor * 100 + patch from cuDNN 9 on (91900 is 9.19.0).
    """
    if version is None:
        return "none"
    return _code_text(version, 10000 if version >= 90000 else 1000)


def report() -> list[str]:
    """The lines ``python -m common.sysinfo`` prints, without the host prefix."""
    import torch

    lines = [
        f"python {platform.python_version()} ({sys.executable})",
        f"torch {torch.__version__} (git {torch.version.git_version[:12]})",
    ]
    gpus_given = os.environ.get("SLURM_GPUS_ON_NODE")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    slurm = (
        f"; SLURM gave this node {gpus_given} GPU(s), CUDA_VISIBLE_DEVICES={visible}"
        if gpus_given
        else ""
    )
    if torch.version.cuda is None:
        lines.append(f"CUDA: none, this torch is a CPU-only build{slurm}")
    elif not torch.cuda.is_available():
        lines.append(
            f"CUDA: torch built for CUDA {torch.version.cuda} but no usable GPU here "
            f"(driver missing or too old, or no GPU given to the job){slurm}"
        )
    else:
        count = torch.cuda.device_count()
        cudnn = cudnn_version_text(torch.backends.cudnn.version())
        lines.append(
            f"CUDA {torch.version.cuda}, cuDNN {cudnn}, {count} visible GPU(s){slurm}"
        )
        for index in range(count):
            props = torch.cuda.get_device_properties(index)
            lines.append(
                f"GPU {index}: {props.name}, {props.total_memory // 2**20} MiB, compute "
                f"capability {props.major}.{props.minor}, {props.multi_processor_count} SMs"
            )
    nccl = nccl_version()
    lines.append(f"NCCL {nccl}" if nccl else "NCCL: not usable here (needs CUDA)")
    found = backends_available().items()
    lines.append("backends: " + ", ".join(f"{n} {'yes' if ok else 'no'}" for n, ok in found))
    return lines


def main() -> int:
    host = socket.gethostname()
    # One write per line: the lines of several nodes go to one output file.
    for line in report():
        sys.stdout.write(f"{host}: {line}\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
