"""Every command a README shows a student, checked as written.

The commands are the lines a student types from the fenced code blocks of README.md,
cluster/README.md and lessons/*/README.md: every line of a ```bash (or ```sh) block that is not
a comment, and the lines that start with ``$ `` in an unlabelled (or ```console) block, whose
other lines are output. A line ending in ``\\`` goes on on the next one; a ``for``/``while``/``if``
runs to its ``done``/``fi``. The conventions that mark a command (README.md, "Every command the
lessons show"): a trailing comment ``# GPU only`` or ``# at your site`` (or such a comment as the
first line of a block, for all of its commands); ``# inside a job`` for a command typed inside
an allocation; a block whose first line is ``# in the job script`` shows lines of a job script.

Each command falls into one class (table-driven, one test id per README line):

* ``skip``: marked GPU only, at your site, or a job script's lines: skipped, the mark in the id;
* ``job``: ``sbatch SCRIPT ARGS`` (with ``NAME=value`` in front): it passes when a test under
  tests/ submits the same script with the same sbatch options and script arguments (and those
  variables), found by reading the tests' source (``sbatch_wait``, ``submit_job``, ``slurm``,
  an ``["sbatch", ...]`` list); options that only say where the output goes (``--output``,
  ``--chdir``, ``--parsable``) do not count. Submitting all of them (about 20 minutes here) is
  left to the tests that do. A test may shorten the job with the variables its script's header
  offers for that (SHORTER: fewer images, steps or cases), nothing else. A job that needs
  another job's id is in NOT_RUN, which names the test that runs it;
* ``quick``: finishes in seconds: run (marked ``readme``, ``make test-readme``) from the course
  root with only the venv active (``VIRTUAL_ENV``, ``.venv/bin`` first on ``PATH``; no
  ``PYTHONPATH``, no ``COURSE_*``, ``SLURM_*``, ``SBATCH_*`` ...), expecting QUICK's exit status;
  a command marked ``# inside a job`` runs in ``salloc`` with lesson 01's shape (2 nodes x 2 tasks);
* ``not run``: long, or needs state (a job id, root, a server): NOT_RUN says why and which test
  covers it.

A command in no class fails with one line naming its README, line and text. Everything but the
quick runs reads files only (about a second, in make test); the quick runs take about half a
minute (make test-readme, a CI lane), besides any wait for the cluster lock.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import itertools
import os
import posixpath
import re
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import cluster_lock

ROOT = Path(__file__).resolve().parent.parent
READMES = ("README.md", "cluster/README.md",
           *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("lessons/*/README.md")))
QUICK_TIMEOUT_S = 120
LOCK_WAIT_S = 900

# Marks (a comment at the end of a line, or a block's first line for all of its commands).
GPU_ONLY = "GPU only"
OTHER_SITE = "at your site"
INSIDE_JOB = "inside a job"
JOB_SCRIPT = "in the job script"  # a block's first line only
MARKS = (GPU_ONLY, OTHER_SITE, INSIDE_JOB)
SKIPPED = {GPU_ONLY: "GPU only", OTHER_SITE: "needs another site", JOB_SCRIPT: "job script lines"}

# Commands that finish in seconds, run as written: command -> expected exit status.
QUICK = {
    "source .venv/bin/activate": 0,
    "srun --nodes 2 --ntasks-per-node 2 python -m common.env": 0,
    "wc -l lessons/03_ddp_mnist/train.py $(sed -n 's|^from common\\.\\([a-z_]*\\) import.*|"
    "common/\\1.py|p' lessons/03_ddp_mnist/train.py)": 0,
    "sinfo": 0,
    "scontrol show node node2 | grep -E 'State|Reason'": 0,
    "tail -n 50 /var/lib/course-cluster/log/slurmd-node2.log": 0,
    "tail -n 50 /var/lib/course-cluster/log/slurmctld.log": 0,
    "salloc --nodes=2 --ntasks-per-node=1 --time=1 bash -c 'echo \"allocation $SLURM_JOB_ID: "
    "$SLURM_JOB_NODELIST\"; srun bash lessons/00_slurm_basics/whoami.sh'": 0,
    "srun --ntasks=3 bash lessons/00_slurm_basics/whoami.sh": 0,
    'sinfo -o "%P %N %G %f %c %m"': 0,
    # The lesson shows both refused: "allocation failure".
    "sbatch --test-only --gres=gpu:a100:2 --wrap=true": 1,
    "sbatch --test-only --constraint=a100 --wrap=true": 1,
    "python lessons/01_hello_allreduce/spawn_warmup.py --nprocs 2 --steps 3": 0,
    # The lesson shows the failure's exit status with echo, so the line itself ends with 0.
    'python lessons/01_hello_allreduce/hello_allreduce.py --nprocs 2 --break-rank 1; '
    'echo "exit $?"': 0,
    'srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 python -m common.sysinfo': 0,
    "python -m common.mnist_prepare": 0,
    "python lessons/08_data_pipeline/mnist_files.py": 0,
}

# What QUICK's runs must print, where the exit status alone says little.
CARRY_COUNT = (
    "wc -l lessons/03_ddp_mnist/train.py $(sed -n 's|^from common\\.\\([a-z_]*\\) import.*|"
    "common/\\1.py|p' lessons/03_ddp_mnist/train.py)")


def _carry_count_as_said(out: str) -> bool:
    """README.md says the lines a student carries from lesson 03: the figures wc prints now."""
    counts = {Path(name).name: int(n) for n, name in re.findall(r"(?m)^\s*(\d+) (\S+)$", out)}
    common = sum(n for name, n in counts.items() if name not in ("train.py", "total"))
    said = " ".join((ROOT / "README.md").read_text().split())
    wanted = [f"{counts['total']:,} lines, {counts['train.py']} of them train.py and {common:,}",
              *(f"`{name}` {n}" for name, n in counts.items() if name not in ("train.py", "total"))]
    missing = [w for w in wanted if w not in said]
    assert not missing, f"README.md's count is stale; wc -l says: {missing}"
    return True


QUICK_OUTPUT = {
    # README.md's count of the lines a student carries agrees with wc's.
    CARRY_COUNT: _carry_count_as_said,
    # The failure's own exit status, which the line prints.
    'python lessons/01_hello_allreduce/hello_allreduce.py --nprocs 2 --break-rank 1; '
    'echo "exit $?"': lambda out: re.search(r"(?m)^exit [1-9]\d*$", out),
    # One report per node of the allocation (2 nodes x 2 tasks), not one per task.
    'srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 python -m common.sysinfo':
        lambda out: sorted(re.findall(r"(?m)^(node\d+): python ", out)) == ["node1", "node2"],
}

# Commands not run here: command -> (why, the test that covers it or "").
NOT_RUN = {
    "make demo": ("lesson 03's job.sh, 3 epochs of 60,000 images on the cluster, a minute or two",
                  "tests/test_cluster_student.py::"
                  "test_student_runs_lesson03_readme_then_stops_and_resumes"),
    "make test": ("the whole suite, about 9 minutes", ""),
    ".venv/bin/python -m ipykernel install --user --name slurm-ddp-course --display-name "
    '"Python (slurm-ddp-course)"': ("writes a kernel into the user's Jupyter folder", ""),
    ".venv/bin/jupyter lab lessons/": ("a server: runs until stopped", ""),
    "sudo bash cluster/up.sh": ("restarts the shared cluster",
                                "tests/test_cluster.py::test_up_is_idempotent_and_down_leaves_nothing"),
    "sudo bash cluster/down.sh": ("stops the shared cluster",
                                  "tests/test_cluster.py::test_up_is_idempotent_and_down_leaves_nothing"),
    "sacct -j <jobid> --format=JobID,State,ExitCode,Elapsed,MaxRSS": (
        "needs a job id", "tests/test_cluster_accounting.py"),
    "scontrol update NodeName=node2 State=RESUME": ("changes the shared cluster's state", ""),
    "srun --jobid=987 --overlap bash -c 'echo \"inside job $SLURM_JOB_ID, step $SLURM_STEP_ID, "
    "on $(hostname)\"'": ("needs the job id busy.sh got",
                          "tests/test_lesson00.py::test_busy_job_overlap_step_and_scancel"),
    "scancel 987": ("needs the job id busy.sh got",
                    "tests/test_lesson00.py::test_busy_job_overlap_step_and_scancel"),
    "sweep=$(sbatch --parsable lessons/00_slurm_basics/sweep.sh)": (
        "an array job and its report, whose id it needs",
        "tests/test_lesson00.py::test_array_then_dependent_report"),
    "sbatch --dependency=afterok:$sweep lessons/00_slurm_basics/report.sh $sweep": (
        "needs the sweep's job id", "tests/test_lesson00.py::test_array_then_dependent_report"),
    "torchrun --standalone --nproc-per-node 2 lessons/03_ddp_mnist/train.py --epochs 1": (
        "an epoch of 60,000 images, minutes here",
        "tests/test_lesson03.py::test_carried_train_py_runs_under_torchrun"),
    "python lessons/03_ddp_mnist/train.py --epochs 1 --train-subset 4096": (
        "an epoch of 4,096 images and the whole test set, about 20 s here",
        "tests/test_lesson03.py::test_smoke_single_process_then_nothing_to_do"),
    "torchrun --standalone --nproc-per-node 2 lessons/04_torchrun_enroot/train.py": (
        "about 13 s of training here", "lessons/04_torchrun_enroot/lesson.ipynb"),
    "make container": ("as root: builds a 5.6 GB image", "tests/test_lesson04_charliecloud.py"),
    ".venv/bin/pytest tests/test_lesson04.py": ("the lesson's tests, a few minutes of jobs",
                                                "tests/test_lesson04.py"),
    "scancel --signal=USR1 --batch <jobid>": ("needs a job id", "tests/test_lesson05.py"),
    "scontrol show job <jobid> | grep -E 'JobState|Restarts|EligibleTime'": (
        "needs a job id", "tests/test_lesson05.py"),
    "dep=()": ("a chain of three jobs, several minutes", "tests/test_lesson05.py"),
    'for link in 1 2 3; do\nid=$(sbatch --parsable --array="$link" "${dep[@]}" '
    "--export=ALL,CHAIN=mnist lessons/05_fault_tolerance/chain.sh)\n"
    'dep=(--dependency=afterany:"${id%%;*}")\ndone': (
        "a chain of three jobs, several minutes", "tests/test_lesson05.py"),
    "scontrol update JobId=<jobid> NumNodes=1 NumTasks=2 NumCPUs=8": (
        "needs a job id", "tests/test_lesson07.py"),
    "python lessons/07_fsdp_sharding/export.py checkpoints/fsdp-<jobid>": (
        "needs a job's checkpoints", "tests/test_lesson07.py"),
    "python lessons/08_data_pipeline/plot_scaling.py scaling-<jobid>.out --png again.png": (
        "needs a scaling job's output", "tests/test_lesson08.py"),
    # Commands the tests run in a shorter form (the tests named do).
    "torchrun --standalone --nproc-per-node 2 "
    "lessons/09_beyond_data_parallel/tp.py --steps 20": (
        "20 steps of 2 processes", "tests/test_lesson09.py"),
    "torchrun --standalone --nproc-per-node 2 "
    "lessons/09_beyond_data_parallel/pp.py --microbatches 2,4": (
        "two pipeline schedules of 2 processes", "tests/test_lesson09.py"),
    "torchrun --standalone --nproc-per-node 4 "
    "lessons/09_beyond_data_parallel/compare.py --steps 3 --forms fsdp2": (
        "one form of 4 processes", "tests/test_lesson09.py"),
}


# --------------------------------------------------------------------------- collection


@dataclass(frozen=True)
class Command:
    readme: str
    line: int
    text: str  # as typed: continuation lines joined, the trailing comment dropped
    mark: str | None = None  # GPU_ONLY, OTHER_SITE, INSIDE_JOB or JOB_SCRIPT

    @property
    def where(self) -> str:
        return f"{self.readme}:{self.line}"


FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
SHELL_BLOCKS = ("bash", "sh", "shell")
PROMPT_BLOCKS = ("", "console")


def split_comment(line: str) -> tuple[str, str]:
    """(command, comment): a ``#`` at the start or after a blank, outside quotes, starts it."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
            elif ch == "\\" and quote == '"':
                continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip(), line[i + 1:].strip()
    return line.rstrip(), ""


