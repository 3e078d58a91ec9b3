"""Lesson 11 on the local cluster, playing a site that requeues only the jobs that ask
(``cluster/up.sh --site no-requeue``: JobRequeue=0): the lighthouse and two replica groups as
jobs, submitted as the README does (``lh=$(sbatch --parsable lighthouse.sh)``, then each group
with ``--dependency=after:$lh``), over an address file that an earlier lighthouse left behind; a
group's node set DOWN as a site's admin (or slurmctld, for a node that stops answering) does it;
the other group steps on alone; Slurm requeues the lost group's job (group.sh's ``#SBATCH
--requeue``: a job on the same node without it ends NODE_FAIL), which heals from the live group
and then holds the same weights and optimizer state, bit for bit; then the student's version: the
group's job killed (scancel --signal=KILL) and a new job of that group submitted, which heals the
same way; then everything ends at once (the lighthouse and both groups cancelled, as a
maintenance or the time limits would end them: SIGTERM, on which a group leaves between two
steps and saves), and a new lighthouse and two new groups (group 1 by the student's line) resume
from the newest checkpoint: the state each loads is the one the last group to leave saved (a
step past the periodic checkpoints: nothing redone); both run to their last step (1200 here) and end
COMPLETED with the same state; last, the lighthouse cancelled, and its address file gone with it.
Every job is waited for to its end.

The node is resumed in a ``finally``, whatever happens (only if it is still down: with the
cluster's ReturnToService=2, a node that was set DOWN comes back by itself as soon as its slurmd
registers again, which it does within seconds, since only its state was changed), and the
cluster is put back in its default profile.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import job_record, jobs_report, on_timeout, run_up, slurm, wait_for, wait_job
from helpers import require_torchft

require_torchft()  # skipped where requirements.txt installs none, failed where it breaks

ROOT = Path(__file__).resolve().parent.parent
LIGHTHOUSE = "lessons/11_torchft/lighthouse.sh"
GROUP = "lessons/11_torchft/group.sh"
HASH = re.compile(r"\[group (\d)\] step (\d+)/\d+ \|.* \| state (\w+)$", re.M)
LEFT = re.compile(r"\[group \d\] SIGTERM \(scancel, a preemption, the time limit\): leaving "
                  r"between steps (\d+) and \d+ \| state (\w+);")  # fmt: skip
RESUMED = re.compile(r"\[group \d\] resumed from (\S+)/step-(\d+): step (\d+) \| state (\w+)$",
                     re.M)  # fmt: skip
# The training's processes, whose stacks a wait that times out shows (the groups' python).
TRAINING = r"python \S*lessons/11_torchft/train_ft"
GUARD_S = 240  # hang guards only: the slow kind of machine takes twice as long
SITE = "no-requeue"  # JobRequeue=0: only a job submitted with --requeue is requeued


def hashes(text: str) -> dict[int, str]:
    return {int(m[2]): m[3] for m in HASH.finditer(text)}


def node_state(node: str) -> str:
    return slurm("sinfo", "-h", "-n", node, "-o", "%T")


def submitter(tmp_path, env: dict[str, str], jobs: list[str]):
    """sbatch (its output in tmp_path/<job id>.out, the job noted in JOBS) and a job's output."""

    def sbatch(*args: str) -> str:
        job = slurm("sbatch", "--parsable", f"--output={tmp_path}/%j.out", *args, env=env)
        jobs.append(job)
        return job

    def out(job: str) -> str:
        path = Path(tmp_path) / f"{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    return sbatch, out


