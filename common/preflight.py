"""Preflight: will a distributed job's processes find each other?  Ask before the real job.

Run it with exactly the layout of the real job, inside its allocation, before the job itself:

    srun python -m common.preflight            # in the job script, right before `srun train.py`

Every task checks what it can see by itself, then all of them meet over TCP at the master
address and port that the real job will use, and rank 0 prints one report:

* the master address resolves, and not to a loopback address when the step spans several nodes
  (every node would talk to itself);
* rank 0's node can bind the master port, and every task can connect to it within a deadline
  (refused, timed out and "someone else answered" are told apart);
* clocks agree within ``--max-clock-skew`` seconds (measured over that connection, NTP-style);
* the GPUs visible on a node match the tasks on it (SLURM_GPUS_ON_NODE, CUDA_VISIBLE_DEVICES);
* torch, CUDA, NCCL and Python versions are the same on every node;
* NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name interfaces that exist, and which interfaces
  could be named (the one that routes to the master first);
* a tiny gloo all_reduce over all tasks completes and adds up right, and how long it took.

Each problem is one line that says what is wrong and how to fix it; the exit status is 1 when
there is any (0 otherwise), so a job script can stop before the real job would hang:

    srun python -m common.preflight || exit 1

Every wait is bounded (``--timeout``, default 15 s per phase, and a watchdog over the whole
run), so it never hangs: a task nobody hears from is reported as missing.

The first section, "launch checks", is what every lesson script runs through common/env.py
(which answers "who am I" and calls these where this file lies beside it): the same checks, on
every process, before it joins its group.  It also reads, for env.py, which torch agent started
the process (``agent_launcher``: torch.distributed.launch with ``--use-env`` looks like torchrun
from the environment).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import errno
import fcntl
import gc
import ipaddress
import json
import os
import platform
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

from common.env import (
    LaunchEnv,
    LaunchError,
    cuda_device_index,
    find_free_port,
    gpus_on_node,
    resolve_launch_env,
)

PREFIX = "preflight:"
DEFAULT_TIMEOUT_S = 15.0
DEFAULT_MAX_CLOCK_SKEW_S = 1.0
TIMEOUT_VAR = "COURSE_PREFLIGHT_TIMEOUT"
# Rehearsal only: pretend this task's clock is off by this many seconds, to see the check fire.
CLOCK_SHIFT_VAR = "COURSE_PREFLIGHT_CLOCK_SHIFT"
IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")

# A problem found on one task: what is wrong, and the fix.  Problems that only matter when the
# tasks live on separate network hosts carry needs_separate_hosts=True (see _shared_network).
Problem = dict


def problem(what: str, fix: str, *, needs_separate_hosts: bool = False) -> Problem:
    return {"what": what, "fix": fix, "separate": needs_separate_hosts}


# --------------------------------------------------------------------------- launch checks
# What common.env runs where this file lies beside it (resolve_launch_env with check=True, its
# set-up helpers): checks of this machine and of the job's shape that turn a later hang, or a
# run on the wrong device, into one line now.  common/env.py itself only answers "who am I".


def check_launch(env: LaunchEnv, environ: Mapping[str, str], step_hosts: Sequence[str] | None):
    """What resolve_launch_env(check=True) checks against this machine, in this order."""
    # Under torchrun the agents have already met before starting the workers, and
    # MASTER_ADDR is the agent's host as torchrun names it: the loopback check is for
    # addresses people set.  The agent also holds the port already.
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    check_master_addr(env if not agent_store else dataclasses.replace(env, num_nodes=1))
    if step_hosts is not None and env.launcher in ("slurm", "mp.spawn"):
        check_rank0_here(env, environ, step_hosts)
    dist = sys.modules.get("torch.distributed")
    joined = dist is not None and dist.is_available() and dist.is_initialized()
    if env.rank == 0 and not agent_store and not joined:  # rank 0 will host the store
        check_port_free(env.master_port)


def check_master_addr(env: LaunchEnv) -> None:
    """The master address must resolve, and across nodes not to loopback (``localhost``, or a
    node name that /etc/hosts maps to 127.0.1.1): each node would wait for rank 0 on itself."""
    master = env.master_addr
    try:
        infos = socket.getaddrinfo(master, env.master_port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise LaunchError(
            f"MASTER_ADDR={master!r} does not resolve ({exc}); set MASTER_ADDR to a "
            f"host name or IP address of the node running rank 0."
        ) from None
    name = master.lower().rstrip(".")
    try:
        literal = ipaddress.ip_address(master.split("%")[0]).is_loopback
    except ValueError:
        literal = name in ("localhost", "localhost.localdomain", "ip6-localhost")
    # This node's own name passes: rank 0's store listens on every address here, and the other
    # nodes, which must not resolve it to loopback, check it themselves.
    own = bool(env.hostname) and name.split(".")[0] == env.hostname.lower().split(".")[0]
    addresses = [info[4][0] for info in infos]
    loopback = [a for a in addresses if ipaddress.ip_address(a.split("%")[0]).is_loopback]
    if env.num_nodes > 1 and loopback and (literal or not own):
        shown = master if master in loopback else f"{master} -> {loopback[0]}"
        raise LaunchError(
            f"MASTER_ADDR={master!r} is a loopback address ({shown}) but the job spans "
            f"{env.num_nodes} nodes: each node would look for rank 0 on itself. Use the first "
            f"node's name as SLURM gives it (scontrol show hostnames \"$SLURM_JOB_NODELIST\" | "
            f"head -n1) or unset MASTER_ADDR and let common.env pick it."
        )


def check_port_free(port: int) -> None:
    """Rank 0 is about to listen on ``port``; say so now if something else already does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store does
        try:
            sock.bind(("", port))
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
            raise LaunchError(
                f"MASTER_PORT={port} is already in use on this host ({exc.strerror}); "
                f"export MASTER_PORT=<another port>, e.g. a free one in 20000-30000."
            ) from None


def ancestor_cmdlines(depth: int = 3) -> list[str]:
    """Command lines of the parent, grandparent, ... from /proc (empty where unreadable)."""
    lines, pid = [], os.getppid()
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                lines.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
    return lines


