"""Lesson 05 benchmark: the figures behind the checkpoint-frequency arithmetic, measured on a
SLURM cluster (the local one, or yours: run it from the course root on a login node).

Prints figures, checks nothing. Each figure comes from a real job of this lesson:

1. signal to stop: from `scancel --signal=USR1 --batch` (what the time-limit warning does) to
   the checkpoint line of the training, and to the end of srun;
2. a requeue cycle: from the requeue to the resumed training's first line, through the
   requeue hold (AuthInfo's cred_expire: 10 s on the local cluster, 120 s by default);
3. how early the warning comes: a job with --time=2 and --signal=B:USR1@60 notes when the
   signal arrives; the difference to its end time is the real warning;
4. one killed rank: SIGKILL to one training process, until SLURM reports the job ended.

    python lessons/05_fault_tolerance/benchmark.py          # about 4 minutes on the local cluster
    python lessons/05_fault_tolerance/benchmark.py killed   # some of: stop warning killed
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LESSON = ROOT / "lessons" / "05_fault_tolerance"
SMALL = ["1", "--train-subset", "30000", "--test-subset", "2000", "--log-every", "20"]


def slurm(*args) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=environ)  # fmt: skip
    if proc.returncode:
        sys.exit(f"error: {' '.join(map(str, args))}: {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]


def fields(job: str) -> dict:
    return dict(re.findall(r"(\w+)=(\S*)", slurm("scontrol", "show", "job", "-o", job)))


def until(predicate, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    sys.exit(f"error: timed out after {timeout} s waiting for {what}")


def ended(job: str) -> bool:
    try:
        state = fields(job).get("JobState", "")
    except SystemExit:  # the record is gone: ended long ago
        return True
    return state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")


def stop_and_requeue(folder: Path) -> tuple[float, float, float]:
    out = folder / "requeue.out"
    job = slurm(
        "sbatch",
        "--parsable",
        f"--output={out}",
        f"--export=ALL,CHECKPOINT={folder}/ckpt.pt",
        LESSON / "requeue.sh",
        *SMALL,
    )

    def text() -> str:
        return out.read_text() if out.exists() else ""

    try:
        until(lambda: "batch 20/" in text(), 180, "the first progress line")
        t0 = time.monotonic()
        slurm("scancel", "--signal=USR1", "--batch", job)
        until(lambda: "checkpoint saved at" in text(), 60, "the checkpoint")
        t_saved = time.monotonic()
        until(lambda: "requeueing job" in text(), 60, "the requeue")
        t_requeue = time.monotonic()
        until(lambda: fields(job).get("JobState") == "PENDING", 60, "the requeued job")
        # It starts again when its requeue hold is over (cred_expire: cluster/slurm.conf.in).
        until(lambda: "resumed from" in text(), 180, "the resumed run", poll=0.1)
        t_resumed = time.monotonic()
        until(lambda: ended(job), 300, "the end of the job", poll=0.5)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    return t_saved - t0, t_requeue - t0, t_resumed - t_requeue


def warning_lead(folder: Path) -> float:
    note = folder / "warned"
    script = f"#!/bin/bash\ntrap 'date +%s.%N > {note}; exit 0' USR1\nsleep 300 & wait\n"
    job = slurm("sbatch", "--parsable", "--time=2", "--signal=B:USR1@60",
                f"--output={folder}/warn.out", "--wrap", script.split("\n", 1)[1])  # fmt: skip
    try:
        until(lambda: fields(job).get("JobState") == "RUNNING", 120, "the warning job")
        start = fields(job)["StartTime"]
        until(note.exists, 180, "the warning", poll=0.2)
        warned = float(note.read_text())
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    end = datetime.fromisoformat(start).timestamp() + 120
    return end - warned


def task_pid(job: str, rank: int) -> int | None:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if (f"SLURM_JOB_ID={job}".encode() in env and f"SLURM_PROCID={rank}".encode() in env
                and b"05_fault_tolerance/train.py" in cmd):  # fmt: skip
            return int(proc.name)
    return None


def killed_rank(folder: Path) -> float:
    out = folder / "killed.out"
    job = slurm(
        "sbatch",
        "--parsable",
        f"--output={out}",
        "--no-requeue",
        f"--export=ALL,CHECKPOINT={folder}/killed.pt",
        LESSON / "requeue.sh",
        *SMALL,
    )
    try:
        until(lambda: out.exists() and "batch 20/" in out.read_text(), 180, "a progress line")
        pid = until(lambda: task_pid(job, 3), 30, "rank 3's process")
        t0 = time.monotonic()
        os.kill(pid, 9)
        until(lambda: ended(job), 120, "the end of the job", poll=0.05)
        return time.monotonic() - t0
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)


def main() -> int:
    grace = re.search(r"GraceTime=(\d+)", slurm("scontrol", "show", "partition", "-o"))
    config = slurm("scontrol", "show", "config")
    kill_wait = re.search(r"KillWait\s*=\s*(\d+)", config)
    # The requeue hold: AuthInfo's cred_expire (120 s when the site does not set it).
    cred = re.search(r"cred_expire=(\d+)", config)
    hold = cred[1] if cred else "120"
    print(f"cluster: {slurm('sinfo', '--version')}, GraceTime {grace[1] if grace else '?'} s, "
          f"KillWait {kill_wait[1] if kill_wait else '?'} s, requeue.sh with "
          f"{' '.join(SMALL[1:3])} (4 ranks on 2 nodes)")  # fmt: skip
    which = set(sys.argv[1:]) or {"stop", "warning", "killed"}
    with tempfile.TemporaryDirectory(prefix="ft-bench-", dir=ROOT / "runs") as tmp:
        folder = Path(tmp)
        if "stop" in which:
            saved, stopped, cycle = stop_and_requeue(folder)
            print(f"signal to checkpoint saved:       {saved:6.1f} s")
            print(f"signal to srun ended (requeue):   {stopped:6.1f} s")
            print(f"requeue to resumed training:      {cycle:6.1f} s (through the {hold} s hold)")
        if "warning" in which:
            lead = warning_lead(folder)
            print(f"--signal=B:USR1@60 came           {lead:6.1f} s before the end (asked: 60 s)")
        if "killed" in which:
            print(f"one rank killed to job ended:     {killed_rank(folder):6.1f} s")
    return 0


if __name__ == "__main__":
    (ROOT / "runs").mkdir(exist_ok=True)
    sys.exit(main())
