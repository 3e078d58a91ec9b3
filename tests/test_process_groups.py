"""Real gloo process groups on this machine, started each way a course script can be started.

Every run goes through common.env and the lessons' set-up (tests/workers/allreduce.py), all_reduces
rank+1 over 2 processes and prints one JSON line per rank; 1 + 2 = 3 everywhere.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import clean_environ  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.env import find_free_port  # noqa: E402

WORKER = str(ROOT / "tests" / "workers" / "allreduce.py")
BIN = Path(sys.executable).parent
TIMEOUT = 60  # seconds for a whole run; the rendezvous itself is bounded by COURSE_DIST_TIMEOUT


def results(stdout):
    return sorted(
        (json.loads(line) for line in stdout.splitlines() if line.startswith("{")),
        key=lambda r: r["rank"],
    )


def check_allreduce(stdout, launcher):
    ranks = results(stdout)
    assert [r["rank"] for r in ranks] == [0, 1], stdout
    for r in ranks:
        assert r["sum"] == 3.0
        assert r["world_size"] == 2 and r["local_world_size"] == 2 and r["num_nodes"] == 1
        assert r["local_rank"] == r["rank"]
        assert r["launcher"] == launcher
        assert r["backend"] == "gloo"
        assert r["threads"] == 1  # cpu_threads honours OMP_NUM_THREADS=1 (helpers.clean_environ)
    assert ranks[0]["master_port"] == ranks[1]["master_port"]
    assert re.findall(r"rank \d+ of 2 joined", stdout) == ["rank 0 of 2 joined"]


def run(cmd, **extra):
    proc = subprocess.run(
        cmd, env=clean_environ(**extra), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.timeout(TIMEOUT + 10)
def test_torchrun_standalone():
    out = run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", WORKER])
    check_allreduce(out, "torchrun")


@pytest.mark.timeout(TIMEOUT + 10)
def test_torch_distributed_launch():
    # Without --use-env the launcher passes --local-rank=N to the script (the worker checks it).
    port = find_free_port()
    cmd = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2",
           "--master_port", str(port), WORKER]  # fmt: skip
    check_allreduce(run(cmd), "torch.distributed.launch")


@pytest.mark.timeout(TIMEOUT + 10)
def test_mp_spawn():
    port = find_free_port()
    out = run([sys.executable, WORKER, "--spawn", "2"], MASTER_PORT=str(port))
    check_allreduce(out, "mp.spawn")


@pytest.mark.timeout(TIMEOUT + 10)
def test_plain_environment_variables():
    port = str(find_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER],
            env=clean_environ(
                RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port
            ),  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    out = ""
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=TIMEOUT)
            assert proc.returncode == 0, stdout + stderr
            out += stdout
    finally:
        for proc in procs:
            proc.kill()
    check_allreduce(out, "env")


@pytest.mark.timeout(TIMEOUT + 10)
def test_missing_rank_times_out_instead_of_hanging():
    """Rank 1 never starts: rank 0 must give up after COURSE_DIST_TIMEOUT, not wait forever."""
    port = str(find_free_port())
    # timeout=TIMEOUT is the hang guard: without the 3 s set here rank 0 waits 600 s.
    proc = subprocess.run(
        [sys.executable, WORKER],
        env=clean_environ(RANK="0", WORLD_SIZE="2", MASTER_PORT=port, COURSE_DIST_TIMEOUT="3"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode != 0
    assert "timed out" in proc.stderr.lower() or "timeout" in proc.stderr.lower(), proc.stderr