def mark_of(comment: str) -> str | None:
    return next((m for m in MARKS if comment.startswith(m)), None)


def _opens(text: str) -> int:
    first = text.split(None, 1)[0] if text.strip() else ""
    if first in ("for", "while", "until", "if", "case"):
        closed = re.search(r"(^|[;\s])(done|fi|esac)\s*$", text)
        return 0 if closed else 1
    if first in ("done", "fi", "esac"):
        return -1
    return 0


def commands_in(readme: str, text: str) -> list[Command]:
    """The commands a student types in one README's fenced blocks."""
    found: list[Command] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        i += 1
        if not fence:
            continue
        indent, ticks, lang = fence.groups()
        body_start = i
        while i < len(lines) and not lines[i].strip().startswith(ticks):
            i += 1
        body = [(n + 1, line[len(indent):] if line.startswith(indent) else line.lstrip())
                for n, line in enumerate(lines[body_start:i], start=body_start)]
        i += 1  # the closing fence
        if lang in SHELL_BLOCKS:
            found += _shell_block(readme, body)
        elif lang in PROMPT_BLOCKS:
            found += [Command(readme, n, *_without_comment(line[2:]))
                      for n, line in body if line.startswith("$ ")]
    return found


def _without_comment(line: str) -> tuple[str, str | None]:
    command, comment = split_comment(line)
    return command.strip(), mark_of(comment)


