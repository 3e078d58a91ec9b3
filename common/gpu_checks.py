"""Before the group: the GPU this rank drives, and whether the installed torch can drive it.

:func:`cuda_device_index` picks ``cuda:N`` from what SLURM gave the task and refuses a GPU two
ranks would share or one torch has no kernels for (:func:`check_cuda_arch`);
:func:`check_cuda_usable` stops a rank that sees no GPU on a node where SLURM gave it real ones.
Each names the fix in one line, down to the pip command of the torch build that runs here.
"""

from __future__ import annotations

import os
import platform
import re
import sys
from collections.abc import Mapping, Sequence

from common.env import LaunchEnv, LaunchError, gpus_on_node


def cuda_device_index(env: LaunchEnv, visible_gpus: int,
                      environ: Mapping[str, str] | None = None) -> int:  # fmt: skip
    """The ``N`` of ``cuda:N``: the local rank where each task sees all the node's GPUs (or one
    per local rank); 0 where it sees one of its own (``--gpus-per-task=1``, ``single:1``); its
    own set's devices in turn under ``--gpus-per-task=2``.  Any other sharing (two ranks on one
    GPU, ``--gpu-bind=closest``) is refused (:func:`gpu_sharing_error`), and so is a GPU the
    installed torch has no kernels for (a V100 under the CUDA 13 wheel): every lesson asks this
    before ``set_device`` and ``init_process_group``, so such a rank stops in one line instead
    of at its first kernel."""
    environ = os.environ if environ is None else environ
    index = _device_index(env, visible_gpus, environ)
    check_cuda_arch(index)
    return index


def _device_index(env: LaunchEnv, visible_gpus: int, environ: Mapping[str, str]) -> int:
    check_gpu_map(environ, env.local_world_size)
    on_node = gpus_on_node(environ)
    if visible_gpus >= env.local_world_size:
        return env.local_rank
    if visible_gpus == 1 and on_node >= env.local_world_size:
        return 0
    if 1 < visible_gpus < on_node and environ.get("SLURM_GPUS_PER_TASK") and (
            on_node >= env.local_world_size):  # fmt: skip
        return env.local_rank % visible_gpus
    raise gpu_sharing_error(env, visible_gpus, on_node, environ)


def check_gpu_map(environ: Mapping[str, str], local_world_size: int) -> None:
    """``--gpu-bind=map_gpu:0,0`` (SLURM_GPU_BIND) binds local task i to the i-th GPU listed."""
    bind = environ.get("SLURM_GPU_BIND", "")
    if "map_gpu:" not in bind:
        return
    listed = []
    for item in bind.rpartition("map_gpu:")[2].split(",")[: max(1, local_world_size)]:
        name, _, repeat = item.partition("*")  # map_gpu:0*2,1 repeats GPU 0 twice
        listed += [name] * (int(repeat) if repeat.isdigit() else 1)
    listed = listed[:local_world_size]
    for i, gpu in enumerate(listed):
        if gpu in listed[:i]:
            raise LaunchError(
                f"SLURM_GPU_BIND={bind!r} binds local tasks {listed.index(gpu)} and {i} to the "
                f"same GPU {gpu}: NCCL needs one GPU per rank. Give each task its own "
                f"(--gpus-per-task=1, or a map_gpu list without repeats)."
            )


def gpu_sharing_error(env: LaunchEnv, visible_gpus: int, on_node: int,
                      environ: Mapping[str, str]) -> LaunchError:  # fmt: skip
    """What cuda_device_index raises where no GPU is this task's own: tasks that
    share a set smaller than the node's (``--gpu-bind=closest``: which GPU is a task's depends
    on how srun spread the tasks over the sockets, cyclically by default, srun(1)
    ``--distribution``), or fewer GPUs than tasks (before NCCL's "Duplicate GPU detected")."""
    if 1 < visible_gpus < on_node and on_node >= env.local_world_size:
        return LaunchError(
            f"this task sees {visible_gpus} of the node's {on_node} GPUs (CUDA_VISIBLE_DEVICES="
            f"{environ.get('CUDA_VISIBLE_DEVICES')!r}, shared with other tasks: --gpu-bind="
            f"closest or SLURM_GPU_BIND={environ.get('SLURM_GPU_BIND', '')!r}), and which one "
            f"is its own depends on how srun spread the tasks over the sockets; give each task "
            f"one GPU: --gpu-bind=single:1 (keeps the closest) or --gpus-per-task=1."
        )
    return LaunchError(
        f"{env.local_world_size} processes on this node (LOCAL_WORLD_SIZE) but only "
        f"{visible_gpus} visible GPUs (CUDA_VISIBLE_DEVICES="
        f"{environ.get('CUDA_VISIBLE_DEVICES')!r}, SLURM_GPUS_ON_NODE="
        f"{environ.get('SLURM_GPUS_ON_NODE')!r}): two ranks would share a GPU. Start one "
        f"process per GPU (--ntasks-per-node / --nproc-per-node) or ask for more GPUs "
        f"(--gpus-per-node)."
    )