def agent_launcher(ancestors: Sequence[str] | None = None) -> str | None:
    """For a worker of a torch agent (common/env.py's launcher): "torch.distributed.launch" when
    ``python -m torch.distributed.launch`` shows in the nearest agent's command line (it hides
    behind ``--use-env`` otherwise), "torchrun" for torchrun or torch.distributed.run, None when
    neither shows.  ``ancestors``: the parents' command lines, nearest first (default /proc)."""
    for cmdline in ancestor_cmdlines() if ancestors is None else ancestors:
        program = cmdline.split()[:3]  # "python -m torch.distributed.launch", ".../bin/torchrun"
        if "torch.distributed.launch" in program:
            return "torch.distributed.launch"
        if "torch.distributed.run" in program or "torchrun" in map(os.path.basename, program):
            return "torchrun"
    return None


# A process of an srun step is in the step's cgroup whatever its environment holds: cgroup v1
# ".../job_<id>/step_<n>/...", v2 ".../slurmstepd.scope/job_<id>/step_<n>/user/task_<t>".  The
# batch script is in step_batch, salloc's shell in step_interactive; without task/cgroup, or in
# a container with its own cgroup namespace, there is no such line: no sign either way.
_STEP_CGROUP = re.compile(r"/job_([0-9]+)/step_([0-9]+)(?:/|$)")


def slurm_step_of_cgroup(proc_cgroup: str) -> tuple[str, str] | None:
    """(job id, step id) of the srun step whose cgroup /proc/self/cgroup names, or None."""
    for line in proc_cgroup.splitlines():
        m = _STEP_CGROUP.search(line.split(":", 2)[-1])
        if m:
            return m[1], m[2]
    return None


def check_slurm_variables_kept(environ: Mapping[str, str], proc_cgroup: str | None) -> None:
    """An srun task that lost every SLURM_* variable (``apptainer exec --cleanenv``, ``env -i``)
    would train alone as rank 0 of 1: say so instead (unless RANK/WORLD_SIZE say who it is)."""
    launcher_vars = ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    if any(name.startswith("SLURM_") or name in launcher_vars for name in environ):
        return
    if proc_cgroup is None:
        try:
            with open("/proc/self/cgroup") as f:
                proc_cgroup = f.read()
        except OSError:
            return
    found = slurm_step_of_cgroup(proc_cgroup)
    if found:
        raise LaunchError(
            f"this process runs in Slurm step {found[0]}.{found[1]} (/proc/self/cgroup) but has "
            f"no SLURM_* variable, so every task would train alone as rank 0 of 1: something "
            f"between srun and Python cleared the environment (apptainer/singularity exec "
            f"--cleanenv or --containall, env -i). Drop that option, or pass the variables in "
            f"(apptainer --env-file, APPTAINERENV_SLURM_PROCID=...); for a deliberate single "
            f"process set RANK=0 WORLD_SIZE=1."
        )


def check_rank0_here(env: LaunchEnv, environ: Mapping[str, str], hosts: Sequence[str]) -> None:
    """Rank 0 hosts the store at MASTER_ADDR, and common.env numbers ranks node by node, so
    rank 0 runs on the step's first node.  A MASTER_ADDR naming another node of the step (set
    by hand, or exported by a batch script for a step on part of the job's nodes) would have
    every rank wait at a host where nothing listens until the timeout: say so in seconds.  (An
    address that is no node name of the step is left alone.)"""
    node = environ.get("SLURMD_NODENAME", "")
    if env.rank != 0 or not node or node == env.master_addr or env.master_addr not in hosts:
        return
    raise LaunchError(
        f"MASTER_ADDR={env.master_addr} but rank 0 runs on {node}, the first node of this step "
        f"(ranks are numbered node by node, as torchrun does): unset MASTER_ADDR, or export "
        f"MASTER_ADDR={node}."
    )


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
    """What common.env's cuda_device_index raises where no GPU is this task's own: tasks that
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
                      nvidia_glob: str = NVIDIA_DEVICE_GLOB) -> None:  # fmt: skip
    """For a process that found no CUDA device: stop if SLURM gave this node GPUs that exist.

    A CPU-only torch, or a container started without its GPUs, would otherwise train on the CPU
    and "succeed" hours later.  Where SLURM's GPUs are bookkeeping only (the course's local
    cluster has no /dev/nvidia*), the process goes on with gloo on the CPU.
    """
    import glob

    import torch  # the caller has imported it already

    gpus = gpus_on_node(environ)
    devices = sorted(glob.glob(nvidia_glob)) if gpus else []
    if not devices:
        return
    if torch.version.cuda is None:
        why = (f"this is a CPU-only build of torch: install the CUDA build (pip install "
               f"torch=={torch.__version__.split('+')[0]} --index-url "
               f"https://download.pytorch.org/whl/cu<version>, see README.md).")  # fmt: skip
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
                    torchvision: str | None = None, index: int = 0) -> str | None:  # fmt: skip
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
    pins = f"torch=={base}" + (f" torchvision=={torchvision.split('+')[0]}" if torchvision else "")
    table = TORCH_CUDA_BUILDS.get(machine, TORCH_CUDA_BUILDS["x86_64"])
    builds = [(tag, driver, codes) for tag, driver, codes in table
              if any(arch_runs_on(f"sm_{code}", cc) for code in codes)]  # fmt: skip
    if release != TORCH_CUDA_BUILDS_RELEASE:
        fix = (f"install a build of torch {base} that has sm_{cc} kernels (pytorch.org's install "
               f"selector lists each release's CUDA builds), or run on another GPU partition.")
    elif builds:
        tag, driver, codes = builds[0]
        runs = " ".join(f"sm_{c}" for c in codes if arch_runs_on(f"sm_{c}", cc))
        fix = (f"install the {tag} build of torch {release}, which has {runs} kernels and "
               f"needs driver {driver} or newer: pip install {pins} --index-url "
               f"https://download.pytorch.org/whl/{tag} (README.md, \"On a real cluster\").")
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
    its first kernel or NCCL call.  Called by common.env's ``cuda_device_index``."""
    import warnings
    from importlib import metadata

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
    try:
        torchvision = metadata.version("torchvision")
    except metadata.PackageNotFoundError:
        torchvision = None
    error = cuda_arch_error(name, capability, torch.cuda.get_arch_list(),
                            torch_version=torch.__version__, cuda=torch.version.cuda,
                            machine=platform.machine(), torchvision=torchvision,
                            index=index)  # fmt: skip
    if error:
        raise LaunchError(error)
    for warning in held:
        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)


