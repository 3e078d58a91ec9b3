"""What a SLURM task or a torchrun worker sees (:func:`slurm_task`, :func:`whoami`), and
pictures of where each rank runs (:func:`plot_layouts`)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from common.notebook.course import _show


def slurm_task(
    nodes: int,
    tasks_per_node: int,
    node: int,
    local: int,
    *,
    job_id: int = 4242,
    gpus_per_node: int | None = None,
    prefix: str = "node",
) -> dict[str, str]:
    """The SLURM variables srun gives task ``local`` on node ``node`` (0-based) of a job step
    with ``nodes`` x ``tasks_per_node`` tasks on nodes named node1, node2, ..."""
    if not (0 <= node < nodes and 0 <= local < tasks_per_node):
        raise ValueError(f"no task {local} on node {node} in a {nodes}x{tasks_per_node} step")
    hosts = f"{prefix}[1-{nodes}]" if nodes > 1 else f"{prefix}1"
    counts = f"{tasks_per_node}(x{nodes})" if nodes > 1 else str(tasks_per_node)
    gpus = tasks_per_node if gpus_per_node is None else gpus_per_node
    env = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NODELIST": hosts,
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NTASKS": str(nodes * tasks_per_node),
        "SLURM_TASKS_PER_NODE": counts,
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": hosts,
        "SLURM_STEP_NUM_TASKS": str(nodes * tasks_per_node),
        "SLURM_STEP_TASKS_PER_NODE": counts,
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(node * tasks_per_node + local),
        "SLURM_LOCALID": str(local),
    }
    if gpus:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    return env


def torchrun_worker(
    nodes: int, nproc: int, node: int, local: int, *, master: str = "node1", port: int = 29500
) -> dict[str, str]:
    """The variables torchrun gives worker ``local`` of the agent on node ``node``."""
    return {
        "RANK": str(node * nproc + local),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(nodes * nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nodes),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "none",
    }


_SHOWN_FIELDS = (
    "rank",
    "local_rank",
    "world_size",
    "local_world_size",
    "node_rank",
    "num_nodes",
    "master_addr",
    "master_port",
    "launcher",
)


def whoami(environ: Mapping[str, str], **spawn) -> dict:
    """What common.env makes of ``environ`` (and of an mp.spawn index: ``spawn_index=``,
    ``spawn_nprocs=``), without the checks against this machine (host names, free ports).
    Raises LaunchError, as the job would."""
    from common.env import resolve_launch_env

    env = resolve_launch_env(dict(environ), argv=[], **spawn)
    return {k: v for k, v in env.as_dict().items() if k in _SHOWN_FIELDS}


def show_whoami(environ: Mapping[str, str], **spawn) -> None:
    """Print :func:`whoami` as one JSON line, or the LaunchError the job would stop with."""
    from common.env import LaunchError

    try:
        print(json.dumps(whoami(environ, **spawn)))
    except LaunchError as exc:
        print(f"LaunchError: {exc}")


# --------------------------------------------------------------------------- pictures


def layout(environs: Iterable[Mapping[str, str]], **spawn) -> list[dict] | str:
    """Resolve every process of a job; the LaunchError text if the job would stop."""
    from common.env import LaunchError

    try:
        return [whoami(e, **s) for e, s in _pairs(environs, spawn)]
    except LaunchError as exc:
        return str(exc)


def _pairs(environs, spawn):
    for e in environs:
        if isinstance(e, tuple):  # (environ, {"spawn_index": i, "spawn_nprocs": n})
            yield e
        else:
            yield e, spawn


def plot_layouts(layouts: Mapping[str, list[dict] | str], gpus_per_node: int = 2):
    """One row per job layout: nodes as boxes, the processes on them as ranks on GPUs.

    ``layouts`` maps a title to the resolved processes (:func:`layout`) or an error text.
    A process may name its machine under "host" (default: "node <node_rank>").
    """
    import textwrap

    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fig, axes = plt.subplots(len(layouts), 1, figsize=(8, 1.9 * len(layouts)), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, (title, procs) in zip(axes[:, 0], layouts.items(), strict=True):
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_axis_off()
        ax.set_xlim(0, 8)
        ax.set_ylim(0, 2)
        if isinstance(procs, str):
            ax.text(
                0.1,
                1.0,
                "\n".join(textwrap.wrap(procs, 95)),
                fontsize=8,
                color="darkred",
                va="center",
                family="monospace",
            )
            continue
        # Processes are grouped by their "host" entry where given, else by node rank.
        hosts = list(dict.fromkeys(_host(p) for p in procs))
        width = 8 / len(hosts)
        for n, host in enumerate(hosts):
            x0 = n * width + 0.1
            ax.add_patch(
                FancyBboxPatch(
                    (x0, 0.1), width - 0.2, 1.8, boxstyle="round,pad=0.02", fc="#f2f2f2", ec="gray"
                )
            )
            ax.text(x0 + 0.1, 1.7, host, fontsize=9, va="center")
            on_node = sorted((p for p in procs if _host(p) == host), key=lambda p: p["local_rank"])
            slots = max(gpus_per_node, len(on_node))
            slot_w = (width - 0.4) / slots
            for p in on_node:
                x = x0 + 0.1 + p["local_rank"] * slot_w
                ax.add_patch(
                    FancyBboxPatch(
                        (x + 0.05, 0.3),
                        slot_w - 0.1,
                        1.1,
                        boxstyle="round,pad=0.02",
                        fc=colors[p["rank"] % 10],
                        alpha=0.8,
                        ec="none",
                    )
                )
                ax.text(
                    x + slot_w / 2,
                    0.85,
                    f"rank {p['rank']}\nlocal {p['local_rank']}\nGPU {p['local_rank']}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                )
    _show(fig)
    # The same in words: a picture is not compared by nbval, this text is.
    for title, procs in layouts.items():
        if isinstance(procs, str):
            print(f"{title}\n  stops: {procs}")
            continue
        hosts = list(dict.fromkeys(_host(p) for p in procs))
        print(title)
        for host in hosts:
            ranks = sorted((p["local_rank"], p["rank"]) for p in procs if _host(p) == host)
            print(f"  {host}: " + ", ".join(f"local {lr} = rank {r}" for lr, r in ranks)
                  + f" (world {procs[0]['world_size']}, {procs[0]['launcher']})")


def _host(proc: dict) -> str:
    return proc.get("host", f"node {proc['node_rank']}")
