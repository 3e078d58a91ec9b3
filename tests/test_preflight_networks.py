"""common.preflight on what the socket interface variables select, across nodes, and on NCCL.

Table-driven on reports as tasks send them to rank 0 (the interfaces, netmasks and variables
each node has), and one real world on this machine for the NCCL line.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT, clean_environ

sys.path.insert(0, str(ROOT))

from common import preflight  # noqa: E402
from common.env import find_free_port  # noqa: E402


def _iface(name, ipv4, netmask="255.255.255.0"):
    return {"name": name, "ipv4": ipv4, "netmask": netmask, "up": True, "loopback": name == "lo"}


def _report(rank, host, network, ifaces, ifname_vars):
    return {"rank": rank, "host": host, "network": network, "clock": None,
            "versions": {"torch": "2.13.0", "cuda": None, "nccl": None, "python": "3.11"},
            "problems": [], "interfaces": [_iface("lo", "127.0.0.1", "255.0.0.0"), *ifaces],
            "ifname_vars": ifname_vars}  # fmt: skip


ETH = [_iface("eth0", "10.1.0.1")], [_iface("eth0", "10.1.0.2")]
BOTH = ([_iface("eth0", "10.1.0.1"), _iface("ib0", "10.9.0.1")],
        [_iface("eth0", "10.1.0.2"), _iface("ib0", "10.9.0.2")])  # fmt: skip


@pytest.mark.parametrize(
    "ifaces,vars0,vars1,network1,problem",
    [
        (ETH, {"GLOO_SOCKET_IFNAME": "eth0"}, {"GLOO_SOCKET_IFNAME": "eth0"}, "n2", None),
        (BOTH, {"NCCL_SOCKET_IFNAME": "ib0"}, {"NCCL_SOCKET_IFNAME": "ib"}, "n2", None),  # prefix
        # node2 names its Ethernet, rank 0's node its InfiniBand: nothing in common
        (BOTH, {"NCCL_SOCKET_IFNAME": "ib0"}, {"NCCL_SOCKET_IFNAME": "eth0"}, "n2",
         "NCCL_SOCKET_IFNAME=eth0 selects 10.1.0.0/24 here, but on rank 0's node (node1) it "
         "selects 10.9.0.0/24"),
        (BOTH, {}, {"GLOO_SOCKET_IFNAME": "ib0"}, "n2", None),  # rank 0 unset: judged by its ib0
        # one network stack (one machine): nothing to cross
        (BOTH, {"NCCL_SOCKET_IFNAME": "ib0"}, {"NCCL_SOCKET_IFNAME": "eth0"}, "n1", None),
    ],
)  # fmt: skip
def test_named_interfaces_must_share_a_network_with_rank_0s(ifaces, vars0, vars1, network1,
                                                           problem):  # fmt: skip
    reports = {0: _report(0, "node1", "n1", ifaces[0], vars0),
               1: _report(1, "node2", network1, ifaces[1], vars1)}  # fmt: skip
    problems, _ = preflight.compare(reports, 2, max_skew=1.0)
    found = [p["what"] for _, _, p in problems]
    if problem is None:
        assert found == [], found
    else:
        assert len(found) == 1 and found[0].startswith(problem), found
        assert problems[0][0] == "node2" and problems[0][1] == [1]


def test_interfaces_report_their_netmask():
    lo = {i["name"]: i for i in preflight.interfaces()}["lo"]
    assert lo["netmask"] == "255.0.0.0"


@pytest.mark.timeout(240)
def test_without_cuda_the_preflight_says_nccl_was_not_checked():
    port = str(find_free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "common.preflight", "--timeout", "5"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=clean_environ(RANK=str(r), WORLD_SIZE="2",
                                                           MASTER_ADDR="127.0.0.1",
                                                           MASTER_PORT=port))
             for r in (0, 1)]  # fmt: skip
    outs = [p.communicate(timeout=90)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "preflight: NCCL not checked: no CUDA device here" in outs[0], outs[0]
    assert "all checks passed" in outs[0], outs[0]
