"""common.preflight: the checks a job runs before the real job.

Pure parts: clock offset, interface-name syntax, merging reports.  Real processes: worlds of
plain `python -m common.preflight` processes (RANK/WORLD_SIZE set as a launcher would) on this
machine, good and broken; two "hosts" made of network namespaces joined by a veth pair, where
loopback really is a different place on each (root only); and srun steps on the local cluster.
Every run is bounded: the preflight's own --timeout, and a kill after RUN_TIMEOUT.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import uuid

import pytest
from helpers import ROOT, clean_environ

sys.path.insert(0, str(ROOT))

from common import preflight  # noqa: E402
from common.env import find_free_port, resolve_launch_env  # noqa: E402

PHASE_S = 4  # --timeout of the preflight in these tests
RUN_TIMEOUT = 90  # a whole world, torch imports included, on a busy 2-core machine


# --------------------------------------------------------------------------- pure parts


def test_clock_offset_is_ntp_midpoint():
    # sent at 10.0, the other clock said 15.2, the reply came at 10.4: 5 s ahead, +/- 0.2
    offset, error = preflight.clock_offset(10.0, 15.2, 10.4)
    assert offset == pytest.approx(5.0) and error == pytest.approx(0.2)


def test_nccl_ifname_syntax():
    names = ["lo", "eth0", "eth1", "docker0", "ib0"]
    assert preflight.nccl_ifname_matches("eth", names) == ["eth0", "eth1"]
    assert preflight.nccl_ifname_matches("=eth0", names) == ["eth0"]
    assert preflight.nccl_ifname_matches("=eth", names) == []
    assert preflight.nccl_ifname_matches("^docker,lo", names) == ["eth0", "eth1", "ib0"]
    assert preflight.nccl_ifname_matches("^=eth0", names) == ["lo", "eth1", "docker0", "ib0"]
    assert preflight.nccl_ifname_matches("ib,eth1", names) == ["eth1", "ib0"]


def test_gloo_ifname_is_exact_names():
    names = ["lo", "eth0", "eth1"]
    assert preflight.gloo_ifname_matches("eth0", names) == ["eth0"]
    assert preflight.gloo_ifname_matches("eth", names) == []
    assert preflight.gloo_ifname_matches("eth1,eth0", names) == ["eth1", "eth0"]


def test_loopback_and_rank_ranges():
    assert preflight.is_loopback("127.0.1.1") and preflight.is_loopback("::1")
    assert preflight.is_loopback("::ffff:127.0.0.1")
    assert not preflight.is_loopback("10.0.0.1") and not preflight.is_loopback("fe80::1%eth0")
    assert preflight.format_ranks([5, 0, 2, 1]) == "0-2,5"
    assert preflight.format_ranks([3]) == "3"


def test_interfaces_of_this_machine_include_loopback():
    found = {i["name"]: i for i in preflight.interfaces()}
    assert found["lo"]["loopback"] and found["lo"]["ipv4"] == "127.0.0.1"
    assert preflight.route_to("127.0.0.1") == "127.0.0.1"


def _report(rank, host, network="n1", torch="2.13.0", clock=None, problems=()):
    return {
        "rank": rank, "host": host, "network": network, "clock": clock,
        "versions": {"torch": torch, "cuda": None, "nccl": None, "python": "3.11.2"},
        "problems": list(problems),
    }  # fmt: skip


def test_compare_names_version_differences_with_their_hosts():
    reports = {0: _report(0, "a"), 1: _report(1, "a"), 2: _report(2, "b", torch="2.12.0")}
    problems, _ = preflight.compare(reports, 3, max_skew=1.0)
    assert len(problems) == 1
    what = problems[0][2]["what"]
    assert "torch versions differ" in what and "2.12.0 on b (ranks 2)" in what, what
    assert "2.13.0 on a (ranks 0-1)" in what, what


def test_compare_clock_skew_beyond_the_error_bound():
    ok = {0: _report(0, "a"), 1: _report(1, "b", clock={"offset": 1.2, "error": 0.3})}
    assert preflight.compare(ok, 2, max_skew=1.0)[0] == []  # 1.2 - 0.3 is within 1 s
    off = {0: _report(0, "a"), 1: _report(1, "b", clock={"offset": -3.0, "error": 0.01})}
    problems, _ = preflight.compare(off, 2, max_skew=1.0)
    assert [(h, r) for h, r, _ in problems] == [("b", [1])]
    assert "clock is 3.000 s behind rank 0's" in problems[0][2]["what"]


def test_compare_loopback_is_a_problem_only_across_network_stacks():
    loop = preflight.problem("MASTER_ADDR=x is loopback", "fix it", needs_separate_hosts=True)
    shared = {r: _report(r, f"node{r}", problems=[loop]) for r in range(2)}
    problems, notes = preflight.compare(shared, 2, max_skew=1.0)
    assert problems == [] and notes == [
        "fine here, where every task shares one network stack (one machine), but a problem on "
        "separate nodes: on node0,node1: MASTER_ADDR=x is loopback"
    ]
    separate = {r: _report(r, f"node{r}", network=f"n{r}", problems=[loop]) for r in range(2)}
    problems, _ = preflight.compare(separate, 2, max_skew=1.0)
    # one line for both tasks
    assert [(h, r) for h, r, _ in problems] == [("node0,node1", [0, 1])]


def test_compare_names_missing_ranks():
    problems, _ = preflight.compare({0: _report(0, "a")}, 3, max_skew=1.0)
    assert "rank(s) 1-2 of WORLD_SIZE=3 never reached" in problems[0][2]["what"]


def test_gpu_check_wants_one_gpu_per_process():
    # torchrun-style worker: 2 processes on the node, 1 GPU visible (SLURM_GPUS_ON_NODE unset)
    environ = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
               "CUDA_VISIBLE_DEVICES": "0"}  # fmt: skip
    env = resolve_launch_env(environ, argv=[])
    facts = {"cuda_visible_devices": "0", "torch_cuda_devices": 0, "slurm_gpus_on_node": None}
    found = preflight.check_gpus(env, facts, environ)
    assert len(found) == 1 and "only 1 visible GPUs" in found[0]["what"], found
    facts = {"cuda_visible_devices": "0,1", "torch_cuda_devices": 0, "slurm_gpus_on_node": None}
    assert preflight.check_gpus(env, facts, {**environ, "CUDA_VISIBLE_DEVICES": "0,1"}) == []


def test_world_size_exported_into_an_srun_step():
    step = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"}
    found = preflight.exported_by_hand({**step, "WORLD_SIZE": "8"})
    assert len(found) == 1 and found[0]["what"].startswith("WORLD_SIZE=8 is set"), found
    assert preflight.exported_by_hand({**step, "WORLD_SIZE": "4"}) == []
    assert preflight.exported_by_hand({**step, "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "x"}) == []


def test_ifname_variables_against_real_interfaces():
    ifaces = preflight.interfaces()
    assert preflight.check_ifname_vars({"GLOO_SOCKET_IFNAME": "lo"}, ifaces, False) == []
    lo = preflight.check_ifname_vars({"GLOO_SOCKET_IFNAME": "lo"}, ifaces, True)
    assert len(lo) == 1 and lo[0]["separate"] and "only the loopback" in lo[0]["what"]
    bad = preflight.check_ifname_vars({"NCCL_SOCKET_IFNAME": "=nosuch0"}, ifaces, False)
    assert "NCCL_SOCKET_IFNAME==nosuch0 matches no interface" in bad[0]["what"], bad


# --------------------------------------------------------------------------- real worlds


def run_world(envs, prefixes=None, timeout=RUN_TIMEOUT, args=()):
    """Start one `python -m common.preflight` per environment; [(returncode, output)] by rank."""
    procs = []
    for i, extra in enumerate(envs):
        cmd = [*(prefixes[i] if prefixes else []), sys.executable, "-m", "common.preflight",
               "--timeout", str(PHASE_S), *args]  # fmt: skip
        procs.append(subprocess.Popen(
            cmd, cwd=ROOT, env=clean_environ(**extra), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        ))  # fmt: skip
    results = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(q.pid, 9)
            pytest.fail(f"the preflight did not finish within {timeout} s")
        results.append((p.returncode, out))
    return results


def world(n, port, **extra):
    return [{"RANK": str(r), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port), **extra} for r in range(n)]  # fmt: skip


def problem_lines(text):
    return [line for line in text.splitlines() if line.startswith("preflight: PROBLEM")]


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_a_good_world_passes_and_reports():
    results = run_world(world(3, find_free_port()))
    out0 = results[0][1]
    assert [rc for rc, _ in results] == [0, 0, 0], results
    assert "3/3 tasks on 1 node(s)" in out0, out0
    assert re.search(r"all_reduce \(gloo, 3 ranks, 1 float\): joined in \d+ ms", out0), out0
    assert "preflight: all checks passed" in out0 and not problem_lines(out0), out0
    assert results[1][1] == "" and results[2][1] == "", results  # only rank 0 reports


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_under_torchrun_the_agent_keeps_its_port():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "common.preflight", "--timeout", str(PHASE_S)],
        cwd=ROOT, env=clean_environ(), capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torchrun's agent holds MASTER_PORT=" in proc.stdout, proc.stdout
    assert "preflight: all checks passed" in proc.stdout, proc.stdout


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_a_missing_rank_clock_skew_and_a_missing_interface_are_all_named():
    # WORLD_SIZE says 3, only 2 processes exist: the classic hang, here found in seconds; and
    # the two that did meet have a clock 7 s apart and an interface variable that names none.
    envs = world(3, find_free_port(), GLOO_SOCKET_IFNAME="nosuch0")[:2]
    envs[1][preflight.CLOCK_SHIFT_VAR] = "7"  # rank 1's clock 7 s ahead
    start = time.monotonic()
    results = run_world(envs)
    assert time.monotonic() - start < RUN_TIMEOUT
    assert [rc for rc, _ in results] == [1, 1], results
    lines = problem_lines(results[0][1])
    assert any("rank(s) 2 of WORLD_SIZE=3 never reached rank 0's port" in x for x in lines), lines
    clock = [re.search(r"\(rank 1\): clock is ([0-9.]+) s ahead of rank 0's", x) for x in lines]
    # The offset comes from one request's round trip: on a loaded machine tenths of a second;
    # 2 s either way still tells a shifted clock (7 s) from a missed one (0 s).
    assert [float(m[1]) for m in clock if m] == [pytest.approx(7, abs=2)], lines
    assert any("(rank 0-1): GLOO_SOCKET_IFNAME=nosuch0 matches no interface" in x
               for x in lines), lines  # fmt: skip
    assert "FAILED: 3 problem(s)" in results[0][1], results[0][1]
    assert "all_reduce" not in results[0][1]  # not attempted on a broken setup


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_a_busy_master_port_is_named():
    with socket.create_server(("", 0)) as squatter:  # listens, never answers
        port = squatter.getsockname()[1]
        results = run_world(world(2, port))
    assert [rc for rc, _ in results] == [1, 1], results
    assert f"MASTER_PORT={port} is already in use" in results[0][1], results[0][1]
    assert "answered, but not as this job's rank 0" in results[1][1], results[1][1]


@pytest.mark.timeout(120)
def test_launch_errors_are_one_line_each():
    results = run_world([
        {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
        {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "no-such-host.invalid"},
    ])  # fmt: skip
    assert results[0][0] == 1 and "RANK=2 is not below WORLD_SIZE=2" in results[0][1]
    assert results[1][0] == 1
    assert "MASTER_ADDR='no-such-host.invalid' does not resolve" in results[1][1], results[1][1]
    assert "Traceback" not in results[0][1] + results[1][1]


# --------------------------------------------------------------------------- two hosts


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def two_hosts():
    """Two network namespaces, each with its own loopback and an eth0 on one private link."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = uuid.uuid4().hex[:6]
    names = [f"course-pf-{tag}-{i}" for i in (1, 2)]
    addrs = ["10.213.7.1", "10.213.7.2"]
    try:
        for ns in names:
            _ip("netns", "add", ns)
        _ip("link", "add", f"pf{tag}a", "type", "veth", "peer", "name", f"pf{tag}b")
        for ns, dev, addr in zip(names, (f"pf{tag}a", f"pf{tag}b"), addrs, strict=True):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "link", "set", dev, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield {"namespaces": names, "addrs": addrs}
    finally:
        for ns in names:  # removing a namespace removes its end of the veth pair, then the other
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def two_host_world(hosts, master, **extra):
    port = 29000 + os.getpid() % 1000
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
             "MASTER_ADDR": master, "MASTER_PORT": str(port), **extra}
            for r in range(2)]  # fmt: skip
    prefixes = [["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                 f'hostname host{r + 1} && exec "$0" "$@"']
                for r, ns in enumerate(hosts["namespaces"])]  # fmt: skip
    return run_world(envs, prefixes)


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_two_hosts_pass_on_their_own_interface(two_hosts):
    results = two_host_world(two_hosts, two_hosts["addrs"][0], GLOO_SOCKET_IFNAME="eth0")
    out0 = results[0][1]
    assert [rc for rc, _ in results] == [0, 0], results
    assert "2/2 tasks on 2 node(s) (host1,host2)" in out0, out0
    assert "interfaces on host2: lo 127.0.0.1; eth0 10.213.7.2 <- route to master" in out0, out0
    assert "all_reduce (gloo, 2 ranks" in out0, out0


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_two_hosts_with_a_loopback_master_address(two_hosts):
    results = two_host_world(two_hosts, "localhost", GLOO_SOCKET_IFNAME="eth0")
    assert [rc for rc, _ in results] == [1, 1], results
    # Nowhere to meet: each task says so at once instead of waiting for the other.
    for _, out in results:
        assert problem_lines(out) == [line for line in out.splitlines() if line], out
        assert "MASTER_ADDR='localhost' is a loopback address" in out, out
        assert "never reached" not in out and "cannot reach" not in out, out


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_two_hosts_with_gloo_on_loopback(two_hosts):
    results = two_host_world(two_hosts, two_hosts["addrs"][0], GLOO_SOCKET_IFNAME="lo")
    assert [rc for rc, _ in results] == [1, 1], results
    lines = problem_lines(results[0][1])
    assert len(lines) == 1, lines
    assert "on host1,host2 (rank 0-1): GLOO_SOCKET_IFNAME=lo selects only the loopback" in lines[0]


# --------------------------------------------------------------------------- the cluster


@pytest.mark.timeout(400)
def test_srun_preflight_on_the_cluster(srun):
    env = {"PYTHONPATH": str(ROOT), "PATH": clean_environ()["PATH"]}
    good = srun("--nodes=2", "--ntasks-per-node=2", "--gres=gpu:2", "python", "-m",
                "common.preflight", "--timeout", "10", env=env, timeout=300)  # fmt: skip
    assert good.returncode == 0, good.stdout + good.stderr
    assert "4/4 tasks on 2 node(s) (node1,node2)" in good.stdout, good.stdout
    assert "gpus on node2: 2 task(s), SLURM_GPUS_ON_NODE=2" in good.stdout, good.stdout
    assert "preflight: all checks passed" in good.stdout, good.stdout
    if "(127.0.0.1)" in good.stdout:  # nodes sharing this machine's network: said, not failed
        assert "fine here, where every task shares one network stack" in good.stdout

    # One GPU for two tasks per node: named before any process group is made.
    short = srun("--nodes=2", "--ntasks-per-node=2", "--gres=gpu:1", "python", "-m",
                 "common.preflight", "--timeout", "10", env=env, timeout=300)  # fmt: skip
    text = short.stdout + short.stderr
    assert short.returncode != 0, text
    lines = problem_lines(text)
    # No world to meet in: every task stops, and the first task of each node says why.
    where = sorted(x.split(":")[1] for x in lines)
    assert where == [" PROBLEM on node1", " PROBLEM on node2"], text
    assert all("2 processes on this node but SLURM gave it SLURM_GPUS_ON_NODE=1" in x
               for x in lines), text  # fmt: skip
