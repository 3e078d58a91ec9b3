"""Helpers for the lesson notebooks: find the course, show its files, run its commands and jobs.

Every lesson folder has one ``lesson.ipynb`` that an instructor runs top to bottom on a laptop
CPU.  The notebooks never keep a copy of the lesson's code: they read it from the lesson's
files (:func:`show_code`), run it as a small local gloo world (:func:`run`), show what a
SLURM task would see (:func:`whoami`, :func:`slurm_task`), and submit the real job script
when a SLURM cluster answers (:func:`submit_or_sample`).

The notebooks are stored with their outputs, so they read well on a code host.  Re-run them
after changing a lesson, from the course root:

    python -m common.notebook execute lessons/*/lesson.ipynb   # run, store outputs, normalise
    python -m common.notebook check lessons/*/lesson.ipynb     # unexecuted or noisy? exit 1

Run the execution under the cluster lock when others share the local cluster
(``flock /tmp/course-cluster.lock python -m common.notebook execute ...``), and set
``COURSE_NOTEBOOK_SUBMIT=0`` to show the stored sample outputs instead of submitting jobs.
Checked by nbval (outputs of the cells marked ``# NBVAL_CHECK_OUTPUT``):

    pytest lessons --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from common import jobwait

# Variables a launcher or SLURM sets for a process.  A notebook started inside an allocation
# (jupyter under salloc) must not hand its own to the commands it runs as examples.
_LAUNCH_VARS = re.compile(
    r"^(SLURM_|SLURMD_|SBATCH_|SRUN_|TORCHELASTIC_|TORCH_ELASTIC_)|^(RANK|LOCAL_RANK|WORLD_SIZE|"
    r"LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_RANK|ROLE_WORLD_SIZE|MASTER_ADDR|"
    r"MASTER_PORT|NODE_RANK|NNODES)$"
)
# A line printed by one process of a job: "rank 3/4 ..." or "... process 3/4".
_RANK_LINE = re.compile(r"\b(?:rank|process) (\d+)/\d+")

ROOT: Path | None = None


def find_root(start: Path | None = None) -> Path:
    """The course root: the first folder at or above ``start`` (default: cwd) with common/."""
    start = Path.cwd() if start is None else Path(start)
    for folder in (start, *start.parents):
        if (folder / "common" / "notebook.py").is_file() and (folder / "lessons").is_dir():
            return folder.resolve()
    raise FileNotFoundError(f"no course root (a folder with common/ and lessons/) above {start}")


def setup(root: Path | None = None) -> Path:
    """Make the course importable here and in every command the notebook runs."""
    global ROOT
    ROOT = find_root() if root is None else Path(root).resolve()
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return ROOT


def _root() -> Path:
    return ROOT if ROOT is not None else setup()


def rel(path: str | os.PathLike) -> str:
    """``path`` relative to the course root where it lies inside it (for printing)."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(_root()))
    except ValueError:
        return str(p)


# --------------------------------------------------------------------------- show code


def _display_markdown(text: str) -> None:
    from IPython.display import Markdown, display

    display(Markdown(text))


def code_excerpt(path: str | os.PathLike, *names: str) -> tuple[str, str]:
    """The text of ``path`` (relative to the course root), or of its top-level definitions
    ``names`` (functions/classes, with their decorators; in a shell script its functions, with
    the comment above each) joined by blank lines.

    Returns (header, code).  A name that is not defined in the file is a ValueError, so a
    notebook notices when the lesson's code was renamed.
    """
    file = _root() / path
    text = file.read_text()
    if not names:
        return f"`{path}`", text.rstrip("\n")
    lines = text.splitlines()
    found = {}
    if file.suffix == ".sh":
        # A shell function: `name() {` at the start of a line, to the first `}` that closes
        # a line at the same place, with the comment lines right above it (not a #! line or
        # a section's `# ---` rule).
        for i, line in enumerate(lines):
            if m := re.match(r"(\w+)\(\) \{$", line):
                end = next(j for j in range(i + 1, len(lines)) if lines[j] == "}")
                first = i
                while (
                    first > 0
                    and lines[first - 1].startswith("#")
                    and not lines[first - 1].startswith(("#!", "# ---"))
                ):
                    first -= 1
                found[m[1]] = (first + 1, end + 1)
    else:
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                found[node.name] = (first, node.end_lineno)
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"{path} defines no {', '.join(missing)} (it has {', '.join(found)})")
    parts, spans = [], []
    for name in names:
        first, last = found[name]
        parts.append("\n".join(lines[first - 1 : last]))
        spans.append(f"{first}-{last}")
    return f"`{path}` lines {', '.join(spans)}", "\n\n".join(parts)


def show_code(path: str | os.PathLike, *names: str) -> None:
    """Show a lesson file (or some of its functions) as highlighted code, read from disk."""
    header, code = code_excerpt(path, *names)
    lang = {".py": "python", ".sh": "bash"}.get(Path(path).suffix, "")
    _display_markdown(f"{header}\n\n```{lang}\n{code}\n```")