# --------------------------------------------------------------------------- pure helpers


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1 (and IPv4-mapped loopback)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def clock_offset(t0: float, t1: float, t2: float) -> tuple[float, float]:
    """Offset of the other clock and its error bound, from one request/reply (NTP's formula).

    We sent at ``t0`` (our clock), the other side stamped ``t1`` (its clock), the reply came
    back at ``t2`` (our clock).  If the two legs took equally long, the other clock is ahead of
    ours by ``t1 - (t0 + t2) / 2``; whatever the legs took, the error is at most half the
    round trip.
    """
    return t1 - (t0 + t2) / 2, (t2 - t0) / 2


def nccl_ifname_matches(spec: str, names: Iterable[str]) -> list[str]:
    """The interfaces NCCL_SOCKET_IFNAME=``spec`` selects among ``names``.

    NCCL's syntax (NCCL docs, "Environment Variables", NCCL_SOCKET_IFNAME): a comma-separated
    list of name *prefixes*; a leading ``^`` excludes the listed ones instead; a leading ``=``
    (after ``^`` if any) makes the names exact.  ``eth`` = eth0, eth1...; ``=eth0``; ``^docker``.
    """
    exclude = spec.startswith("^")
    rest = spec[1:] if exclude else spec
    exact = rest.startswith("=")
    rest = rest[1:] if exact else rest
    items = [i for i in rest.split(",") if i]

    def hit(name: str) -> bool:
        return any(name == i if exact else name.startswith(i) for i in items)

    return [n for n in names if hit(n) != exclude]


def gloo_ifname_matches(spec: str, names: Iterable[str]) -> list[str]:
    """The interfaces GLOO_SOCKET_IFNAME=``spec`` names: exact names, comma-separated."""
    wanted = [i.strip() for i in spec.split(",") if i.strip()]
    present = set(names)
    return [i for i in wanted if i in present]


def format_ranks(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    ranks = sorted(set(ranks))
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)


# --------------------------------------------------------------------------- this task


def interfaces() -> list[dict]:
    """This host's network interfaces: name, IPv4 address (or None), up, loopback.

    Read with the same ioctls ``ifconfig`` uses (Linux); elsewhere only the names are known.
    """
    found = []
    for _, name in socket.if_nameindex():
        entry = {"name": name, "ipv4": None, "netmask": None, "up": None,
                 "loopback": name == "lo"}  # fmt: skip
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError, AttributeError):
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), 0x8913, packed)[16:18])[0]
                entry["up"] = bool(flags & 0x1)  # IFF_UP  (SIOCGIFFLAGS = 0x8913)
                entry["loopback"] = bool(flags & 0x8)  # IFF_LOOPBACK
            with contextlib.suppress(OSError, AttributeError):
                addr = fcntl.ioctl(s.fileno(), 0x8915, packed)[20:24]  # SIOCGIFADDR
                entry["ipv4"] = socket.inet_ntoa(addr)
                mask = fcntl.ioctl(s.fileno(), 0x891B, packed)[20:24]  # SIOCGIFNETMASK
                entry["netmask"] = socket.inet_ntoa(mask)
        found.append(entry)
    return found


def route_to(address: str) -> str | None:
    """The local address this host would use to reach ``address`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # UDP connect only picks the route
            return s.getsockname()[0]
    except OSError:
        return None


def network_identity() -> str:
    """Two tasks with the same value share one network stack: same kernel, same namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return f"{socket.gethostname()}:?"


def versions() -> dict:
    import torch

    nccl = None
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "python": platform.python_version(),
    }


def _visible_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [d for d in text.split(",") if d.strip()]


def gpu_facts(environ: Mapping[str, str]) -> dict:
    import torch

    return {
        "slurm_gpus_on_node": environ.get("SLURM_GPUS_ON_NODE"),
        "cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"),
        "torch_cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def check_gpus(env: LaunchEnv, facts: Mapping, environ: Mapping[str, str]) -> list[Problem]:
    """Fewer GPUs than processes on a node is a problem; more is only idle GPUs.

    torch's own count decides when it sees CUDA; on a machine without CUDA the GPUs SLURM
    declared (CUDA_VISIBLE_DEVICES) are compared, as on the course's local cluster.
    """
    visible = facts["torch_cuda_devices"] or len(_visible_list(facts["cuda_visible_devices"]) or [])
    if not visible:
        return []  # no GPU anywhere: gloo on the CPU, nothing to match
    try:
        cuda_device_index(env, visible, environ)
    except LaunchError as exc:
        return [problem(str(exc).rstrip("."), "")]
    return []


def check_ifname_vars(
    environ: Mapping[str, str], ifaces: Sequence[Mapping], multi_node: bool
) -> list[Problem]:
    names = [i["name"] for i in ifaces]
    loopbacks = {i["name"] for i in ifaces if i["loopback"]}
    usable = ", ".join(i["name"] for i in ifaces if not i["loopback"] and i["ipv4"]) or "none"
    found = []
    for var in IFNAME_VARS:
        spec = environ.get(var)
        if not spec:
            continue
        chosen = (nccl_ifname_matches if var.startswith("NCCL") else gloo_ifname_matches)(
            spec, names
        )
        if not chosen:
            found.append(problem(
                f"{var}={spec} matches no interface on this node (it has {', '.join(names)})",
                f"export {var}=<one of: {usable}> or unset it",
            ))  # fmt: skip
        elif multi_node and set(chosen) <= loopbacks:
            found.append(problem(
                f"{var}={spec} selects only the loopback interface, which other nodes cannot "
                f"reach: each node would advertise 127.0.0.1 to the others",
                f"export {var}=<one of: {usable}> (the interface on the nodes' network)",
                needs_separate_hosts=True,
            ))  # fmt: skip
    return found