def _shell_block(readme: str, body: list[tuple[int, str]]) -> list[Command]:
    found = []
    block_mark = None
    first = next((line.strip() for _, line in body if line.strip()), "")
    if first.startswith("#"):
        comment = first[1:].strip()
        block_mark = JOB_SCRIPT if comment.startswith(JOB_SCRIPT) else mark_of(comment)
    start, parts, depth, mark = None, [], 0, None
    for n, raw in body:
        command, comment = split_comment(raw)
        if start is None:
            if not command.strip():
                continue
            start, mark = n, None
        mark = mark or mark_of(comment)
        if command.endswith("\\"):
            parts.append(command[:-1].strip())
            continue
        parts.append(command.strip())
        depth += _opens(command.strip())
        if depth > 0:
            continue
        text = " ".join(p for p in parts if p) if len(parts) > 1 and not _compound(parts) \
            else "\n".join(p for p in parts if p)
        found.append(Command(readme, start, text, block_mark or mark))
        start, parts, depth = None, [], 0
    return found


def _compound(parts: list[str]) -> bool:
    return _opens(parts[0]) > 0


@functools.cache
def all_commands() -> tuple[Command, ...]:
    return tuple(c for readme in READMES for c in commands_in(readme, (ROOT / readme).read_text()))


# --------------------------------------------------------------------------- job commands


