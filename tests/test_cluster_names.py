"""Names on the local cluster's network, as torch's rendezvous store looks them up.

torch's TCPStore listens on an IPv6 socket and names each client with getnameinfo() of the
address it sees, which for an IPv4 client is ``::ffff:a.b.c.d``. cluster/up.sh's block in
/etc/hosts answers that form, so a multi-node job prints no
``[c10d] The hostname of the client socket cannot be retrieved. err=-3`` line.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
WARNING = "cannot be retrieved"
NET = os.environ.get("COURSE_CLUSTER_NET", "10.213.0")  # as cluster/lib.sh

# Run on each node: the reverse lookups the store makes for its clients, from that node.
REVERSE = (
    "import json, socket\n"
    "def name(addr):\n"
    "    try:\n"
    "        return socket.getnameinfo((addr, 0), socket.NI_NAMEREQD)[0]\n"
    "    except OSError as exc:\n"
    "        return f'error {exc}'\n"
    f"print(json.dumps({{a: name(a) for a in ('::ffff:{NET}.1', '::ffff:{NET}.2',"
    " '::ffff:127.0.0.1')}))\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(240)
def test_every_node_names_v4_mapped_addresses(srun):
    proc = srun("-N2", "--ntasks-per-node=1", PYTHON, "-c", REVERSE, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(rows) == 2, proc.stdout
    for row in rows:
        assert row == {f"::ffff:{NET}.1": "node1", f"::ffff:{NET}.2": "node2",
                       "::ffff:127.0.0.1": "localhost"}, row  # fmt: skip


@pytest.mark.timeout(480)
def test_two_node_gloo_job_prints_no_client_hostname_warning(srun):
    """A real 2-node x 2-task gloo all_reduce: three clients from two hosts reach rank 0's
    store on node1 (one of them over node1's own address); none draws the warning."""
    env = {"MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    proc = srun(
        "-N2", "--ntasks-per-node=2", "--kill-on-bad-exit=1", PYTHON,
        "tests/workers/cluster_allreduce.py", env=env, timeout=360,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert sorted(r["rank"] for r in rows) == [0, 1, 2, 3], proc.stdout
    assert all(r["sum"] == 10.0 for r in rows), rows
    assert WARNING not in proc.stdout + proc.stderr, proc.stderr


def test_hosts_block_lists_v4_mapped_names(cluster):
    """The block up.sh writes: each name once as IPv4 and once as ::ffff: (IPv4 first, so
    forward lookups keep returning the IPv4 address first)."""
    text = Path("/etc/hosts").read_text()
    block = text.split("# BEGIN course-cluster", 1)[1].split("# END course-cluster", 1)[0]
    lines = [line.split() for line in block.splitlines()[1:] if line and not line.startswith("#")]
    for name in ("node1", "node2", "course-ctl"):
        addrs = [a for a, *names in lines if name in names]
        assert len(addrs) == 2 and addrs[1] == "::ffff:" + addrs[0], (name, addrs)
    assert ["::ffff:127.0.0.1", "localhost"] in lines
