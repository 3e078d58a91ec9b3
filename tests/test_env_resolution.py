"""common.env: every resolution rule and every fail-fast case, table-driven.

The environments are written out as SLURM / torchrun set them (see the variable lists that
`srun env` and a torchrun worker print).  Checks against this machine (name resolution, a busy
port) use real sockets.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.env import (  # noqa: E402
    LaunchEnv,
    LaunchError,
    _torch_launcher,
    expand_hostlist,
    master_port_for_job,
    parse_tasks_per_node,
    resolve_launch_env,
)
from common.launch import check_launch  # noqa: E402


def resolve(environ, check=False, **kwargs):
    """resolve_launch_env, then (``check``) check_launch, as a lesson's set-up calls them."""
    kwargs.setdefault("argv", ["train.py"])
    env = resolve_launch_env(environ, **kwargs)
    if check:
        check_launch(env, environ)
    return env


def slurm_step(procid, localid, nodeid, ntasks, nodelist, tasks_per_node, job_id="1234", **extra):
    """The variables srun gives one task of a job step."""
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURM_TASKS_PER_NODE": tasks_per_node,
        **extra,
    }


def torchrun_worker(rank, local_rank, world, local_world, group_rank, group_world, **extra):
    """The variables a torchrun agent gives one worker."""
    return {
        "TORCHELASTIC_RUN_ID": "run1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(group_world),
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": "29400",
        **extra,
    }


# Batch script of `sbatch --nodes=2 --ntasks-per-node=2` (no srun): as printed on the local cluster.
BATCH_SCRIPT = {
    "SLURM_JOB_ID": "77",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURMD_NODENAME": "node1",
}

FIELDS = "launcher rank local_rank world_size local_world_size node_rank num_nodes".split()