ENV_PREFIX = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
OUTPUT_ONLY = ("--parsable", "--wait", "--output=", "--error=", "--chdir=")


@dataclass(frozen=True)
class Job:
    """A submission: sbatch OPTIONS SCRIPT ARGS with ENV in the environment."""

    options: tuple[str, ...]
    script: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env)
        return " ".join(filter(None, (env, "sbatch", *self.options, self.script, *self.args)))


@functools.cache
def _is_script(word: str) -> bool:
    return word.endswith(".sh") and UNKNOWN not in word and (ROOT / word).is_file()


def job_of(text: str) -> Job | None:
    """The submission a README's ``[NAME=value ...] sbatch [options] SCRIPT [args]`` makes."""
    try:
        words = shlex.split(text)
    except ValueError:
        return None
    env = []
    while words and ENV_PREFIX.match(words[0]):
        env.append(tuple(words.pop(0).split("=", 1)))
    if not words or words[0] != "sbatch" or "--test-only" in words:
        return None
    script = next((i for i, w in enumerate(words) if _is_script(w)), None)
    if script is None or any(not w.startswith("-") for w in words[1:script]):
        return None
    return Job(_significant(words[1:script]), words[script], tuple(words[script + 1:]),
               tuple(sorted(env)))


def _significant(options) -> tuple[str, ...]:
    return tuple(sorted(o for o in options if not o.startswith(OUTPUT_ONLY)))


UNKNOWN = "\0"  # a part of a value that reading the source cannot know (tmp_path, a variable)


