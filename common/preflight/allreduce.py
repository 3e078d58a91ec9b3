"""The preflight's last check: a tiny all_reduce over every task, gloo then NCCL, that must
complete in time and add up right."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import time

from common.env import LaunchEnv
from common.launch import cuda_device_index
from common.preflight.helpers import Problem, problem

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
