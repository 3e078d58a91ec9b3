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
import os

import torch
import torch.distributed as dist

from common.env import LaunchEnv, LaunchError, cuda_device_index, resolve_launch_env

# A rendezvous that cannot complete (a rank that never started, a wrong MASTER_ADDR) should fail
# within a minute, not after torch's default of 10-30 minutes.
DEFAULT_TIMEOUT_S = 60
TIMEOUT_VAR = "COURSE_DIST_TIMEOUT"


@dataclasses.dataclass(frozen=True)
class DistContext:
    env: LaunchEnv
    backend: str  # "nccl" or "gloo"
    device: torch.device  # cuda:<local_rank> or cpu

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def pick_backend_and_device(env: LaunchEnv | None = None) -> tuple[str, torch.device]:
    """NCCL on cuda:<local_rank> when CUDA devices are visible, else gloo on the CPU."""
    if not torch.cuda.is_available():
        return "gloo", torch.device("cpu")
    env = resolve_launch_env() if env is None else env
    return "nccl", torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))


def _timeout_s(timeout_s: float | None) -> float:
    if timeout_s is not None:
        return timeout_s
    text = os.environ.get(TIMEOUT_VAR)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise LaunchError(f"{TIMEOUT_VAR}={text!r} is not a number of seconds.") from None
    if value <= 0:
        raise LaunchError(f"{TIMEOUT_VAR}={text!r} must be a positive number of seconds.")
    return value


def _set_cpu_threads(env: LaunchEnv) -> None:
    """One process per core share, never more threads than the task may use.

    Each process would otherwise start one thread per core of the whole machine and the processes
    of a node would fight over the same cores.  SLURM_CPUS_PER_TASK is what the job asked for; the
    CPUs this process may really run on (its affinity) are the hard limit.  On the course's local
    cluster the nodes declare more CPUs than the machine has (the numbers are bookkeeping, so real
    job scripts are accepted unchanged), so the affinity share is what counts there.
    """
    share = len(os.sched_getaffinity(0)) // env.local_world_size
    asked = os.environ.get("SLURM_CPUS_PER_TASK", "").strip()
    if asked.isdigit():
        share = min(share, int(asked))
    torch.set_num_threads(max(1, share))


def init_distributed(
    env: LaunchEnv | None = None, backend: str | None = None, timeout_s: float | None = None
) -> DistContext:
    """Join the process group described by ``env`` (default: :func:`resolve_launch_env`).

    The timeout bounds the rendezvous and every collective: ``timeout_s``, else the
    ``COURSE_DIST_TIMEOUT`` variable, else 60 s.
    """
    env = resolve_launch_env() if env is None else env
    picked_backend, device = pick_backend_and_device(env)
    backend = backend or picked_backend
    if backend == "gloo":
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=_timeout_s(timeout_s))

    # init_method="env://" reads these; under torchrun they are already set and the agent hosts
    # the store, so the same call works for every launcher.
    os.environ.update(
        MASTER_ADDR=env.master_addr,
        MASTER_PORT=str(env.master_port),
        RANK=str(env.rank),
        WORLD_SIZE=str(env.world_size),
        LOCAL_RANK=str(env.local_rank),
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL creates its communicator on the device
    _set_cpu_threads(env)
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )
    return DistContext(env=env, backend=backend, device=device)


def cleanup() -> None:
    """Leave the process group (safe to call when none was started)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # Objects that still point at the destroyed gloo group (DDP's reducer, work handles)
        # often sit in reference cycles. Freed later, at interpreter shutdown, gloo's threads
        # can abort the process ("terminate called without an active exception", exit -6)
        # after training succeeded; collecting them now, while Python is fully alive, does not.
        gc.collect()


def print0(*args, **kwargs) -> None:
    """print() on global rank 0 only (every rank prints when no group is running)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)