class _Resolver:
    """Values of the expressions in a test file that are made of constants: strings, paths
    joined with ``/`` (ROOT is the course root), f-strings, lists, dicts, and names bound to
    them in the module or the function, or given by ``pytest.mark.parametrize``."""

    def __init__(self, tree: ast.Module):
        self.module = self._bindings(tree.body)

    @staticmethod
    def _bindings(body) -> dict[str, list[ast.expr]]:
        found: dict[str, list[ast.expr]] = {}
        for node in body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                    and isinstance(node.targets[0], ast.Name):
                found.setdefault(node.targets[0].id, []).append(node.value)
        return found

    def function(self, func: ast.FunctionDef) -> dict[str, list]:
        """Names of the function: local assignments, then its parametrize values."""
        local: dict[str, list] = {k: [("expr", v) for v in vs]
                                  for k, vs in self._bindings(ast.walk(func)).items()}
        for deco in func.decorator_list:
            if not (isinstance(deco, ast.Call) and getattr(deco.func, "attr", "") == "parametrize"
                    and len(deco.args) >= 2 and isinstance(deco.args[0], ast.Constant)):
                continue
            names = [n.strip() for n in str(deco.args[0].value).split(",")]
            values = deco.args[1]
            if isinstance(values, ast.Call) and getattr(values.func, "id", "") in (
                    "sorted", "list", "tuple") and len(values.args) == 1:
                values = values.args[0]  # sorted(JOBS): the names of a dict
            if isinstance(values, ast.Name):
                values = (self.module.get(values.id) or [None])[-1]
            if isinstance(values, ast.Dict):
                values = ast.List(elts=[k for k in values.keys if k is not None])
            if not isinstance(values, (ast.List, ast.Tuple)):
                continue
            for k, name in enumerate(names):
                local[name] = []
                for row in values.elts:
                    if isinstance(row, ast.Call) and getattr(row.func, "attr", "") == "param":
                        row = row.args[0] if len(names) == 1 else ast.Tuple(elts=row.args)
                    item = row if len(names) == 1 else (
                        row.elts[k] if isinstance(row, (ast.Tuple, ast.List)) else None)
                    if item is not None:
                        local[name].append(("expr", item))
        return local

    def values(self, node, names, depth=0) -> list:
        """Every value the expression may have (str, list, dict), UNKNOWN where unknown."""
        if depth > 8:
            return [UNKNOWN]
        if isinstance(node, ast.Constant):
            return [node.value if isinstance(node.value, str) else str(node.value)]
        if isinstance(node, ast.Name):
            if node.id == "ROOT":
                return [""]
            bound = names.get(node.id) or [("expr", v) for v in self.module.get(node.id, [])]
            if not bound:
                return [UNKNOWN]
            return [v for _, expr in bound for v in self.values(expr, names, depth + 1)]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return [_join(a, b) for a, b in itertools.product(
                self.values(node.left, names, depth + 1), self.values(node.right, names, depth + 1))
                if isinstance(a, str) and isinstance(b, str)] or [UNKNOWN]
        if isinstance(node, ast.JoinedStr):
            parts = [self.values(v.value, names, depth + 1) if isinstance(v, ast.FormattedValue)
                     else [str(v.value)] for v in node.values]
            return ["".join(p if isinstance(p, str) else UNKNOWN for p in combo)
                    for combo in itertools.islice(itertools.product(*parts), 16)]
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "str" \
                and len(node.args) == 1:
            return self.values(node.args[0], names, depth + 1)
        if isinstance(node, ast.Call) and node.keywords:  # job_env(tmp_path, NAME="value")
            return [{k.arg: self.values(k.value, names, depth + 1)[0]
                     for k in node.keywords if k.arg}]
        if isinstance(node, (ast.List, ast.Tuple)):
            seqs = self.sequences(node.elts, names, depth + 1)
            return [list(seq) for seq in itertools.islice(seqs, 16)]
        if isinstance(node, ast.Dict):
            keys = [self.values(k, names, depth + 1)[0] if k is not None else UNKNOWN
                    for k in node.keys]
            vals = [self.values(v, names, depth + 1)[0] for v in node.values]
            return [dict(zip(keys, vals, strict=True))]
        return [UNKNOWN]

    def sequences(self, elts, names, depth=0):
        """Every list of strings the elements may make (a starred name splices its list)."""
        options = []
        for elt in elts:
            if isinstance(elt, ast.Starred):
                seqs = [v if isinstance(v, list) else [UNKNOWN]
                        for v in self.values(elt.value, names, depth)]
                options.append(seqs)
            else:
                options.append([[v if isinstance(v, str) else UNKNOWN]
                                for v in self.values(elt, names, depth)])
        for combo in itertools.product(*options):
            yield [w for part in combo for w in part]


def _join(a: str, b: str) -> str:
    return posixpath.normpath(posixpath.join(a, b)).lstrip("/") if a else b.lstrip("/")


# Functions of the tests that submit a script without "sbatch" in their arguments.
SUBMITTERS = {"sbatch_wait", "submit_job", "submit_as_student", "sbatch_as_student", "sbatch"}
SBATCH_AFTER = {"sbatch_wait"}  # the fixture: sbatch options after the script, script_args=


def _calls(tree: ast.Module):
    """(function name, call or list node) for every call and list in a module's functions."""
    for func in ast.walk(tree):
        if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(func):
                if isinstance(node, (ast.Call, ast.List, ast.Tuple)):
                    yield func, node


@functools.cache
def submissions() -> tuple[tuple[str, Job], ...]:
    """(test id, Job) for every submission of a lesson script found in tests/test_*.py."""
    found = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if path.name != Path(__file__).name:
            found |= submissions_in(f"tests/{path.name}", path.read_text())
    return tuple(sorted(found, key=str))


