"""Lesson 11's groups of several ranks (train_ft_fsdp.py), on this machine: two groups of two
ranks (gloo on loopback, each rank a process as srun starts it, a real lighthouse). Inside a
group the ranks shard the model (FSDP2: each holds part of it); across the groups rank r
averages with rank r. A group is killed whole (srun --kill-on-bad-exit ends a dying rank's
peers), the other steps on alone, and each rank of the group started again heals its own shard
from its peer rank: then every rank holds what its peer holds, bit for bit. Sent SIGTERM
(scancel), both ranks of a group leave before the same step, with status 75. When every group
and the lighthouse end, each rank of the new groups loads its own shards of the newest
checkpoint. The cluster's version is in tests/test_lesson11_cluster.py.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

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
RESUMED = re.compile(r"resumed from (\S+): step (\d+) \| shard (\w+)")


def shards(text: str) -> dict[int, str]:
    return {int(m[1]): m[3] for m in SHARD.finditer(text)}


def start_group(tmp_path, procs, env, n: int, name: str, *extra: str) -> tuple[list, list]:
    """Group N's two ranks, as srun starts a job's two tasks (its own store: its rank 0's)."""
    port, logs = str(free_port()), []
    for rank in range(2):
        log = tmp_path / f"{name}-rank{rank}.log"
        ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                 "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, str(FSDP), "--group", str(n), "--steps", "100000",
                 "--train-subset", "2048", *extra],
                cwd=ROOT, env={**env, **ranks}, stdout=out, stderr=subprocess.STDOUT,
                text=True))  # fmt: skip
        logs.append(Log(log, procs))
    return logs, procs[-2:]


def test_groups_of_two_ranks_shard_the_model_and_heal_rank_by_rank(tmp_path):
    procs: list[subprocess.Popen] = []
    env: dict[str, str] = {}

    def group(n: int, name: str) -> tuple[list[Log], list[subprocess.Popen]]:
        return start_group(tmp_path, procs, env, n, name, "--log-every", "20")

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


def test_every_group_and_the_lighthouse_lost_each_rank_resumes_its_shards_bit_for_bit(tmp_path):
    """The lighthouse killed: every rank of both groups waits its quorum's timeout (8 s here)
    and says so in one line naming the newest checkpoint (written by every rank of the quorum's
    first group, each its own shards). A new lighthouse and two new groups: each rank loads its
    own shards, the ones its rank logged at that step, and every step both runs logged after it
    is the same, rank by rank, bit for bit (a rank that loaded another's shards, or the whole
    model, would differ at once)."""
    procs: list[subprocess.Popen] = []
    ckpt = tmp_path / "ckpt"
    env: dict[str, str] = {}
    every = ("--log-every", "10", "--ckpt-every", "20", "--ckpt-dir", str(ckpt))
    try:
        env.update(lighthouse(tmp_path, procs, min_replicas=1)[1], COURSE_DIST_TIMEOUT="8")
        g0, p0 = start_group(tmp_path, procs, env, 0, "first0", *every)
        g1, p1 = start_group(tmp_path, procs, env, 1, "first1", *every)
        deadline = time.monotonic() + GUARD_S
        while not (ckpt / "step-00000040" / ".metadata").is_file():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
                g0[0].text(), g1[0].text())
            time.sleep(0.1)
        g1[0].wait_for(r"step ([5-9]\d|\d{3,})/\d+ \| groups 2", procs)
        procs[0].kill()  # the lighthouse
        t_kill = time.monotonic()
        for proc in p0 + p1:
            proc.wait(timeout=GUARD_S)
        waited = time.monotonic() - t_kill
        newest = max(p.name for p in ckpt.glob("step-*"))
        first = [log.text() for log in g0 + g1]
        for proc, text in zip(p0 + p1, first, strict=True):
            last = text.strip().splitlines()[-1]
            assert proc.returncode == 1 and "Traceback" not in text, text
            assert last.startswith("error: no quorum within 8 s at step ") and last.endswith(
                f"the newest checkpoint, {ckpt / newest}, is where new groups resume"), text
        assert 8 <= waited < 8 + 30, waited  # the quorum's timeout, not a hang
        # Each rank wrote its own file of the checkpoint (DCP: __<rank>_0.distcp).
        assert sorted(p.name for p in (ckpt / newest).glob("*.distcp")) == [
            "__0_0.distcp", "__1_0.distcp"], list((ckpt / newest).iterdir())

        procs.clear()  # both groups in the first quorum (min_replicas 2): none steps alone
        env.update(lighthouse(tmp_path, procs, min_replicas=2)[1])
        n0, _ = start_group(tmp_path, procs, env, 0, "second0", *every)
        n1, _ = start_group(tmp_path, procs, env, 1, "second1", *every)
        step = int(newest.split("-")[1])
        before = [shards(first[0]), shards(first[1])]  # group 0's rank 0 and rank 1
        later = [s for s in before[0] if s > step]
        assert later and before[0][step] != before[1][step], first[:2]
        for rank, log in enumerate(n0 + n1):
            found = log.wait_for(RESUMED.pattern, procs)
            assert (found[1], int(found[2])) == (str(ckpt / newest), step), found[0]
            assert found[3] == before[rank % 2][step], (found[0], first[rank % 2])
        for log in n0 + n1:
            log.wait_for(rf"step {max(later)}/\d+ \|", procs)
    finally:
        stop(procs)
    for rank, log in enumerate(n0 + n1):
        after = shards(log.text())
        assert all(after[s] == before[rank % 2][s] for s in later), (first[rank % 2], log.text())
        assert "healed" not in log.text(), log.text()  # every rank started from the checkpoint
