"""Lesson 00 (SLURM basics): every job script of the lesson runs on the local cluster.

Each test submits real jobs (sbatch, srun, salloc, scancel) and checks what they print and
what SLURM recorded; the sample outputs stored in the lesson folder have the same shape as the
fresh runs. The README's own commands (busy.sh, the sweep and its report) are submitted as it
types them, from the course root, their output files in a temporary folder (``--output``); the
other jobs run with ``--chdir`` into one, so their files land there.
The jobs are short: the whole file takes about 20 s of cluster time.
"""

from __future__ import annotations

import getpass
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import CLUSTER_LOG_DIR, slurm_version
from helpers import clean_environ

from common import jobwait

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "lessons" / "00_slurm_basics"

TASK_LINE = re.compile(
    r"^step (?P<step>\d+) task (?P<task>\d+)/(?P<ntasks>\d+) on (?P<host>\S+): node index "
    r"(?P<node>\d+), local index (?P<local>\d+), CPUs (?P<cpus>\d+), "
    r"CUDA_VISIBLE_DEVICES=(?P<gpus>\S+)$"
)


def environ():
    """A clean environment for the SLURM commands: no SLURM_/SBATCH_ input from outside."""
    env = clean_environ()
    return {k: v for k, v in env.items() if not k.startswith(("SBATCH_", "SRUN_", "SALLOC_"))}


