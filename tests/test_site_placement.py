"""Sites that place tasks and bind GPUs differently: rank 0 and each rank's GPU follow Slurm.

- Rank 0 elsewhere: with ``--distribution=arbitrary`` and SLURM_HOSTFILE, task 0 runs where
  the file's first line says (node2 here), not on the first node of the step. common/env.py
  numbers ranks node by node, so rank 0 is the first task on node1, where every task looks
  for it: lesson 01's all_reduce and lesson 03's training run to the end. (Slurm 26.05's
  topology order: tests/test_site_profiles.py.) The batch script elsewhere (``sbatch
  --batch=<features>``): lesson 03's job script still names the job's first host.
- GPU binding: for each way a site hands out GPUs that the local cluster can make (every task
  all of the node's, ``--gpus-per-task=1``, ``--gpu-bind=single:1``, ``map_gpu``), in block and
  cyclic order, every task's ``cuda_device_index`` is computed from what Slurm really set, and
  no two tasks of a node drive the same physical GPU. ``--gpu-bind=closest`` cannot give a
  task part of a node's GPUs here (the nodes' CPUs are not this machine's: no socket to be
  close to; cluster/README.md); tests/test_env_resolution.py covers it from the variables.

Marked ``sites``: a lane of its own (make test-sites, CI).
"""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT, cluster_lock, job_environ, job_record, slurm

pytestmark = pytest.mark.sites

# One line per task: its node, the GPUs Slurm made visible and the index common/ picks.
PICK = (
    "import json, os\n"
    "from common.env import resolve_launch_env\n"
    "from common.launch import cuda_device_index\n"
    "env = resolve_launch_env()\n"
    "cvd = [g for g in os.environ.get('CUDA_VISIBLE_DEVICES', '').split(',') if g]\n"
    "i = cuda_device_index(env, len(cvd))\n"
    "print(json.dumps({'rank': env.rank, 'node': env.hostname, 'cvd': cvd, 'gpu': cvd[i]}))\n"
)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("distribution", ["block", "cyclic"])
@pytest.mark.parametrize(
    "gpus",
    [
        ["--gres=gpu:2"],
        ["--gpus-per-task=1"],
        ["--gres=gpu:2", "--gpu-bind=single:1"],
        ["--gres=gpu:2", "--gpu-bind=map_gpu:1,0"],
    ],
    ids=lambda g: " ".join(g),
)
def test_each_rank_drives_its_own_gpu(cluster, srun, gpus, distribution):
    proc = srun("-N2", "--ntasks-per-node=2", f"--distribution={distribution}", *gpus,
                sys.executable, "-c", PICK, env={"PYTHONPATH": str(ROOT)}, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tasks = [json.loads(line) for line in proc.stdout.splitlines()]
    assert sorted(t["rank"] for t in tasks) == [0, 1, 2, 3], proc.stdout
    for node in ("node1", "node2"):
        picked = [t["gpu"] for t in tasks if t["node"] == node]
        assert len(picked) == 2 and len(set(picked)) == 2, tasks


HOSTS = "node2\nnode2\nnode1\nnode1\n"


@pytest.mark.timeout(600)
def test_lesson01_with_task0_on_the_second_node(cluster, srun, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text(HOSTS)
    proc = srun("-n4", "--distribution=arbitrary", "--cpus-per-task=1", sys.executable,
                "lessons/01_hello_allreduce/hello_allreduce.py",
                env={"SLURM_HOSTFILE": str(hosts), "PYTHONPATH": str(ROOT)},
                timeout=360)  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "master node1:" in out, out  # the step's first host, where rank 0 runs
    assert "rank 0/4 on node1 (node 0, local 0)" in out, out
    assert "all 4 ranks hold the expected sum" in out.splitlines(), out


@pytest.mark.timeout(800)
def test_lesson03_job_with_task0_on_the_second_node(cluster, sbatch_wait, tmp_path):
    """The whole job script under --distribution=arbitrary, as a site's user submits it."""
    hosts = tmp_path / "hosts"
    hosts.write_text(HOSTS)
    with cluster_lock():
        result = sbatch_wait(
            "lessons/03_ddp_mnist/job.sh", "--distribution=arbitrary",
            script_args=["1", "--train-subset", "1024", "--test-subset", "256"],
            env=job_environ({"SLURM_HOSTFILE": str(hosts),
                             "CHECKPOINT": str(tmp_path / "arb.pt")}), timeout=360,
        )  # fmt: skip
    assert result.returncode == 0, result.output
    assert "MASTER_ADDR=node1 " in result.output, result.output
    assert "world size 4 (2 node(s) x 2)" in result.output, result.output


@pytest.mark.timeout(800)
def test_lesson03_job_with_its_batch_script_on_the_second_node(cluster, sbatch_wait, tmp_path):
    """``sbatch --batch=<features>`` runs the batch script on a node with those features, not
    necessarily the job's first (slurmctld's pick_batch_host); they must be among the job's
    ``--constraint`` (sbatch(1), --batch: ``--constraint="haswell*1&knl*4" --batch=haswell``).
    Lesson 03's job script still tells every task the first host, where srun's rank 0 runs
    (common/env_cli.py)."""
    with cluster_lock():
        slurm("scontrol", "update", "NodeName=node2", "AvailableFeatures=batchhost",
              "ActiveFeatures=batchhost")  # fmt: skip
        try:
            result = sbatch_wait(
                "lessons/03_ddp_mnist/job.sh", "--constraint=batchhost*1", "--batch=batchhost",
                script_args=["1", "--train-subset", "1024", "--test-subset", "256"],
                env=job_environ({"CHECKPOINT": str(tmp_path / "batch.pt")}), timeout=360,
            )  # fmt: skip
            record = job_record(result.job_id) or {}
        finally:
            slurm("scontrol", "update", "NodeName=node2", "AvailableFeatures=",
                  "ActiveFeatures=")  # fmt: skip
    assert record.get("BatchHost") == "node2", record
    assert result.returncode == 0, result.output
    assert "MASTER_ADDR=node1 " in result.output, result.output
    assert "world size 4 (2 node(s) x 2)" in result.output, result.output
    features = slurm("scontrol", "show", "node", "node2", "-o")
    assert "AvailableFeatures=(null)" in features, features  # as the cluster declares it
