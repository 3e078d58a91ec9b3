"""Start and stop torch.distributed the same way in every lesson.

from common.dist import init_distributed, cleanup, print0
ctx = init_distributed()      # who am I (common.env), backend, device, process group
...
print0("loss", loss)           # only global rank 0 prints
cleanup()
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import glob
import os

import torch
import torch.distributed as dist

from common.env import (
    LaunchEnv,
    LaunchError,
    cuda_device_index,
    gpus_on_node,
    resolve_launch_env,
)

# Two bounds. The rendezvous (every rank reaching rank 0's store) should fail within minutes when
# a rank never starts or MASTER_ADDR is wrong, not after torch's default of 10-30 minutes; but a
# collective must be allowed to wait as long as torch's own NCCL default (10 min), because ranks
# legitimately wait for each other: rank 0 writing a checkpoint while the others sit in a
# barrier, one node importing torch from a slow shared filesystem. A COURSE_DIST_TIMEOUT smaller
# than the rendezvous bound bounds the rendezvous too (the tests and the local cluster use that).
DEFAULT_RDZV_TIMEOUT_S = 120
DEFAULT_TIMEOUT_S = 600
RDZV_TIMEOUT_VAR = "COURSE_RDZV_TIMEOUT"
TIMEOUT_VAR = "COURSE_DIST_TIMEOUT"

# Devices by which a Linux machine shows NVIDIA GPUs, whatever torch thinks of them.
NVIDIA_DEVICE_GLOB = "/dev/nvidia[0-9]*"


@dataclasses.dataclass(frozen=True)
class DistContext:
    env: LaunchEnv
    backend: str  # "nccl" or "gloo"
    device: torch.device  # cuda:<local_rank> or cpu

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def pick_backend_and_device(env: LaunchEnv | None = None) -> tuple[str, torch.device]:
    """NCCL on cuda:<local_rank> when CUDA devices are visible, else gloo on the CPU.

    Stops (LaunchError) when SLURM gave this node GPUs that exist but torch cannot use: a CPU-only
    wheel or one built for a newer driver would otherwise train on the CPU and "succeed".
    """
    if not torch.cuda.is_available():
        check_gpus_usable()
        return "gloo", torch.device("cpu")
    env = resolve_launch_env() if env is None else env
    return "nccl", torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))


def check_gpus_usable(environ=None, nvidia_glob: str = NVIDIA_DEVICE_GLOB) -> str | None:
    """Called when torch sees no CUDA device. Returns a note to print, or raises LaunchError.

    - SLURM gave GPUs and the node has NVIDIA devices: torch cannot use them (LaunchError).
    - SLURM gave GPUs but the node has none (the course's local cluster, whose GPUs are
      bookkeeping): a one-line note that training runs on the CPU.
    - No GPUs given: None.
    """
    gpus = gpus_on_node(environ)
    if not gpus:
        return None
    devices = sorted(glob.glob(nvidia_glob))
    if devices:
        raise LaunchError(
            f"SLURM gave this node {gpus} GPU(s) (SLURM_GPUS_ON_NODE) and it has {len(devices)} "
            f"NVIDIA device(s) ({devices[0]}...), but torch {torch.__version__} cannot use CUDA "
            f"(torch.version.cuda={torch.version.cuda}): "
            + (
                "this is a CPU-only build of torch; install the CUDA build (pip install "
                f"torch=={torch.__version__.split('+')[0]} from the index for your CUDA version)."
                if torch.version.cuda is None
                else "the driver is older than this CUDA build needs (nvidia-smi shows the "
                "driver's CUDA version); install a torch built for it, or load a newer driver "
                "module."
            )
        )
    return (
        f"note: SLURM gave this node {gpus} GPU(s) but it has no NVIDIA device (the local "
        f"cluster's GPUs are bookkeeping only): training runs on the CPU with gloo."
    )


def _timeouts(timeout_s: float | None) -> tuple[float, float]:
    """(rendezvous, collectives) in seconds: ``timeout_s`` or the variables or the defaults."""
    collectives = timeout_s if timeout_s is not None else _seconds_var(TIMEOUT_VAR)
    collectives = DEFAULT_TIMEOUT_S if collectives is None else collectives
    rendezvous = _seconds_var(RDZV_TIMEOUT_VAR) or DEFAULT_RDZV_TIMEOUT_S
    return min(rendezvous, collectives), collectives


def _seconds_var(name: str) -> float | None:
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise LaunchError(f"{name}={text!r} is not a number of seconds.") from None
    if not value > 0:
        raise LaunchError(f"{name}={text!r} must be a positive number of seconds.")
    return value


def usable_cpus() -> tuple[int, bool]:
    """(CPUs this process may run on, whether that set is the whole machine's).

    Linux tells through the affinity mask, which SLURM narrows to the task's own CPUs when it
    binds tasks (TaskPlugin=task/affinity or task/cgroup); macOS and Windows have no affinity
    call, and there every process may use every CPU.
    """
    total = os.cpu_count() or 1
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is None:
        return total, True
    mine = len(affinity(0))
    return mine, mine >= total


def _set_cpu_threads(env: LaunchEnv) -> None:
    """One process per core share, never more threads than the task may use.

    Each process would otherwise start one thread per core of the whole machine and the processes
    of a node would fight over the same cores. Where SLURM bound this task to its own CPUs, that
    set is already this process's share; where the task may run anywhere on the node, the node's
    CPUs are shared by its local processes. SLURM_CPUS_PER_TASK (what the job asked for) caps it.
    On the course's local cluster the nodes declare more CPUs than the machine has (bookkeeping,
    so real job scripts are accepted unchanged), so the machine's share is what counts there.
    """
    cpus, whole_machine = usable_cpus()
    asked = os.environ.get("SLURM_CPUS_PER_TASK", "").strip()
    asked_n = int(asked) if asked.isascii() and asked.isdigit() else 0
    torch.set_num_threads(thread_share(cpus, whole_machine, env.local_world_size, asked_n))


def thread_share(cpus: int, whole_machine: bool, local_processes: int, asked: int = 0) -> int:
    """Threads for one process: its CPUs (shared with the node's other processes only when the
    set is the whole machine's), at most ``asked`` (SLURM_CPUS_PER_TASK) when given, at least 1."""
    share = cpus // max(1, local_processes) if whole_machine else cpus
    if asked > 0:
        share = min(share, asked)
    return max(1, share)


def init_distributed(
    env: LaunchEnv | None = None, backend: str | None = None, timeout_s: float | None = None
) -> DistContext:
    """Join the process group described by ``env`` (default: :func:`resolve_launch_env`).

    Two bounds: the rendezvous waits at most ``COURSE_RDZV_TIMEOUT`` (120 s) for every rank to
    reach rank 0's store; every collective afterwards at most ``timeout_s``, else
    ``COURSE_DIST_TIMEOUT``, else 600 s (whichever is smaller also bounds the rendezvous).
    A rendezvous that does not complete raises LaunchError naming the address and the fix.
    """
    env = resolve_launch_env() if env is None else env
    picked_backend, device = pick_backend_and_device(env)
    backend = backend or picked_backend
    if backend == "gloo":
        device = torch.device("cpu")
    rendezvous_s, collectives_s = _timeouts(timeout_s)

    # Under torchrun these are already set; from srun, mp.spawn or by hand, common.env worked
    # them out. Later code (and torch itself) may read them.
    os.environ.update(
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL creates its communicator on the device
    elif env.rank == 0 and (note := check_gpus_usable()):
        print(note, flush=True)
    _set_cpu_threads(env)

    # The rendezvous, by hand, to bound it on its own: rank 0 hosts a key-value store (under
    # torchrun the agent already does) and waits for every rank to connect; the others connect.
    # This is what init_method="env://" does, with the collectives' timeout for both.
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = dist.TCPStore(
            host_name=env.master_addr,
            port=env.master_port,
            world_size=env.world_size,
            is_master=env.rank == 0 and not agent_hosts_store,
            timeout=datetime.timedelta(seconds=rendezvous_s),
            multi_tenant=True,
        )
    except (RuntimeError, TimeoutError) as exc:  # DistStoreError, DistNetworkError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LaunchError(
            f"rank {env.rank}: the rendezvous at MASTER_ADDR={env.master_addr} "
            f"MASTER_PORT={env.master_port} did not complete within {rendezvous_s:g} s ({first}). "
            f"Check that all {env.world_size} processes started and can reach that address "
            f"(or wait longer: {RDZV_TIMEOUT_VAR}=<seconds>)."
        ) from None
    store.set_timeout(datetime.timedelta(seconds=collectives_s))
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=collectives_s),
    )
    return DistContext(env=env, backend=backend, device=device)


def cleanup() -> None:
    """Leave the process group, at the end of the distributed work (safe to call when none
    was started)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # Objects that still point at the destroyed gloo group (DDP's reducer, work handles)
        # often sit in reference cycles. Freed later, at interpreter shutdown, gloo's threads
        # can abort the process ("terminate called without an active exception", exit -6)
        # after training succeeded; collecting them now, while Python is fully alive, does not.
        gc.collect()
        # What is still alive now (torch's modules: a few hundred thousand objects once DDP
        # has imported torch._dynamo) stays alive until the process ends. Frozen, the collector
        # no longer walks it, and its last pass at exit is spared: about half a CPU-second per
        # process (tests/budget.py prints it), which adds up over the ranks of every run.
        gc.freeze()


def print0(*args, **kwargs) -> None:
    """print() on global rank 0 only (every rank prints when no group is running)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)
