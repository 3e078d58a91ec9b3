"""Before the group: what would fail later against this machine, said in one line now.

After common.env.resolve_launch_env, every lesson's set-up calls :func:`check_launch` (rank 0's
address, node and port; an srun task's SLURM_* variables), :func:`cuda_device_index` (the
rank's own GPU, one the installed torch can run) or, with no GPU, :func:`check_cuda_usable`
(GPUs SLURM gave that torch cannot see), then the settings: CPU threads, the timeout, the line
a rank prints when it cannot join.  Lesson 06's preflight (common/preflight/) runs them too.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import importlib.metadata
import ipaddress
import os
import platform
import re
import socket
import sys
from collections.abc import Mapping, Sequence

from common.env import LaunchEnv, LaunchError, _opt_int_var, gpus_on_node, step_hosts

# --------------------------------------------------------------------------- the launch


def check_launch(env: LaunchEnv, environ: Mapping[str, str] | None = None, *,
                 proc_cgroup: str | None = None) -> None:  # fmt: skip
    """Checks, in this order, the ``env`` resolve_launch_env found in ``environ`` (default
    ``os.environ``); ``proc_cgroup``: /proc/self/cgroup's text (read when ``environ`` is None)."""
    if environ is None or proc_cgroup is not None:  # an srun task's variables
        check_slurm_variables_kept(os.environ if environ is None else environ, proc_cgroup)
    environ = os.environ if environ is None else environ
    hosts = step_hosts(environ)
    # Under torchrun the agents met before starting the workers, MASTER_ADDR is the agent's
    # host as torchrun names it, and the agent holds the port: those checks are for people.
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    check_master_addr(env if not agent_store else dataclasses.replace(env, num_nodes=1))
    if hosts is not None and env.launcher in ("slurm", "mp.spawn"):
        check_rank0_here(env, environ, hosts)
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
        raise LaunchError(f"MASTER_ADDR={master!r} does not resolve ({exc}); set MASTER_ADDR to a "
                          f"host name or IP address of the node running rank 0.") from None
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
        raise LaunchError(f"MASTER_ADDR={master!r} is a loopback address ({shown}) but the job "
                          f"spans {env.num_nodes} nodes: each node would look for rank 0 on "
                          f"itself. Use the first node's name as SLURM gives it (scontrol show "
                          f"hostnames \"$SLURM_JOB_NODELIST\" | head -n1) or unset MASTER_ADDR "
                          f"and let common.env pick it.")  # fmt: skip


