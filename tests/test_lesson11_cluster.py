"""Lesson 11 on the local cluster: the lighthouse and two replica groups as jobs, as the README
submits them; a group's node set DOWN as a site's admin (or slurmctld, for a node that stops
answering) does it; the other group steps on alone; Slurm requeues the lost group's job, which
heals from the live group and then holds the same weights and optimizer state, bit for bit;
then the student's version: the group's job killed (scancel --signal=KILL) and a new job of that
group submitted, which heals the same way.

The node is resumed in a ``finally``, whatever happens (only if it is still down: with the
cluster's ReturnToService=2, a node that was set DOWN comes back by itself as soon as its slurmd
registers again, which it does within seconds, since only its state was changed).
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import job_record, slurm, wait_for

pytest.importorskip("torchft", reason="torchft has wheels for Linux x86_64 only")

LIGHTHOUSE = "lessons/11_torchft/lighthouse.sh"
GROUP = "lessons/11_torchft/group.sh"
HASH = re.compile(r"\[group (\d)\] step (\d+)/\d+ \|.* \| state (\w+)$", re.M)
GUARD_S = 240  # hang guards only: the slow kind of machine takes twice as long


def hashes(text: str) -> dict[int, str]:
    return {int(m[2]): m[3] for m in HASH.finditer(text)}


def node_state(node: str) -> str:
    return slurm("sinfo", "-h", "-n", node, "-o", "%T")


@pytest.mark.sites
@pytest.mark.timeout(600)
def test_a_group_whose_node_fails_is_requeued_and_heals_bit_for_bit(cluster, cluster_lock,
                                                                     tmp_path):  # fmt: skip
    # Where the lighthouse's address goes (both scripts), a shorter run (group.sh's header).
    where = {"FT_DIR": str(tmp_path)}
    shorter = {"SUBSET": "2048", "STEPS": "100000"}
    jobs: list[str] = []
    down: list[str] = []

    def sbatch(script, *args, name) -> str:
        env = where | (shorter if script == GROUP else {})
        job = slurm("sbatch", "--parsable", f"--output={tmp_path}/{name}-%j.out", script, *args,
                    env=env)  # fmt: skip
        jobs.append(job)
        return job

    def out(name, job) -> str:
        path = Path(tmp_path) / f"{name}-{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def same_state_after(healed: int, survivor: str, healer: str) -> str:
        """Both groups' state hashes at the first logged step after HEALED are equal; the
        healer's output."""
        step = (healed // 25 + 1) * 25
        for g in (survivor, healer):
            wait_for(f"job {g}'s state after step {step}", lambda g=g: step in hashes(
                out("group", g)), GUARD_S)  # fmt: skip
        text0, text1 = out("group", survivor), out("group", healer)
        assert hashes(text1)[step] == hashes(text0)[step], (text0, text1)
        return text1

    with cluster_lock():
        try:
            lh = sbatch(LIGHTHOUSE, name="lighthouse")
            wait_for("the lighthouse's address", lambda: (tmp_path / "lighthouse").exists(),
                     GUARD_S)  # fmt: skip
            g0 = sbatch(GROUP, "0", name="group")
            wait_for("group 0 to run", lambda: (job_record(g0) or {}).get("JobState")
                     == "RUNNING", GUARD_S)  # fmt: skip
            g1 = sbatch(GROUP, "1", name="group")
            wait_for("both groups stepping together", lambda: re.search(
                r"step 50/\d+ \| participants 2", out("group", g1)), GUARD_S)  # fmt: skip
            node = job_record(g1)["NodeList"]
            assert node != job_record(g0)["NodeList"], "the groups share a node"

            # The failure: group 1's node DOWN.
            down.append(node)
            slurm("scontrol", "update", f"NodeName={node}", "State=DOWN",
                  "Reason=lesson11-test")  # fmt: skip
            t_down = time.monotonic()
            wait_for(f"{node} back in service", lambda: "down" not in node_state(node)
                     and "drain" not in node_state(node), GUARD_S, poll=0.1)  # fmt: skip
            print(f"{node} back by itself within {time.monotonic() - t_down:.1f} s of DOWN")
            down.clear()
            gone = wait_for("group 0 alone", lambda: re.search(
                r"participants 2 -> 1 at step (\d+)", out("group", g0)), GUARD_S)  # fmt: skip
            # (The job's output file holds both runs: the requeued one starts at "run 1".)
            healed = wait_for("the requeued group 1 to heal", lambda: re.search(
                r"run 1 on .*?healed: step 0 -> (\d+)", out("group", g1), re.S),
                GUARD_S)  # fmt: skip
            print(f"group 1's requeued run healed {time.monotonic() - t_down:.1f} s after DOWN")
            assert int(job_record(g1)["Restarts"]) == 1
            assert int(healed[1]) > int(gone[1])
            text1 = same_state_after(int(healed[1]), g0, g1)
            # srun's line, or slurmstepd's (whichever got out before the step ended, or both)
            assert re.search("node failure", text1, re.I) and "run 1 on " in text1, text1

            # The student's version: the group's job killed, a new job of the group submitted.
            slurm("scancel", "--signal=KILL", g1)
            wait_for("group 0 alone again", lambda: len(re.findall(
                r"participants 2 -> 1", out("group", g0))) == 2, GUARD_S)  # fmt: skip
            g1b = sbatch(GROUP, "1", name="group")
            healed = wait_for("the new group 1 to heal", lambda: re.search(
                r"healed: step 0 -> (\d+)", out("group", g1b)), GUARD_S)  # fmt: skip
            same_state_after(int(healed[1]), g0, g1b)
            assert "Lighthouse listening" in out("lighthouse", lh)
        finally:
            for job in jobs:
                subprocess.run(["scancel", job], capture_output=True, timeout=30)
            for node in down:
                if "down" in node_state(node) or "drain" in node_state(node):
                    slurm("scontrol", "update", f"NodeName={node}", "State=RESUME")
