"""The command line of common/env.py: ``python -m common.env [--export]``.

Every job script asks it who the job is before starting anything: one JSON line per task
(``srun python -m common.env``), or ``export NAME=value`` lines for a per-node launcher
(``eval "$(python -m common.env --export)"``).  A bad launch is one line on stderr, exit 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence

from common import env as env_module
from common.env import (
    LaunchEnv,
    LaunchError,
    _opt_int_var,
    expand_hostlist,
    gpus_on_node,
    resolve_launch_env,
)
from common.launch import check_launch, check_master_addr, cuda_device_index


def nproc_per_node(environ: Mapping[str, str] | None = None) -> int:
    """Processes for a per-node launcher (torchrun): the GPUs SLURM gave this node, else the
    visible CUDA devices, else 1."""
    return gpus_on_node(environ) or _cuda_device_count() or 1


def export_values(env: LaunchEnv, environ: Mapping[str, str] | None = None) -> dict:
    """``python -m common.env --export``: torchrun's ``--master-addr --master-port --nnodes
    --node-rank --nproc-per-node`` for a shell script.  In the batch script NNODES is the job's
    node count (NODE_RANK 0 holds for its node only).  RANK and WORLD_SIZE are not exported:
    every process started from that shell would inherit them and take them for its own."""
    environ = os.environ if environ is None else environ
    nproc = nproc_per_node(environ)
    if env.launcher == "slurm" and env.local_world_size > 1:
        # These values are for ONE launcher per node. With several srun tasks here, each would
        # start a launcher claiming the same NODE_RANK and port: stop before they fight over it.
        raise LaunchError(
            f"double spawn: srun started {env.local_world_size} tasks on this node "
            f"(SLURM_STEP_TASKS_PER_NODE) and each would start a per-node launcher with "
            f"NPROC_PER_NODE={nproc} processes. A per-node launcher needs exactly one task per "
            f"node: srun --ntasks=$SLURM_NNODES --ntasks-per-node=1 (or drop the launcher and let "
            f"srun start one task per process)."
        )
    num_nodes = env.num_nodes
    if env.launcher == "single" and environ.get("SLURM_JOB_ID"):
        num_nodes = (
            _opt_int_var(environ, "SLURM_JOB_NUM_NODES", minimum=1)
            or _opt_int_var(environ, "SLURM_NNODES", minimum=1)
            or 1
        )
        if num_nodes > 1:  # the batch script hands these to processes on every node
            if not environ.get("MASTER_ADDR") and environ.get("SLURM_JOB_NODELIST"):
                # Node 0 of a step over the whole job, where its rank 0 runs: the job's first
                # host. The batch script runs there unless `sbatch --batch=<features>` put it
                # on another node (pick_batch_host, slurmctld/node_scheduler.c).
                first = expand_hostlist(environ["SLURM_JOB_NODELIST"], "SLURM_JOB_NODELIST")[0]
                env = dataclasses.replace(env, master_addr=first)
            check_master_addr(dataclasses.replace(env, num_nodes=num_nodes))
    return {
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": env.master_port,
        "NNODES": num_nodes,
        "NODE_RANK": env.node_rank,
        "NPROC_PER_NODE": nproc,
    }


# How torch reaches a GPU: NVIDIA's control device, AMD's kernel driver (ROCm), WSL2's bridge.
# Where none exists, no process sees a GPU, and asking torch would cost its import (about 2 s
# of CPU) in every `python -m common.env` of every job script.
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def _cuda_device_count(driver_files: Sequence[str] = GPU_DRIVER_FILES) -> int:
    if not any(os.path.exists(path) for path in driver_files):
        return 0
    import torch  # imported late: only a machine with a GPU driver pays for it

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def main(args: Sequence[str]) -> int:
    # torch.distributed.launch passes --local-rank=N to the module it starts; it is not ours.
    args = [a for a in args if not a.startswith(("--local-rank", "--local_rank"))]
    if args and args[0] in ("-h", "--help"):
        summary = (env_module.__doc__ or "").split("\n\n")[0]
        print(f"usage: python -m common.env [--export]\n\n{summary}")
        return 0
    if args and args != ["--export"]:
        print(f"common.env: unknown argument {args[0]!r}; usage: python -m common.env [--export]",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        env = resolve_launch_env()
        check_launch(env)
        gpus = _cuda_device_count()
        if gpus:
            cuda_device_index(env, gpus)
        if args == ["--export"]:
            for name, value in export_values(env).items():
                print(f"export {name}={shlex.quote(str(value))}")
        else:
            print(json.dumps({**env.as_dict(), "backend": "nccl" if gpus else "gloo"}))
    except LaunchError as exc:
        print(f"common.env: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
