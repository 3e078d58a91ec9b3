"""Sites with pyxis, and heterogeneous steps: rank variables that Slurm's own do not match.

- ``pyxis`` and ``pyxis-hook`` (cluster/up.sh --site): a TaskProlog gives every task of every
  srun step what pyxis gives a task of ``srun --container-image`` with an NGC PyTorch image,
  RANK=SLURM_PROCID and LOCAL_RANK=SLURM_LOCALID, and with enroot's hook 50-slurm-pytorch.sh
  also WORLD_SIZE, MASTER_ADDR and MASTER_PORT (cluster/task_prolog.sh.in). common/env.py reads
  them as srun's own, so lesson 01's job (mp.spawn in each task: "RANK/WORLD_SIZE are already
  set" before) and lesson 03's run to the end; with task 0 on node2 (--distribution=arbitrary,
  SLURM_HOSTFILE), where RANK=SLURM_PROCID would make node2 host rank 0 while every rank looks
  for it at node1, the ranks stay node by node.
- A heterogeneous step (``srun A : B``) whose first component runs on node2: srun sorts the
  combined host list (node1 first) while SLURM_NODEID counts components in order. Lesson 01's
  all_reduce runs over both components, rank 0 on node1.

Each pyxis test starts the cluster in its profile under the cluster lock and puts it back in
the default profile at the end. Marked ``sites``: make test-sites.
"""

from __future__ import annotations

import contextlib
import re
import sys

import pytest
from conftest import ROOT, cluster_lock, run_up, submit_job

pytestmark = pytest.mark.sites

LESSON01 = ROOT / "lessons/01_hello_allreduce"
HOSTS = "node2\nnode2\nnode1\nnode1\n"  # task 0 and 1 on node2 (--distribution=arbitrary)


@contextlib.contextmanager
def site(name):
    with cluster_lock():
        run_up("--site", name)
        try:
            yield
        finally:
            run_up()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("profile", ["pyxis", "pyxis-hook"])
def test_lessons_under_pyxis(cluster, tmp_path, profile):
    probe = tmp_path / "probe.sh"
    probe.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=2\n"
        'echo "batch RANK=${RANK-unset}"\n'
        "srun bash -c 'echo \"$SLURM_PROCID $(hostname) $SLURM_LOCALID RANK=${RANK-unset} "
        "LOCAL_RANK=${LOCAL_RANK-unset} WORLD_SIZE=${WORLD_SIZE-unset} "
        "MASTER=${MASTER_ADDR-unset}:${MASTER_PORT-unset}\"' | sort\n"
    )  # fmt: skip
    hosts = tmp_path / "hosts"
    hosts.write_text(HOSTS)
    arbitrary = {"SLURM_HOSTFILE": str(hosts)}
    with site(profile):
        _, probed = submit_job(tmp_path, probe, env=arbitrary, timeout=240,
                               sbatch_args=["--distribution=arbitrary"])  # fmt: skip
        status01, out01 = submit_job(tmp_path, LESSON01 / "job.sh", timeout=240)
        # one srun task per rank, task 0 on node2
        status_arb, out_arb = submit_job(
            tmp_path, LESSON01 / "job_task_per_gpu.sh", env=arbitrary, timeout=240,
            sbatch_args=["--distribution=arbitrary"])  # fmt: skip
        status03, out03 = submit_job(
            tmp_path, ROOT / "lessons/03_ddp_mnist/job.sh", "1", "--train-subset", "1024",
            "--test-subset", "256", env={**arbitrary, "CHECKPOINT": str(tmp_path / "p.pt")},
            timeout=300, sbatch_args=["--distribution=arbitrary"])  # fmt: skip
    job = re.search(r"MASTER=\S*:(\S+)", probed)
    # The profile plays pyxis: every srun task, not the batch script, has RANK=SLURM_PROCID
    # (0 on node2 here)...
    lines = probed.splitlines()
    assert lines[0] == "batch RANK=unset" and lines[1].startswith("0 node2 0 RANK=0 "), probed
    for line in lines[1:5]:
        procid, _, localid, rest = line.split(" ", 3)
        assert rest.startswith(f"RANK={procid} LOCAL_RANK={localid} "), probed
        if profile == "pyxis":  # ...and with the hook WORLD_SIZE and the rendezvous too
            assert rest.endswith("WORLD_SIZE=unset MASTER=unset:unset"), probed
        else:
            assert job and 61000 <= int(job[1]) <= 65535, probed
            assert rest.endswith(f"WORLD_SIZE=4 MASTER=node1:{job[1]}"), probed
    for status, out in ((status01, out01), (status_arb, out_arb)):
        assert status == 0 and "all 4 ranks hold the expected sum" in out, out
        assert re.search(r"^rank 0/4 on node1 \(node 0, local 0\)", out, re.M), out
        assert "Traceback" not in out, out
    assert status03 == 0 and "world size 4 (2 node(s) x 2)" in out03, out03
    assert "MASTER_ADDR=node1 " in out03 and "done: test_acc " in out03, out03
    assert "Traceback" not in out03, out03


HET_JOB = """#!/bin/bash
#SBATCH --nodes=1 --ntasks=2 --nodelist=node2 --cpus-per-task=1 --mem=2G
#SBATCH hetjob
#SBATCH --nodes=1 --ntasks=1 --nodelist=node1 --cpus-per-task=1 --mem=2G
srun --het-group=0,1 bash -c 'echo "task $SLURM_PROCID on $(hostname): SLURM_NODEID=$SLURM_NODEID \
SLURM_STEP_NODELIST=$SLURM_STEP_NODELIST SLURM_STEP_TASKS_PER_NODE=$SLURM_STEP_TASKS_PER_NODE"' \
    | sort
srun --het-group=0,1 {python} {script}
"""


@pytest.mark.timeout(600)
def test_lesson01_in_a_heterogeneous_job(cluster, tmp_path):
    """``#SBATCH hetjob``, component 0 on node2: srun --het-group=0,1 runs one step over both.
    With SLURM_NODEID read as the index into SLURM_STEP_NODELIST, node2's two tasks took node1's
    place, where the list gives one task ("SLURM_LOCALID=1 is not below the 1 tasks")."""
    script = tmp_path / "het.sh"
    script.write_text(HET_JOB.format(python=sys.executable,
                                     script=LESSON01 / "hello_allreduce.py"))  # fmt: skip
    status, out = submit_job(tmp_path, script, env={"PYTHONPATH": str(ROOT),
                             "COURSE_DIST_TIMEOUT": "60"}, timeout=400)  # fmt: skip
    # What Slurm set: the sorted list, and node2's tasks counted as component 0's node 0.
    assert "task 0 on node2: SLURM_NODEID=0 SLURM_STEP_NODELIST=node[1-2] " \
           "SLURM_STEP_TASKS_PER_NODE=1,2" in out, out  # fmt: skip
    assert "task 2 on node1: SLURM_NODEID=1 " in out, out
    assert status == 0 and "all 3 ranks hold the expected sum" in out, out
    assert re.search(r"^rank 0/3 on node1 \(node 0, local 0\)", out, re.M), out
    assert "master node1:" in out, out
