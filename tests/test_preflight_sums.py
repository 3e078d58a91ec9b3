"""The preflight's all_reduce check (common/preflight/allreduce.py) adds numbers that stay exact.

It used to sum a float32 1 over the ranks and multiply it by the world size at each of its six
all_reduces: 34**6 is no float32, so every rank of a sound 34-rank job reported "all_reduce
summed to 1544803712, expected 1544804416" and a network fix (GLOO_SOCKET_IFNAME). Now each
rank puts in rank + 1 before every all_reduce, in float64, and every result is checked.

A table of world sizes for the arithmetic; real gloo worlds of 34 and 64 ranks (threads of this
process, one gloo group each); real processes for the check itself (3 ranks, enough rounds
that the old scheme's float32 went inexact), and for the report of a wrong sum, which names no
network fix.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import resource
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, clean_environ

sys.path.insert(0, str(ROOT))

from common import preflight  # noqa: E402
from common.env import find_free_port  # noqa: E402

TIMEOUT_S = 60  # every collective, join and process below is bounded by this
RUN_TIMEOUT = 120  # a world of processes, torch imports included, on a busy 2-core machine


# --------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize("world_size", [1, 2, 3, 17, 34, 64, 1000, 65536])
def test_every_order_of_adding_gives_the_exact_sum(world_size):
    """Whatever order the backend adds the ranks' values in (a ring, a tree, rank by rank)."""
    dtype = getattr(torch, preflight.ALLREDUCE_DTYPE)
    values = torch.tensor([preflight.allreduce_value(r) for r in range(world_size)], dtype=dtype)
    want = preflight.allreduce_expected(world_size)
    assert want == sum(range(1, world_size + 1))
    for got in (values.cumsum(0)[-1], values.flip(0).cumsum(0)[-1], values.sum()):
        assert got.item() == want
        assert preflight.wrong_sum(got.item(), world_size) == ""


@pytest.mark.parametrize(("world_size", "got", "said"), [
    (34, 595.0, ""),
    (34, 594.0, "summed to 594, expected 595 (1 + 2 + ... + 34: each rank adds its rank + 1)"),
    (34, 1544803712.0, "summed to 1544803712, expected 595"),
    (3, 6.5, "summed to 6.5, expected 6"),
    (3, float("nan"), "summed to nan, expected 6"),
])  # fmt: skip
def test_a_wrong_sum_says_what_came_and_what_was_expected(world_size, got, said):
    text = preflight.wrong_sum(got, world_size)
    assert text.startswith(said) if said else text == ""


# --------------------------------------------------------------------------- real gloo worlds


def _enough_files(world_size):
    """A world of threads holds a full mesh of sockets in this one process."""
    need = 4 * world_size * world_size + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"{world_size} ranks in one process need {need} open files (limit {hard})")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def gloo_world_in_threads(world_size, rounds, contribute, dtype=None):
    """Each rank's list of all_reduce results: ``rounds`` all_reduces on a real gloo group per
    rank, each rank in a thread; ``contribute(rank, round, x)`` sets x before each one."""
    dtype = dtype or getattr(torch, preflight.ALLREDUCE_DTYPE)
    bound = datetime.timedelta(seconds=TIMEOUT_S)
    master = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=bound,
                           wait_for_workers=False)  # fmt: skip
    results: list = [None] * world_size

    def rank(r):
        try:
            store = dist.TCPStore("127.0.0.1", master.port, world_size, is_master=False,
                                  timeout=bound)  # fmt: skip
            group = dist.ProcessGroupGloo(store, r, world_size, bound)
            x = torch.empty(1, dtype=dtype)
            sums = []
            for i in range(rounds):
                contribute(r, i, x)
                group.allreduce([x]).wait(bound)
                sums.append(x.item())
            results[r] = sums
        except Exception as exc:  # noqa: BLE001 - reported by the test
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S + 10)
    assert not any(t.is_alive() for t in threads), "a rank's gloo group did not finish"
    return results


def preflight_values(r, i, x):
    x.fill_(preflight.allreduce_value(r))


def old_values(r, i, x):
    """The old check: a 1 once, then the previous sum again (n, n**2, ... n**6)."""
    if i == 0:
        x.fill_(1)


@pytest.mark.timeout(2 * TIMEOUT_S + 30)
@pytest.mark.parametrize("world_size", [34, 64])
def test_the_check_holds_on_real_gloo_worlds_of_34_and_64_ranks(world_size):
    _enough_files(world_size)
    want = float(preflight.allreduce_expected(world_size))
    results = gloo_world_in_threads(world_size, 6, preflight_values)
    assert all(sums == [want] * 6 for sums in results), results[:3]
    assert all(preflight.wrong_sum(s, world_size) == "" for sums in results for s in sums)


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_the_old_check_failed_on_a_sound_world_of_34_ranks():
    """Why the check changed: the same real world, the old arithmetic, a wrong sum."""
    _enough_files(34)
    results = gloo_world_in_threads(34, 6, old_values, dtype=torch.float32)
    assert all(sums[-1] != 34**6 for sums in results), results[:3]


# --------------------------------------------------------------------------- real processes

TINY = """
import sys
from common import preflight
from common.env import resolve_launch_env
print(repr(preflight.tiny_allreduce(resolve_launch_env(), 30.0, iterations=16)))
"""

# One rank's value arrives altered (as from a faulty node): the sum is wrong, the network fine.
ALTERED = """
import sys
from common.env import resolve_launch_env
from common.preflight import allreduce, cli
if resolve_launch_env().rank == 1:
    allreduce.allreduce_value = lambda rank: rank + 2  # where tiny_allreduce looks it up
sys.exit(cli.main(["--timeout", "30"]))
"""


def run_processes(world_size, code):
    """One ``python -c code`` per rank of a world on this machine: [(returncode, output)]."""
    port = str(find_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env=clean_environ(RANK=str(r), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=port),
        )
        for r in range(world_size)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=RUN_TIMEOUT)[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_seventeen_rounds_on_three_ranks_stay_exact():
    """3**17 is no float32 (the old scheme failed here on 3 ranks as it did on 34 in 6 rounds)."""
    results = run_processes(3, TINY)
    for _, out in results:
        assert "all_reduce (gloo, 3 ranks, 1 float): joined in" in out, results
        assert "summed to" not in out and "error=''" in out, results


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_a_wrong_sum_is_reported_as_such_without_a_network_fix():
    results = run_processes(3, ALTERED)
    assert [rc for rc, _ in results] == [1, 1, 1], results
    for rank, (_, out) in enumerate(results):
        lines = [x for x in out.splitlines() if x.startswith("preflight: PROBLEM")]
        assert lines == [
            f"preflight: PROBLEM on {socket.gethostname()} (rank {rank}): the gloo all_reduce "
            "completed but added up wrong: all_reduce 1 of 6 summed to 7, expected 6 (1 + 2 + "
            "... + 3: each rank adds its rank + 1). Fix: no network setting causes this (the "
            "ranks connected and the data arrived): run the preflight again, and if it repeats, "
            "report this line to the cluster's admins (a faulty node, network card or GPU, or a "
            "broken torch build)."
        ], out
        assert "SOCKET_IFNAME" not in lines[0] and "Traceback" not in out, out
    assert "preflight: FAILED" in results[0][1], results[0][1]
