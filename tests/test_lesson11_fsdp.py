"""Lesson 11's groups of several ranks (train_ft_fsdp.py), on this machine: two groups of two
ranks (gloo on loopback, each rank a process as srun starts it, a real lighthouse). Inside a
group the ranks shard the model (FSDP2: each holds part of it); across the groups rank r
averages with rank r. A group is killed whole (srun --kill-on-bad-exit ends a dying rank's
peers), the other steps on alone, and each rank of the group started again heals its own shard
from its peer rank: then every rank holds what its peer holds, bit for bit. Sent SIGTERM
(scancel), both ranks of a group leave before the same step, with status 75. The cluster's
version is in tests/test_lesson11_cluster.py.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest
from helpers import clean_environ, require_torchft
from test_lesson11 import GUARD_S, LESSON, ROOT, Log, free_port, lighthouse, stop

require_torchft()
pytestmark = pytest.mark.lesson11  # five processes for ~40 s on 2 cores: lesson 11's lane

FSDP = LESSON / "train_ft_fsdp.py"
SHARD = re.compile(r"\[group \d rank \d\] step (\d+)/\d+ \| groups \d \| loss ([\d.]+) \|.* "
                   r"\| shard (\w+)$", re.M)  # fmt: skip
LEFT = re.compile(r"SIGTERM \(scancel, a preemption, the time limit\): the group leaves between "
                  r"steps (\d+) and")  # fmt: skip
HOLDS = re.compile(r"holding (\d+) of the model's (\d+) parameters")


def shards(text: str) -> dict[int, str]:
    return {int(m[1]): m[3] for m in SHARD.finditer(text)}


def test_groups_of_two_ranks_shard_the_model_and_heal_rank_by_rank(tmp_path):
    procs: list[subprocess.Popen] = []
    env: dict[str, str] = {}

    def group(n: int, name: str) -> tuple[list[Log], list[subprocess.Popen]]:
        port, logs = str(free_port()), []  # the group's own store: its rank 0's
        for rank in range(2):
            log = tmp_path / f"{name}-rank{rank}.log"
            ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                     "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            with open(log, "w") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, str(FSDP), "--group", str(n), "--steps", "100000",
                     "--log-every", "20", "--train-subset", "2048"],
                    cwd=ROOT, env={**env, **ranks}, stdout=out, stderr=subprocess.STDOUT,
                    text=True))  # fmt: skip
            logs.append(Log(log, procs))
        return logs, procs[-2:]

    try:
        env.update(lighthouse(tmp_path, procs, min_replicas=1)[1])
        g0, p0 = group(0, "group0")
        g1, p1 = group(1, "group1")
        together = int(g1[0].wait_for(r"step ([4-9]\d|\d{3,})/\d+ \| groups 2", procs)[1])
        for proc in p1[::-1]:  # rank 1 dies; srun --kill-on-bad-exit then ends rank 0
            proc.kill()
            proc.wait(timeout=30)
        survivor = procs[:1] + p0
        gone = int(g0[0].wait_for(r"groups 2 -> 1 at step (\d+)", survivor)[1])
        g0[0].wait_for(rf"step {gone // 20 * 20 + 40}/\d+ \| groups 1", survivor)
        g1b, p1b = group(1, "group1-replacement")
        live = survivor + p1b
        healed = [log.wait_for(r"healed: step (\d+) -> (\d+)", live) for log in g1b]
        # The first step both replacement ranks logged after healing, and the survivors' there.
        common = max(int(log.wait_for(SHARD.pattern, live)[1]) for log in g1b)
        for log in g0 + g1b:
            log.wait_for(rf"step {common}/\d+ \|", live)
        for proc in p1b:  # SIGTERM (scancel): every rank of the group leaves at the same step
            proc.send_signal(signal.SIGTERM)
        for proc in p1b:
            proc.wait(timeout=GUARD_S)
    finally:
        stop(procs)
    assert healed[0][2] == healed[1][2] and int(healed[0][2]) > gone, healed
    held = [HOLDS.search(log.text()) for log in g0]
    assert all(held), g0[0].text()
    # Sharded: each rank holds part of the model, the two parts the whole of it.
    total = int(held[0][2])
    assert all(0 < int(h[1]) < total for h in held) and sum(int(h[1]) for h in held) == total
    for rank in range(2):  # rank r of the replacement holds what rank r of the survivor holds
        assert shards(g1b[rank].text())[common] == shards(g0[rank].text())[common], (
            g0[rank].text(), g1b[rank].text())
        before, alive = shards(g1[rank].text()), shards(g0[rank].text())
        assert before[together] == alive[together], (g1[rank].text(), g0[rank].text())
    assert shards(g0[0].text())[common] != shards(g0[1].text())[common]  # different parts
    left = [LEFT.search(log.text()) for log in g1b]
    assert [p.returncode for p in p1b] == [75, 75] and all(left), [log.text() for log in g1b]
    assert left[0][1] == left[1][1], (left[0][0], left[1][0])
    # It learns: the survivor's rank 0 losses from step 60 on (one batch of 32 each), averaged,
    # well below ln 10 = 2.3 (untrained).
    late = [float(m[2]) for m in SHARD.finditer(g0[0].text()) if int(m[1]) >= 60]
    assert late and sum(late) / len(late) < 1.0, g0[0].text()


@pytest.mark.parametrize("args, says", [
    (["--slow-factor", "3"], "error: --slow-factor is train_ft.py's (groups of one process)"),
    (["--batch-size", "63"], "error: --batch-size 63 (per group) does not split over the group's "
                             "2 ranks: give a multiple of 2"),
    ([], "error: TORCHFT_LIGHTHOUSE is not set"),
], ids=["slow-factor", "batch", "no-lighthouse"])  # fmt: skip
def test_bad_input_is_one_line(args, says):
    """Refused in one line before any process group: an option of the one-process form, a group
    batch that does not split over the ranks, no lighthouse."""
    env = clean_environ(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # fmt: skip
    env.pop("TORCHFT_LIGHTHOUSE", None)
    proc = subprocess.run([sys.executable, str(FSDP), *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=GUARD_S)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(says), proc.stderr