NVIDIA_DEVICE_GLOB = "/dev/nvidia[0-9]*"  # NVIDIA's per-GPU device files, whatever torch thinks


def check_cuda_usable(environ: Mapping[str, str] | None = None,
                      nvidia_glob: str | None = None) -> None:  # fmt: skip
    """For a process that found no CUDA device: stop if SLURM gave this node GPUs that exist
    (``nvidia_glob``, default :data:`NVIDIA_DEVICE_GLOB`).

    A CPU-only torch, or a container started without its GPUs, would otherwise train on the CPU
    and "succeed" hours later.  Where SLURM's GPUs are bookkeeping only (the course's local
    cluster has no /dev/nvidia*), the process goes on with gloo on the CPU.
    """
    import glob

    import torch  # the caller has imported it already

    environ = os.environ if environ is None else environ
    gpus = gpus_on_node(environ)
    devices = sorted(glob.glob(nvidia_glob or NVIDIA_DEVICE_GLOB)) if gpus else []
    if not devices:
        return
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if torch.version.cuda is not None and visible is not None and not visible.strip():
        raise LaunchError(
            f"SLURM gave this node {gpus} GPU(s) (SLURM_GPUS_ON_NODE) but this task's "
            f"CUDA_VISIBLE_DEVICES is empty, so torch sees none: the task was given no GPU (its "
            f"srun step asked for none, or the script emptied it). Ask srun for them "
            f"(--gpus-per-task=1, --gres=gpu:N), or do not set CUDA_VISIBLE_DEVICES=''.")
    if torch.version.cuda is None:
        fix = cpu_build_fix(torch.__version__, _installed("torchvision"), platform.machine())
        why = f"this is a CPU-only build of torch: install a CUDA build over it: {fix}"
    else:
        why = ("inside a container, start it with its GPUs (apptainer --nv, enroot/pyxis with the "
               "NVIDIA hook; a Charliecloud image needs the driver's libraries copied in once: "
               "ch-fromhost --nvidia <image>); otherwise the driver is older than this CUDA build "
               "needs (nvidia-smi shows the driver's CUDA version): install a torch built for "
               "it.")  # fmt: skip
    raise LaunchError(
        f"SLURM gave this node {gpus} GPU(s) (SLURM_GPUS_ON_NODE) and it has {len(devices)} "
        f"NVIDIA device(s) ({devices[0]}...), but torch {torch.__version__} sees no CUDA device "
        f"(torch.version.cuda={torch.version.cuda}): {why}"
    )


# The CUDA builds of torch 2.14 on download.pytorch.org, per host architecture: (index tag,
# oldest driver branch, compute capabilities it has kernels for, as 10 * major + minor).  The
# capabilities are torch 2.14.1's own table (PYTORCH_RELEASES_CODE_CC in torch/cuda/__init__.py,
# "kept in sync with .ci/manywheel/build_cuda.sh") and its release matrix (pytorch/pytorch#190355:
# CUDA 12.6 "Legacy" for Maxwell, Pascal, Volta; 13.0 and 13.2 from Turing on).  The drivers are
# NVIDIA's minor version compatibility (CUDA Compatibility guide, table 1): CUDA 12.x runs on
# driver 525 or newer, 13.x on 580 or newer.  2.15 drops the 12.6 build (pytorch/pytorch#190385).
TORCH_CUDA_BUILDS_RELEASE = "2.14"
TORCH_CUDA_BUILDS = {
    "x86_64": (("cu126", 525, (50, 60, 70, 75, 80, 86, 90)),
               ("cu130", 580, (75, 80, 86, 90, 100, 120))),
    "aarch64": (("cu126", 525, (80, 90)),
                ("cu130", 580, (80, 90, 100, 110, 120))),
}  # fmt: skip