def submissions_in(label: str, source: str) -> set[tuple[str, Job]]:
    """(LABEL::function, Job) for the submissions of a lesson script in one test file."""
    found = set()
    tree = ast.parse(source)
    resolver = _Resolver(tree)
    functions: dict[ast.AST, dict] = {}
    for func, node in _calls(tree):
        if func not in functions:
            functions[func] = resolver.function(func)
        names = functions[func]
        elts = node.args if isinstance(node, ast.Call) else node.elts
        kind = getattr(getattr(node, "func", None), "id", None) or getattr(
            getattr(node, "func", None), "attr", None)
        if not any(_maybe_script(e) for e in elts):
            continue
        keywords = {k.arg: k.value for k in getattr(node, "keywords", [])}
        for words in itertools.islice(resolver.sequences(elts, names), 64):
            script = next((i for i, w in enumerate(words) if _is_script(w)), None)
            if script is None:
                continue
            before, after = words[:script], words[script + 1:]
            if "sbatch" in before:  # slurm("sbatch", ...), ["sbatch", ...]
                before = before[before.index("sbatch") + 1:]
            elif kind not in SUBMITTERS:  # a path handed to anything else: no submission
                continue
            if kind in SBATCH_AFTER:
                options = [*before, *after]
                args_node = keywords.get("script_args")
                args_options = (resolver.values(args_node, names) if args_node is not None
                                else [[]])
            else:
                options, args_options = before, [after]
            options = [o for o in options if o.startswith("-")]
            env_node = keywords.get("env")
            envs = resolver.values(env_node, names) if env_node is not None else [{}]
            for args, env in itertools.product(args_options, envs):
                if not isinstance(args, list):
                    continue
                env = env if isinstance(env, dict) else {}
                job = Job(_significant(options), words[script], tuple(args),
                          tuple(sorted((k, v) for k, v in env.items()
                                       if isinstance(v, str) and UNKNOWN not in k + v)))
                found.add((f"{label}::{func.name}", job))
    return found


def _maybe_script(node) -> bool:
    """Could the element be a script's path (a constant that does not end in .sh is not)?"""
    return not isinstance(node, ast.Constant) or str(node.value).endswith(".sh")


HARNESS_ENV = ("COURSE_",)  # what a test sets for the local cluster (timeouts, paths)
# The variables a script's header offers for a shorter run of the same job (fewer steps, fewer
# cases), besides its arguments: a test may set them and still submit the README's command.
SHORTER = {
    "lessons/03_ddp_mnist/job.sh": ("SUBSET",),
    "lessons/05_fault_tolerance/requeue.sh": ("SUBSET",),
    "lessons/05_fault_tolerance/chain.sh": ("SUBSET",),
    "lessons/05_fault_tolerance/crash.sh": ("SUBSET",),
    "lessons/07_fsdp_sharding/job.sh": ("SUBSET",),
    "lessons/08_data_pipeline/scaling.sh": ("MODES", "SHAPES", "STEPS"),
    "lessons/09_beyond_data_parallel/tp.sh": ("STEPS",),
    "lessons/09_beyond_data_parallel/pp.sh": ("MICROBATCHES", "STEPS"),
    "lessons/09_beyond_data_parallel/2d.sh": ("STEPS",),
    "lessons/09_beyond_data_parallel/compare.sh": ("STEPS",),
}


def covering(job: Job) -> list[str]:
    """The tests that submit what the README's command does: the same script, sbatch options
    and arguments, and the same variables (besides the harness's COURSE_* settings and the
    script's SHORTER ones)."""
    ignored = SHORTER.get(job.script, ())

    def env_of(sub: Job) -> tuple:
        return tuple(e for e in sub.env if not e[0].startswith(HARNESS_ENV)
                     and (e[0] not in ignored or e[0] in dict(job.env)))

    return sorted({test for test, sub in submissions()
                   if (sub.script, sub.options, sub.args) == (job.script, job.options, job.args)
                   and env_of(sub) == job.env})


def test_shorter_variables_are_the_scripts_own():
    """Each SHORTER variable is one its script's header shows in front of sbatch."""
    for script, names in SHORTER.items():
        header = [line for line in (ROOT / script).read_text().splitlines() if line.startswith("#")]
        shown = {name for line in header if "sbatch" in line
                 for name in re.findall(r"\b([A-Z_]+)=\S+", line.split("sbatch")[0])}
        assert set(names) <= shown, (script, sorted(set(names) - shown))


# --------------------------------------------------------------------------- classes


def classify(command: Command) -> tuple[str, str]:
    """(class, detail): skip, quick, not run or job; "" when it falls into none."""
    if command.mark in SKIPPED:
        return "skip", SKIPPED[command.mark]
    if command.text in QUICK:
        return "quick", "inside a job" if command.mark == INSIDE_JOB else ""
    job = job_of(command.text)
    if job and covering(job):
        return "job", str(job)
    if command.text in NOT_RUN:
        return "not run", NOT_RUN[command.text][0]
    if job:
        return "job", str(job)  # which no test submits: the test fails
    return "", ""