RESOLUTION_CASES = [
    # id, environ, kwargs, expected (launcher, rank, local_rank, world, local_world, node, nodes),
    # master_addr, master_port (None: any valid port)
    ("single", {}, {}, ("single", 0, 0, 1, 1, 0, 1), "127.0.0.1", None),
    ("single-port", {"MASTER_PORT": "12345"}, {}, ("single", 0, 0, 1, 1, 0, 1), "127.0.0.1", 12345),
    (
        "torchrun-one-node",
        torchrun_worker(1, 1, 2, 2, 0, 1),
        {},
        ("torchrun", 1, 1, 2, 2, 0, 1),
        "localhost",
        29400,
    ),
    (
        "torchrun-four-nodes",
        torchrun_worker(5, 1, 8, 2, 2, 4, MASTER_ADDR="gpu01"),
        {},
        ("torchrun", 5, 1, 8, 2, 2, 4),
        "gpu01",
        29400,
    ),
    (
        "launch-local-rank-flag",
        torchrun_worker(1, 1, 2, 2, 0, 1),
        {"argv": ["train.py", "--local-rank=1"]},
        ("torch.distributed.launch", 1, 1, 2, 2, 0, 1),
        "localhost",
        29400,
    ),
    (
        "launch-old-underscore-flag",
        torchrun_worker(0, 0, 2, 2, 0, 1),
        {"argv": ["train.py", "--local_rank=0"]},
        ("torch.distributed.launch", 0, 0, 2, 2, 0, 1),
        "localhost",
        29400,
    ),
    (
        "env-by-hand",
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "23000"},
        {},
        ("env", 1, 1, 2, 2, 0, 1),
        "10.0.0.5",
        23000,
    ),
    (
        "env-defaults-addr-and-port",
        {"RANK": "0", "WORLD_SIZE": "2"},
        {},
        ("env", 0, 0, 2, 2, 0, 1),
        "127.0.0.1",
        29500,
    ),
    (
        "env-two-nodes-local-vars",
        {
            "RANK": "3",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "n1",
        },
        {},
        ("env", 3, 1, 4, 2, 1, 2),
        "n1",
        29500,
    ),
    (
        "env-inside-srun",
        {"RANK": "1", "WORLD_SIZE": "4", **slurm_step(1, 1, 0, 4, "node[1-2]", "2(x2)")},
        {},
        ("env", 1, 1, 4, 2, 0, 2),
        "node1",
        16234,
    ),
    (
        "slurm-2x2",
        slurm_step(3, 1, 1, 4, "node[1-2]", "2(x2)"),
        {},
        ("slurm", 3, 1, 4, 2, 1, 2),
        "node1",
        15000 + 1234,
    ),
    (
        "slurm-uneven-2(x3),1",
        slurm_step(6, 0, 3, 7, "gpu[01-03,07]", "2(x3),1"),
        {},
        ("slurm", 6, 0, 7, 1, 3, 4),
        "gpu01",
        16234,
    ),
    (
        "slurm-master-addr-set",
        slurm_step(0, 0, 0, 2, "node[1-2]", "1(x2)", MASTER_ADDR="10.1.1.1", MASTER_PORT="3000"),
        {},
        ("slurm", 0, 0, 2, 1, 0, 2),
        "10.1.1.1",
        3000,
    ),
    (
        # Every array task is a job with its own SLURM_JOB_ID: the port follows the job id alone
        # (adding the task id would give job 100's task 3 the port of job 103).
        "slurm-array-task",
        slurm_step(0, 0, 0, 1, "node1", "1", job_id="100", SLURM_ARRAY_TASK_ID="3"),
        {},
        ("slurm", 0, 0, 1, 1, 0, 1),
        "node1",
        15100,
    ),
    (
        "slurm-fallback-job-variables",
        {
            "SLURM_JOB_ID": "9",
            "SLURM_STEPID": "0",
            "SLURM_PROCID": "2",
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": "1",
            "SLURM_NTASKS": "3",
            "SLURM_JOB_NODELIST": "cpu[1,5]",
            "SLURM_TASKS_PER_NODE": "2,1",
        },
        {},
        ("slurm", 2, 0, 3, 1, 1, 2),
        "cpu1",
        15009,
    ),
    (
        "sbatch-script-is-one-process",
        BATCH_SCRIPT,
        {},
        ("single", 0, 0, 1, 1, 0, 1),
        "node1",
        15077,
    ),
    (
        # Slurm 26.05 exports the batch step's id with "%d" (src/common/env.c, setup_env).
        "sbatch-script-26.05-step-id-minus-5",
        {**BATCH_SCRIPT, "SLURM_STEP_ID": "-5", "SLURM_STEPID": "-5"},
        {},
        ("single", 0, 0, 1, 1, 0, 1),
        "node1",
        15077,
    ),
    (
        "sbatch-script-unsigned-sentinel",
        {**BATCH_SCRIPT, "SLURM_STEP_ID": "4294967291"},
        {},
        ("single", 0, 0, 1, 1, 0, 1),
        "node1",
        15077,
    ),
    (
        "mp.spawn-alone",
        {"MASTER_PORT": "24000"},
        {"spawn_index": 1, "spawn_nprocs": 2},
        ("mp.spawn", 1, 1, 2, 2, 0, 1),
        "127.0.0.1",
        24000,
    ),
    (
        "mp.spawn-default-port",
        {},
        {"spawn_index": 0, "spawn_nprocs": 3},
        ("mp.spawn", 0, 0, 3, 3, 0, 1),
        "127.0.0.1",
        29500,
    ),
    (
        "mp.spawn-per-node-under-srun",
        slurm_step(1, 0, 1, 2, "node[1-2]", "1(x2)"),
        {"spawn_index": 1, "spawn_nprocs": 2},
        ("mp.spawn", 3, 1, 4, 2, 1, 2),
        "node1",
        16234,
    ),
    (
        "mp.spawn-in-batch-script",
        BATCH_SCRIPT,
        {"spawn_index": 1, "spawn_nprocs": 2},
        ("mp.spawn", 1, 1, 2, 2, 0, 1),
        "node1",
        15077,
    ),
    (
        "mp.spawn-one-proc-inside-torchrun",
        torchrun_worker(1, 1, 2, 2, 0, 1),
        {"spawn_index": 0, "spawn_nprocs": 1},
        ("torchrun", 1, 1, 2, 2, 0, 1),
        "localhost",
        29400,
    ),
    # pyxis (srun --container-image, an image that defines PYTORCH_VERSION) sets RANK and
    # LOCAL_RANK to SLURM_PROCID and SLURM_LOCALID in every task (pytorch_setup); enroot's hook
    # 50-slurm-pytorch.sh adds WORLD_SIZE=SLURM_NTASKS, MASTER_ADDR and MASTER_PORT (61000 +
    # job id % 4536). Read as srun's own: ranks node by node, the hook's address and port.
    (
        "pyxis-rank-and-local-rank",
        slurm_step(3, 1, 1, 4, "node[1-2]", "2(x2)", RANK="3", LOCAL_RANK="1"),
        {},
        ("slurm", 3, 1, 4, 2, 1, 2),
        "node1",
        16234,
    ),
    (
        "pyxis-with-enroot-hook",
        slurm_step(2, 0, 1, 4, "node[1-2]", "2(x2)", RANK="2", LOCAL_RANK="0", WORLD_SIZE="4",
                   MASTER_ADDR="node1", MASTER_PORT="62234"),  # fmt: skip
        {},
        ("slurm", 2, 0, 4, 2, 1, 2),
        "node1",
        62234,
    ),
    (
        "pyxis-mp.spawn-per-node",
        slurm_step(1, 0, 1, 2, "node[1-2]", "1(x2)", RANK="1", LOCAL_RANK="0"),
        {"spawn_index": 1, "spawn_nprocs": 2},
        ("mp.spawn", 3, 1, 4, 2, 1, 2),
        "node1",
        16234,
    ),
    (
        "pyxis-hook-mp.spawn-per-node",
        slurm_step(0, 0, 0, 2, "node[1-2]", "1(x2)", RANK="0", LOCAL_RANK="0", WORLD_SIZE="2",
                   MASTER_ADDR="node1", MASTER_PORT="62234", OMP_NUM_THREADS="1"),  # fmt: skip
        {"spawn_index": 0, "spawn_nprocs": 2},
        ("mp.spawn", 0, 0, 4, 2, 0, 2),
        "node1",
        62234,
    ),
    (
        "torchrun-under-srun-one-task-per-node",
        {**slurm_step(1, 0, 1, 2, "node[1-2]", "1(x2)"), **torchrun_worker(3, 1, 4, 2, 1, 2)},
        {},
        ("torchrun", 3, 1, 4, 2, 1, 2),
        "localhost",
        29400,
    ),
    (
        "torchrun-one-worker-under-srun-2-per-node",
        {**slurm_step(1, 1, 0, 2, "node1", "2"), **torchrun_worker(1, 0, 2, 1, 1, 2)},
        {},
        ("torchrun", 1, 0, 2, 1, 1, 2),
        "localhost",
        29400,
    ),
]