def _installed(name: str) -> str | None:
    """The version of the installed distribution ``name``, None if it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cuda_build_install(tag: str, torch_version: str, torchvision: str | None = None,
                       python: str | None = None) -> str:  # fmt: skip
    """The command that puts torch's ``tag`` build (cu126) into this Python's environment
    (``python``, default this interpreter), each version pinned with its label:
    torch==2.14.1+cu126.  A plain ==2.14.1 does nothing there, since the 2.14.1 already installed
    (PyPI's, or a +cpu build) satisfies it ("Requirement already satisfied"), and
    --force-reinstall would download every nvidia-* package of the build too."""
    pins = [f"torch=={torch_version.split('+')[0]}+{tag}"]
    if torchvision:
        pins.append(f"torchvision=={torchvision.split('+')[0]}+{tag}")
    return (f"{python or sys.executable} -m pip install {' '.join(pins)} --index-url "
            f"https://download.pytorch.org/whl/{tag}")


def cpu_build_fix(torch_version: str, torchvision: str | None, machine: str,
                  python: str | None = None) -> str:  # fmt: skip
    """What check_cuda_usable tells a CPU-only build of torch (2.14.1+cpu) to install: the CUDA
    builds of its release for this host (:data:`TORCH_CUDA_BUILDS`), newest first."""
    base = torch_version.split("+")[0]
    if ".".join(base.split(".")[:2]) != TORCH_CUDA_BUILDS_RELEASE:
        return (f"torch=={base}+cu<version> with --index-url https://download.pytorch.org/whl/"
                f"cu<version>, the label pinned (pytorch.org's install selector lists the "
                f"builds).")  # fmt: skip
    table = TORCH_CUDA_BUILDS.get(machine, TORCH_CUDA_BUILDS["x86_64"])
    (old, old_driver, old_codes), (new, driver, codes) = table[0], table[-1]
    return (f"{cuda_build_install(new, torch_version, torchvision, python)} (driver {driver} or "
            f"newer, sm_{codes[0]} to sm_{codes[-1]}; for an older driver or GPU the same with "
            f"{old}, driver {old_driver}, sm_{old_codes[0]} to sm_{old_codes[-1]}: README.md, "
            f"\"On a real cluster\").")


# Integrated GPUs (Jetson 5.3, 6.2, 7.2, 8.7; Thor 10.1, renamed 11.0): a discrete GPU's cubin of
# the same major does not run there, nor theirs elsewhere (torch's DEVICE_REQUIREMENT).  From CUDA
# 13.2 on, sm_70/80/86 cubins run on Jetson too (DEVICE_REQUIREMENT_POST_JETSON_SBSA_UNIFICATION).
_INTEGRATED_GPUS = frozenset({53, 62, 72, 87, 101, 110})


def arch_runs_on(arch: str, capability: int, cuda: tuple[int, ...] = (13, 0)) -> bool:
    """Whether code built for ``arch`` (an entry of ``torch.cuda.get_arch_list()``: ``sm_86``,
    ``sm_90a``, ``compute_120``) runs on a GPU of ``capability`` (10 * major + minor) under CUDA
    ``cuda``.  torch's own rule (torch/cuda/__init__.py in 2.14: ``_check_capability`` through
    ``_code_compatible_with_device`` and ``DEVICE_REQUIREMENT``): a cubin ``sm_XY`` runs on the
    same major at minor Y or above (sm_86 on 8.9, not on 9.0 nor 7.5); an ``a`` cubin (sm_90a) on
    that capability only.  torch treats ``compute_XY`` like ``sm_XY``; it is PTX, which the driver
    compiles for any newer GPU, majors included (CUDA C++ Programming Guide, "Binary
    Compatibility" and "PTX Compatibility"), so here it runs on XY and above."""
    match = re.fullmatch(r"(sm|compute)_(\d+)([af]?)", arch)
    if not match:
        return False
    code, suffix = int(match[2]), match[3]
    if suffix == "a":  # arch-specific features: neither forward nor family compatible
        return capability == code
    if match[1] == "compute":
        return capability >= code
    if {code, capability} == {101, 110}:
        return True
    if code in _INTEGRATED_GPUS:
        return capability == code
    if capability in _INTEGRATED_GPUS and not (cuda >= (13, 2) and code in (70, 80, 86)):
        return False
    return capability // 10 == code // 10 and capability >= code


def _cuda_tuple(version: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version or "")[:2])