def same_state_after(out, healed: int, survivor: str, healer: str) -> str:
    """Both groups' state hashes at the first logged step (every 25) after HEALED are equal;
    the healer's output. OUT(name, job) reads a job's output file."""
    step = (healed // 25 + 1) * 25
    for g in (survivor, healer):
        wait_for(f"job {g}'s state after step {step}", lambda g=g: step in hashes(
            out("group", g)), GUARD_S)  # fmt: skip
    text0, text1 = out("group", survivor), out("group", healer)
    assert hashes(text1)[step] == hashes(text0)[step], (text0, text1)
    return text1


@pytest.mark.lesson11  # run only by make test-slurm's last pass (tests/lanes.py)
@pytest.mark.timeout(2400)
def test_a_group_whose_node_fails_is_requeued_and_heals_bit_for_bit(cluster, cluster_lock,
                                                                     tmp_path):  # fmt: skip
    # Where the lighthouse's address goes (both scripts), a shorter run (group.sh's header: fewer
    # images, fewer steps: the stored run's 1200). A replacement heals at the step the survivor
    # reached alone meanwhile (about 40 steps a second on an idle machine, where the requeued
    # group healed at 354 after a failure at step 54; 117 in CI under load; 699 in the stored
    # run); two groups together make about 5 steps a second.
    where = {"FT_DIR": str(tmp_path)}
    shorter = {"SUBSET": "2048", "STEPS": "1200"}
    address_file = tmp_path / "lighthouse"
    jobs: list[str] = []
    down: list[str] = []

    def sbatch(script, *args, name, options=()) -> str:
        env = where | (shorter if script == GROUP else {})
        job = slurm("sbatch", "--parsable", f"--output={tmp_path}/{name}-%j.out", *options,
                    script, *args, env=env)  # fmt: skip
        jobs.append(job)
        return job

    def out(name, job) -> str:
        path = Path(tmp_path) / f"{name}-{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    with cluster_lock(), on_timeout(lambda: jobs_report(jobs, tmp_path, TRAINING)):
        run_up("--site", SITE)
        try:
            config = slurm("scontrol", "show", "config")
            assert re.search(r"^JobRequeue\s*=\s*0$", config, re.M), config
            # An address an earlier lighthouse left (its job long gone): never used.
            address_file.write_text("http://node2:15001 1\n")
            # The README's commands: the groups are submitted at once, Slurm starts them once
            # the lighthouse's job has started.
            lh = sbatch(LIGHTHOUSE, name="lighthouse")
            after = (f"--dependency=after:{lh}",)
            g0 = sbatch(GROUP, "0", name="group", options=after)
            g1 = sbatch(GROUP, "1", name="group", options=after)
            wait_for("both groups stepping together", lambda: re.search(
                r"step \d+/\d+ \| participants 2", out("group", g1)), GUARD_S)  # fmt: skip
            records = {job: job_record(job) for job in (lh, g0, g1)}
            for g in (g0, g1):
                # Started no sooner than the lighthouse, and given its address, not the old one.
                assert records[g]["StartTime"] >= records[lh]["StartTime"], records
                assert re.search(rf"lighthouse http://\S+ \(job {lh}\)$", out("group", g),
                                 re.M), out("group", g)  # fmt: skip
                assert records[g]["Requeue"] == "1", records[g]  # group.sh's --requeue
            assert records[lh]["Requeue"] == "0", records[lh]  # the site's default
            node = records[g1]["NodeList"]
            assert node != records[g0]["NodeList"], "the groups share a node"
            assert node != records[lh]["NodeList"], "group 1 shares the lighthouse's node"
            # A job on group 1's node that does not ask for a requeue.
            other = slurm("sbatch", "--parsable", f"--nodelist={node}", "--output=/dev/null",
                          "--wrap", "sleep 600")  # fmt: skip
            jobs.append(other)
            wait_for("the other job to run", lambda: (job_record(other) or {}).get("JobState")
                     == "RUNNING", GUARD_S)  # fmt: skip

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
            # It loads the newest checkpoint first (saved by group 0 alone meanwhile, if it got
            # that far), then heals from group 0 to its step.
            healed = wait_for("the requeued group 1 to heal", lambda: re.search(
                r"run 1 on .*?healed: step \d+ -> (\d+)", out("group", g1), re.S),
                GUARD_S)  # fmt: skip
            print(f"group 1's requeued run healed {time.monotonic() - t_down:.1f} s after DOWN")
            assert int(job_record(g1)["Restarts"]) == 1
            # JobRequeue=0 at work: the other job ended NODE_FAIL, not requeued (a requeued
            # `sleep 600` would still run at the wait's end). Its record may be purged by now
            # (MinJobAge=30 s): wait_job reads slurmdbd's then.
            ended_other, _, record_other = wait_job(other, timeout=GUARD_S)
            assert ended_other == "NODE_FAIL", (ended_other, record_other)
            assert int(record_other.get("Restarts", 0)) == 0, record_other
            assert int(healed[1]) > int(gone[1])
            text1 = same_state_after(out, int(healed[1]), g0, g1)
            # srun's line, or slurmstepd's (whichever got out before the step ended, or both)
            assert re.search("node failure", text1, re.I) and "run 1 on " in text1, text1

            # The student's version: the group's training step killed, a new job of the group
            # submitted. SIGKILL to the step's task at once (`<jobid>.0`); the whole job's
            # `scancel --signal=KILL <jobid>` would end it as a plain scancel does, SIGTERM
            # first, on which the group leaves cleanly (measured with lesson 05's signal_probe).
            slurm("scancel", "--signal=KILL", f"{g1}.0")
            assert wait_job(g1, timeout=GUARD_S)[0] == "FAILED"  # srun's status 9: killed
            assert not LEFT.search(out("group", g1).partition("run 1 on ")[2]), out("group", g1)
            wait_for("group 0 alone again", lambda: len(re.findall(
                r"participants 2 -> 1", out("group", g0))) == 2, GUARD_S)  # fmt: skip
            g1b = sbatch(GROUP, "1", name="group")
            healed = wait_for("the new group 1 to heal", lambda: re.search(
                r"healed: step \d+ -> (\d+)", out("group", g1b)), GUARD_S)  # fmt: skip
            same_state_after(out, int(healed[1]), g0, g1b)
            print(f"group 1's replacement healed at step {healed[1]} of {shorter['STEPS']}")

            # Everything ends: the groups and the lighthouse cancelled, once the two groups have
            # saved a checkpoint together (every 100 steps, by the quorum's first group).
            ckpt = tmp_path / "checkpoints"

            def newest() -> int:
                done = [int(p.name[5:]) for p in ckpt.glob("step-*") if (p / ".metadata").exists()]
                return max(done, default=-1)

            wait_for("a checkpoint after the heal", lambda: newest() > int(healed[1]), GUARD_S)
            periodic = newest()
            # A plain scancel: SIGTERM first, to every process of the three jobs. Each group
            # ends the step in flight, leaves and saves it; one that got it later than the
            # lighthouse's end may find no quorum and be killed after KillWait, having saved
            # nothing: the newest checkpoint is the last leaver's step, past the periodic one.
            slurm("scancel", lh, g0, g1b)  # the README's scancel $lh <jobid> <jobid>
            for job in (g0, g1b, lh):
                assert wait_job(job, timeout=GUARD_S)[0] == "CANCELLED", job
            left = [m for g in (g0, g1b) if (m := LEFT.search(out("group", g)))]
            if left:  # the last group to leave saved the step it had reached
                saved, state = max((int(m[1]), m[2]) for m in left)
                assert newest() == saved >= periodic, (newest(), saved, periodic)
            else:  # both were waiting for a quorum when the lighthouse went, and were killed
                # after KillWait, unsaved (README, "Everything ends at once"; seen once on
                # 22.05): the newest checkpoint is the periodic one, the state logged there
                saved = newest()
                assert saved >= periodic and saved % 100 == 0, (saved, periodic)
                state = hashes(out("group", g0))[saved]
                print(f"no group left on SIGTERM (both in a quorum request): step {saved} kept")
            lh = sbatch(LIGHTHOUSE, name="lighthouse")
            after = (f"--dependency=after:{lh}",)
            t_resubmit = time.monotonic()
            g0 = sbatch(GROUP, "0", name="group", options=after)
            # Group 1 as the student's replacement line (no dependency): group.sh waits for the
            # new lighthouse's address (FT_WAIT_S); this job runs to the end, as README's does.
            g1b = sbatch(GROUP, "1", name="group")
            for g in (g0, g1b):
                found = wait_for(f"job {g} to resume", lambda g=g: RESUMED.search(
                    out("group", g)), GUARD_S)  # fmt: skip
                assert (found[1], int(found[2]), int(found[3])) == (str(ckpt), saved, saved)
                assert found[4] == state, (found[0], left)  # the state the last leaver saved
            print(f"new groups resumed at step {saved} {time.monotonic() - t_resubmit:.1f} s "
                  f"after they were submitted")  # fmt: skip
            # Both run to their last step, as the README's jobs do, and end there alike.
            last = int(shorter["STEPS"])
            for g in (g0, g1b):
                assert wait_job(g, timeout=4 * GUARD_S)[0] == "COMPLETED", out("group", g)
            end0, end1 = hashes(out("group", g0)), hashes(out("group", g1b))
            assert last in end0 and end0[last] == end1.get(last), (end0, end1)
            assert "Lighthouse listening" in out("lighthouse", lh)

            # The lighthouse's end takes its address away (its EXIT trap, after scancel's TERM).
            assert address_file.read_text().split()[1] == lh, address_file.read_text()
            slurm("scancel", lh)
            assert wait_job(lh, timeout=GUARD_S)[0] == "CANCELLED"
            assert not address_file.exists(), address_file.read_text()
            assert f"address removed from {address_file}" in out("lighthouse", lh), out(
                "lighthouse", lh)  # fmt: skip
        finally:
            for job in jobs:
                subprocess.run(["scancel", job], capture_output=True, timeout=30)
            for node in down:
                if "down" in node_state(node) or "drain" in node_state(node):
                    slurm("scontrol", "update", f"NodeName={node}", "State=RESUME")
            run_up()


@pytest.mark.lesson11  # run only by make test-slurm's last pass (tests/lanes.py)
@pytest.mark.timeout(1800)
def test_a_crashed_node_is_found_by_timeouts_and_its_group_heals(cluster, cluster_lock,
                                                                 tmp_path):  # fmt: skip
    """A real crash (cluster/crash_node.sh: every process of group 1's node stopped, its link
    down, so no socket closes): group 0 learns it only from a timeout, gloo's (10 s, train_ft.py;
    the step in flight discarded) or the lighthouse's heartbeat timeout (5 s, when the crash
    came between all-reduces), and steps alone; slurmctld sets the node DOWN only after
    SlurmdTimeout (60 s) and requeues the group's job, which runs on a third node while the
    crashed one stays down (as a site keeps a crashed node out until someone has looked at it)
    and heals from group 0, bit for bit. Then that group is preempted (lesson 05's preempt.sh
    on its node): it leaves between two steps on SIGTERM, its job is requeued (by group.sh on
    Slurm 22.05, within the grace time) and heals again, group 0 going on at the step it left
    with no step discarded; then a plain scancel of its job, which leaves the same way and
    ends CANCELLED with the line to bring it back. Last, the node comes back (crash_node.sh
    --back). What each took is printed.

    A third node, not the crashed one back: --back continues the node's slurmd where a reboot
    would start a new one, and on Slurm 26.05 a job requeued onto that node then failed to launch
    ("namespace_p_join: open failed for .../<job>/.ns", held: "launch failed requeued held"),
    where 22.05 ran it (cluster/README.md)."""
    env = {"FT_DIR": str(tmp_path), "SUBSET": "2048", "STEPS": "100000"}  # stopped by the test
    jobs: list[str] = []
    crashed: list[str] = []

    def sbatch(script, *args, name) -> str:
        job = slurm("sbatch", "--parsable", f"--output={tmp_path}/{name}-%j.out", script, *args,
                    env=env)  # fmt: skip
        jobs.append(job)
        return job

    def out(name, job) -> str:
        path = Path(tmp_path) / f"{name}-{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def crash(*args) -> str:
        proc = subprocess.run(["bash", "cluster/crash_node.sh", *args], cwd=ROOT, text=True,
                              capture_output=True, timeout=60)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    with cluster_lock(), on_timeout(lambda: jobs_report(jobs, tmp_path, TRAINING)):
        run_up("--nodes", "3")
        try:
            lh = sbatch(LIGHTHOUSE, name="lighthouse")
            g0 = sbatch(f"--dependency=after:{lh}", GROUP, "0", name="group")
            g1 = sbatch(f"--dependency=after:{lh}", GROUP, "1", name="group")
            wait_for("both groups stepping together", lambda: re.search(
                r"step \d+/\d+ \| participants 2", out("group", g1)), GUARD_S)  # fmt: skip
            node = job_record(g1)["NodeList"]
            assert node == "node2", job_record(g1)  # the README crashes node2: group 1's node
            assert node != job_record(g0)["NodeList"], "the groups share a node"
            crashed.append(node)
            crash(node)
            t0 = time.monotonic()
            # No socket closed: group 0 learns it from a timeout, not from the peer: gloo's
            # (10 s) when the crash came inside an all-reduce, the step then discarded; the
            # lighthouse's heartbeat timeout (5 s) when it came while group 0 asked for a quorum.
            lost = wait_for("group 0 to give up on group 1", lambda: re.search(
                r"participants 2 -> 1 at step (\d+)", out("group", g0)), GUARD_S)  # fmt: skip
            t_lost = time.monotonic() - t0
            text0 = out("group", g0)
            assert not re.search(r"Connection (closed|reset) by peer", text0), text0[-3000:]
            how = ("gloo's timeout" if "Timed out waiting 10000ms" in text0
                   else "the heartbeat timeout")  # fmt: skip
            wait_for(f"{node} DOWN", lambda: "down" in node_state(node), GUARD_S, poll=0.5)
            t_down = time.monotonic() - t0
            # slurmctld sets a node DOWN at one of its pings (every SlurmdTimeout/3 = 20 s) once
            # the node's last answer is SlurmdTimeout (60 s) older than the ping before; a live
            # node answers at least every 40 s (it is pinged only when its last answer is over
            # 20 s old), so the DOWN comes 40 to 100 s after the crash (ping_nodes.c, ping_nodes();
            # controller.c, ping_interval), and with slurmctld's own reason.
            assert t_down >= 60 - 2 * 60 // 3, t_down
            reason = slurm("sinfo", "-h", "-n", node, "-o", "%E")
            assert reason == "Not responding", reason
            healed = wait_for("the requeued group 1 to heal", lambda: re.search(
                r"run 1 on .*?healed: step \d+ -> (\d+)", out("group", g1), re.S),
                2 * GUARD_S)  # fmt: skip
            t_healed = time.monotonic() - t0
            record = job_record(g1)
            assert int(record["Restarts"]) == 1 and record["NodeList"] == "node3", record
            same_state_after(out, int(healed[1]), g0, g1)
            print(f"crash of {node}: group 0 stepping alone after {t_lost:.1f} s (at step "
                  f"{lost[1]}, {how}), {node} DOWN after {t_down:.1f} s, the requeued group "
                  f"healed on node3 at step {healed[1]} after {t_healed:.1f} s")  # fmt: skip

            # A preemption of the requeued group (an urgent job on node3, lesson 05's
            # preempt.sh): SIGTERM to its task, which leaves between two steps and saves; the
            # job goes back in the queue (group.sh requeues it within the grace time where Slurm
            # does not: 22.05), runs again once the urgent job has ended, and heals. Group 0
            # went on at the step group 1 left, without discarding one.
            discarded = out("group", g0).count("discarded")
            urgent = slurm("sbatch", "--parsable", "--nodes=1", "--nodelist=node3",
                           f"--output={tmp_path}/urgent-%j.out",
                           "lessons/05_fault_tolerance/preempt.sh")  # fmt: skip
            jobs.append(urgent)
            t1 = time.monotonic()
            left = wait_for("group 1 to leave on SIGTERM", lambda: LEFT.search(out("group", g1)),
                            GUARD_S)  # fmt: skip
            t_left = time.monotonic() - t1
            drops = wait_for("group 0 alone again", lambda: re.findall(
                r"participants 2 -> 1 at step (\d+)", out("group", g0))[1:], GUARD_S)  # fmt: skip
            assert int(drops[0]) == int(left[1]), (drops, left[0])
            assert out("group", g0).count("discarded") == discarded, out("group", g0)[-3000:]
            assert wait_job(urgent, timeout=GUARD_S)[0] == "COMPLETED"
            healed = wait_for("the preempted group 1 to heal", lambda: re.search(
                r"run 2 on .*?healed: step \d+ -> (\d+)", out("group", g1), re.S),
                GUARD_S)  # fmt: skip
            t_back = time.monotonic() - t1
            assert int(job_record(g1)["Restarts"]) == 2, job_record(g1)
            same_state_after(out, int(healed[1]), g0, g1)
            print(f"preemption of group 1 on node3: it left {t_left:.1f} s after the urgent "
                  f"job's submission (step {left[1]}), healed at step {healed[1]} after "
                  f"{t_back:.1f} s")  # fmt: skip

            # A plain scancel of group 1's job: it leaves the same way, and the job ends
            # CANCELLED, not requeued, with the line to bring the group back.
            slurm("scancel", g1)
            assert wait_job(g1, timeout=GUARD_S)[0] == "CANCELLED"
            last = out("group", g1).rpartition("run 2 on ")[2]
            left = LEFT.search(last)
            assert left and "saved, not requeued. To go on later: sbatch lessons/11_torchft/" \
                "group.sh 1" in last, last  # fmt: skip
            drops = wait_for("group 0 alone once more", lambda: re.findall(
                r"participants 2 -> 1 at step (\d+)", out("group", g0))[2:], GUARD_S)  # fmt: skip
            assert int(drops[0]) == int(left[1]), (drops, left[0])
            assert out("group", g0).count("discarded") == discarded, out("group", g0)[-3000:]
            print(crash("--back", node))
            crashed.clear()
            wait_for(f"{node} back in service", lambda: "down" not in node_state(node), GUARD_S)
        finally:
            for node in crashed:
                crash("--back", node)
            for job in jobs:
                subprocess.run(["scancel", job], capture_output=True, timeout=30)
            for job in jobs:
                wait_job(job, timeout=GUARD_S)
            run_up()


def task_pid(job: str, rank: int) -> int:
    """The process of task RANK of JOB's first step: found by its environment (the nodes are
    this machine's processes), as a node's admin would find it with ps."""
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:  # gone, or not a process
            continue
        if (b"train_ft_fsdp.py" in cmdline and f"SLURM_JOB_ID={job}".encode() in environ
                and f"SLURM_PROCID={rank}".encode() in environ):  # fmt: skip
            # The task itself, slurmstepd's child (not a child of its own with its environment)
            parent = (proc / "stat").read_text().rpartition(")")[2].split()[1]
            if Path(f"/proc/{parent}/comm").read_text().strip() == "slurmstepd":
                return int(proc.name)
    raise AssertionError(f"no task {rank} of job {job} running train_ft_fsdp.py")


@pytest.mark.lesson11  # run only by make test-slurm's last pass (tests/lanes.py)
@pytest.mark.timeout(900)
def test_groups_of_two_ranks_heal_each_shard_from_the_peer_rank(cluster, cluster_lock, tmp_path):
    """group.sh with --ntasks=2, as the README types it: each group a job of two tasks running
    train_ft_fsdp.py (the model sharded over them) on a node of its own. One rank of group 1
    killed (SIGKILL to its process, as a crash of that process): srun's --kill-on-bad-exit ends
    the other rank at once (without it, it would wait in the group's collectives for its timeout,
    600 s), the job ends FAILED; group 0 steps on alone; a new job of group 1 (the same line)
    heals: each rank from its peer rank, then holding what that rank holds, bit for bit; both
    groups run to the last step and end COMPLETED with the same shards. (A plain scancel of such
    a group, both ranks leaving before the same step: tests/test_lesson11_fsdp.py.)"""
    # Group 0 steps alone at about 23 steps a second while the new group 1 starts (11 s here):
    # 1200 steps leave it three times that before it would end with nothing left to heal from.
    env = {"FT_DIR": str(tmp_path), "SUBSET": "2048", "STEPS": "1200"}
    jobs: list[str] = []

    sbatch, out = submitter(tmp_path, env, jobs)

    def shards(job: str, rank: int) -> dict[int, str]:
        return {int(m[1]): m[2] for m in re.finditer(
            rf"\[group \d rank {rank}\] step (\d+)/\d+ \|.* \| shard (\w+)$", out(job), re.M)}

    with cluster_lock(), on_timeout(lambda: jobs_report(jobs, tmp_path, TRAINING)):
        run_up()
        try:
            lh = sbatch(LIGHTHOUSE)
            g0 = sbatch(f"--dependency=after:{lh}", "--ntasks=2", GROUP, "0")
            g1 = sbatch(f"--dependency=after:{lh}", "--ntasks=2", GROUP, "1")
            wait_for("both groups stepping together", lambda: re.search(
                r"\[group 1 rank 1\] step \d+/\d+ \| groups 2", out(g1)), GUARD_S)  # fmt: skip
            records = {g: job_record(g) for g in (g0, g1)}
            assert records[g0]["NodeList"] != records[g1]["NodeList"], records
            assert all(r["NumTasks"] == "2" for r in records.values()), records
            killed = time.monotonic()
            os.kill(task_pid(g1, 1), signal.SIGKILL)
            state = wait_job(g1, timeout=GUARD_S)[0]
            took = time.monotonic() - killed
            assert state == "FAILED" and took < 30, (state, took, out(g1)[-3000:])
            assert "a rank of group 1 failed (srun's lines above)" in out(g1), out(g1)[-3000:]
            assert "To bring the group back: sbatch --ntasks=2 lessons/11_torchft/group.sh 1" \
                in out(g1), out(g1)[-3000:]  # fmt: skip
            gone = wait_for("group 0 alone", lambda: re.search(
                r"\[group 0 rank 0\] groups 2 -> 1 at step (\d+)", out(g0)), GUARD_S)  # fmt: skip
            g1b = sbatch("--ntasks=2", GROUP, "1")
            healed = [wait_for(f"rank {r} of the new group 1 to heal", lambda r=r: re.search(
                rf"\[group 1 rank {r}\] healed: step \d+ -> (\d+)", out(g1b)), GUARD_S)
                for r in range(2)]  # fmt: skip
            assert healed[0][1] == healed[1][1] and int(healed[0][1]) > int(gone[1]), healed
            common = (int(healed[0][1]) // 25 + 1) * 25  # the first logged step after it
            for job in (g0, g1b):
                for r in range(2):
                    wait_for(f"step {common} of rank {r}", lambda job=job, r=r: common in
                             shards(job, r), GUARD_S)  # fmt: skip
            for r in range(2):
                assert shards(g1b, r)[common] == shards(g0, r)[common], (out(g0), out(g1b))
            assert shards(g0, 0)[common] != shards(g0, 1)[common]  # two parts of one model
            for job in (g0, g1b):  # both to the last step, alike
                assert wait_job(job, timeout=4 * GUARD_S)[0] == "COMPLETED", out(job)[-3000:]
            for r in range(2):
                assert shards(g1b, r)[1200] == shards(g0, r)[1200], (out(g0), out(g1b))
            slurm("scancel", lh)  # the lighthouse, once the groups are done (its header's line)
            print(f"groups of 2 ranks: group 1's job ended {took:.1f} s after its rank 1 was "
                  f"killed; group 0 alone at step {gone[1]}; the new group 1 healed both ranks "
                  f"at step {healed[0][1]}, equal at step {common}")  # fmt: skip
        finally:
            for job in jobs:
                subprocess.run(["scancel", job], capture_output=True, timeout=30)
            for job in jobs:
                wait_job(job, timeout=GUARD_S)


@pytest.mark.lesson11  # run only by make test-slurm's last pass (tests/lanes.py)
@pytest.mark.timeout(900)
def test_on_nodes_of_four_gpus_a_group_that_shares_a_node_moves(cluster, cluster_lock, tmp_path):
    """Nodes of 4 GPUs, as many sites have (cluster/up.sh --gpus-per-node 4): the header's
    --gres=gpu:2 lets Slurm put both groups on one node, where one node lost would end both. The
    group that looks second (group.sh notes each group's nodes in FT_DIR/groups, under a lock)
    moves: it ends before training, and a new job of that group, without the shared node, joins
    the other on a node of its own. With no other node for it (the second group submitted with
    --exclude=<the other node>), it says so in one line and trains on. Given all of a node's GPUs
    (--gres=gpu:4), the groups land on two nodes; with --exclusive one waits (the lighthouse
    holds a node). The groups that move are of two ranks: the new job keeps the group's size
    and what sbatch's command line gave it (1 CPU a task, 20 minutes)."""
    env = {"FT_DIR": str(tmp_path), "SUBSET": "2048", "STEPS": "100000"}
    jobs: list[str] = []
    moved = re.compile(r"^=== \S+ group (\d) \(job (\d+)\) runs on (\S+) too, where a node lost "
                       r"would end both groups: group (\d) goes on as job (\d+), without (\S+)$",
                       re.M)  # fmt: skip
    warning = re.compile(r"^warning: group (\d) \(job (\d+)\) runs on (\S+) too: a node lost "
                         r"would end both groups, and partition \S+ has no other node for this "
                         r"one; training on\.", re.M)  # fmt: skip

    sbatch, out = submitter(tmp_path, env, jobs)

    def end(job: str) -> None:
        slurm("scancel", job)
        wait_job(job, timeout=GUARD_S)
        jobs.remove(job)  # waited for: the finally below waits for the others

    def stepping(g: list[str]) -> list[str]:
        """Both groups stepping together; their node lists."""
        for job in g:
            wait_for(f"job {job} stepping with both groups", lambda job=job: re.search(
                r"step \d+/\d+ \| (participants|groups) 2", out(job)), GUARD_S)  # fmt: skip
        return [job_record(job)["NodeList"] for job in g]

    def two_groups(*options: str) -> list[str]:
        return [sbatch(f"--dependency=after:{lh}", *options, GROUP, str(n)) for n in range(2)]

    with cluster_lock(), on_timeout(lambda: jobs_report(jobs, tmp_path, TRAINING)):
        run_up("--gpus-per-node", "4")
        try:
            lh = sbatch(LIGHTHOUSE)
            # Groups of two ranks with the header's --gres=gpu:2: Slurm puts both on one node.
            g = two_groups("--ntasks=2", "--cpus-per-task=1", "--time=00:20:00")
            m = wait_for("a group moved", lambda: next((m for job in g for m in
                         moved.finditer(out(job))), None), GUARD_S)  # fmt: skip
            mover = next(job for job in g if m[0] in out(job))
            jobs.append(m[5])  # the replacement, for the finally
            stayer = g[1 - g.index(mover)]
            assert (m[1], m[2], m[4]) == (str(g.index(stayer)), stayer, str(g.index(mover))), m[0]
            assert m[3] == m[6] == job_record(stayer)["NodeList"], m[0]  # the shared node, avoided
            assert wait_job(mover, timeout=GUARD_S)[0] == "COMPLETED"
            assert "step " not in out(mover), out(mover)  # it left before training
            record = job_record(m[5])
            assert record["ExcNodeList"] == m[6] and record["NumTasks"] == "2", record  # its size
            assert (record["CPUs/Task"], record["TimeLimit"]) == ("1", "00:20:00"), record
            assert record["TresPerNode"].endswith("gpu:2"), record
            apart = stepping([stayer, m[5]])
            assert apart[0] != apart[1], apart
            assert not any(warning.search(out(job)) for job in (stayer, m[5]))
            assert not moved.search(out(m[5]))
            for job in (stayer, m[5]):
                end(job)
            jobs.remove(mover)
            # No other node: group 1 kept off the node group 0 did not take, so it joins group 0.
            first = sbatch(f"--dependency=after:{lh}", GROUP, "0")
            taken = wait_for(f"job {first} running", lambda: job_record(first)["NodeList"]
                             if job_record(first)["JobState"] == "RUNNING" else None, GUARD_S)
            other = "node2" if taken == "node1" else "node1"
            second = sbatch(f"--exclude={other}", GROUP, "1")
            nodes = stepping([first, second])
            assert nodes[0] == nodes[1], nodes
            said = warning.search(out(second))
            assert said and said.groups() == ("0", first, nodes[0]), out(second)
            assert not moved.search(out(second)) and not warning.search(out(first))
            for job in (first, second):
                end(job)
            g = two_groups("--gres=gpu:4")  # all of a node's GPUs
            nodes = stepping(g)
            assert nodes[0] != nodes[1], nodes
            assert not any(moved.search(out(job)) or warning.search(out(job)) for job in g)
            for job in g:
                end(job)
            # --exclusive keeps the lighthouse off a group's node too: of two nodes, one is left.
            g = [sbatch(f"--dependency=after:{lh}", "--exclusive", GROUP, str(n)) for n in (0, 1)]
            first = wait_for("one exclusive group stepping", lambda: next((job for job in g if
                             re.search(r"step \d+/\d+ \| participants 1", out(job))), None),
                             GUARD_S)  # fmt: skip
            time.sleep(5)  # a scheduling pass or two
            waiting = job_record(g[1 - g.index(first)])
            assert waiting["JobState"] == "PENDING", waiting
            print(f"4-GPU nodes: with --gres=gpu:2 both groups on {m[3]}, group {m[4]} moved "
                  f"(groups on {' and '.join(apart)}); with no other node for it, it said so; "
                  f"with --gres=gpu:4 on {' and '.join(nodes)}; with --exclusive one group "
                  f"pending ({waiting['Reason']})")
        finally:
            for job in jobs:
                subprocess.run(["scancel", job], capture_output=True, timeout=30)
            for job in jobs:
                wait_job(job, timeout=GUARD_S)
            run_up()