@pytest.mark.parametrize(
    "environ,kwargs,expected,addr,port",
    [pytest.param(*case[1:], id=case[0]) for case in RESOLUTION_CASES],
)
def test_resolution(environ, kwargs, expected, addr, port):
    env = resolve(environ, **kwargs)
    assert tuple(getattr(env, f) for f in FIELDS) == expected
    assert env.master_addr == addr
    if port is None:
        assert 1 <= env.master_port <= 65535
    else:
        assert env.master_port == port
    assert env.job_id == environ.get("SLURM_JOB_ID")
    assert env.hostname == socket.gethostname()
    assert env.as_dict()["rank"] == env.rank and set(env.as_dict()) >= set(FIELDS)


def test_launch_env_is_frozen():
    env = resolve({})
    assert isinstance(env, LaunchEnv)
    with pytest.raises(AttributeError):
        env.rank = 3


AGENT = {"TORCHELASTIC_RUN_ID": "x"}
TORCHRUN = "python3 /venv/bin/torchrun --nproc-per-node 2 t.py"
RUN_MODULE = "python -m torch.distributed.run --nproc-per-node 2 t.py"
LAUNCH = "python -m torch.distributed.launch --use-env --nproc_per_node 2 t.py"
LAUNCH_NO_PYTHON = "python -m torch.distributed.launch --use-env --no-python run.sh"