def check_master(env: LaunchEnv) -> tuple[list[str], list[Problem]]:
    """The master address's IPs, and what is wrong with it as seen from this task.

    common.env's own check first (it resolves, and is not ``localhost`` or a literal loopback
    address in a multi-node job).  A *name* that resolves to loopback (Debian's 127.0.1.1 for a
    node's own name) is a problem only when the tasks really sit on separate network stacks: on
    the course's local cluster every node is this machine and ``node1`` is 127.0.0.1.
    """
    try:
        check_master_addr(env)
    except LaunchError as exc:
        return [], [problem(str(exc).rstrip("."), "")]
    infos = socket.getaddrinfo(env.master_addr, env.master_port, type=socket.SOCK_STREAM)
    ips = list(dict.fromkeys(info[4][0] for info in infos))
    if env.num_nodes > 1 and all(is_loopback(ip) for ip in ips):
        return ips, [problem(
            f"MASTER_ADDR={env.master_addr} resolves to {ips[0]}, a loopback address, but the "
            f"step spans {env.num_nodes} nodes: every node would look for rank 0 on itself",
            "give the nodes' names their network addresses (DNS, /etc/hosts), or export "
            "MASTER_ADDR=<rank 0's address on the nodes' network>",
            needs_separate_hosts=True,
        )]  # fmt: skip
    return ips, []


def check_hostname_for_gloo(environ: Mapping[str, str], multi_node: bool) -> list[Problem]:
    """Without GLOO_SOCKET_IFNAME, gloo binds to the address its host name resolves to."""
    if not multi_node or environ.get("GLOO_SOCKET_IFNAME"):
        return []
    name = socket.gethostname()
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        ips = set()
    if not ips:
        return [problem(
            "the node's own name does not resolve; without GLOO_SOCKET_IFNAME gloo then "
            "falls back to the loopback address, which other nodes cannot reach",
            "export GLOO_SOCKET_IFNAME=<the interface on the nodes' network> (see the "
            "interfaces below), or add the name to DNS or /etc/hosts",
            needs_separate_hosts=True,
        )]  # fmt: skip
    if all(is_loopback(ip) for ip in ips):
        return [problem(
            f"the node's own name resolves to {sorted(ips)[0]} (loopback); without "
            f"GLOO_SOCKET_IFNAME gloo uses that address, which other nodes cannot reach",
            "export GLOO_SOCKET_IFNAME=<the interface on the nodes' network> (see the "
            "interfaces below), or fix /etc/hosts",
            needs_separate_hosts=True,
        )]  # fmt: skip
    return []


@dataclasses.dataclass
class Facts:
    """Everything one task reports to rank 0."""

    rank: int
    host: str
    node_rank: int
    network: str
    versions: dict
    gpus: dict
    local_world_size: int
    interfaces: list
    route: dict
    problems: list
    ifname_vars: dict = dataclasses.field(default_factory=dict)  # NCCL_/GLOO_SOCKET_IFNAME
    clock: dict | None = None  # this clock minus rank 0's, and the error bound, seconds
    connect_s: float | None = None


def local_facts(env: LaunchEnv, environ: Mapping[str, str]) -> Facts:
    multi = env.num_nodes > 1
    ips, found = check_master(env)
    ifaces = interfaces()
    route_ip = route_to(ips[0]) if ips else None
    route_if = next((i["name"] for i in ifaces if route_ip and i["ipv4"] == route_ip), None)
    gpus = gpu_facts(environ)
    found += check_gpus(env, gpus, environ)
    found += check_ifname_vars(environ, ifaces, multi)
    found += check_hostname_for_gloo(environ, multi)
    return Facts(
        rank=env.rank,
        host=env.hostname,
        node_rank=env.node_rank,
        network=network_identity(),
        versions=versions(),
        gpus=gpus,
        local_world_size=env.local_world_size,
        interfaces=ifaces,
        route={"master_ips": ips, "local_ip": route_ip, "iface": route_if},
        problems=found,
        ifname_vars={v: environ[v] for v in IFNAME_VARS if environ.get(v)},
    )


# --------------------------------------------------------------------------- across tasks


def compare(
    reports: Mapping[int, Mapping], world_size: int, max_skew: float
) -> tuple[list[tuple[str, list[int], Problem]], list[str]]:
    """What rank 0 concludes from every task's report (``reports``: rank -> Facts as dict).

    Returns (problems, notes): each problem as (host, ranks, problem) with identical problems of
    several ranks on one host merged; notes are informative lines.
    """
    found: list[tuple[str, int, Problem]] = []
    notes: list[str] = []
    ranks = sorted(reports)
    missing = [r for r in range(world_size) if r not in reports]
    if missing:
        found.append(("", -1, problem(
            f"rank(s) {format_ranks(missing)} of WORLD_SIZE={world_size} never reached rank 0's "
            f"port (their own PROBLEM lines, if any, say why)",
            "check that every task started (srun's errors), that WORLD_SIZE is the number of "
            "processes really started, and that MASTER_ADDR/MASTER_PORT are the same for all "
            "tasks and reachable from every node",
        )))  # fmt: skip

    shared = len({reports[r]["network"] for r in ranks}) == 1 and not missing
    for r in ranks:
        for p in reports[r]["problems"]:
            if p.get("separate") and shared:
                continue  # one network stack: loopback really reaches every task
            found.append((reports[r]["host"], r, p))
    if shared:
        downgraded: dict[str, list[str]] = {}
        for r in ranks:
            for p in reports[r]["problems"]:
                hosts = downgraded.setdefault(p["what"], []) if p.get("separate") else []
                if p.get("separate") and reports[r]["host"] not in hosts:
                    hosts.append(reports[r]["host"])
        notes.extend(
            f"fine here, where every task shares one network stack (one machine), but a "
            f"problem on separate nodes: on {','.join(hosts)}: {what}"
            for what, hosts in downgraded.items()
        )

    if not shared and 0 in reports:
        for r in ranks:
            if reports[r]["network"] != reports[0]["network"]:
                found += [(reports[r]["host"], r, p)
                          for p in named_networks(reports[r], reports[0])]  # fmt: skip

    # Versions: the same everywhere, else name each variant with where it runs.
    for key in ("torch", "cuda", "nccl", "python"):
        variants: dict[str, list[int]] = {}
        for r in ranks:
            variants.setdefault(str(reports[r]["versions"].get(key)), []).append(r)
        if len(variants) > 1:
            where = "; ".join(
                f"{v} on {_hosts_of(reports, rs)} (ranks {format_ranks(rs)})"
                for v, rs in variants.items()
            )
            found.append(("", -1, problem(
                f"{key} versions differ between tasks: {where}",
                "use one Python environment for every node (a venv on a shared filesystem, "
                "COURSE_VENV), or the same container image",
            )))  # fmt: skip

    # Clocks: offsets to rank 0, measured by each task over its connection.
    for r in ranks:
        clock = reports[r].get("clock")
        if clock and abs(clock["offset"]) - clock["error"] > max_skew:
            ahead = "ahead of" if clock["offset"] > 0 else "behind"
            found.append((reports[r]["host"], r, problem(
                f"clock is {abs(clock['offset']):.3f} s {ahead} rank 0's (+/- "
                f"{clock['error']:.3f} s), more than the {max_skew:g} s allowed",
                "synchronise the nodes' clocks (chrony/ntpd; ask the admins): log times, "
                "file times on the shared filesystem and timeouts stop agreeing",
            )))  # fmt: skip

    # The same problem on several tasks is one line naming all of them.
    merged: dict[tuple[str, str], tuple[list[str], list[int]]] = {}
    for host, r, p in found:
        hosts, rs = merged.setdefault((p["what"], p["fix"]), ([], []))
        if host and host not in hosts:
            hosts.append(host)
        if r >= 0:
            rs.append(r)
    problems = [
        (",".join(hosts), rs, {"what": what, "fix": fix})
        for (what, fix), (hosts, rs) in merged.items()
    ]
    return problems, notes


