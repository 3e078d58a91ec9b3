"""common.env and common.launch refuse a bad launch in one line: every fail-fast case,
table-driven, and the GPU a rank drives (or why it may not).  The environments are written out
as SLURM and torchrun set them (tests/test_env_resolution.py's helpers); checks against this
machine (name resolution, a busy port) use real sockets.
"""

import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from test_env_resolution import resolve, slurm_step, torchrun_worker  # noqa: E402

from common.env import LaunchError  # noqa: E402
from common.launch import cuda_device_index  # noqa: E402

ERROR_CASES = [
    # id, environ, kwargs, strings the message must contain
    ("rank-not-int", {"RANK": "one", "WORLD_SIZE": "2"}, {}, ["RANK", "'one'"]),
    ("world-missing", {"RANK": "0"}, {}, ["WORLD_SIZE"]),
    ("agent-without-rank", {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}, {}, ["RANK"]),
    ("rank-too-big", {"RANK": "2", "WORLD_SIZE": "2"}, {}, ["RANK=2", "WORLD_SIZE=2"]),
    ("world-zero", {"RANK": "0", "WORLD_SIZE": "0"}, {}, ["WORLD_SIZE=0"]),
    (
        "local-rank-without-size",
        {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"},
        {},
        ["LOCAL_RANK", "LOCAL_WORLD_SIZE"],
    ),
    (
        "local-size-without-rank",
        {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
        {},
        ["LOCAL_RANK", "LOCAL_WORLD_SIZE"],
    ),
    (
        "local-rank-too-big",
        {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
        {},
        ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"],
    ),
    (
        "slurm-localid-missing",
        {
            k: v
            for k, v in slurm_step(0, 0, 0, 2, "n[1-2]", "1(x2)").items()
            if k != "SLURM_LOCALID"
        },
        {},
        ["SLURM_LOCALID", "srun"],
    ),
    ("slurm-procid-not-int", slurm_step("a", 0, 0, 2, "n[1-2]", "1(x2)"), {}, ["SLURM_PROCID"]),
    ("slurm-procid-too-big", slurm_step(4, 1, 1, 4, "n[1-2]", "2(x2)"), {}, ["SLURM_PROCID=4"]),
    ("slurm-ntasks-not-int", slurm_step(0, 0, 0, "x", "n1", "1"), {}, ["SLURM_STEP_NUM_TASKS"]),
    (
        "slurm-counts-disagree",
        slurm_step(0, 0, 0, 3, "n[1-2]", "2(x2)"),
        {},
        ["SLURM_STEP_NUM_TASKS=3", "SLURM_STEP_TASKS_PER_NODE"],
    ),
    (
        "slurm-nodes-disagree",
        slurm_step(0, 0, 0, 6, "n[1-2]", "2(x3)"),
        {},
        ["SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NODELIST"],
    ),
    ("slurm-bad-nodelist", slurm_step(0, 0, 0, 2, "node[1-", "1(x2)"), {}, ["SLURM_STEP_NODELIST"]),
    (
        "slurm-bad-tasks-per-node",
        slurm_step(0, 0, 0, 2, "n[1-2]", "1(x"),
        {},
        ["SLURM_STEP_TASKS_PER_NODE"],
    ),
    (
        "slurm-nodeid-too-big",
        slurm_step(1, 0, 2, 2, "n[1-2]", "1(x2)"),
        {},
        ["SLURM_NODEID=2"],
    ),
    ("slurm-job-id-not-int", slurm_step(0, 0, 0, 1, "n1", "1", job_id="abc"), {}, ["SLURM_JOB_ID"]),
    (
        "world-size-disagrees-with-srun",
        {"RANK": "0", "WORLD_SIZE": "2", **slurm_step(0, 0, 0, 4, "n[1-2]", "2(x2)")},
        {},
        ["WORLD_SIZE=2", "SLURM_STEP_NUM_TASKS=4"],
    ),
    (
        # RANK that is not SLURM_PROCID in an srun task, no WORLD_SIZE: not pyxis's; say so.
        "rank-by-hand-in-srun-without-world-size",
        {"RANK": "2", "LOCAL_RANK": "0", **slurm_step(0, 0, 0, 4, "n[1-2]", "2(x2)")},
        {},
        ["WORLD_SIZE is not set", "RANK=2", "SLURM_PROCID=0", "pyxis", "unset RANK"],
    ),
    (
        "pyxis-local-rank-missing",
        {"RANK": "1", **slurm_step(1, 1, 0, 4, "n[1-2]", "2(x2)")},
        {},
        ["WORLD_SIZE is not set", "LOCAL_RANK=<not set>", "pyxis"],
    ),
    (
        # srun --preserve-env keeps the job's SLURM_NTASKS, from which the hook sets WORLD_SIZE.
        "pyxis-hook-world-size-of-the-job",
        {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
         **slurm_step(1, 1, 0, 2, "n1", "2", SLURM_NTASKS="4")},  # fmt: skip
        {},
        ["WORLD_SIZE=4", "SLURM_STEP_NUM_TASKS=2", "50-slurm-pytorch.sh"],
    ),
    (
        "torchrun-nnodes-disagrees-with-srun",
        {**slurm_step(0, 0, 0, 2, "n[1-2]", "1(x2)"), **torchrun_worker(0, 0, 2, 2, 0, 1)},
        {},
        ["GROUP_WORLD_SIZE=1", "SLURM_STEP_NUM_TASKS=2", "--nnodes"],
    ),
    (
        "double-spawn-torchrun",
        {**slurm_step(1, 1, 0, 4, "n[1-2]", "2(x2)"), **torchrun_worker(1, 1, 8, 2, 1, 4)},
        {},
        ["double spawn", "SLURM_STEP_TASKS_PER_NODE", "LOCAL_WORLD_SIZE", "--ntasks=$SLURM_NNODES"],
    ),
    (
        "double-spawn-mp.spawn",
        slurm_step(1, 1, 0, 4, "n[1-2]", "2(x2)"),
        {"spawn_index": 0, "spawn_nprocs": 2},
        ["double spawn", "SLURM_STEP_TASKS_PER_NODE", "mp.spawn", "--ntasks=$SLURM_NNODES"],
    ),
    (
        "mp.spawn-inside-torchrun",
        torchrun_worker(0, 0, 2, 2, 0, 1),
        {"spawn_index": 0, "spawn_nprocs": 2},
        ["double spawn", "RANK", "--nproc-per-node"],
    ),
    ("spawn-index-alone", {}, {"spawn_index": 0}, ["spawn_nprocs"]),
    ("spawn-index-too-big", {}, {"spawn_index": 2, "spawn_nprocs": 2}, ["spawn_index=2"]),
    ("port-not-int", {"MASTER_PORT": "http"}, {}, ["MASTER_PORT", "'http'"]),
    ("port-zero", {"MASTER_PORT": "0"}, {}, ["MASTER_PORT=0", "1-65535"]),
    ("port-too-big", {"MASTER_PORT": "70000"}, {}, ["MASTER_PORT=70000", "1-65535"]),
    (
        "multi-node-without-master-addr",
        {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
        {},
        ["MASTER_ADDR"],
    ),
    (
        "master-addr-does-not-resolve",
        {"MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "23001"},
        {"check": True},
        ["MASTER_ADDR='no-such-host.invalid'", "does not resolve"],
    ),
]


@pytest.mark.parametrize(
    "environ,kwargs,needles", [pytest.param(*c[1:], id=c[0]) for c in ERROR_CASES]
)
def test_fail_fast(environ, kwargs, needles):
    with pytest.raises(LaunchError) as info:
        resolve(environ, **kwargs)
    for needle in needles:
        assert needle in str(info.value)


@pytest.fixture
def busy_port():
    """A port on which something really listens."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_busy_port_fails_for_rank0_that_binds(busy_port):
    environ = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": str(busy_port)}
    with pytest.raises(LaunchError, match=f"MASTER_PORT={busy_port} is already in use"):
        resolve(environ, check=True)
    with pytest.raises(LaunchError, match="MASTER_PORT"):
        resolve({"MASTER_PORT": str(busy_port)}, spawn_index=0, spawn_nprocs=2, check=True)


def test_busy_port_is_fine_when_someone_else_binds(busy_port):
    # Rank 1 only connects; under torchrun the agent already holds the port.
    resolve({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": str(busy_port)}, check=True)
    resolve(torchrun_worker(0, 0, 2, 2, 0, 1, MASTER_PORT=str(busy_port)), check=True)


def test_free_port_and_resolving_host_pass_checks():
    env = resolve({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost"}, check=True)
    assert env.master_addr == "localhost"


CLOSEST = "shared with other tasks: --gpu-bind=closest"
CROWDED = "LOCAL_WORLD_SIZE.*visible GPUs.*--gpus-per-node"


@pytest.mark.parametrize(
    "local_rank,local_world,visible,gpus_on_node,extra,index",
    [
        (1, 2, 2, None, {}, 1),  # one GPU per local rank: cuda:<local_rank>
        (3, 4, 8, "8", {}, 3),
        (1, 2, 1, "2", {}, 0),  # --gpus-per-task=1: each task sees only its own GPU
        (1, 2, 1, "2", {"SLURM_GPU_BIND": "single:1"}, 0),
        # --gpus-per-task=2: task 3 drives the second GPU of its own pair
        (3, 4, 2, "8", {"SLURM_GPUS_PER_TASK": "2"}, 1),
        # --gpu-bind=closest, 8 tasks on 8 GPUs in 2 sockets: local rank 5 sees 4,5,6,7, and so
        # do 4, 6, 7 (block over sockets) or 1, 3, 7 (cyclic, srun's default): refused
        (5, 8, 4, "8", {"SLURM_GPU_BIND": "closest"}, CLOSEST),
        (4, 8, 4, "8", {}, CLOSEST),
        (1, 4, 2, "2", {}, CROWDED),  # 4 processes, 2 GPUs: would share
        (1, 2, 1, "1", {}, CROWDED),  # 2 tasks, 1 GPU on the node
        (1, 2, 1, None, {}, CROWDED),
        (5, 8, 4, "4", {}, CROWDED),  # a set of 4 on a node of 4 is all of them: 8 would share
    ],
)
def test_cuda_device_index(local_rank, local_world, visible, gpus_on_node, extra, index):
    env = resolve({"RANK": str(local_rank), "WORLD_SIZE": "8", "LOCAL_RANK": str(local_rank),
                   "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": "n1"})  # fmt: skip
    environ = {"CUDA_VISIBLE_DEVICES": "0", **extra}
    if gpus_on_node:
        environ["SLURM_GPUS_ON_NODE"] = gpus_on_node
    if isinstance(index, str):
        with pytest.raises(LaunchError, match=index) as err:
            cuda_device_index(env, visible, environ)
        assert "\n" not in str(err.value)
    else:
        assert cuda_device_index(env, visible, environ) == index


@pytest.mark.parametrize(
    "bind,local_world,repeated",
    [
        ("map_gpu:0,0", 2, "local tasks 0 and 1 to the same GPU 0"),
        ("verbose,map_gpu:1,0,1", 3, "local tasks 0 and 2 to the same GPU 1"),
        ("map_gpu:0*2,1", 3, "local tasks 0 and 1 to the same GPU 0"),
        ("map_gpu:0,1,0", 2, None),  # the repeat is for a third task that this node lacks
        ("closest", 8, None),
    ],
)
def test_a_gpu_map_that_repeats_a_gpu_is_refused(bind, local_world, repeated):
    """--gpu-bind=map_gpu:0,0 (SLURM_GPU_BIND): two tasks on one GPU, said before NCCL's
    "Duplicate GPU detected"."""
    env = resolve({"RANK": "0", "WORLD_SIZE": str(local_world), "LOCAL_RANK": "0",
                   "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": "n1"})  # fmt: skip
    environ = {"SLURM_GPU_BIND": bind, "SLURM_GPUS_ON_NODE": str(local_world)}
    if repeated is None:
        assert cuda_device_index(env, 1, environ) == 0
    else:
        with pytest.raises(LaunchError, match=f"SLURM_GPU_BIND=.*binds {repeated}"):
            cuda_device_index(env, 1, environ)
