"""Lesson 12: the sick node, found while the job runs, and moved off.

On this machine (4 ranks, gloo on loopback, started as srun starts a step's tasks): a NaN in
one rank's batch is skipped on every rank, and the run then equals, bit for bit, a run that
skipped that step on purpose (and differs from one that did not skip it); NaNs that keep coming
stop the job with the rank named and a checkpoint saved; a bit flipped in one rank's weights is
named at the next window, and the checkpoint holds the majority's copy (the checksum the verdict
printed), from which the run goes on with every rank equal again. On the local cluster: a node
slowed from outside (slow_node.sh) is named while the job runs, the job moves itself off it and
finishes on the other nodes with the state of an undisturbed run; with no node left to move
to, it says so in one line.
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    cluster_lock,
    job_environ,
    job_record,
    jobs_report,
    on_timeout,
    run_up,
    slurm,
    wait_for,
    wait_job,
)
from helpers import clean_environ, stacks, start_ranks

pytestmark = pytest.mark.lesson12

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "lessons" / "12_sick_node"
TRAIN = ["python", str(LESSON / "train.py")]
RANKS = 4
STEPS, SUBSET = 120, 2048  # a short run: 120 steps on the first 2,048 images
SHORT = ["--steps", str(STEPS), "--train-subset", str(SUBSET), "--test-subset", str(SUBSET)]
STATE = re.compile(r"^done: test_acc [\d.]+% after (\d+) steps in [\d.]+s \| state (\w+) "
                   r"\| bn (\w+)$", re.M)
GUARD_S = 300  # hang guards only: 4 ranks take ~10 s alone, a few times that beside CI's lanes


def train(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """The four ranks of one run; their outputs (rank 0's first) and the first non-zero exit."""
    log = tmp_path / f"run-{time.monotonic_ns()}.log"
    with open(log, "w") as f:
        procs = start_ranks(RANKS, [*TRAIN, *SHORT, *args], stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + GUARD_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        hung = stacks(procs)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    text = log.read_text()
    assert not hung, f"a rank still ran after {GUARD_S} s; its stacks:\n{hung}\n{text[-3000:]}"
    status = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(args, status, text, "")


def state(text: str, bn: bool = False) -> str:
    """The run's final checksum of its weights and optimizer state; with BN, of its BatchNorm
    statistics too (rank 0's, which every rank holds at the end)."""
    found = STATE.search(text)
    assert found, text[-3000:]
    return found[2] + (f" bn {found[3]}" if bn else "")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The undisturbed run every other run is measured against."""
    run = train(tmp_path=tmp_path_factory.mktemp("clean"))
    assert run.returncode == 0, run.stdout[-3000:]
    assert "0 step(s) skipped, weights equal on all 4 ranks" in run.stdout, run.stdout[-3000:]
    return run.stdout


def test_a_nan_is_skipped_on_every_rank_as_a_planned_skip_is(clean, tmp_path):
    # On rank 0: its BatchNorm statistics are the ones DDP hands to every rank, so a skip that
    # did not undo the forward's update of them would leave NaN in the final state.
    nan = train("--fault", "nan", "--fault-rank", "0", "--fault-step", "30", "--fault-steps",
                "1", tmp_path=tmp_path)  # fmt: skip
    assert nan.returncode == 0, nan.stdout[-3000:]
    assert re.search(r"^step 30: non-finite loss on rank 0 on \S+: step skipped on every rank",
                     nan.stdout, re.M), nan.stdout[-3000:]  # fmt: skip
    planned = train("--skip-step", "30", tmp_path=tmp_path)
    assert planned.returncode == 0, planned.stdout[-3000:]
    assert state(nan.stdout, bn=True) == state(planned.stdout, bn=True), (
        nan.stdout[-2000:], planned.stdout[-2000:])  # fmt: skip
    assert state(nan.stdout) != state(clean), "the skipped step changed nothing: trained on?"


def test_nans_that_keep_coming_stop_the_job_and_name_the_rank(tmp_path):
    ckpt, report = tmp_path / "ckpt.pt", tmp_path / "sick"
    run = train("--fault", "nan", "--fault-rank", "2", "--fault-step", "40", "--checkpoint",
                str(ckpt), "--report", str(report), tmp_path=tmp_path)  # fmt: skip
    assert run.returncode == 3, run.stdout[-3000:]
    assert re.search(r"^sick node: (\S+) \(rank 2\): 3 non-finite losses in 100 steps; "
                     r"checkpoint saved at step 43;", run.stdout, re.M), run.stdout[-3000:]
    assert report.read_text().strip() == subprocess.run(
        ["hostname"], capture_output=True, text=True).stdout.strip()  # fmt: skip
    saved = torch.load(ckpt, weights_only=False)
    assert saved["step"] == 43
    assert all(torch.isfinite(t).all() for t in saved["model"].values())


def test_a_flipped_bit_is_named_and_the_majority_copy_is_saved(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    flip = train("--fault", "bitflip", "--fault-rank", "0", "--fault-step", "50",
                 "--checkpoint", str(ckpt), tmp_path=tmp_path)  # fmt: skip
    assert flip.returncode == 3, flip.stdout[-3000:]
    # Found at the first window after the flip (every 20 steps).
    found = re.search(r"^sick node: \S+ \(rank 0\): weights and optimizer state differ from "
                      r"the other ranks' at step 60 \(rank 0 (\w+); the others (\w+)\); "
                      r"checkpoint saved at step 60", flip.stdout, re.M)  # fmt: skip
    assert found, flip.stdout[-3000:]
    # Saved by rank 1: rank 0, which saves otherwise, holds the damaged copy.
    import sys

    sys.path.insert(0, str(LESSON))
    from health import fingerprint

    from common.mnist import build_model, build_optimizer

    saved = torch.load(ckpt, weights_only=False)
    model = build_model()
    model.load_state_dict(saved["model"])
    optimizer, _ = build_optimizer(model, 1e-2, STEPS)
    optimizer.load_state_dict(saved["optimizer"])
    assert f"{fingerprint(model, optimizer).item() & (2**64 - 1):016x}" == found[2] != found[1]
    # And the run goes on from it, every rank equal again.
    resumed = train("--checkpoint", str(ckpt), tmp_path=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "at step 60" in resumed.stdout and "weights equal on all 4 ranks" in resumed.stdout


@pytest.mark.parametrize("args, says", [
    (["--check-every", "0"], "--check-every must be at least 1, got 0"),
    (["--slow-factor", "0.5"], "--slow-factor must be more than 1"),
    (["--max-skips", "9", "--skip-window", "5"], "--max-skips 9 can never happen within"),
    (["--fault", "nan"], "--fault nan needs where: --fault-rank R or --fault-node NODE"),
])  # fmt: skip
def test_train_py_refuses_bad_input_in_one_line(args, says):
    proc = subprocess.run([*TRAIN, *args], cwd=ROOT, env=clean_environ(), capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr


@pytest.mark.parametrize("script, args, env, says", [
    ("job.sh", [], {"STEPS": "lots"}, "STEPS='lots' is not a whole number of steps"),
    ("job.sh", [], {"SUBSET": "half"}, "SUBSET='half' is not a whole number of images"),
    ("slow_node.sh", ["x", "node2"], {}, "JOBID='x' is not a job id"),
    ("slow_node.sh", ["1", "node2", "soon"], {}, "SECONDS='soon' is not a whole number"),
    ("slow_node.sh", ["999999", "node2"], {}, "job 999999 is not running"),
])  # fmt: skip
def test_scripts_refuse_bad_input_in_one_line(script, args, env, says):
    proc = subprocess.run(["bash", str(LESSON / script), *args], cwd=ROOT, timeout=60,
                          env=clean_environ(SLURM_SUBMIT_DIR=str(ROOT), SLURM_JOB_ID="1",
                                            SLURM_JOB_NAME="t", SLURM_JOB_NODELIST="node1",
                                            **env),
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr


# --- On the local cluster ------------------------------------------------------------------


def output(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.parametrize("fault, named", [
    ("nan", r"node2 \(rank 2,3\): 3 non-finite losses in 100 steps; checkpoint saved at step 53"),
    ("bitflip", r"node2 \(rank 2\): weights and optimizer state differ from the other ranks' at "
                r"step 60 \(rank 2 \w+; the others \w+\); checkpoint saved at step 60"),
])  # fmt: skip
def test_with_no_node_to_move_to_the_job_says_so(cluster, tmp_path, fault, named):
    """The README's fault jobs on the default cluster, whose two nodes the job takes: excluding
    one leaves too few, and the job says so in one line (on three nodes it moves: below)."""
    with cluster_lock():
        job = slurm("sbatch", "--parsable", f"--output={tmp_path}/sick-%j.out",
                    "lessons/12_sick_node/job.sh", "--fault", fault, "--fault-node", "node2",
                    env={"STEPS": "100", "SUBSET": "2048"})  # fmt: skip
        state, status, _ = wait_job(job, GUARD_S)
    text = output(tmp_path / f"sick-{job}.out")
    assert (state, status) == ("FAILED", 3), text[-3000:]
    assert re.search(rf"^sick node: {named}", text, re.M), text[-3000:]
    assert re.search(r"^error: without node2, partition \S+ has 1 node\(s\) and this job needs "
                     r"2: not resubmitted\.", text, re.M), text[-3000:]  # fmt: skip
    kept = ROOT / "checkpoints" / f"sick-{job}.pt"
    assert kept.exists(), "the checkpoint was not kept"
    kept.unlink()


def test_the_job_moves_at_the_size_sbatch_was_given(cluster, tmp_path):
    """Options on sbatch's command line are not kept with the script: the job that moves off a
    sick node asks for what the first one got (here 1 node, 2 CPUs a task, 8 GB, 20 minutes),
    not job.sh's header (2 nodes, which the default cluster could not give without node1)."""
    size = ["--nodes=1", "--cpus-per-task=2", "--mem=8G", "--time=00:20:00"]
    with cluster_lock():
        first = slurm("sbatch", "--parsable", f"--output={tmp_path}/sick-%j.out", *size,
                      "--nodelist=node1", "lessons/12_sick_node/job.sh", "--fault", "nan",
                      "--fault-node", "node1", env={"STEPS": "100", "SUBSET": "2048"})  # fmt: skip
        state1, status1, _ = wait_job(first, GUARD_S)
        text1 = output(tmp_path / f"sick-{first}.out")
        assert (state1, status1) == ("FAILED", 3), text1[-3000:]
        moved = re.search(r"moved off node1: job (\d+) resumes", text1)
        assert moved, text1[-3000:]
        state2, _, record = wait_job(moved[1], GUARD_S)
    text2 = output(tmp_path / f"sick-{moved[1]}.out")
    assert state2 == "COMPLETED", text2[-3000:]
    assert "at step 53, on node2" in text2, text2[-3000:]
    got = {k: record.get(k) for k in ("NodeList", "NumNodes", "NumTasks", "CPUs/Task",
                                      "MinMemoryNode", "TimeLimit")}  # fmt: skip
    assert got == {"NodeList": "node2", "NumNodes": "1", "NumTasks": "2", "CPUs/Task": "2",
                   "MinMemoryNode": "8G", "TimeLimit": "00:20:00"}, record  # fmt: skip
    (ROOT / "checkpoints" / f"sick-{first}.pt").unlink(missing_ok=True)


@pytest.fixture
def three_nodes(cluster):
    """The cluster restarted with a third node to move to, under the lock; two after."""
    with cluster_lock():
        run_up("--nodes", "3")
        try:
            yield
        finally:
            run_up()


@pytest.mark.timeout(2 * GUARD_S + 120)
def test_a_slowed_node_is_named_and_the_job_finishes_without_it(three_nodes, tmp_path):
    steps, subset = 300, 4096
    env = {"STEPS": str(steps), "SUBSET": str(subset)}
    first = slurm("sbatch", "--parsable", f"--output={tmp_path}/sick-%j.out",
                  "lessons/12_sick_node/job.sh", env=env)  # fmt: skip
    log = tmp_path / f"sick-{first}.out"
    wait_for("the first timing window", lambda: "times step 20 " in output(log), GUARD_S)
    slow = subprocess.run(["bash", "lessons/12_sick_node/slow_node.sh", first, "node2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=GUARD_S,
                          env=job_environ())  # fmt: skip
    # slow_node.sh's step ends with the job it slows.
    state1, status1, _ = wait_job(first, GUARD_S)
    text1 = output(log)
    assert (state1, status1) == ("FAILED", 3), text1[-3000:] + slow.stdout + slow.stderr
    assert re.search(r"^sick node: node2 \(rank 2,3\): its fastest rank computes [\d.]+x [\d.]+x "
                     r"[\d.]+x as long as the median rank elsewhere", text1, re.M), text1[-3000:]
    moved = re.search(r"moved off node2: job (\d+) resumes", text1)
    assert moved, text1[-3000:]
    second = moved[1]
    state2, _, record = wait_job(second, GUARD_S)
    text2 = output(tmp_path / f"sick-{second}.out")
    assert state2 == "COMPLETED", text2[-3000:]
    assert record["NodeList"] == "node[1,3]" and "node2" in record["ExcNodeList"], record
    saved = int(re.search(r"checkpoint saved at step (\d+)", text1)[1])
    assert f"at step {saved}, on node1,node3" in text2, text2[-3000:]
    # The resumed run on other nodes ends where an undisturbed run of the same shape ends.
    undisturbed = train("--steps", str(steps), "--train-subset", str(subset), "--test-subset",
                        str(subset), tmp_path=tmp_path)  # fmt: skip
    assert state(text2, bn=True) == state(undisturbed.stdout, bn=True), (
        text2[-2000:], undisturbed.stdout[-2000:])  # fmt: skip
    # Nothing flagged on the nodes left: no false alarm after the move.
    assert re.search(r"^clean: highest compute ratio [\d.]+ \(flag at 3\.0\), 0 step\(s\) skipped",
                     text2, re.M), text2[-3000:]  # fmt: skip


# Lesson 11's torchft groups with lesson 12's straggler check (train_ft.py --slow-factor): the
# group on the slowed node leaves, group.sh submits its replacement elsewhere, which heals from
# the live group; the live group never stops.
FT_HASH = re.compile(r"\[group (\d)\] step (\d+)/\d+ \|.* \| state (\w+)$", re.M)


def ft_hashes(text: str) -> dict[int, str]:
    return {int(m[2]): m[3] for m in FT_HASH.finditer(text)}


@pytest.mark.timeout(5 * GUARD_S)
def test_a_torchft_group_on_a_slowed_node_leaves_and_is_replaced_elsewhere(three_nodes,
                                                                           tmp_path):  # fmt: skip
    if (sys.platform, platform.machine()) != ("linux", "x86_64") or sys.version_info >= (3, 14):
        pytest.skip("torchft 0.2.0 has wheels for CPython 3.10-3.13 on Linux x86_64 only "
                    "(requirements.txt installs it nowhere else)")  # fmt: skip
    import torchft  # noqa: F401  (requirements.txt installs it here: not importing is a failure)

    # Where the lighthouse's address goes (a folder every node sees), a shorter run (group.sh's
    # header). The lighthouse waits for two groups (MIN_REPLICAS=2), so the live group waits
    # for the replacement instead of stepping alone: on an idle machine it does some 50 steps a
    # second alone and reached step 300, the end, before the replacement started (14 s after
    # the verdict), which then had nobody to heal from. (The README's lighthouse line, without
    # it, is run by tests/test_lesson11_cluster.py.)
    env = {"FT_DIR": str(tmp_path), "SUBSET": "2048", "STEPS": "300"}
    jobs: list[str] = []

    def sbatch(*args: str, name: str, extra: dict | None = None) -> str:
        job = slurm("sbatch", "--parsable", f"--output={tmp_path}/{name}-%j.out", *args,
                    env=env | (extra or {}))  # fmt: skip
        jobs.append(job)
        return job

    def out(name: str, job: str) -> str:
        return output(tmp_path / f"{name}-{job}.out")

    training = r"python \S*lessons/11_torchft/train_ft"  # whose stacks a wait's timeout shows
    with on_timeout(lambda: jobs_report(jobs, tmp_path, training)):
        try:
            lh = sbatch("lessons/11_torchft/lighthouse.sh", name="lighthouse",
                        extra={"MIN_REPLICAS": "2"})
            g0, g1 = (sbatch(f"--dependency=after:{lh}", "lessons/11_torchft/group.sh", str(g),
                             "--slow-factor", "3", name="group") for g in (0, 1))  # fmt: skip
            wait_for("both groups past their first window", lambda: re.search(
                r"step \d+/\d+ \| participants 2", out("group", g1)), 3 * GUARD_S)  # fmt: skip
            node = job_record(g1)["NodeList"]
            assert node == "node2", job_record(g1)  # the README slows node2: group 1's node
            # 600 s, not the default 120: three windows of 10 slowed steps took 150 s and more
            # beside CI's lanes (5 s a step on Slurm 26.05; the slowing ends with the group anyway).
            slow = subprocess.run(["bash", "lessons/12_sick_node/slow_node.sh", g1, node, "600"],
                                  cwd=ROOT, capture_output=True, text=True, timeout=3 * GUARD_S,
                                  env=job_environ())  # fmt: skip
            state1, status1, _ = wait_job(g1, GUARD_S)
            text1 = out("group", g1)
            assert (state1, status1) == ("FAILED", 3), text1[-3000:] + slow.stdout + slow.stderr
            left = re.search(r"leaving at step (\d+): this group's node node2 computes [\d.]+x "
                             r"[\d.]+x [\d.]+x the other groups' median", text1)  # fmt: skip
            assert left, text1[-3000:]
            moved = re.search(r"moved off node2: group 1 goes on as job (\d+), without node2",
                              text1)  # fmt: skip
            assert moved, text1[-3000:]
            g1b = moved[1]
            jobs.append(g1b)
            # The live group saw the same windows, waited for a second group, and went on with the
            # replacement.
            text0 = out("group", g0)
            assert "slow: group 1 computes" in text0, text0[-3000:]
            healed = wait_for("the replacement to heal", lambda: re.search(
                r"healed: step \d+ -> (\d+)", out("group", g1b)), GUARD_S)  # fmt: skip
            assert int(healed[1]) >= int(left[1]), out("group", g1b)  # where group 0 waited
            for g in (g0, g1b):
                state, _, record = wait_job(g, 3 * GUARD_S)
                assert state == "COMPLETED", out("group", g)[-3000:]
            record = job_record(g1b)
            assert record["NodeList"] != "node2" and record["ExcNodeList"] == "node2", record
            assert int(job_record(g0)["Restarts"]) == 0
            # Every state both logged after the heal is the same, bit for bit, to the last step.
            after0, after1 = ft_hashes(out("group", g0)), ft_hashes(out("group", g1b))
            common = sorted(s for s in after1 if s > int(healed[1]) and s in after0)
            assert common and common[-1] == 300, (after0, after1)
            assert all(after0[s] == after1[s] for s in common), (after0, after1)
            # No false alarm on the nodes left: neither group left again (one window over the
            # factor may come under CI's load, 3.3x once beside a load average of 22; three in a
            # row are needed).
            assert "leaving at" not in out("group", g0) + out("group", g1b)
        finally:
            for job in jobs:
                subprocess.run(["scancel", job], capture_output=True, timeout=30)