def import_file(path: str | os.PathLike):
    """Import a lesson's script (relative to the course root) as a module, to use its helpers
    (its ``if __name__ == "__main__"`` part does not run)."""
    import importlib.util

    file = _root() / path
    name = "lesson_" + re.sub(r"\W", "_", str(Path(path).with_suffix("")))
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- run commands


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


# --------------------------------------------------------------------------- what a task sees


def slurm_task(
    nodes: int,
    tasks_per_node: int,
    node: int,
    local: int,
    *,
    job_id: int = 4242,
    gpus_per_node: int | None = None,
    prefix: str = "node",
) -> dict[str, str]:
    """The SLURM variables srun gives task ``local`` on node ``node`` (0-based) of a job step
    with ``nodes`` x ``tasks_per_node`` tasks on nodes named node1, node2, ..."""
    if not (0 <= node < nodes and 0 <= local < tasks_per_node):
        raise ValueError(f"no task {local} on node {node} in a {nodes}x{tasks_per_node} step")
    hosts = f"{prefix}[1-{nodes}]" if nodes > 1 else f"{prefix}1"
    counts = f"{tasks_per_node}(x{nodes})" if nodes > 1 else str(tasks_per_node)
    gpus = tasks_per_node if gpus_per_node is None else gpus_per_node
    env = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOB_NODELIST": hosts,
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NTASKS": str(nodes * tasks_per_node),
        "SLURM_TASKS_PER_NODE": counts,
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": hosts,
        "SLURM_STEP_NUM_TASKS": str(nodes * tasks_per_node),
        "SLURM_STEP_TASKS_PER_NODE": counts,
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(node * tasks_per_node + local),
        "SLURM_LOCALID": str(local),
    }
    if gpus:
        env["SLURM_GPUS_ON_NODE"] = str(gpus)
    return env


def torchrun_worker(
    nodes: int, nproc: int, node: int, local: int, *, master: str = "node1", port: int = 29500
) -> dict[str, str]:
    """The variables torchrun gives worker ``local`` of the agent on node ``node``."""
    return {
        "RANK": str(node * nproc + local),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(nodes * nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nodes),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "none",
    }


_SHOWN_FIELDS = (
    "rank",
    "local_rank",
    "world_size",
    "local_world_size",
    "node_rank",
    "num_nodes",
    "master_addr",
    "master_port",
    "launcher",
)


def whoami(environ: Mapping[str, str], **spawn) -> dict:
    """What common.env makes of ``environ`` (and of an mp.spawn index: ``spawn_index=``,
    ``spawn_nprocs=``), without the checks against this machine (host names, free ports).
    Raises LaunchError, as the job would."""
    from common.env import resolve_launch_env

    env = resolve_launch_env(dict(environ), argv=[], **spawn)
    return {k: v for k, v in env.as_dict().items() if k in _SHOWN_FIELDS}


def show_whoami(environ: Mapping[str, str], **spawn) -> None:
    """Print :func:`whoami` as one JSON line, or the LaunchError the job would stop with."""
    from common.env import LaunchError

    try:
        print(json.dumps(whoami(environ, **spawn)))
    except LaunchError as exc:
        print(f"LaunchError: {exc}")


# --------------------------------------------------------------------------- pictures


def layout(environs: Iterable[Mapping[str, str]], **spawn) -> list[dict] | str:
    """Resolve every process of a job; the LaunchError text if the job would stop."""
    from common.env import LaunchError

    try:
        return [whoami(e, **s) for e, s in _pairs(environs, spawn)]
    except LaunchError as exc:
        return str(exc)


def _pairs(environs, spawn):
    for e in environs:
        if isinstance(e, tuple):  # (environ, {"spawn_index": i, "spawn_nprocs": n})
            yield e
        else:
            yield e, spawn