@pytest.mark.parametrize(
    "environ,argv,ancestors,expected",
    [
        (AGENT, ["t.py"], [TORCHRUN], "torchrun"),
        (AGENT, ["t.py"], [RUN_MODULE], "torchrun"),
        (AGENT, ["t.py"], [LAUNCH], "torch.distributed.launch"),
        (AGENT, ["t.py"], ["bash run.sh", LAUNCH_NO_PYTHON], "torch.distributed.launch"),
        (AGENT, ["t.py", "--local-rank=0"], [], "torch.distributed.launch"),
        (AGENT, ["t.py"], [], "torchrun"),
        (
            AGENT,
            ["t.py"],
            ["bash lessons/04_torchrun_enroot/x.sh", LAUNCH],
            "torch.distributed.launch",
        ),
        ({"RANK": "0"}, ["t.py"], ["bash"], "env"),
    ],
)
def test_torch_launcher_detection(environ, argv, ancestors, expected):
    assert _torch_launcher(environ, argv, ancestors) == expected


@pytest.mark.parametrize(("launcher", "expected"), [
    (["-m", "torch.distributed.launch", "--use-env"], "torch.distributed.launch"),
    (["-m", "torch.distributed.run"], "torchrun"),
])  # fmt: skip
def test_launcher_named_from_the_real_agent(launcher, expected):
    """The agent's command line read from /proc (common/env.py's agent_launcher): with
    --use-env, torch.distributed.launch sets exactly what torchrun sets."""
    from common.env import find_free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, *launcher, "--nproc_per_node", "1", "--master_port",
           str(find_free_port()), "-m", "common.env"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["launcher"] == expected, proc.stdout


HOSTLIST_CASES = [
    ("node1", ["node1"]),
    ("node[1-2]", ["node1", "node2"]),
    ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
    ("n[001-002]", ["n001", "n002"]),  # zero padding kept
    ("rack[1-2]-gpu[08-09]", ["rack1-gpu08", "rack1-gpu09", "rack2-gpu08", "rack2-gpu09"]),
    ("a[1,3],b[09-10],c", ["a1", "a3", "b09", "b10", "c"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
]


@pytest.mark.parametrize("text,hosts", HOSTLIST_CASES, ids=[c[0] for c in HOSTLIST_CASES])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-", "node[3-1]", "node]1[", ""])
def test_bad_hostlist_names_the_variable(text):
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST"):
        expand_hostlist(text, "SLURM_JOB_NODELIST")


@pytest.mark.parametrize(
    "text,counts",
    [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("1(x2)", [1, 1]), ("3,2(x2)", [3, 2, 2])],
)
def test_tasks_per_node(text, counts):
    assert parse_tasks_per_node(text) == counts


def test_master_port_for_job():
    ports = [master_port_for_job(job) for job in range(1, 40000, 7)]
    assert all(1024 <= p < 32768 for p in ports)  # unprivileged, below the ephemeral range
    assert master_port_for_job(1234) == master_port_for_job("1234")  # every task agrees
    assert len({master_port_for_job(j) for j in range(500, 600)}) == 100  # neighbours differ
    for bad in ("-5", "0", "1_0", "+3", "\u0663", "\uff13"):
        with pytest.raises(LaunchError, match="SLURM_JOB_ID"):
            master_port_for_job(bad)

