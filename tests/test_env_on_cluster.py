"""common.env inside a real SLURM job on the local 2-node cluster (tests/workers/env_job.sh)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.env import master_port_for_job  # noqa: E402


def tagged(output, tag):
    """The JSON objects the job printed on lines starting with ``tag: ``, sorted by rank."""
    prefix = f"{tag}: {{"
    rows = [
        json.loads(line[len(prefix) - 1 :])
        for line in output.splitlines()
        if line.startswith(prefix)
    ]
    return sorted(rows, key=lambda r: r["rank"])


@pytest.mark.timeout(600)
def test_env_in_a_two_node_job(cluster, sbatch_wait):
    result = sbatch_wait("tests/workers/env_job.sh", timeout=240)
    out = result.output
    assert result.returncode == 0, out
    port = master_port_for_job(result.job_id)

    # The batch script runs on the first node as one process; it exports what the job needs.
    (batch,) = tagged(out, "batch")
    assert (batch["launcher"], batch["rank"], batch["world_size"]) == ("single", 0, 1)
    assert batch["master_addr"] == "node1" and batch["hostname"] == "node1"
    assert batch["job_id"] == str(result.job_id) and batch["master_port"] == port
    export_line = next(line for line in out.splitlines() if line.startswith("export: "))
    assert f"export MASTER_ADDR=node1 export MASTER_PORT={port} export NNODES=2" in export_line
    assert "NPROC_PER_NODE=2" in export_line and "WORLD_SIZE" not in export_line

    # srun tasks: ranks 0-3, two per node, rank 0 on node1 is the master.
    steps = tagged(out, "step")
    assert [s["rank"] for s in steps] == [0, 1, 2, 3], out
    for s in steps:
        assert s["launcher"] == "slurm" and s["backend"] == "gloo"
        assert (s["world_size"], s["local_world_size"], s["num_nodes"]) == (4, 2, 2)
        assert s["node_rank"] == s["rank"] // 2 and s["local_rank"] == s["rank"] % 2
        assert s["hostname"] == f"node{s['node_rank'] + 1}"
        assert (s["master_addr"], s["master_port"]) == ("node1", port)

    assert "double spawn: refused: double spawn: srun started 2 tasks on this node" in out, out