def _param(command: Command):
    kind, detail = classify(command)
    name = {"skip": detail.replace(" ", "-"), "": "unclassified"}.get(kind, kind.replace(" ", "-"))
    marks = []
    if kind == "skip":
        marks.append(pytest.mark.skip(reason=f"{detail}: {command.text}"))
    elif kind == "quick":
        # The command's own limit, after a wait for the cluster lock that jobs of others hold.
        marks += [pytest.mark.readme, pytest.mark.timeout(QUICK_TIMEOUT_S + LOCK_WAIT_S)]
    return pytest.param(command, marks=marks, id=f"{command.where}-{name}")


def test_collection_finds_every_readme_command():
    commands = all_commands()
    counts = {readme: sum(c.readme == readme for c in commands) for readme in READMES}
    assert counts == {
        "README.md": 10, "cluster/README.md": 9, "lessons/00_slurm_basics/README.md": 10,
        "lessons/01_hello_allreduce/README.md": 9, "lessons/02_launch_vs_srun/README.md": 2,
        "lessons/03_ddp_mnist/README.md": 11, "lessons/04_torchrun_enroot/README.md": 14,
        "lessons/05_fault_tolerance/README.md": 11, "lessons/06_diagnosing_hangs/README.md": 2,
        "lessons/07_fsdp_sharding/README.md": 5, "lessons/08_data_pipeline/README.md": 7,
        "lessons/09_beyond_data_parallel/README.md": 7,
    }, counts
    assert Command("lessons/03_ddp_mnist/README.md", 44, "sbatch lessons/03_ddp_mnist/job.sh") \
        in commands
    assert Command("lessons/03_ddp_mnist/README.md", 46,
                   "sbatch lessons/03_ddp_mnist/job.sh 2 --sync-bn", GPU_ONLY) in commands
    assert job_of("CHECKPOINT=checkpoints/mine.pt sbatch lessons/03_ddp_mnist/job.sh 3") == Job(
        (), "lessons/03_ddp_mnist/job.sh", ("3",), (("CHECKPOINT", "checkpoints/mine.pt"),))


def test_collection_reads_the_conventions():
    text = "\n".join([
        "```bash", "# at your site: all of them", "export A=1", "sbatch x.sh", "```",
        "```bash", "FOO=1 sbatch \\", "   --nodes=1 job.sh 2   # GPU only: why", "# a comment",
        "for i in 1 2; do", "  echo $i  # not a mark", "done", "echo 'a # b' # inside a job", "```",
        "  ```", "  $ srun hostname", "  node1", "  ```",
        "```python", "print(1)", "```", "```text", "$ not a command", "```",
    ])
    assert commands_in("R", text) == [
        Command("R", 3, "export A=1", OTHER_SITE), Command("R", 4, "sbatch x.sh", OTHER_SITE),
        Command("R", 7, "FOO=1 sbatch --nodes=1 job.sh 2", GPU_ONLY),
        Command("R", 10, "for i in 1 2; do\necho $i\ndone"),
        Command("R", 13, "echo 'a # b'", INSIDE_JOB), Command("R", 16, "srun hostname"),
    ]


def test_submissions_are_read_from_the_tests_source():
    source = '''
LESSON = ROOT / "lessons" / "03_ddp_mnist"
SMALL = ["--train-subset", "8000"]
JOBS = {"job.sh": 1, "job_task_per_gpu.sh": 2}

@pytest.mark.parametrize("script", sorted(JOBS))
def test_each(sbatch_wait, script, tmp_path):
    sbatch_wait(f"lessons/01_hello_allreduce/{script}", f"--output={tmp_path}/x.out")

def test_args(tmp_path):
    submit_job(tmp_path, LESSON / "job.sh", "1", *SMALL, env={"CHECKPOINT": "c.pt"})
    sbatch_wait(str(LESSON / "job.sh"), "--nodes=1", script_args=("2",), env=job_env(EPOCHS="3"))
    subprocess.run(["sbatch", "--parsable", "--chdir", "lessons/02_launch_vs_srun/job.sh"])
    subprocess.run(["bash", str(LESSON / "job.sh")])

def helper(*args):
    slurm("sbatch", *args)
'''
    found = submissions_in("t.py", source)
    l01, l03 = "lessons/01_hello_allreduce", "lessons/03_ddp_mnist/job.sh"
    assert found == {
        ("t.py::test_each", Job((), f"{l01}/job.sh", ())),
        ("t.py::test_each", Job((), f"{l01}/job_task_per_gpu.sh", ())),
        ("t.py::test_args",
         Job((), l03, ("1", "--train-subset", "8000"), (("CHECKPOINT", "c.pt"),))),
        ("t.py::test_args", Job(("--nodes=1",), l03, ("2",), (("EPOCHS", "3"),))),
        ("t.py::test_args", Job(("--chdir",), "lessons/02_launch_vs_srun/job.sh", ())),
    }, sorted(map(str, found))
    # The same script with other arguments, options or variables is another command.
    readme = job_of("sbatch lessons/03_ddp_mnist/job.sh 1")
    assert readme not in {job for _, job in found}
    assert job_of("EPOCHS=3 sbatch --nodes=1 lessons/03_ddp_mnist/job.sh 2") in {
        job for _, job in found}