def check_port_free(port: int) -> None:
    """Rank 0 is about to listen on ``port``; say so now if something else already does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store does
        try:
            sock.bind(("", port))
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
            raise LaunchError(f"MASTER_PORT={port} is already in use on this host "
                              f"({exc.strerror}); export MASTER_PORT=<another port>, e.g. a free "
                              f"one in 20000-30000.") from None  # fmt: skip


# An srun step's process is in its step's cgroup whatever its environment holds: v1 ".../job_<id>
# /step_<n>/...", v2 ".../slurmstepd.scope/job_<id>/step_<n>/user/task_<t>", from Slurm 26.05 the
# SLUID for the id (cgroup.conf(5) CgroupJobIdPaths; src/common/sluid.c: "s" and 13 Crockford
# base32 digits).  No such line (no task/cgroup, a cgroup namespace): no sign either way.
_STEP_CGROUP = re.compile(r"/(?:job_([0-9]+)|(s[0-9A-HJKMNP-TV-Z]{13}))/step_([0-9]+)(?:/|$)")
PROC_CGROUP = "/proc/self/cgroup"


def slurm_step_of_cgroup(proc_cgroup: str) -> tuple[str, str] | None:
    """(job id or SLUID, step id) of the srun step that /proc/self/cgroup names, or None."""
    for line in proc_cgroup.splitlines():
        m = _STEP_CGROUP.search(line.split(":", 2)[-1])
        if m:
            return m[1] or m[2], m[3]
    return None


def check_slurm_variables_kept(environ: Mapping[str, str], proc_cgroup: str | None,
                               cgroup_file: str = PROC_CGROUP) -> None:  # fmt: skip
    """An srun task that lost every SLURM_* variable (``apptainer exec --cleanenv``, ``env -i``)
    would train alone as rank 0 of 1 (``proc_cgroup``: ``cgroup_file``'s text, None: read it)."""
    launcher_vars = ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    if any(name.startswith("SLURM_") or name in launcher_vars for name in environ):
        return
    if proc_cgroup is None:
        try:
            with open(cgroup_file) as f:
                proc_cgroup = f.read()
        except OSError:
            return
    found = slurm_step_of_cgroup(proc_cgroup)
    if found:
        job, step = found
        where = (f"Slurm step {job}.{step} ({cgroup_file})" if job.isdigit() else
                 f"step {step} of the Slurm job with SLUID {job} ({cgroup_file}, which names "
                 f"no job id)")  # fmt: skip
        raise LaunchError(
            f"this process runs in {where} but has no SLURM_* variable, so every task would "
            f"train alone as rank 0 of 1: something between srun and Python cleared the "
            f"environment (apptainer/singularity exec --cleanenv or --containall, env -i). Drop "
            f"that option, or pass the variables in (apptainer --env-file, APPTAINERENV_SLURM_"
            f"PROCID=...); for a deliberate single process set RANK=0 WORLD_SIZE=1.")


def check_rank0_here(env: LaunchEnv, environ: Mapping[str, str], hosts: Sequence[str]) -> None:
    """Rank 0 hosts the store and runs on the step's first node (ranks go node by node): a
    MASTER_ADDR naming another node of the step (by hand, or a batch script's for a step on part
    of the job) has every rank wait where nothing listens.  Other addresses are left alone."""
    node = environ.get("SLURMD_NODENAME", "")
    if env.rank != 0 or not node or node == env.master_addr or env.master_addr not in hosts:
        return
    raise LaunchError(f"MASTER_ADDR={env.master_addr} but rank 0 runs on {node}, the first node "
                      f"of this step (ranks are numbered node by node, as torchrun does): unset "
                      f"MASTER_ADDR, or export MASTER_ADDR={node}.")  # fmt: skip


# --------------------------------------------------------------------------- the GPU


def cuda_device_index(env: LaunchEnv, visible_gpus: int,
                      environ: Mapping[str, str] | None = None) -> int:  # fmt: skip
    """The ``N`` of ``cuda:N``: the local rank where each task sees all the node's GPUs (or one
    per local rank); 0 where it sees one of its own (``--gpus-per-task=1``, ``single:1``); its
    own set's devices in turn under ``--gpus-per-task=2``.  Other sharing is refused
    (:func:`gpu_sharing_error`), so is a GPU torch has no kernels for (:func:`check_cuda_arch`)."""
    environ = os.environ if environ is None else environ
    check_gpu_map(environ, env.local_world_size)
    on_node = gpus_on_node(environ)
    if visible_gpus >= env.local_world_size:
        index = env.local_rank
    elif visible_gpus == 1 and on_node >= env.local_world_size:
        index = 0
    elif 1 < visible_gpus < on_node and environ.get("SLURM_GPUS_PER_TASK") and (
            on_node >= env.local_world_size):  # fmt: skip
        index = env.local_rank % visible_gpus
    else:
        raise gpu_sharing_error(env, visible_gpus, on_node, environ)
    check_cuda_arch(index)
    return index


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
            raise LaunchError(f"SLURM_GPU_BIND={bind!r} binds local tasks {listed.index(gpu)} and "
                              f"{i} to the same GPU {gpu}: NCCL needs one GPU per rank. Give each "
                              f"task its own (--gpus-per-task=1, or a map_gpu list without "
                              f"repeats).")  # fmt: skip


def gpu_sharing_error(env: LaunchEnv, visible_gpus: int, on_node: int,
                      environ: Mapping[str, str]) -> LaunchError:  # fmt: skip
    """Where no GPU is this task's own: tasks share a set smaller than the node's (``--gpu-bind=
    closest``; srun(1) ``--distribution`` decides whose is which), or fewer GPUs than tasks."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if 1 < visible_gpus < on_node and on_node >= env.local_world_size:
        return LaunchError(f"this task sees {visible_gpus} of the node's {on_node} GPUs "
                           f"(CUDA_VISIBLE_DEVICES={visible!r}, shared with other tasks: "
                           f"--gpu-bind=closest or SLURM_GPU_BIND="
                           f"{environ.get('SLURM_GPU_BIND', '')!r}), and which one is its own "
                           f"depends on how srun spread the tasks over the sockets; give each "
                           f"task one GPU: --gpu-bind=single:1 (keeps the closest) or "
                           f"--gpus-per-task=1.")  # fmt: skip
    return LaunchError(f"{env.local_world_size} processes on this node (LOCAL_WORLD_SIZE) but only "
                       f"{visible_gpus} visible GPUs (CUDA_VISIBLE_DEVICES={visible!r}, "
                       f"SLURM_GPUS_ON_NODE={environ.get('SLURM_GPUS_ON_NODE')!r}): two ranks "
                       f"would share a GPU. Start one process per GPU (--ntasks-per-node / "
                       f"--nproc-per-node) or ask for more GPUs (--gpus-per-node).")  # fmt: skip


NVIDIA_DEVICE_GLOB = "/dev/nvidia[0-9]*"  # NVIDIA's per-GPU device files, whatever torch thinks


def check_cuda_usable(environ: Mapping[str, str] | None = None,
                      nvidia_glob: str | None = None) -> None:  # fmt: skip
    """For a process that found no CUDA device: stop if SLURM gave this node GPUs that exist
    (``nvidia_glob``), else a CPU-only torch or a container without its GPUs trains on the CPU and
    "succeeds" hours later.  The local cluster's GPUs are bookkeeping: no /dev/nvidia*, gloo."""
    import glob

    import torch  # the caller has imported it already

    environ = os.environ if environ is None else environ
    gpus = gpus_on_node(environ)
    devices = sorted(glob.glob(nvidia_glob or NVIDIA_DEVICE_GLOB)) if gpus else []
    if not devices:
        return
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if torch.version.cuda is not None and visible is not None and not visible.strip():
        raise LaunchError(f"SLURM gave this node {gpus} GPU(s) (SLURM_GPUS_ON_NODE) but this "
                          f"task's CUDA_VISIBLE_DEVICES is empty, so torch sees none: the task "
                          f"was given no GPU (its srun step asked for none, or the script emptied "
                          f"it). Ask srun for them (--gpus-per-task=1, --gres=gpu:N), or do not "
                          f"set CUDA_VISIBLE_DEVICES=''.")  # fmt: skip
    if torch.version.cuda is None:
        fix = cpu_build_fix(torch.__version__, _installed("torchvision"), platform.machine())
        why = f"this is a CPU-only build of torch: install a CUDA build over it: {fix}"
    else:
        why = ("inside a container, start it with its GPUs (apptainer --nv, enroot/pyxis with the "
               "NVIDIA hook; a Charliecloud image needs the driver's libraries copied in once: "
               "ch-fromhost --nvidia <image>); otherwise the driver is older than this CUDA build "
               "needs (nvidia-smi shows the driver's CUDA version): install a torch built for "
               "it.")  # fmt: skip
    raise LaunchError(f"SLURM gave this node {gpus} GPU(s) (SLURM_GPUS_ON_NODE) and it has "
                      f"{len(devices)} NVIDIA device(s) ({devices[0]}...), but torch "
                      f"{torch.__version__} sees no CUDA device (torch.version.cuda="
                      f"{torch.version.cuda}): {why}")  # fmt: skip


# torch 2.14's CUDA builds per host: (index tag, oldest driver, compute capabilities as 10 * major
# + minor): torch 2.14.1's PYTORCH_RELEASES_CODE_CC (torch/cuda/__init__.py), pytorch/pytorch
# #190355 (12.6 for Maxwell to Volta; 13.x from Turing on), NVIDIA's CUDA Compatibility guide
# table 1 (12.x on 525+, 13.x on 580+).  2.15 drops 12.6 (pytorch/pytorch#190385).
TORCH_CUDA_BUILDS_RELEASE = "2.14"
TORCH_CUDA_BUILDS = {
    "x86_64": (("cu126", 525, (50, 60, 70, 75, 80, 86, 90)),
               ("cu130", 580, (75, 80, 86, 90, 100, 120))),
    "aarch64": (("cu126", 525, (80, 90)),
                ("cu130", 580, (80, 90, 100, 110, 120))),
}  # fmt: skip


def _installed(name: str) -> str | None:
    """The version of the installed distribution ``name``, None if it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cuda_build_install(tag: str, torch_version: str, torchvision: str | None = None,
                       python: str | None = None) -> str:  # fmt: skip
    """The pip command that puts torch's ``tag`` build (cu126) into this Python's environment,
    each version pinned with its label (torch==2.14.1+cu126): a plain ==2.14.1 is "already
    satisfied" by the build installed, and --force-reinstall downloads every nvidia-* too."""
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
    """Whether ``arch`` (of ``torch.cuda.get_arch_list()``: sm_86, sm_90a, compute_120) runs on
    a GPU of ``capability`` under CUDA ``cuda``, by torch 2.14's ``_code_compatible_with_device``:
    sm_XY on major X at minor Y or above, sm_XYa on XY only; compute_XY is PTX, which the driver
    compiles for any newer GPU (CUDA C++ Programming Guide, "PTX Compatibility")."""
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


def cuda_arch_error(name: str, capability: tuple[int, int], arch_list: Sequence[str], *,
                    torch_version: str, cuda: str | None, machine: str = "x86_64",
                    torchvision: str | None = None, index: int = 0,
                    python: str | None = None) -> str | None:  # fmt: skip
    """The one line that stops a rank whose GPU this torch has no kernels for, else None, from
    what torch reports (so every GPU can be tried without one).  As in torch, a build with no
    CUDA or an empty arch list (ROCm, some source builds) passes."""
    if cuda is None or not arch_list:
        return None
    cc, cuda_version = capability[0] * 10 + capability[1], re.findall(r"\d+", cuda)[:2]
    if any(arch_runs_on(arch, cc, tuple(map(int, cuda_version))) for arch in arch_list):
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
    """Stop in one line on a GPU the installed torch has no kernels for (a V100 under CUDA 13):
    torch only warns (``_check_capability``), then every rank dies at its first kernel."""
    import warnings

    import torch  # the caller has imported it already

    if torch.version.cuda is None or not torch.cuda.is_available():
        return
    if not 0 <= index < torch.cuda.device_count():
        return  # two ranks on one GPU and the like: cuda_device_index's own refusals say it
    # The first call that initialises CUDA runs torch's queued checks, whose warning says less
    # than the line below: hold it, and show it where the GPU is fine.
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


# --------------------------------------------------------------------------- the set-up's settings
# Launchers that start several workers inside one SLURM task: they share the task's CPUs.
_WORKER_LAUNCHERS = ("torchrun", "torch.distributed.launch", "mp.spawn")


def usable_cpus() -> tuple[int, bool]:
    """(CPUs this process may run on, whether that is the whole machine): the affinity mask,
    which SLURM narrows to the task's CPUs when it binds tasks; macOS has none."""
    total = os.cpu_count() or 1
    if not hasattr(os, "sched_getaffinity"):
        return total, True
    mine = len(os.sched_getaffinity(0))
    return mine, mine >= total


def process_cpus(env: LaunchEnv, environ: Mapping[str, str] | None = None,
                 cpus: tuple[int, bool] | None = None) -> int:  # fmt: skip
    """This process's share of its task's CPUs (at least 1): a launcher's workers share their
    task's set; where nothing is bound the node's processes share the machine; capped by
    SLURM_CPUS_PER_TASK.  Split between torch's threads and DataLoader workers (lesson 08)."""
    mine, whole_machine = usable_cpus() if cpus is None else cpus
    per_task = env.local_world_size if env.launcher in _WORKER_LAUNCHERS else 1
    share = mine // (env.local_world_size if whole_machine else per_task)
    asked = _opt_int_var(os.environ if environ is None else environ, "SLURM_CPUS_PER_TASK",
                         minimum=1)  # fmt: skip
    return max(1, min(share, asked // per_task) if asked else share)


def cpu_threads(env: LaunchEnv, environ: Mapping[str, str] | None = None,
                cpus: tuple[int, bool] | None = None) -> int:  # fmt: skip
    """Threads for ``torch.set_num_threads``: OMP_NUM_THREADS if set, else :func:`process_cpus`;
    otherwise each process takes every core and they fight over them."""
    environ = os.environ if environ is None else environ
    return _opt_int_var(environ, "OMP_NUM_THREADS", minimum=1, hint="Set it to a whole number "
                        "of threads, e.g. 4, or unset it.") or process_cpus(env, environ, cpus)


DEFAULT_TIMEOUT_S = 600  # torch's own default for NCCL; gloo's is 30 minutes
TIMEOUT_VAR = "COURSE_DIST_TIMEOUT"


def dist_timeout(environ: Mapping[str, str] | None = None) -> datetime.timedelta:
    """How long a rank waits for the others (rendezvous, every collective): COURSE_DIST_TIMEOUT
    seconds, else 600.  Minutes, since ranks legitimately wait (a checkpoint, a slow import);
    the failure demos and tests set a few seconds so that a hang ends quickly."""
    text = (os.environ if environ is None else environ).get(TIMEOUT_VAR, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise LaunchError(f"{TIMEOUT_VAR}={text!r} is not a positive number of seconds; "
                          f"set e.g. {TIMEOUT_VAR}=600 or unset it.")  # fmt: skip
    return datetime.timedelta(seconds=seconds)


def init_error_message(env: LaunchEnv, exc: BaseException) -> str:
    """One line, in place of torch's traceback, for a rank whose ``init_process_group`` failed
    (DistStoreError: the others did not come; DistNetworkError: rank 0's address did not answer)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if "Duplicate GPU detected" in text:
        return (f"rank {env.rank}: two ranks drive one GPU ({first}); give each task its own "
                f"GPU (--gpus-per-task=1) or start one process per GPU.")  # fmt: skip
    return (f"rank {env.rank}: could not join the process group at MASTER_ADDR={env.master_addr} "
            f"MASTER_PORT={env.master_port} ({first}). Check that all {env.world_size} processes "
            f"started and can reach that address (a longer wait: {TIMEOUT_VAR}=<seconds>).")