def _networks(report: Mapping, spec: str, var: str) -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of the interfaces that ``var``=``spec`` selects in ``report``."""
    ifaces = [i for i in report["interfaces"] if i.get("ipv4") and i.get("netmask")]
    chosen = (nccl_ifname_matches if var.startswith("NCCL") else gloo_ifname_matches)(
        spec, [i["name"] for i in ifaces])
    return [ipaddress.IPv4Network(f"{i['ipv4']}/{i['netmask']}", strict=False)
            for i in ifaces if i["name"] in chosen]  # fmt: skip


def named_networks(report: Mapping, rank0: Mapping) -> list[Problem]:
    """A task on another node than rank 0 whose NCCL_/GLOO_SOCKET_IFNAME interface is on no
    network that rank 0's own choice is on: the backend's connections between them go over
    interfaces that do not see each other (existence alone was checked on each node)."""
    found = []
    for var, spec in report.get("ifname_vars", {}).items():
        mine = _networks(report, spec, var)
        theirs = _networks(rank0, rank0.get("ifname_vars", {}).get(var, spec), var)
        if mine and theirs and not set(mine) & set(theirs):
            found.append(problem(
                f"{var}={spec} selects {', '.join(map(str, mine))} here, but on rank 0's node "
                f"({rank0['host']}) it selects {', '.join(map(str, theirs))}: no network in "
                f"common, so the backend's connections between them may not get through",
                f"export {var}=<the interface on the network the nodes share> on every node "
                f"(if your site routes between these networks, check with the all_reduce below)",
                needs_separate_hosts=True,
            ))  # fmt: skip
    return found


def _hosts_of(reports: Mapping[int, Mapping], ranks: Iterable[int]) -> str:
    return ",".join(dict.fromkeys(reports[r]["host"] for r in ranks))


def problem_line(host: str, ranks: Sequence[int], p: Mapping) -> str:
    """``preflight: PROBLEM on <hosts> (rank <ranks>): <what>. Fix: <fix>.``"""
    where = f" on {host}" if host else ""
    where += f" (rank {format_ranks(ranks)})" if ranks else ""
    fix = f" Fix: {p['fix']}." if p["fix"] else ""  # common.env's messages carry their own
    return f"{PREFIX} PROBLEM{where}: {p['what']}.{fix}"


# --------------------------------------------------------------------------- the meeting


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


def _now() -> float:
    return time.time() + float(os.environ.get(CLOCK_SHIFT_VAR) or 0)


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall((json.dumps(message) + "\n").encode())


def _recv(sock: socket.socket, buf: bytearray, deadline: Deadline) -> dict:
    """One newline-terminated JSON message; socket.timeout when the deadline passes."""
    while b"\n" not in buf:
        left = deadline.left()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(left)
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the other side closed the connection")
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return json.loads(line)


def _token(env: LaunchEnv) -> str:
    """Both sides must agree on it, or we reached somebody else's service."""
    return f"course-preflight:{env.job_id}:{env.world_size}:{env.master_port}"