def test_tables_name_readme_commands_only():
    """A command dropped from the READMEs goes from the tables too."""
    texts = {c.text for c in all_commands()}
    stale = sorted((set(QUICK) | set(NOT_RUN) | set(QUICK_OUTPUT)) - texts)
    assert not stale, stale
    assert not set(QUICK) & set(NOT_RUN)
    submitted = sorted(t for t in NOT_RUN if job_of(t) and covering(job_of(t)))
    assert not submitted, f"a test submits these as written: no need for NOT_RUN {submitted}"


def test_every_readme_command_has_a_class():
    unclassified = [f"{c.where}: {c.text}" for c in all_commands() if not classify(c)[0]]
    assert not unclassified, (
        "README commands in no class (mark them, add them to QUICK or NOT_RUN, or submit the "
        "same job in a test):\n" + "\n".join(unclassified))


@pytest.mark.parametrize("command", [_param(c) for c in all_commands()])
def test_readme_command(command):
    kind, detail = classify(command)
    if kind == "job":
        tests = covering(job_of(command.text))
        same_script = sorted({f"{t}: {s}" for t, s in submissions()
                              if s.script == job_of(command.text).script})
        assert tests, (f"{command.where}: no test submits `{detail}`; the tests submit this "
                       f"script as:\n" + "\n".join(same_script or ["(nothing)"]))
    elif kind == "not run":
        covered_by = NOT_RUN[command.text][1]
        job = job_of(command.text)
        if job:  # the test named submits the same script, with other arguments
            assert covered_by in {t for t, s in submissions() if s.script == job.script}, (
                f"{command.where}: {covered_by or 'no test'} does not submit {job.script}")
        elif covered_by:
            _assert_test_exists(covered_by)
    elif kind == "quick":
        proc = run_quick(command.text, inside_job=command.mark == INSIDE_JOB)
        output = proc.stdout + proc.stderr
        assert proc.returncode == QUICK[command.text], (
            f"{command.where}: `{command.text}` exited with {proc.returncode}, "
            f"not {QUICK[command.text]}:\n{output[-3000:]}")
        if command.text in QUICK_OUTPUT:
            assert QUICK_OUTPUT[command.text](output), f"{command.where}:\n{output[-3000:]}"
    else:
        pytest.fail(f"{command.where}: {command.text}", pytrace=False)


def _assert_test_exists(test_id: str):
    path, _, name = test_id.partition("::")
    assert (ROOT / path).is_file(), test_id
    if name:
        tree = ast.parse((ROOT / path).read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == name for n in ast.walk(tree)), \
            test_id


# --------------------------------------------------------------------------- running


def student_environ() -> dict[str, str]:
    """This environment as a student's shell has it: the venv active and nothing else."""
    drop = ("COURSE_", "SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PYTHON", "VIRTUAL_ENV",
            "MNIST_", "TORCHELASTIC_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "OMP_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    venv = ROOT / ".venv"
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p) != venv / "bin"]
    env.update(VIRTUAL_ENV=str(venv), PATH=os.pathsep.join([str(venv / "bin"), *path]))
    return env


NEEDS_NODES = ("srun ", "salloc ", "sbatch ")


@functools.cache
def run_quick(text: str, inside_job: bool = False) -> subprocess.CompletedProcess:
    """Run a README command with bash from the course root, holding the cluster lock when it
    asks for nodes; ``inside_job``: within an allocation of 2 nodes x 2 tasks."""
    cmd = ["bash", "-c", text]
    if inside_job:
        cmd = ["salloc", "--nodes=2", "--ntasks-per-node=2", "--time=2", *cmd]
    needs_nodes = inside_job or text.startswith(NEEDS_NODES)
    lock = cluster_lock(timeout=LOCK_WAIT_S) if needs_nodes else contextlib.nullcontext()
    with lock:  # the wait for the lock (someone else's jobs) is not the command's time
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=student_environ(), capture_output=True,
                              text=True, timeout=QUICK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    print(f"{time.monotonic() - start:.1f} s: {text}")
    return proc
