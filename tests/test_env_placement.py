"""common.env: rank 0 runs on the step's first node, whatever order srun gave the tasks.

SLURM_PROCID follows srun's distribution: cyclic deals tasks out across the nodes, arbitrary
follows SLURM_HOSTFILE, and Slurm 26.05 with a topology plugin orders a block distribution's
nodes by switch, so task 0 can run on the step's last node, while every task would look for rank
0 (the store under ``env://``) on the first host of SLURM_STEP_NODELIST. common.env numbers
ranks node by node instead (SLURM_NODEID, SLURM_LOCALID), as torchrun does. Table-driven: each
row is a 4-task step over node[1-2] as the local cluster really laid it out (``srun -N2
--ntasks-per-node=2 bash -c 'echo $SLURM_PROCID $(hostname) $SLURM_NODEID $SLURM_LOCALID'``).
The jobs themselves run in tests/test_site_placement.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.env import LaunchError, resolve_launch_env  # noqa: E402
from common.env_cli import export_values  # noqa: E402
from common.launch import check_rank0_here  # noqa: E402

HOSTS = ["node1", "node2"]


def task(procid, nodeid, localid, tasks_per_node="2(x2)", **extra):
    """One task of a 4-task step over node[1-2]."""
    return {
        "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid), "SLURM_NODEID": str(nodeid), "SLURM_NTASKS": "4",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURMD_NODENAME": HOSTS[nodeid], **extra,
    }  # fmt: skip


# (SLURM_PROCID, SLURM_NODEID, SLURM_LOCALID) of each task, in SLURM_PROCID order.
LAYOUTS = {
    "block": [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)],
    "cyclic": [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)],
    # SLURM_HOSTFILE: node2 node2 node1 node1
    "arbitrary": [(0, 1, 0), (1, 1, 1), (2, 0, 0), (3, 0, 1)],
    # Slurm 26.05, TopologyPlugin=topology/tree, node2 on the first leaf switch (--site
    # rank0-elsewhere): the default block distribution starts on node2.
    "block, 26.05 topology/tree": [(0, 1, 0), (1, 1, 1), (2, 0, 0), (3, 0, 1)],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rank0_is_on_the_host_every_task_names(layout):
    distribution = layout.split(",")[0]
    envs = [resolve_launch_env(task(*t, SLURM_DISTRIBUTION=distribution), argv=["train.py"])
            for t in LAYOUTS[layout]]  # fmt: skip
    assert sorted(e.rank for e in envs) == [0, 1, 2, 3]
    assert {e.master_addr for e in envs} == {"node1"}
    rank0 = next(t for t, e in zip(LAYOUTS[layout], envs, strict=True) if e.rank == 0)
    assert HOSTS[rank0[1]] == "node1" and rank0[2] == 0
    # node by node: the ranks of a node are consecutive, its local ranks in order
    assert all(e.rank == 2 * t[1] + t[2] and e.local_rank == t[2] and e.node_rank == t[1]
               for t, e in zip(LAYOUTS[layout], envs, strict=True))  # fmt: skip


# What pyxis adds to each task of `srun --container-image` with an NGC PyTorch image
# (pytorch_setup in pyxis_slurmstepd.c), and with enroot's hook 50-slurm-pytorch.sh; as the
# local cluster's --site pyxis / pyxis-hook TaskProlog printed them for job 1 (MASTER_PORT 61001).
def pyxis_vars(procid, localid, hook):
    own = {"RANK": str(procid), "LOCAL_RANK": str(localid)}
    if hook:
        own |= {"WORLD_SIZE": "4", "MASTER_ADDR": "node1", "MASTER_PORT": "61001",
                "OMP_NUM_THREADS": "1"}  # fmt: skip
    return own


@pytest.mark.parametrize("hook", [False, True], ids=["pyxis", "pyxis-hook"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pyxis_rank_variables_keep_rank0_on_the_first_host(layout, hook):
    """RANK=SLURM_PROCID would put rank 0 wherever srun placed task 0 (node2 in three of the
    layouts), while MASTER_ADDR, the hook's too, names node1: the ranks stay node by node."""
    envs = [resolve_launch_env(task(*t, **pyxis_vars(t[0], t[2], hook)), argv=["train.py"])
            for t in LAYOUTS[layout]]  # fmt: skip
    assert [e.launcher for e in envs] == ["slurm"] * 4
    assert all(e.rank == 2 * t[1] + t[2] and e.local_rank == t[2] and e.world_size == 4
               for t, e in zip(LAYOUTS[layout], envs, strict=True))  # fmt: skip
    assert {(e.master_addr, e.master_port) for e in envs} == {("node1", 61001 if hook else 15077)}


# A heterogeneous step as the local cluster (Slurm 22.05.8) ran it: in a 2-node job,
# `srun -N1 -n2 -w node2 ... : -N1 -n1 -w node1 ...` (component 0 on node2) and the same from
# `#SBATCH hetjob` with `srun --het-group=0,1`. srun sorted the host list and the task counts
# (node1 first), SLURM_NODEID is the component's offset plus its node index (node2's is 0).
HET_STEP = {"SLURM_JOB_ID": "3", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "3",
            "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2",
            "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_STEP_TASKS_PER_NODE": "1,2", "SLURM_TASKS_PER_NODE": "1,2"}  # fmt: skip