def _listen(port: int) -> socket.socket:
    """Rank 0 opens the master port on every address, as torch's TCPStore does."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


class Server:
    """Rank 0: accept one connection per other rank, answer the clock probe, keep reports."""

    def __init__(self, env: LaunchEnv, sock: socket.socket, own: Facts):
        self.env, self.sock = env, sock
        self.reports: dict[int, dict] = {0: dataclasses.asdict(own)}
        self.conns: dict[int, tuple[socket.socket, bytearray]] = {}
        self.lock = threading.Lock()
        self.intruders: list[str] = []

    def gather(self, deadline: Deadline) -> None:
        threads = []
        self.sock.settimeout(0.2)
        while deadline.left() > 0 and len(self.reports) < self.env.world_size:
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            t = threading.Thread(target=self._serve, args=(conn, addr, deadline), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(deadline.left() + 0.5)

    def _serve(self, conn: socket.socket, addr, deadline: Deadline) -> None:
        buf = bytearray()
        try:
            hello = _recv(conn, buf, deadline)
            if hello.get("token") != _token(self.env):
                with self.lock:
                    self.intruders.append(f"{addr[0]} sent {str(hello)[:80]}")
                conn.close()
                return
            _send(conn, {"t1": _now(), "host": self.env.hostname})
            report = _recv(conn, buf, deadline)
            rank = report["rank"]
            with self.lock:
                if rank in self.reports:
                    self.intruders.append(f"rank {rank} connected twice (from {addr[0]})")
                    conn.close()
                    return
                self.reports[rank] = report
                self.conns[rank] = (conn, buf)
        except (OSError, ValueError, KeyError):
            conn.close()

    def tell_all(self, message: dict) -> None:
        for conn, _ in self.conns.values():
            with contextlib.suppress(OSError):
                conn.settimeout(2)
                _send(conn, message)

    def close(self) -> None:
        for conn, _ in self.conns.values():
            conn.close()
        self.sock.close()


def connect(env: LaunchEnv, deadline: Deadline) -> tuple[socket.socket | None, str]:
    """Connect to rank 0, retrying while it may still be starting; (socket, '') or (None, why)."""
    why = "no attempt"
    while deadline.left() > 0:
        try:
            sock = socket.create_connection(
                (env.master_addr, env.master_port), timeout=min(2.0, deadline.left())
            )
            return sock, ""
        except socket.gaierror as exc:
            return None, f"MASTER_ADDR={env.master_addr} does not resolve ({exc})"
        except TimeoutError:
            why = "timed out (packets dropped: a firewall, or an address of the wrong network)"
        except ConnectionRefusedError:
            why = "connection refused (nothing listens there: rank 0 not started, or the " \
                  "address points to another host)"
        except OSError as exc:
            why = f"{exc.strerror or exc}"
        time.sleep(min(0.2, deadline.left()))
    return None, why


@dataclasses.dataclass
class Outcome:
    problems: list = dataclasses.field(default_factory=list)  # (host, ranks, problem)
    notes: list = dataclasses.field(default_factory=list)
    run_allreduce: bool = False


def meet(env: LaunchEnv, own: Facts, timeout: float, max_skew: float) -> Outcome | None:
    """The TCP phase.  Rank 0 returns the outcome for everyone; other ranks return what rank 0
    told them (None: they never got through, and printed their own problems)."""
    deadline = Deadline(timeout)
    if env.rank == 0:
        try:
            check_port_free(env.master_port)
            sock = _listen(env.master_port)
        except (LaunchError, OSError) as exc:
            what = str(exc).split("; ")[0] if isinstance(exc, LaunchError) else (
                f"cannot open MASTER_PORT={env.master_port} on {env.hostname} "
                f"({getattr(exc, 'strerror', None) or exc})")  # fmt: skip
            p = problem(what, "export MASTER_PORT=<a free port>, e.g. in 20000-30000, the same "
                        "for every task")
            return Outcome(problems=[(env.hostname, [0], p)])
        server = Server(env, sock, own)
        try:
            server.gather(deadline)
            problems, notes = compare(server.reports, env.world_size, max_skew)
            for text in server.intruders:
                problems.append((env.hostname, [0], problem(
                    f"an unexpected connection on MASTER_PORT={env.master_port}: {text}",
                    "give this job a port nobody else uses (MASTER_PORT), and the tasks "
                    "distinct ranks",
                )))  # fmt: skip
            outcome = Outcome(problems, notes, run_allreduce=not problems)
            # Stop listening before the others hear the verdict: they go on to the all_reduce's
            # store on this same port, and a connection left in this socket's backlog would be
            # reset when it closes (torch prints "recvValue failed ... Connection reset").
            server.sock.close()
            server.tell_all({"problems": len(problems), "allreduce": outcome.run_allreduce})
            outcome.notes[:0] = _summary(env, server.reports, timeout)
            return outcome
        finally:
            server.close()

    start = time.monotonic()
    sock, why = connect(env, deadline)
    if sock is None:
        where = f"{env.master_addr}:{env.master_port}"
        own.problems.insert(0, problem(
            f"cannot reach rank 0 at MASTER_ADDR:MASTER_PORT={where} within {timeout:g} s: {why}",
            "check that rank 0 started and that MASTER_ADDR names rank 0's node on an address "
            "this node can reach (its network interface, not loopback)",
        ))  # fmt: skip
        return None
    connect_s = time.monotonic() - start
    buf = bytearray()
    try:
        with sock:
            t0 = _now()
            _send(sock, {"token": _token(env), "rank": env.rank})
            reply = _recv(sock, buf, deadline)
            t2 = _now()
            offset, error = clock_offset(t0, reply["t1"], t2)
            own.clock = {"offset": -offset, "error": error}  # > 0: this clock is ahead
            own.connect_s = connect_s
            _send(sock, dataclasses.asdict(own))
            verdict = _recv(sock, buf, Deadline(timeout + 5))
    except (OSError, ValueError, KeyError) as exc:
        own.problems.insert(0, problem(
            f"MASTER_ADDR:MASTER_PORT={env.master_addr}:{env.master_port} answered, but not as "
            f"this job's rank 0 ({exc})",
            "another program or job uses that port: export MASTER_PORT=<a free port>",
        ))  # fmt: skip
        return None
    return Outcome(run_allreduce=verdict["allreduce"])


def _summary(env: LaunchEnv, reports: Mapping[int, Mapping], timeout: float) -> list[str]:
    """Rank 0's informative lines: who came, versions, GPUs, clocks, interfaces."""
    ranks = sorted(reports)
    hosts = list(dict.fromkeys(reports[r]["host"] for r in ranks))
    lines = [
        f"{len(ranks)}/{env.world_size} tasks on {len(hosts)} node(s) ({','.join(hosts)}) met "
        f"rank 0 at {env.master_addr}:{env.master_port} "
        f"({', '.join(reports[0]['route']['master_ips']) or '?'})"
    ]
    v = reports[0]["versions"]
    lines.append(f"versions: torch {v['torch']}, CUDA {v['cuda']}, NCCL {v['nccl']}, "
                 f"Python {v['python']}")
    for host in hosts:
        on = [r for r in ranks if reports[r]["host"] == host]
        g = reports[on[0]]["gpus"]
        lines.append(
            f"gpus on {host}: {len(on)} task(s), SLURM_GPUS_ON_NODE={g['slurm_gpus_on_node']}, "
            f"CUDA_VISIBLE_DEVICES={g['cuda_visible_devices']}, torch sees "
            f"{g['torch_cuda_devices']} CUDA device(s)"
        )
    clocks = [reports[r]["clock"] for r in ranks if reports[r].get("clock")]
    if clocks:
        worst = max(clocks, key=lambda c: abs(c["offset"]))
        lines.append(f"clocks: largest offset to rank 0 {worst['offset'] * 1000:+.1f} ms "
                     f"(+/- {worst['error'] * 1000:.1f} ms)")
    for host in hosts:
        first = next(r for r in ranks if reports[r]["host"] == host)
        rep = reports[first]
        names = [
            f"{i['name']} {i['ipv4']}" + (" <- route to master" if i["name"] ==
                                          rep["route"]["iface"] else "")
            for i in rep["interfaces"] if i["ipv4"]
        ]  # fmt: skip
        lines.append(f"interfaces on {host}: {'; '.join(names) or 'none with IPv4'}")
    set_vars = [f"{v}={os.environ[v]}" for v in IFNAME_VARS if os.environ.get(v)]
    lines.append("socket interface variables: " + (", ".join(set_vars) or "none set"))
    return lines


# --------------------------------------------------------------------------- all_reduce