def slurm(*cmd, timeout=60, check=True):
    proc = subprocess.run([str(c) for c in cmd], cwd=ROOT, env=environ(), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    if check:
        assert proc.returncode == 0, f"{cmd}: {proc.stdout}{proc.stderr}"
    return proc


def sbatch(*args):
    """Submit from the course root; the job id."""
    out = slurm("sbatch", "--parsable", *args).stdout
    return out.strip().split(";")[0]


def records(job_id):
    """{JobId: fields} for a job (one entry per array task) from scontrol."""
    out = slurm("scontrol", "show", "job", "--oneliner", job_id, check=False).stdout
    return {
        f["JobId"]: f
        for f in (dict(re.findall(r"(\S+?)=(\S*)", line)) for line in out.splitlines())
        if "JobId" in f
    }


def wait(job_id, timeout=60):
    """Wait (common/jobwait.py) until the job, every array task of it, has ended; {JobId: fields}
    of its last records."""
    try:
        end = jobwait.wait(job_id, timeout, env=environ())
    except (TimeoutError, RuntimeError) as exc:
        slurm("scancel", job_id, check=False)
        pytest.fail(f"{exc}: {records(job_id)}", pytrace=False)
    return {f["JobId"]: f for f in end.records if "JobId" in f}


def the_sample(pattern):
    found = sorted(LESSON.glob(pattern))
    assert len(found) == 1, f"expected one sample output {pattern} in {LESSON}, found {found}"
    return found[0].read_text()


def own_lines(text):
    """The lines the lesson's scripts print, without srun's notes (they vary run to run)."""
    return [line for line in text.splitlines() if not line.startswith(("srun:", "slurmstepd"))]


# --------------------------------------------------------------------------- without a cluster


def test_report_needs_the_sweep_job_id(tmp_path):
    env = {**environ(), "SLURM_SUBMIT_DIR": str(ROOT)}
    proc = subprocess.run(["bash", str(LESSON / "report.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "usage: sbatch --dependency=afterok:" in proc.stderr
    proc = subprocess.run(["bash", str(LESSON / "report.sh"), "999999"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        f"error: no results of array job 999999 in {tmp_path}/runs/sweep-999999: give the "
        "sweep's job id"
    ), proc.stderr


# --------------------------------------------------------------------------- on the cluster


def test_anatomy_job_steps_and_tasks(cluster, cluster_lock, tmp_path):
    with cluster_lock():
        job = sbatch(f"--chdir={tmp_path}", "--export=ALL,GREETING=hello",
                     "lessons/00_slurm_basics/anatomy.sh")  # fmt: skip
        record = wait(job)[job]
    text = (tmp_path / f"anatomy-{job}.out").read_text()  # --output=%x-%j.out, in --chdir
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", text
    lines = text.splitlines()
    assert lines[0] == f"== the job: {job} (anatomy), batch script on node1", text
    assert lines[1] == ("nodes node[1-2] (2), tasks 4 (2(x2) per node), CPUs per task 2, "
                        "GPUs per node 2, memory per node 1024 MB"), text  # fmt: skip
    assert lines[2] == f"working directory {tmp_path} (--chdir), submitted from {ROOT}", text
    assert lines[3] == "GREETING=hello", text
    # sbatch sets the task variables in the batch script too (as task 0). The step id: not set
    # up to 25.11; from 26.05 the batch step's own, -5 (SLURM_BATCH_SCRIPT printed with %d:
    # src/common/env.c, setup_env, now sets it for every step id but NO_VAL).
    step_id = "-5" if slurm_version() >= (26, 5) else "<not set>"
    assert lines[4] == ("in the batch script: SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 "
                        f"SLURM_NTASKS=4 SLURM_STEP_ID={step_id}"), text  # fmt: skip

    tasks = [m.groupdict() for m in map(TASK_LINE.match, lines) if m]
    by_step = {s: sorted((t for t in tasks if t["step"] == s), key=lambda t: int(t["task"]))
               for s in ("0", "1", "2")}  # fmt: skip
    # Step 0, the job's shape: 2 tasks on each node, numbered node by node.
    assert [(t["task"], t["host"], t["node"], t["local"], t["gpus"]) for t in by_step["0"]] == [
        ("0", "node1", "0", "0", "0,1"), ("1", "node1", "0", "1", "0,1"),
        ("2", "node2", "1", "0", "0,1"), ("3", "node2", "1", "1", "0,1"),
    ], text  # fmt: skip
    assert {t["cpus"] for t in by_step["0"]} == {"2"}, text  # --cpus-per-task reached srun
    # Step 1: one task per node.
    assert [(t["task"], t["ntasks"], t["host"]) for t in by_step["1"]] == [
        ("0", "2", "node1"), ("1", "2", "node2")], text  # fmt: skip
    # Step 2: --gpus-per-task=1, each task of a node gets another GPU.
    assert [t["gpus"] for t in by_step["2"]] == ["0", "1", "0", "1"], text
    # Step 3: one output file per task, named after node (%N) and task (%t).
    for name, host in [("node1-0", "node1"), ("node1-1", "node1"), ("node2-2", "node2"),
                       ("node2-3", "node2")]:  # fmt: skip
        assert f"{name}.out: {host}" in lines, text
        assert (tmp_path / f"runs/anatomy-{job}/{name}.out").read_text().strip() == host
    # squeue --steps, while step 4 ran: the batch step and step 4 (and the extern step where
    # PrologFlags=Contain creates one).
    steps = re.findall(rf"^\s*{job}\.(\S+)\s", text, re.M)
    assert sorted(s for s in steps if s != "extern") == ["4", "batch"], text
    for field in ("JobState=RUNNING", "TimeLimit=00:02:00", "NumNodes=2", "NumTasks=4",
                  "CPUs/Task=2", "MinMemoryNode=1G", f"WorkDir={tmp_path}",
                  f"StdOut={tmp_path}/anatomy-{job}.out"):  # fmt: skip
        assert field in lines, text

    # The stored sample is a run of the same script: the same lines, up to ids and paths.
    def shape(out):
        out = re.sub(r"\b\d+\.(batch|4)\b", r"ID.\1", out)
        out = re.sub(r"(job: |anatomy-|JobId=)\d+", r"\1ID", out)
        out = re.sub(r"(directory|from|WorkDir=|StdOut=)\s?\S+?(/anatomy-ID\.out)?(?=\s|$)",
                     r"\1 PATH\2", out)  # fmt: skip
        out = re.sub(r"\b\d+:\d\d\b", "TIME", out)
        return sorted(" ".join(line.split()) for line in own_lines(out)  # squeue pads columns
                      if not re.match(r"\s*\d+\.extern\s", line))  # fmt: skip

    sample = the_sample("anatomy-*.out")
    if slurm_version() != (22, 5):  # every check above ran; only the sample's shape is left out
        pytest.skip(f"the stored anatomy sample is Slurm 22.05's and scontrol's fields differ in "
                    f"{'.'.join(map(str, slurm_version()))}: the fresh run is compared with it on "
                    "22.05 only")  # fmt: skip
    assert shape(sample.replace("GREETING=<not set>", "GREETING=hello")) == shape(text)


def oom_enforced():
    """Does this cluster kill a step that goes over --mem (cgroup memory constraint)?"""
    config = slurm("scontrol", "show", "config").stdout
    if not re.search(r"^TaskPlugin\s*=.*task/cgroup", config, re.M):
        return False
    cgroup_conf = Path("/etc/slurm/cgroup.conf")
    text = cgroup_conf.read_text() if cgroup_conf.exists() else ""
    return bool(re.search(r"^\s*ConstrainRAMSpace\s*=\s*yes", text, re.M | re.I))


def require_accounting():
    """cluster/up.sh starts slurmdbd for every Slurm version and site profile: sacct answers."""
    proc = slurm("sacct", "--noheader", "-j", "1", check=False)
    assert "accounting storage is disabled" not in proc.stdout + proc.stderr, (
        "sacct: accounting storage is disabled, though cluster/up.sh starts slurmdbd "
        f"(its log: {CLUSTER_LOG_DIR})")  # fmt: skip


def mailbox():
    """This user's mailbox on the local cluster, whose MailProg (cluster/mailprog.sh, for every
    Slurm version and site profile) delivers to /var/mail."""
    config = slurm("scontrol", "show", "config").stdout
    prog = re.search(r"^MailProg\s*=\s*(\S+)", config, re.M)
    assert prog and Path(prog[1]).name == "mailprog.sh" and Path(prog[1]).exists(), (
        f"MailProg is {prog[1] if prog else 'not set'}, not cluster/mailprog.sh")  # fmt: skip
    return Path("/var/mail") / getpass.getuser()


def test_memory_job_over_its_mem(cluster, cluster_lock, tmp_path):
    with cluster_lock():
        job = sbatch(f"--chdir={tmp_path}", "lessons/00_slurm_basics/memory.sh")
        record = wait(job)[job]
    text = (tmp_path / f"memory-{job}.out").read_text()
    assert f"job {job} on node1: --mem gives 300 MB per node" in text, text
    assert "holding 100 MB" in text, text
    if oom_enforced():
        # The kernel stops the step near 300 MB; SLURM says why. The step ends OUT_OF_MEMORY;
        # the job FAILED (Slurm 22.05: the batch script's srun failed) or OUT_OF_MEMORY.
        assert record["JobState"] in ("OUT_OF_MEMORY", "FAILED"), (record, text)
        assert "holding 600 MB" not in text and "still alive" not in text, text
        # slurmstepd's words changed in 23.02 (task_cgroup_memory.c, task_cgroup_memory_check_oom).
        assert (f"Detected 1 oom-kill event(s) in StepId={job}.0" in text
                or f"Detected 1 oom_kill event in StepId={job}.0" in text), text
        require_accounting()
        # The database hears of the end a moment after scontrol (a second or two; 60 s is a
        # guard for a loaded machine, not a measure).
        deadline = time.monotonic() + 60
        while True:
            steps = slurm("sacct", "--noheader", "--parsable2", "-j", job,
                          "--format=JobID,State").stdout  # fmt: skip
            if f"{job}.0|OUT_OF_MEMORY" in steps.splitlines():
                break
            assert time.monotonic() < deadline, steps
            time.sleep(0.5)
    else:
        assert record["JobState"] == "COMPLETED", (record, text)
        assert "still alive: this cluster does not enforce --mem" in text, text
    assert the_sample("memory-*.out").splitlines()[1] == "holding 100 MB"


def expected_loss(lr):
    """What sweep.sh's awk computes: 20 gradient steps on x^2 from x = 1."""
    x = 1.0
    for _ in range(20):
        x -= lr * 2 * x
    return f"{x * x:.3g}"


def test_array_then_dependent_report(cluster, cluster_lock, tmp_path):
    rates = ["0.01", "0.1", "0.4", "1.05"]
    # As the README types them, from the course root: the results go to runs/sweep-<id> there.
    with cluster_lock():
        sweep = sbatch(f"--output={tmp_path}/%x-%A_%a.out", "lessons/00_slurm_basics/sweep.sh")
        try:
            report = sbatch(f"--output={tmp_path}/%x-%j.out", f"--dependency=afterok:{sweep}",
                            "lessons/00_slurm_basics/report.sh", sweep)  # fmt: skip
            queued = slurm("squeue", "--noheader", "--jobs", report, "--format=%T %r").stdout
            swept = wait(sweep)
            done = wait(report)[report]
        finally:
            shutil.rmtree(ROOT / "runs" / f"sweep-{sweep}", ignore_errors=True)
    # The report waited for the whole array (unless the array had ended already).
    assert queued.split() in (["PENDING", "Dependency"], []), queued
    assert sorted(f["ArrayTaskId"] for f in swept.values()) == ["0", "1", "2", "3"]
    assert {f["JobState"] for f in swept.values()} == {"COMPLETED"}, swept
    for index, lr in enumerate(rates):
        text = (tmp_path / f"sweep-{sweep}_{index}.out").read_text()  # %A_%a
        assert re.fullmatch(
            rf"array job {sweep} task {index} \(job id \d+\) on node\d: lr={lr}\n"
            rf"lr={lr} final loss {re.escape(expected_loss(float(lr)))}\n",
            text,
        ), text
    assert done["JobState"] == "COMPLETED", done
    text = (tmp_path / f"report-{report}.out").read_text()
    ranked = sorted(rates, key=lambda lr: float(expected_loss(float(lr))))
    assert text.splitlines()[: len(rates) + 2] == [
        f"job {report}: results of array job {sweep}",
        *(f"lr={lr} final loss {expected_loss(float(lr))}" for lr in ranked),
        "best: lr=0.4",
    ], text
    require_accounting()  # (report.sh says "Slurm accounting storage is disabled" where none)
    assert re.search(rf"^{sweep}_0\s+sweep\s+COMPLETED\s+0:0", text, re.M), text
    assert re.search(rf"^{sweep}_0\s+\S+\s+\S+\s+100M\s+COMPLETED", text, re.M), text
    box = mailbox()  # --mail-type=END: slurmctld mails when the report ended
    subject = f"Subject: Slurm Job_id={report} Name=report Ended"
    deadline = time.monotonic() + 60  # a guard: the mail comes seconds after the end
    while not (box.exists() and subject in box.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"no mail '{subject}' in {box}"
        time.sleep(0.5)
    sample_sweep = sorted(LESSON.glob("sweep-*_*.out"))
    assert [p.name.split("_")[1] for p in sample_sweep] == ["0.out", "1.out", "2.out", "3.out"]
    assert the_sample("report-*.out").splitlines()[1:6] == text.splitlines()[1:6]
    assert ("== sacct" in text) and the_sample("report-*.out").count("\n== ") == text.count("\n== ")


def test_busy_job_overlap_step_and_scancel(cluster, cluster_lock, tmp_path):
    with cluster_lock():
        job = sbatch(f"--output={tmp_path}/%x-%j.out", "lessons/00_slurm_basics/busy.sh")
        try:
            deadline = time.monotonic() + 30
            out = tmp_path / f"busy-{job}.out"
            # RUNNING, and its step 0 started (it prints every second): the next step is step 1
            while records(job)[job]["JobState"] != "RUNNING" or "working:" not in (
                out.read_text() if out.exists() else ""
            ):
                assert time.monotonic() < deadline, records(job)
                time.sleep(0.3)
            assert (
                slurm("squeue", "--noheader", "--jobs", job, "--format=%T").stdout.strip()
                == "RUNNING"
            )
            # A second step in a job whose CPUs step 0 holds: --overlap lets it in at once.
            inside = slurm("srun", f"--jobid={job}", "--overlap", "bash", "-c",
                           'echo "inside job $SLURM_JOB_ID, step $SLURM_STEP_ID, on $(hostname)"',
                           timeout=45)  # fmt: skip
        finally:
            slurm("scancel", job, check=False)
        record = wait(job)[job]
    assert inside.stdout == f"inside job {job}, step 1, on node1\n", inside.stdout
    assert record["JobState"] == "CANCELLED", record
    text = (tmp_path / f"busy-{job}.out").read_text()
    assert text.startswith(f"job {job} on node1: working for at most 60 s\nworking: 1 s\n"), text
    assert re.search(rf"\*\*\* JOB {job} ON node1 CANCELLED AT ", text), text
    assert the_sample("busy-*.out").splitlines()[1] == "working: 1 s"


def test_salloc_srun_and_task_placement(cluster, cluster_lock):
    whoami = "lessons/00_slurm_basics/whoami.sh"
    with cluster_lock():
        # salloc runs its command here, with an allocation; srun inside runs on its nodes.
        alloc = slurm("salloc", "--nodes=2", "--ntasks-per-node=1", "--time=1", "bash", "-c",
                      f'echo "allocation $SLURM_JOB_ID: $SLURM_JOB_NODELIST"; srun bash {whoami}',
                      timeout=60)  # fmt: skip
        # --ntasks alone: SLURM packs the tasks on as few nodes as hold them.
        packed = slurm("srun", "--ntasks=3", "bash", whoami)
        spread = slurm("srun", "--nodes=2", "--ntasks=3", "bash", whoami)
    assert "Granted job allocation" in alloc.stderr, alloc.stderr
    job = re.search(r"^allocation (\d+): node\[1-2\]$", alloc.stdout, re.M)
    assert job, alloc.stdout
    hosts = sorted(m["host"] for m in map(TASK_LINE.match, alloc.stdout.splitlines()) if m)
    assert hosts == ["node1", "node2"], alloc.stdout

    def placement(proc):
        return sorted((int(m["task"]), m["host"])
                      for m in map(TASK_LINE.match, proc.stdout.splitlines()) if m)  # fmt: skip

    assert [t for t, _ in placement(packed)] == [0, 1, 2], packed.stdout
    assert len({host for _, host in placement(packed)}) == 1, packed.stdout
    assert placement(spread) == [(0, "node1"), (1, "node1"), (2, "node2")], spread.stdout


@pytest.mark.parametrize(
    "request_, refusal",
    [
        (["--gres=gpu:a100:2"], "Requested node configuration is not available"),  # untyped GPUs
        (["--gres=gpu:3"], "Requested node configuration is not available"),  # 2 per node
        (["--constraint=a100"], "Invalid feature specification"),  # no node has the feature
        (["--nodes=3"], "Node count specification invalid"),  # the cluster has 2
    ],
)
def test_requests_the_cluster_cannot_meet_are_refused_at_once(cluster, request_, refusal):
    proc = slurm("sbatch", "--test-only", *request_, "--wrap=true", check=False, timeout=30)
    assert proc.returncode == 1 and refusal in proc.stderr, proc.stderr
    ok = slurm("sbatch", "--test-only", "--nodes=2", "--gres=gpu:2", "--wrap=true", timeout=30)
    assert "to start at" in ok.stderr and "node[1-2]" in ok.stderr, ok.stderr
