"""Wait for a Slurm job to end and give its exit status as ``sbatch --wait`` does, but asking
slurmctld every half second instead of after 2, 10, 42, 74... s (sbatch's back-off), so a job
of 12 s is reported after 12 s, not 42.

The one job-wait of the course: ``make demo`` and ``bash cluster/wait.sh JOBID`` run this file,
the notebooks call it through common.notebook (``submit``, ``job_state``) and the tests through
tests/conftest.py (``wait_job``). It needs only the standard library, so any python3 runs it:

    job=$(sbatch --parsable job.sh) && python3 -m common.jobwait "${job%%;*}"

The exit status is the one ``sbatch --wait`` returns (src/sbatch/sbatch.c, ``_job_wait``, the
same in Slurm 22.05 to 26.05): the batch script's exit status when it exited, 1 when a signal
ended it (``WIFEXITED`` false: scancel, the time limit, a node failure; ExitCode "0:9", "0:15"),
and for an array the largest over its tasks. Not a shell's 128+N: that would read as if the
waiting command itself had been killed, and a script that swaps ``sbatch --wait`` for this one
must see the same numbers. The signal stays in the job's ExitCode and its state (CANCELLED,
TIMEOUT, ...), which ``wait`` returns too. A requeued job is waited for until its last run ends.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import time
from collections.abc import Mapping

# Base job states after which a job does not run again (squeue/scontrol names; sbatch.c's
# IS_JOB_FINISHED). A requeued job goes back to PENDING (REQUEUED while it is cleaned up).
FINISHED_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "TIMEOUT",
})  # fmt: skip
POLL_S = 0.5
# "Name=value" fields of `scontrol show job -o`; names such as CPUs/Task included.
_FIELD = re.compile(r"(?:^|\s)([\w/:]+)=(\S*)")
_JOB_ID = re.compile(r"^[0-9]+(_[0-9]+)?$")


@dataclasses.dataclass
class JobEnd:
    state: str  # COMPLETED, FAILED, CANCELLED, ... (an array: the first task not COMPLETED)
    status: int  # what sbatch --wait returns (see above)
    records: list[dict[str, str]]  # the last fields scontrol showed, one dict per array task


def _ask(argv: list[str], env: Mapping[str, str] | None) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30,
                              env=None if env is None else dict(env))  # fmt: skip
    except subprocess.TimeoutExpired:
        return None  # a busy controller: ask again


def job_records(job_id: str, env: Mapping[str, str] | None = None) -> list[dict] | None:
    """``scontrol show job -o JOB_ID`` as one dict per line (an array job: one per task, and
    one for its pending tasks); None once slurmctld no longer knows the job (MinJobAge after
    its end, or a wrong id); [] when it did not answer."""
    proc = _ask(["scontrol", "show", "job", "-o", str(job_id)], env)
    if proc is None:
        return []
    if proc.returncode != 0:
        return None if "Invalid job id" in proc.stderr else []
    return [dict(_FIELD.findall(line)) for line in proc.stdout.splitlines() if "JobId=" in line]


def exit_status(exit_code: str) -> int:
    """What sbatch --wait returns for a finished job whose ExitCode is "STATUS:SIGNAL"."""
    status, _, sig = exit_code.partition(":")
    if not status.isdigit() or (sig and sig != "0"):
        return 1
    return int(status)


def _end(states: list[str], codes: list[str], records: list[dict]) -> JobEnd:
    state = next((s for s in states if s != "COMPLETED"), "COMPLETED")
    return JobEnd(state, max(exit_status(c) for c in codes), records)


def _ended(records: list[dict]) -> JobEnd | None:
    states = [r.get("JobState", "") for r in records]
    if not records or not all(s in FINISHED_STATES for s in states):
        return None
    return _end(states, [r.get("ExitCode", "") for r in records], records)


def _accounted(job_id: str, env: Mapping[str, str] | None, last: list[dict]) -> JobEnd | None:
    """The end as the accounting database has it, when there is one (sacct -X: one row per
    array task, the last run of a requeued job)."""
    proc = _ask(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "State,ExitCode"], env)
    rows = [line.split("|") for line in proc.stdout.split()] if proc else []
    if not proc or proc.returncode != 0 or not rows or any(len(r) != 2 for r in rows):
        return None
    states = [state.split()[0] for state, _ in rows]  # "CANCELLED by 1000"
    if not all(s in FINISHED_STATES for s in states):
        return None
    return _end(states, [code for _, code in rows], last)


def job_state(job_id: str, env: Mapping[str, str] | None = None) -> tuple[str, int | None]:
    """(state, exit status) of the job now; the status is None until it has ended."""
    records = job_records(job_id, env)
    if records is None:
        end = _accounted(job_id, env, [])
        if end is None:
            raise RuntimeError(f"job {job_id} is known neither to slurmctld nor to an "
                               "accounting database (a wrong id, or it ended long ago)")
        return end.state, end.status
    end = _ended(records)
    if end is not None:
        return end.state, end.status
    return (records[-1].get("JobState", "UNKNOWN") if records else "UNKNOWN"), None


def wait(job_id: str, timeout: float | None = None, poll: float = POLL_S,
         env: Mapping[str, str] | None = None) -> JobEnd:  # fmt: skip
    """Ask slurmctld every POLL seconds until the job (every task of an array) has ended.

    Raises TimeoutError after TIMEOUT seconds (None: no limit, as sbatch --wait), and
    RuntimeError when slurmctld no longer knows a job it was not seen ending.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    last: list[dict] = []
    while True:
        records = job_records(job_id, env)
        if records is None:  # gone: it ended more than MinJobAge ago, or was never there
            end = _accounted(job_id, env, last) or _ended(last)
            if end is not None:
                return end
            raise RuntimeError(f"job {job_id} is known neither to slurmctld nor to an "
                               "accounting database (a wrong id, or it ended long ago)")
        if records:
            last = records
            end = _ended(records)
            if end is not None:
                return end
        if deadline is not None and time.monotonic() > deadline:
            state = last[-1].get("JobState", "?") if last else "?"
            raise TimeoutError(f"job {job_id} still {state} after {timeout} s")
        time.sleep(poll)


def main(argv: list[str]) -> int:
    job_id = argv[0] if len(argv) == 1 else ""
    if not _JOB_ID.match(job_id):
        print("usage: bash cluster/wait.sh JOBID   (JOBID: what sbatch --parsable printed, "
              f"got '{' '.join(argv)}')", file=sys.stderr)  # fmt: skip
        return 2
    try:
        return wait(job_id).status
    except RuntimeError as exc:
        print(f"cluster/wait.sh: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C stops the waiting, not the job (as with sbatch --wait)
        print(f"cluster/wait.sh: stopped waiting; job {job_id} goes on (scancel {job_id})",
              file=sys.stderr)  # fmt: skip
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