# What the check adds up. Every rank puts in rank + 1, afresh before each all_reduce, and every
# result is checked against n(n+1)/2: a rank left out or counted twice shows, and in float64 the
# sums are exact for any world size (below 2**53). Not a 1 multiplied by n at each round, in
# float32: n**6 is not a float32 once n's odd part is 17 or more (34 ranks: 34**6 = 1544804416
# comes back as 1544803712), and the check would fail on a sound network.
ALLREDUCE_DTYPE = "float64"


def allreduce_value(rank: int) -> int:
    """What rank ``rank`` puts into each all_reduce of the check."""
    return rank + 1


def allreduce_expected(world_size: int) -> int:
    """The sum of allreduce_value over ``world_size`` ranks: 1 + 2 + ... + world_size."""
    return world_size * (world_size + 1) // 2


def wrong_sum(got: float, world_size: int) -> str:
    """'' when ``got`` is the check's sum over ``world_size`` ranks, else what is wrong."""
    want = allreduce_expected(world_size)
    if got == want:
        return ""
    shown = str(int(got)) if float(got).is_integer() else repr(float(got))
    return (f"summed to {shown}, expected {want} (1 + 2 + ... + {world_size}: each rank adds its "
            f"rank + 1)")


@dataclasses.dataclass
class AllreduceResult:
    error: str = ""  # the group or a collective failed: a timeout, a refused or lost connection
    wrong_sum: str = ""  # every collective completed, and one of them added up wrong
    summary: str = ""  # all went well: how long it took


def tiny_allreduce(env: LaunchEnv, timeout: float, *, iterations: int = 5,
                   backend: str = "gloo") -> AllreduceResult:  # fmt: skip
    """Join a group at the master address and sum one number ``iterations + 1`` times.

    gloo first, whatever the real job uses: it needs no GPU, and it is the backend whose socket
    interface (GLOO_SOCKET_IFNAME) and host name resolution the preflight just looked at. Then,
    where CUDA is there, NCCL on this rank's GPU (NCCL_SOCKET_IFNAME, its transports).
    """
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))
        torch.cuda.set_device(device)

    start = time.monotonic()
    try:
        # The store by hand: rank 0 hosts it on our port even under torchrun (whose own
        # rendezvous would leave the hosting to its agent, on MASTER_PORT).
        bound = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                              is_master=env.rank == 0, timeout=bound)  # fmt: skip
        dist.init_process_group(
            backend, store=store, rank=env.rank, world_size=env.world_size, timeout=bound,
            device_id=device if backend == "nccl" else None,
        )
        joined = time.monotonic() - start
        x = torch.empty(1, dtype=getattr(torch, ALLREDUCE_DTYPE), device=device)
        times, sums = [], []
        for _ in range(iterations + 1):
            x.fill_(allreduce_value(env.rank))
            t = time.monotonic()
            dist.all_reduce(x)
            times.append(time.monotonic() - t)
            sums.append(x.item())
        for i, got in enumerate(sums, 1):
            if why := wrong_sum(got, env.world_size):
                return AllreduceResult(wrong_sum=f"all_reduce {i} of {len(sums)} {why}")
        best = min(times[1:] or times)
        return AllreduceResult(summary=(
            f"all_reduce ({backend}, {env.world_size} ranks, 1 float): joined in "
            f"{joined * 1000:.0f} ms, first {times[0] * 1000:.1f} ms, then {best * 1000:.2f} ms"
        ))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - any failure of the group is the finding
        text = " ".join(str(exc).split())
        return AllreduceResult(error=f"{type(exc).__name__}: {text[:300]}")
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        gc.collect()  # what points at the group goes now, not at exit (lesson 03's train.py)


def allreduce_problem(backend: str, result: AllreduceResult, seconds: float) -> Problem:
    """The PROBLEM for a failed check: a wrong sum is no network matter, a failure may be."""
    name = "gloo" if backend == "gloo" else "NCCL"
    if result.wrong_sum:
        return problem(
            f"the {name} all_reduce completed but added up wrong: {result.wrong_sum}",
            "no network setting causes this (the ranks connected and the data arrived): run "
            "the preflight again, and if it repeats, report this line to the cluster's admins "
            "(a faulty node, network card or GPU, or a broken torch build)",
        )
    if backend == "gloo":
        return problem(
            f"the gloo all_reduce failed within {seconds:g} s: {result.error}",
            "if the TCP check above passed, the collective's own connections failed: "
            "set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the nodes' network "
            "interface (listed above)",
        )
    return problem(
        f"the NCCL all_reduce failed within {seconds:g} s: {result.error}",
        "gloo got through, so look at NCCL's own choice: NCCL_SOCKET_IFNAME, "
        "NCCL_DEBUG=INFO (lesson 06), the GPUs each task sees",
    )


def nccl_allreduce(env: LaunchEnv, timeout: float) -> AllreduceResult:
    """The same on the GPUs with NCCL where torch sees CUDA; else a plain line that it was not
    checked (a gloo that works says nothing about NCCL's transports)."""
    import torch

    if not (torch.cuda.is_available() and torch.distributed.is_nccl_available()):
        why = "no CUDA device here" if not torch.cuda.is_available() else "no NCCL in this torch"
        return AllreduceResult(
            summary=f"NCCL not checked: {why} (the gloo all_reduce above is all this checks)")
    # A second group on the next port: rank 0's store of the first is gone with its group.
    return tiny_allreduce(dataclasses.replace(env, master_port=env.master_port % 65535 + 1),
                          timeout, backend="nccl")  # fmt: skip


# --------------------------------------------------------------------------- main


def exported_by_hand(environ: Mapping[str, str]) -> list[Problem]:
    """WORLD_SIZE/RANK exported by the job script into an srun step (no torchrun around)."""
    if "SLURM_STEP_NUM_TASKS" not in environ or "TORCHELASTIC_RUN_ID" in environ:
        return []
    tasks = environ["SLURM_STEP_NUM_TASKS"]
    if "WORLD_SIZE" in environ and environ["WORLD_SIZE"].strip() != tasks.strip():
        return [problem(
            f"WORLD_SIZE={environ['WORLD_SIZE']} is set in the environment, but srun started "
            f"{tasks} tasks (SLURM_STEP_NUM_TASKS): with it, torch would wait for ranks that "
            f"never come",
            "remove `export WORLD_SIZE=...` (and RANK) from the job script; the number of "
            "tasks comes from srun (--nodes x --ntasks-per-node)",
        )]  # fmt: skip
    return []



