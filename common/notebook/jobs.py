"""Jobs: a training log's epochs (:func:`parse_log`, :func:`plot_history`), and the real job
script submitted where a cluster answers, else its stored sample output
(:func:`submit_or_sample`)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from common import jobwait
from common.notebook.commands import Result, clean_environ
from common.notebook.course import _root, _show, rel

# lesson 03's epoch line (lessons/03_ddp_mnist/train.py prints it, lessons 05 and 07 too)
EPOCH_LINE = re.compile(
    r"^epoch (?P<epoch>\d+)/(?P<epochs>\d+) \| train_loss (?P<train_loss>[\d.]+) \| "
    r"test_loss (?P<test_loss>[\d.]+) \| test_acc (?P<test_acc>[\d.]+)% \| "
    r"(?P<samples_per_s>[\d.]+) samples/s \| epoch_time (?P<epoch_time>[\d.]+)s"
)


def parse_log(text: str) -> list[dict]:
    """The epoch lines of lessons 03, 05 and 07, as dicts (the last copy of an epoch wins: a
    resumed run prints again the epoch it was stopped in)."""
    rows = {}
    for match in map(EPOCH_LINE.match, text.splitlines()):
        if match:
            row = {k: float(v) for k, v in match.groupdict().items()}
            row["epoch"], row["epochs"] = int(row["epoch"]), int(row["epochs"])
            rows[row["epoch"]] = row
    return [rows[k] for k in sorted(rows)]


def plot_history(rows: list[dict], title: str = ""):
    """Loss and test accuracy per epoch (rows from :func:`parse_log`)."""
    import matplotlib.pyplot as plt

    epochs = [r["epoch"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    left.plot(epochs, [r["train_loss"] for r in rows], "o-", label="train loss")
    left.plot(epochs, [r["test_loss"] for r in rows], "s-", label="test loss")
    left.set_xlabel("epoch")
    left.set_ylabel("cross-entropy")
    left.legend()
    right.plot(epochs, [r["test_acc"] for r in rows], "o-", color="tab:green")
    right.set_xlabel("epoch")
    right.set_ylabel("test accuracy (%)")
    for ax in (left, right):
        ax.set_xticks(epochs)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _show(fig)


# --------------------------------------------------------------------------- the cluster


def cluster_state(timeout: float = 10) -> str | None:
    """None when a SLURM cluster answers and has a node free for work, else why not.

    ``COURSE_NOTEBOOK_SUBMIT=0`` in the environment turns submission off (say, on a login
    node during a talk): the notebooks then show the stored outputs.
    """
    if os.environ.get("COURSE_NOTEBOOK_SUBMIT", "1") == "0":
        return "COURSE_NOTEBOOK_SUBMIT=0"
    try:
        out = subprocess.run(
            ["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=timeout
        )
    except FileNotFoundError:
        return "sinfo is not installed"
    except subprocess.TimeoutExpired:
        return f"sinfo did not answer within {timeout} s"
    if out.returncode:
        return "sinfo failed: " + (out.stderr.strip().splitlines() or ["?"])[-1]
    states = [s.strip().rstrip("*~#$@") for s in out.stdout.split()]
    if not any(s in ("idle", "mixed") for s in states):
        return "no node is idle (" + (", ".join(states) or "no nodes") + ")"
    return None


def _sbatch_option(script: Path, name: str) -> str | None:
    for line in script.read_text().splitlines():
        m = re.match(rf"#SBATCH\s+--{name}[= ](\S+)", line)
        if m:
            return m.group(1)
    return None


def sample_outputs(script: str | os.PathLike) -> list[Path]:
    """Stored output files of real runs of ``script``, kept in its lesson folder.

    They are named as SLURM named them: ``<job-name>-<id>.out`` for scripts that set
    ``--output=%x-%j.out``, ``slurm-<id>.out`` otherwise.
    """
    file = _root() / script
    name = _sbatch_option(file, "job-name")
    prefix = name if name and _sbatch_option(file, "output") else "slurm"
    named = re.compile(rf"{re.escape(prefix)}-(\d+)\.out")
    found = [(int(m.group(1)), p) for p in file.parent.iterdir() if (m := named.fullmatch(p.name))]
    return [p for _, p in sorted(found)]


def job_state(job_id: str) -> tuple[str, int | None]:
    """(state, exit status) of a job (common/jobwait.py); the status is None until the job
    ended, and what ``sbatch --wait`` returns after: 1 when a signal ended it."""
    return jobwait.job_state(job_id)


def submit(
    script: str,
    *args: str,
    timeout: float = 180,
    expect: int | None = 0,
    env: Mapping[str, str] | None = None,
) -> Result:
    """Submit a job script from the course root, wait for it to end, print its output file.

    Like ``sbatch --wait``, which looks at the job after 2, 10 and 42 s and then every 32 s,
    so a job of 12 s is reported after 42; here the job's state is asked twice a second
    (common/jobwait.py), and the exit status is sbatch's: 1 when a signal ended the job.
    The output goes to runs/notebooks/ (not the course root).  A job still running after
    ``timeout`` seconds is cancelled.
    """
    # A new folder for every submission: job ids start again at 1 when a cluster is re-created,
    # and a job writing with --open-mode=append would add to an older job's file.
    runs = _root() / "runs" / "notebooks"
    runs.mkdir(parents=True, exist_ok=True)
    out_dir = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=runs))
    argv = ["sbatch", "--parsable", f"--output={rel(out_dir)}/%x-%j.out", script, *args]
    print("$ " + shlex.join(argv))
    sub = subprocess.run(
        argv, cwd=_root(), env=clean_environ(env), capture_output=True, text=True, timeout=60
    )
    if sub.returncode:
        raise RuntimeError(f"sbatch refused {script}: {sub.stderr.strip()}")
    job_id = sub.stdout.strip().split(";")[0]
    start = time.monotonic()
    try:
        end = jobwait.wait(job_id, timeout)
    except TimeoutError:
        subprocess.run(["scancel", job_id], check=False, timeout=30)
        raise RuntimeError(f"job {job_id} of {script} ran past {timeout} s; cancelled") from None
    state, status = end.state, end.status
    files = sorted(out_dir.glob("*.out"))
    output = files[0].read_text() if files else ""
    print(
        f"job {job_id} {state} with exit code {status} after {time.monotonic() - start:.0f} s; "
        f"{rel(files[0]) if files else 'no output file'}:"
    )
    print(output, end="" if output.endswith("\n") or not output else "\n")
    if expect is not None and status != expect:
        raise RuntimeError(f"job {job_id} ({script}) exited with {status}, expected {expect}")
    return Result(shlex.join(argv), status, output)


def submit_or_sample(
    script: str,
    *args: str,
    timeout: float = 180,
    expect: int | None = 0,
    env: Mapping[str, str] | None = None,
    sample: str | None = None,
    match: str | None = None,
) -> Result:
    """Submit ``script`` when the cluster is up; otherwise say so and print a stored sample:
    ``sample`` (a file name in the lesson folder), else the last of :func:`sample_outputs`
    whose text matches the regular expression ``match`` (where several scripts of a lesson
    write ``slurm-<id>.out``).

    Returns the job's Result, or one with returncode None holding the sample's text (empty
    when there is none).
    """
    why = cluster_state()
    if why is None:
        return submit(script, *args, timeout=timeout, expect=expect, env=env)
    folder = (_root() / script).parent
    samples = [folder / sample] if sample else sample_outputs(script)
    samples = [p for p in samples if p.is_file() and re.search(match or "", p.read_text())]
    if not samples:
        print(f"No SLURM cluster here ({why}), and no stored sample output of {script} yet.")
        return Result(script, None, "")
    print(f"No SLURM cluster here ({why}); stored output of a real run of {script}:")
    print(f"=== {rel(samples[-1])}")
    text = samples[-1].read_text()
    print(text, end="")
    return Result(script, None, text)
