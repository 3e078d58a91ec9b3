"""Commands a notebook runs as examples (:func:`run`): a clean environment, a time limit, the
ranks' lines in order."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from common.notebook.course import _root

# Variables a launcher or SLURM sets for a process.  A notebook started inside an allocation
# (jupyter under salloc) must not hand its own to the commands it runs as examples.
_LAUNCH_VARS = re.compile(
    r"^(SLURM_|SLURMD_|SBATCH_|SRUN_|TORCHELASTIC_|TORCH_ELASTIC_)|^(RANK|LOCAL_RANK|WORLD_SIZE|"
    r"LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|ROLE_WORLD_SIZE|MASTER_ADDR|"
    r"MASTER_PORT|NODE_RANK|NNODES)$"
)
# A line printed by one process of a job: "rank 3/4 ..." or "... process 3/4".
_RANK_LINE = re.compile(r"\b(?:rank|process) (\d+)/\d+")


def clean_environ(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without launcher/SLURM variables, plus the course on
    PYTHONPATH and this Python's bin/ on PATH (for torchrun), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not _LAUNCH_VARS.match(k)}
    root = str(_root())
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def order_by_rank(text: str) -> str:
    """Put the lines that name a rank ("rank 3/4", "process 3/4") in rank order.

    Processes print at the same time, so the order of their lines changes from run to run.
    Lines of one rank keep their order, and every other line keeps its place.
    """
    lines = text.splitlines()
    slots = [i for i, line in enumerate(lines) if _RANK_LINE.search(line)]
    ranked = sorted(
        (lines[i] for i in slots), key=lambda line: int(_RANK_LINE.search(line).group(1))
    )
    for i, line in zip(slots, ranked, strict=True):
        lines[i] = line
    return "\n".join(lines) + ("\n" if text.endswith("\n") else "")


@dataclasses.dataclass
class Result:
    command: str
    returncode: int | None
    output: str

    def _ipython_display_(self) -> None:
        """The output was printed already; as a cell's last value, show nothing more."""


def _descendants(pid: int) -> list[int]:
    """The processes under PID, from /proc (Linux; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run(
    command: str | Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
    expect: int | None = 0,
    ranked: bool = False,
    show: bool = True,
    quiet_env: bool = False,
) -> Result:
    """Run a command from the course root and print it with its output (stdout and stderr).

    ``env`` adds variables to a clean environment (see :func:`clean_environ`); they are shown
    in front of the command unless ``quiet_env``.  ``ranked`` orders the lines of the
    processes by rank (see :func:`order_by_rank`).  A run that takes longer than ``timeout``
    seconds is killed, with everything it started.  An exit status other than ``expect``
    raises RuntimeError (None: any status is fine).
    """
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    shown = shlex.join(argv)
    if env and not quiet_env:
        shown = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items()) + " " + shown
    proc = subprocess.Popen(
        argv,
        cwd=_root(),
        env=clean_environ({k: str(v) for k, v in (env or {}).items()}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout kills the workers too
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts its workers in sessions of their own: kill every descendant, not only
        # the process group, or a stuck worker keeps the pipe open and the wait never ends.
        for pid in [proc.pid, *_descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            output, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.stdout.close()
            proc.wait()
            output = "(its output was lost: a process it started still held it)\n"
        if show:
            print(f"$ {shown}\n{output}")
        raise RuntimeError(f"{shown!r} did not finish within {timeout} s (killed)") from None
    if ranked:
        output = order_by_rank(output)
    if show:
        print(f"$ {shown}")
        print(output, end="" if output.endswith("\n") or not output else "\n")
        if proc.returncode:
            print(f"[exit status {proc.returncode}]")
    if expect is not None and proc.returncode != expect:
        # The last lines too: a test runner (nbval) shows the exception, not the cell's output.
        tail = "\n".join(output.splitlines()[-15:])
        raise RuntimeError(f"{shown!r} exited with {proc.returncode}, expected {expect}; its "
                           f"last lines:\n{tail}")  # fmt: skip
    return Result(shown, proc.returncode, output)