def _timeout_default(environ: Mapping[str, str]) -> float:
    text = environ.get(TIMEOUT_VAR)
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise LaunchError(f"{TIMEOUT_VAR}={text!r} is not a number of seconds") from None
    if value <= 0:
        raise LaunchError(f"{TIMEOUT_VAR}={text!r} must be a positive number of seconds")
    return value


def _watchdog(seconds: float, rank: int) -> None:
    """The last resort against a hang: whatever is still running after ``seconds``, stop."""

    def fire():
        print(f"{PREFIX} PROBLEM (rank {rank}): the preflight itself did not finish within "
              f"{seconds:g} s and was stopped. Fix: read the lines above; raise --timeout if "
              f"the nodes are merely slow.", file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def say(text: str) -> None:
    # One write per line, all on stdout: the tasks share the job's output file, and lines of
    # one stream keep their order there.
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def port_beside_the_agent(env: LaunchEnv, timeout: float) -> int:
    """The port the tasks meet on under torchrun, whose agent holds MASTER_PORT: rank 0 takes
    a free port of its host (the kernel's choice) and posts it in the agent's store, where every
    worker is a client (TORCHELASTIC_USE_AGENT_STORE; torch's own env:// rendezvous connects
    the same way, torch/distributed/rendezvous.py ``_create_c10d_store``).  A fixed neighbour
    such as MASTER_PORT + 1 may be in use on a busy host."""
    import torch.distributed as dist

    store = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))  # fmt: skip
    # One key per restart of the workers: the agent's store outlives them.
    key = f"course-preflight/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/port"
    if env.rank == 0:
        store.set(key, str(find_free_port()))
    return int(store.get(key))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m common.preflight",
        description="Check, before the real job, that the tasks of a distributed job can meet.",
    )
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds for each phase (default {TIMEOUT_VAR} or "
                             f"{DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--max-clock-skew", type=float, default=DEFAULT_MAX_CLOCK_SKEW_S,
                        help="seconds two clocks may differ (default %(default)s)")
    parser.add_argument("--no-allreduce", action="store_true", help="skip the gloo all_reduce")
    args = parser.parse_args(
        [a for a in (sys.argv[1:] if argv is None else argv)
         if not a.startswith(("--local-rank", "--local_rank"))]
    )  # fmt: skip
    started = time.monotonic()
    try:
        timeout = args.timeout if args.timeout is not None else _timeout_default(os.environ)
        if timeout <= 0:
            raise LaunchError(f"--timeout {timeout:g} must be a positive number of seconds")
        env = resolve_launch_env(check=False)
        # A master address that does not resolve, or that is loopback in a job spanning several
        # nodes, leaves nowhere to meet: stop now rather than wait out the timeout. (Under
        # torchrun the agents already met; common.env leaves its address alone, and so do we.)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            check_master_addr(env)
    except LaunchError as exc:
        # No world to meet in: every task stops; the first task of each node says why.
        if os.environ.get("SLURM_LOCALID", os.environ.get("LOCAL_RANK", "0")) == "0":
            for p in [*exported_by_hand(os.environ), problem(str(exc).rstrip("."), "")]:
                say(problem_line(socket.gethostname(), [], p))
        return 1
    _watchdog(3 * timeout + 15, env.rank)
    agent_port = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Under torchrun its agent already listens on MASTER_PORT (which proves it can be
        # opened): meet on a port rank 0 takes and posts in the agent's store.
        agent_port = env.master_port
        try:
            env = dataclasses.replace(env, master_port=port_beside_the_agent(env, timeout))
        except Exception as exc:  # noqa: BLE001 - the agent's store did not answer in time
            what = " ".join(str(exc).split())[:200] or type(exc).__name__
            say(problem_line(env.hostname, [env.rank], problem(
                f"torchrun's store at MASTER_ADDR:MASTER_PORT={env.master_addr}:{agent_port} "
                f"did not answer within {timeout:g} s ({what})",
                "check that torchrun's agent still runs (its log), or raise --timeout")))
            return 1

    own = local_facts(env, os.environ)
    if env.world_size == 1:
        outcome = Outcome(
            problems=[(env.hostname, [0], p) for p in own.problems],
            run_allreduce=not own.problems,
        )
        outcome.notes.extend(_summary(env, {0: dataclasses.asdict(own)}, timeout))
    else:
        outcome = meet(env, own, timeout, args.max_clock_skew)

    if outcome is None:  # a task that never got through: say why from here
        for p in own.problems:
            say(problem_line(env.hostname, [env.rank], p))
        return 1

    if env.rank == 0:
        if agent_port is not None:
            say(f"{PREFIX} torchrun's agent holds MASTER_PORT={agent_port}; the tasks meet on "
                f"port {env.master_port} instead")
        for line in outcome.notes:
            say(f"{PREFIX} {line}")
        for host, ranks, p in outcome.problems:
            say(problem_line(host, ranks, p))

    failed = bool(outcome.problems)
    if outcome.run_allreduce and not args.no_allreduce:
        seconds = min(timeout, 10.0)
        result = tiny_allreduce(env, seconds)
        if result.error or result.wrong_sum:
            failed = True
            if env.rank == 0 or env.world_size > 1:
                say(problem_line(env.hostname, [env.rank],
                                 allreduce_problem("gloo", result, seconds)))  # fmt: skip
        elif env.rank == 0:
            say(f"{PREFIX} {result.summary}")
        if not failed:
            result = nccl_allreduce(env, seconds)
            if result.error or result.wrong_sum:
                failed = True
                say(problem_line(env.hostname, [env.rank],
                                 allreduce_problem("nccl", result, seconds)))  # fmt: skip
            elif env.rank == 0:
                say(f"{PREFIX} {result.summary}")
    elif env.rank != 0 and not outcome.run_allreduce:
        failed = True  # rank 0 printed the problems

    if env.rank == 0:
        elapsed = time.monotonic() - started
        if failed:
            count = len(outcome.problems) or 1
            say(f"{PREFIX} FAILED: {count} problem(s), see the PROBLEM lines "
                f"({elapsed:.1f} s)")
        else:
            say(f"{PREFIX} all checks passed ({elapsed:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