def plot_layouts(layouts: Mapping[str, list[dict] | str], gpus_per_node: int = 2):
    """One row per job layout: nodes as boxes, the processes on them as ranks on GPUs.

    ``layouts`` maps a title to the resolved processes (:func:`layout`) or an error text.
    A process may name its machine under "host" (default: "node <node_rank>").
    """
    import textwrap

    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    fig, axes = plt.subplots(len(layouts), 1, figsize=(8, 1.9 * len(layouts)), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, (title, procs) in zip(axes[:, 0], layouts.items(), strict=True):
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_axis_off()
        ax.set_xlim(0, 8)
        ax.set_ylim(0, 2)
        if isinstance(procs, str):
            ax.text(
                0.1,
                1.0,
                "\n".join(textwrap.wrap(procs, 95)),
                fontsize=8,
                color="darkred",
                va="center",
                family="monospace",
            )
            continue
        # Processes are grouped by their "host" entry where given, else by node rank.
        hosts = list(dict.fromkeys(_host(p) for p in procs))
        width = 8 / len(hosts)
        for n, host in enumerate(hosts):
            x0 = n * width + 0.1
            ax.add_patch(
                FancyBboxPatch(
                    (x0, 0.1), width - 0.2, 1.8, boxstyle="round,pad=0.02", fc="#f2f2f2", ec="gray"
                )
            )
            ax.text(x0 + 0.1, 1.7, host, fontsize=9, va="center")
            on_node = sorted((p for p in procs if _host(p) == host), key=lambda p: p["local_rank"])
            slots = max(gpus_per_node, len(on_node))
            slot_w = (width - 0.4) / slots
            for p in on_node:
                x = x0 + 0.1 + p["local_rank"] * slot_w
                ax.add_patch(
                    FancyBboxPatch(
                        (x + 0.05, 0.3),
                        slot_w - 0.1,
                        1.1,
                        boxstyle="round,pad=0.02",
                        fc=colors[p["rank"] % 10],
                        alpha=0.8,
                        ec="none",
                    )
                )
                ax.text(
                    x + slot_w / 2,
                    0.85,
                    f"rank {p['rank']}\nlocal {p['local_rank']}\nGPU {p['local_rank']}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                )
    _show(fig)
    # The same in words: a picture is not compared by nbval, this text is.
    for title, procs in layouts.items():
        if isinstance(procs, str):
            print(f"{title}\n  stops: {procs}")
            continue
        hosts = list(dict.fromkeys(_host(p) for p in procs))
        print(title)
        for host in hosts:
            ranks = sorted((p["local_rank"], p["rank"]) for p in procs if _host(p) == host)
            print(f"  {host}: " + ", ".join(f"local {lr} = rank {r}" for lr, r in ranks)
                  + f" (world {procs[0]['world_size']}, {procs[0]['launcher']})")


def _host(proc: dict) -> str:
    return proc.get("host", f"node {proc['node_rank']}")


def _show(fig) -> None:
    """Display a figure once (as a PNG) and close it, so the cell shows no second copy."""
    import matplotlib.pyplot as plt
    from IPython.display import display

    display(fig)
    plt.close(fig)


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


# --------------------------------------------------------------------------- notebook files

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
}
# Cell metadata worth keeping; everything else (execution timings, scroll state) is noise.
_CELL_METADATA = ("tags",)


def normalise(nb) -> None:
    """Drop what changes from run to run without meaning anything: timings, Python version,
    scroll state.  Execution counts become 1, 2, 3, ... in cell order."""
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": dict(LANGUAGE_INFO)}
    count = 0
    for cell in nb.cells:
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in _CELL_METADATA}
        if cell.cell_type == "code":
            count += 1
            cell.execution_count = count
            for out in cell.outputs:
                out.pop("transient", None)
                if "execution_count" in out:
                    out["execution_count"] = count


def problems(nb) -> list[str]:
    """Why this stored notebook is not fit to commit (empty list: it is fine)."""
    found = []
    if nb.metadata.get("kernelspec") != KERNELSPEC:
        found.append(f"kernelspec is {nb.metadata.get('kernelspec')}, expected {KERNELSPEC}")
    if nb.metadata.get("language_info") != LANGUAGE_INFO:
        found.append("language_info differs from the normalised one (e.g. a Python version)")
    extra = set(nb.metadata) - {"kernelspec", "language_info"}
    if extra:
        found.append(f"notebook metadata carries {sorted(extra)}")
    count = 0
    for index, cell in enumerate(nb.cells):
        extra = set(cell.metadata) - set(_CELL_METADATA)
        if extra:
            found.append(f"cell {index} metadata carries {sorted(extra)}")
        if cell.cell_type != "code":
            continue
        count += 1
        if cell.execution_count != count:
            found.append(
                f"cell {index}: execution_count {cell.execution_count}, expected "
                f"{count} (not executed top to bottom)"
            )
        if not cell.outputs:
            found.append(f"cell {index}: no output (not executed?)")
        for out in cell.outputs:
            if out.output_type == "error":
                found.append(f"cell {index}: stored with an error ({out.get('ename')})")
    return found


def execute(path: str | os.PathLike, timeout: float = 600) -> float:
    """Run a notebook top to bottom in its own folder, store outputs, normalise; seconds taken."""
    import nbformat
    from nbclient import NotebookClient

    path = Path(path).resolve()
    nb = nbformat.read(path, as_version=4)
    start = time.monotonic()
    NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    seconds = time.monotonic() - start
    normalise(nb)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return seconds


def _main(argv: Sequence[str]) -> int:
    import nbformat

    usage = "usage: python -m common.notebook execute|check NOTEBOOK.ipynb..."
    if len(argv) < 2 or argv[0] not in ("execute", "check"):
        print(usage, file=sys.stderr)
        return 2
    status = 0
    for name in argv[1:]:
        if argv[0] == "execute":
            print(f"{name}: executed in {execute(name):.1f} s", flush=True)
        else:
            found = problems(nbformat.read(name, as_version=4))
            for line in found:
                print(f"{name}: {line}")
            status |= bool(found)
    return status


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