def cuda_arch_error(name: str, capability: tuple[int, int], arch_list: Sequence[str], *,
                    torch_version: str, cuda: str | None, machine: str = "x86_64",
                    torchvision: str | None = None, index: int = 0,
                    python: str | None = None) -> str | None:  # fmt: skip
    """The one line that stops a rank whose GPU this torch has no kernels for, else None.  Its
    inputs are what torch reports (``get_device_name``, ``get_device_capability``,
    ``get_arch_list``, ``__version__``, ``version.cuda``), so every GPU can be tried without one.
    As torch does, a build with no CUDA or an empty arch list (ROCm, some source builds) passes."""
    if cuda is None or not arch_list:
        return None
    cc = capability[0] * 10 + capability[1]
    if any(arch_runs_on(arch, cc, _cuda_tuple(cuda)) for arch in arch_list):
        return None
    base = torch_version.split("+")[0]
    release = ".".join(base.split(".")[:2])
    table = TORCH_CUDA_BUILDS.get(machine, TORCH_CUDA_BUILDS["x86_64"])
    builds = [(tag, driver, codes) for tag, driver, codes in table
              if any(arch_runs_on(f"sm_{code}", cc) for code in codes)]  # fmt: skip
    if release != TORCH_CUDA_BUILDS_RELEASE:
        fix = (f"install a build of torch {base} that has sm_{cc} kernels (pytorch.org's install "
               f"selector lists each release's CUDA builds), or run on another GPU partition.")
    elif builds:
        tag, driver, codes = builds[0]
        runs = " ".join(f"sm_{c}" for c in codes if arch_runs_on(f"sm_{c}", cc))
        command = cuda_build_install(tag, base, torchvision, python)
        fix = (f"install the {tag} build of torch {release}, which has {runs} kernels and "
               f"needs driver {driver} or newer: {command} (README.md, \"On a real cluster\").")
    else:
        spans = ", ".join(f"{tag}: sm_{codes[0]} to sm_{codes[-1]}" for tag, _, codes in table)
        fix = (f"no CUDA build of torch {release} has kernels for it ({spans}): use an older "
               f"torch release, or another GPU partition.")
    return (f"GPU {index} ({name}) has compute capability {capability[0]}.{capability[1]} "
            f"(sm_{cc}), which torch {torch_version} cannot run: it was built for "
            f"{' '.join(arch_list)} (torch.cuda.get_arch_list()), so its first kernel or NCCL "
            f"call would fail with \"no kernel image is available\"; {fix}")  # fmt: skip


def check_cuda_arch(index: int) -> None:
    """Before ``torch.cuda.set_device``: stop in one line if this process's GPU is one the
    installed torch has no kernels for (a V100 under the CUDA 13 wheel).  torch itself only warns
    there (``_check_capability``, several lines at CUDA's first use), and every rank then dies at
    its first kernel or NCCL call.  Called by ``cuda_device_index``."""
    import warnings

    import torch  # the caller has imported it already

    if torch.version.cuda is None or not torch.cuda.is_available():
        return
    if not 0 <= index < torch.cuda.device_count():
        return  # two ranks on one GPU and the like: cuda_device_index's own refusals say it
    # The first call that needs CUDA initialised runs torch's queued checks, whose warning would
    # come before the one line below and say less: hold what the filters let through, and show
    # it where the GPU is fine.
    with warnings.catch_warnings(record=True) as held:
        capability = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
    error = cuda_arch_error(name, capability, torch.cuda.get_arch_list(),
                            torch_version=torch.__version__, cuda=torch.version.cuda,
                            machine=platform.machine(), torchvision=_installed("torchvision"),
                            index=index)  # fmt: skip
    if error:
        raise LaunchError(error)
    for warning in held:
        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
