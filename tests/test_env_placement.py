"""common.env: where rank 0 runs when srun does not place tasks in block order.

srun's block, cyclic and plane distributions put task 0 on the first node of the step; with
``--distribution=arbitrary`` task i runs on the i-th host of SLURM_HOSTFILE (srun(1)), so rank
0, which hosts the rendezvous under ``env://``, can be on any node. Table-driven, as SLURM sets
the variables (the step of ``SLURM_HOSTFILE=hosts srun -n4 --distribution=arbitrary``, measured on
the local cluster: every task sees SLURM_DISTRIBUTION=arbitrary and the file's path). The jobs
themselves run in tests/test_site_rank0.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.env import LaunchError, resolve_launch_env  # noqa: E402
from common.preflight import check_rank0_here  # noqa: E402


def task(procid, nodeid, node, **extra):
    """One task of a 4-task step over node[1-2], 2 tasks per node."""
    return {
        "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid % 2), "SLURM_NODEID": str(nodeid), "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURMD_NODENAME": node, **extra,
    }  # fmt: skip


def hostfile(tmp_path, text):
    path = tmp_path / "hosts"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "file_text, distribution, master",
    [
        ("node2\nnode2\nnode1\nnode1\n", "arbitrary", "node2"),
        ("node2,node2,node1,node1\n", "arbitrary", "node2"),  # one line, commas
        ("node[2-2]\nnode2\nnode1\nnode1\n", "arbitrary", "node2"),  # a host list expression
        ("node1\nnode1\nnode2\nnode2\n", "arbitrary", "node1"),
        ("node2\nnode2\nnode1\nnode1\n", "block", "node1"),  # the file is not used then
        ("node2\nnode2\nnode1\nnode1\n", "cyclic", "node1"),
    ],
)
def test_rank0_host_follows_the_distribution(tmp_path, file_text, distribution, master):
    environ = task(2, 0, "node1", SLURM_DISTRIBUTION=distribution,
                   SLURM_HOSTFILE=hostfile(tmp_path, file_text))  # fmt: skip
    env = resolve_launch_env(environ, argv=["train.py"], check=False)
    assert env.master_addr == master and env.rank == 2


def test_the_batch_script_of_an_arbitrary_job_names_rank0s_node(tmp_path):
    """The batch script runs on the job's first node; its `python -m common.env --export`
    hands MASTER_ADDR to every task, so it must name rank 0's node, not its own."""
    environ = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
               "SLURM_NODEID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "node[1-2]",
               "SLURM_JOB_NUM_NODES": "2", "SLURMD_NODENAME": "node1",
               "SLURM_DISTRIBUTION": "arbitrary",
               "SLURM_HOSTFILE": hostfile(tmp_path, "node2\nnode2\nnode1\nnode1\n")}  # fmt: skip
    env = resolve_launch_env(environ, argv=["job.sh"], check=False)
    assert env.launcher == "single" and env.master_addr == "node2"


@pytest.mark.parametrize(
    "path_of, needle",
    [
        (lambda tmp: str(tmp / "missing"), "cannot be read here (No such file or directory)"),
        (lambda tmp: hostfile(tmp, "\n"), "names no host"),
        (lambda tmp: "", "names no host"),
    ],
)
def test_arbitrary_without_a_readable_host_file_is_one_line(tmp_path, path_of, needle):
    environ = task(0, 1, "node2", SLURM_DISTRIBUTION="arbitrary", SLURM_HOSTFILE=path_of(tmp_path))
    with pytest.raises(LaunchError) as err:
        resolve_launch_env(environ, argv=["train.py"], check=False)
    text = str(err.value)
    assert needle in text and "export MASTER_ADDR=" in text and "\n" not in text, text


@pytest.mark.parametrize(
    "environ, refused",
    [
        (task(0, 1, "node2"), True),  # rank 0 elsewhere, nothing says so
        (task(0, 0, "node1"), False),  # rank 0 where everyone looks for it
        (task(1, 1, "node2"), False),  # not rank 0: it does not host the store
        # exported by a batch script that took its own node for rank 0's
        (task(0, 1, "node2", MASTER_ADDR="node1"), True),
        (task(0, 1, "node2", MASTER_ADDR="10.0.0.1"), False),  # no node name: left alone
    ],
)
def test_rank0_refuses_when_it_runs_elsewhere(environ, refused):
    env = resolve_launch_env(environ, argv=["train.py"], check=False)
    hosts = ["node1", "node2"]
    if not refused:
        check_rank0_here(env, environ, hosts)
        return
    with pytest.raises(LaunchError) as err:
        check_rank0_here(env, environ, hosts)
    assert str(err.value).startswith("rank 0 runs on node2, not on node1"), err.value