# (SLURMD_NODENAME, SLURM_PROCID, SLURM_NODEID, SLURM_LOCALID) of each task
HET_TASKS = [("node2", 0, 0, 0), ("node2", 1, 0, 1), ("node1", 2, 1, 0)]
HET_JOB = {"SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "node2",
           "SLURM_JOB_NODELIST_HET_GROUP_1": "node1", "SLURM_NTASKS_HET_GROUP_0": "2",
           "SLURM_NTASKS_HET_GROUP_1": "1"}  # fmt: skip


@pytest.mark.parametrize("extra", [{}, HET_JOB], ids=["het-step", "hetjob"])
def test_heterogeneous_step_numbers_nodes_by_the_sorted_host_list(extra):
    """Read with SLURM_NODEID, node2's tasks took node1's place (one task there, so local rank
    1 was refused), and task 0 on node2 was rank 0 while every rank looked for it at node1."""
    envs = {(node, procid): resolve_launch_env(
        {**HET_STEP, **extra, "SLURMD_NODENAME": node, "SLURM_PROCID": str(procid),
         "SLURM_NODEID": str(nodeid), "SLURM_LOCALID": str(localid)},
        argv=["train.py"]) for node, procid, nodeid, localid in HET_TASKS}  # fmt: skip
    got = {k: (e.rank, e.node_rank, e.local_rank, e.local_world_size) for k, e in envs.items()}
    assert got == {("node1", 2): (0, 0, 0, 1), ("node2", 0): (1, 1, 0, 2),
                   ("node2", 1): (2, 1, 1, 2)}  # fmt: skip
    assert {e.master_addr for e in envs.values()} == {"node1"}
    assert {(e.world_size, e.num_nodes) for e in envs.values()} == {(3, 2)}
    # A het job's batch script sees component 0's hosts only (SLURM_JOB_NODELIST=node2): a
    # MASTER_ADDR it exported is refused by rank 0, on node1, in one line.
    rank0 = {**HET_STEP, **extra, "SLURMD_NODENAME": "node1", "SLURM_PROCID": "2",
             "SLURM_NODEID": "1", "SLURM_LOCALID": "0", "MASTER_ADDR": "node2"}  # fmt: skip
    env0 = resolve_launch_env(rank0, argv=["x"])
    assert env0.rank == 0
    with pytest.raises(LaunchError, match=r"^MASTER_ADDR=node2 but rank 0 runs on node1"):
        check_rank0_here(env0, rank0, ["node1", "node2"])


def test_uneven_nodes_count_the_earlier_nodes_tasks():
    """-n4 over 2 nodes without --ntasks-per-node can give node1 3 tasks and node2 1."""
    layout = [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0)]
    ranks = [resolve_launch_env(task(*t, tasks_per_node="3,1"), argv=["train.py"]).rank
             for t in layout]  # fmt: skip
    assert ranks == [0, 1, 2, 3]


def test_mp_spawn_in_one_task_per_node_counts_by_node():
    """One srun task per node, mp.spawn 2 processes in each: the task on the step's first
    node holds ranks 0 and 1, whichever SLURM_PROCID it has."""
    environ = task(0, 1, 0, tasks_per_node="1(x2)", SLURM_NTASKS="2", SLURM_STEP_NUM_TASKS="2")
    env = resolve_launch_env(environ, spawn_index=1, spawn_nprocs=2, argv=["x"])
    assert (env.rank, env.local_rank, env.world_size, env.master_addr) == (3, 1, 4, "node1")


# Addresses for names, so that check_master_addr resolves them on any machine.
@pytest.mark.parametrize("batch_node, master",
                         [("192.0.2.1", "192.0.2.1"), ("192.0.2.2", "192.0.2.1")])  # fmt: skip
def test_the_batch_script_exports_the_jobs_first_host(batch_node, master):
    """``eval "$(python -m common.env --export)"`` in a batch script: torchrun's --node-rank
    is SLURM_NODEID, so node 0, the job's first host, hosts the rendezvous, wherever the batch
    script itself runs."""
    environ = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
               "SLURM_NODEID": "0", "SLURM_NTASKS": "4",
               "SLURM_JOB_NODELIST": "192.0.2.1,192.0.2.2", "SLURM_JOB_NUM_NODES": "2",
               "SLURMD_NODENAME": batch_node}  # fmt: skip
    env = resolve_launch_env(environ, argv=["job.sh"])
    assert env.launcher == "single"
    exported = export_values(env, environ)
    assert (exported["MASTER_ADDR"], exported["NNODES"]) == (master, 2)


@pytest.mark.parametrize(
    "environ, refused",
    [
        (task(2, 0, 0, MASTER_ADDR="node2"), True),  # exported for another node of the step
        (task(2, 0, 0, MASTER_ADDR="node1"), False),  # rank 0 where everyone looks for it
        (task(2, 0, 0), False),  # nothing exported: the step's first host
        (task(0, 1, 0, MASTER_ADDR="node2"), False),  # rank 2: it hosts nothing
        (task(2, 0, 0, MASTER_ADDR="10.0.0.1"), False),  # no node name: left alone
    ],
)
def test_rank0_refuses_a_master_addr_naming_another_node(environ, refused):
    env = resolve_launch_env(environ, argv=["train.py"])
    if not refused:
        check_rank0_here(env, environ, HOSTS)
        return
    with pytest.raises(LaunchError) as err:
        check_rank0_here(env, environ, HOSTS)
    text = str(err.value)
    assert text.startswith("MASTER_ADDR=node2 but rank 0 runs on node1") and "\n" not in text
