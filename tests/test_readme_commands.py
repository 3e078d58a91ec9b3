"""Every command a README shows a student, checked as written.

The commands are the lines a student types from the fenced code blocks of README.md,
cluster/README.md and lessons/*/README.md: every line of a ```bash (or ```sh) block that is not
a comment, and the lines that start with ``$ `` in an unlabelled (or ```console) block, whose
other lines are output. A line ending in ``\\`` goes on on the next one; a ``for``/``while``/``if``
runs to its ``done``/``fi``. The conventions that mark a command (README.md, "Every command the
lessons show"): a trailing comment ``# GPU only`` or ``# at your site`` (or such a comment as the
first line of a block, for all of its commands); ``# inside a job`` for a command typed inside
an allocation; a block whose first line is ``# in the job script`` shows lines of a job script.

Each command falls into one class (table-driven, one test id per README line). A command passes
only where it ran here; every other one is skipped with its reason, and pytest's summary counts
them (``summary()``, printed by tests/conftest.py):

* ``quick``: finishes in seconds: run (marked ``readme``, ``make test-readme``) from the course
  root with only the venv active (``VIRTUAL_ENV``, ``.venv/bin`` first on ``PATH``; no
  ``PYTHONPATH``, no ``COURSE_*``, ``SLURM_*``, ``SBATCH_*`` ...), expecting QUICK's exit status
  and, where QUICK_OUTPUT says, what it prints; a command marked ``# inside a job`` runs in
  ``salloc`` with lesson 01's shape (2 nodes x 2 tasks);
* ``job``: ``sbatch SCRIPT ARGS`` (with ``NAME=value`` in front), and ``as written`` (another
  command, ``make demo``): AS_WRITTEN_BY names the test under tests/ that submits or runs it as
  written, in its own lane (submitting them all takes about 20 minutes). The test here checks
  that pytest collects that test (a test renamed or gone fails here) and that its source submits
  the same script with the same sbatch options, script arguments and variables (``sbatch_wait``,
  ``submit_job``, ``slurm``, an ``["sbatch", ...]`` list, or a make target whose recipe does:
  MAKE_TARGETS); options that only say where the output goes (``--output``, ``--chdir``,
  ``--parsable``) do not count, and a test may shorten the job with the variables its script's
  header offers for that (SHORTER: fewer images, steps or cases), nothing else. Then it skips,
  naming the test and its lane;
* ``not run``: needs a job id or root, runs longer than a quick command or until stopped:
  NOT_RUN gives the reason and the test that runs the same with what it needs (checked to be
  collected, as above), if any; skipped;
* ``skip``: marked GPU only, at your site, or a job script's lines: skipped, the mark the reason.

A command in no class fails with one line naming its README, line and text. Everything but the
quick runs reads files and collects the tests named (a few seconds, in make test); the quick runs
take about a minute (make test-readme, a CI lane), besides any wait for the cluster lock.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import itertools
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

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

IPYKERNEL = ('.venv/bin/python -m ipykernel install --user --name slurm-ddp-course '
             '--display-name "Python (slurm-ddp-course)"')

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
    # About 20 s: an epoch of 4,096 images, then the whole test set.
    "python lessons/03_ddp_mnist/train.py --epochs 1 --train-subset 4096": 0,
    # About 13 s of training.
    "torchrun --standalone --nproc-per-node 2 lessons/04_torchrun_enroot/train.py": 0,
    # Writes the kernel where JUPYTER_DATA_DIR says: a temporary folder here (QUICK_TMP_ENV).
    IPYKERNEL: 0,
    # About 10 s: three estimates, nothing allocated.
    "python lessons/10_fit_and_keep/fit.py": 0,
}

# Commands that write outside the course: the variable that moves that place, set to a temporary
# folder for the run.
QUICK_TMP_ENV = {IPYKERNEL: "JUPYTER_DATA_DIR"}

# What QUICK's runs must print, where the exit status alone says little.
CARRY_COUNT = (
    "wc -l lessons/03_ddp_mnist/train.py $(sed -n 's|^from common\\.\\([a-z_]*\\) import.*|"
    "common/\\1.py|p' lessons/03_ddp_mnist/train.py)")


def _kernel_installed(out: str) -> bool:
    """The kernel README.md's notebooks ask for: this venv's python, under the name shown."""
    where = re.search(r"(?m)^Installed kernelspec slurm-ddp-course in (\S+)$", out)
    assert where, out
    spec = json.loads((Path(where[1]) / "kernel.json").read_text())
    shutil.rmtree(Path(where[1]).parent.parent)  # the temporary JUPYTER_DATA_DIR
    assert spec["display_name"] == "Python (slurm-ddp-course)", spec
    assert Path(spec["argv"][0]).parent.resolve() == (ROOT / ".venv" / "bin").resolve(), spec
    return True


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
    "python lessons/03_ddp_mnist/train.py --epochs 1 --train-subset 4096":
        lambda out: re.search(r"(?m)^done: test_acc [\d.]+% after 1 epochs$", out),
    "torchrun --standalone --nproc-per-node 2 lessons/04_torchrun_enroot/train.py":
        lambda out: "weights identical on all 2 ranks: True" in out,
    IPYKERNEL: _kernel_installed,
}

CRASHED = ("tests/test_lesson05.py::"
           "test_crashed_rank_restarted_then_faulty_node_named_then_excluded")
FSDP_JOB = "tests/test_lesson07.py::test_job_saves_on_2_nodes_requeues_and_resumes_on_1"
UP_DOWN = "tests/test_cluster.py::test_up_is_idempotent_and_down_leaves_nothing"

# Commands that a test under tests/ runs or submits as written: command -> that test (file::
# function, or a file for all of its tests). A job may be shortened there by the variables its
# script's header offers for that (SHORTER), nothing else. Not run here: skipped, naming the test
# and its lane, once pytest has collected that test and its source submits the same job (or runs
# the make target whose recipe does).
AS_WRITTEN_BY = {
    "make demo": "tests/test_demo.py::test_make_demo",
    "sbatch lessons/00_slurm_basics/busy.sh":
        "tests/test_lesson00.py::test_busy_job_overlap_step_and_scancel",
    "sbatch lessons/01_hello_allreduce/job.sh":
        "tests/test_lesson01.py::test_job_script_on_local_cluster",
    "sbatch lessons/01_hello_allreduce/by_hand.sh":
        "tests/test_lesson01.py::test_by_hand_job_on_local_cluster",
    "sbatch lessons/01_hello_allreduce/job_task_per_gpu.sh":
        "tests/test_lesson01.py::test_job_script_on_local_cluster",
    "sbatch lessons/02_launch_vs_srun/launch_nproc2.sh":
        "tests/test_lesson02.py::test_job_script_on_local_cluster",
    "sbatch lessons/02_launch_vs_srun/job.sh":
        "tests/test_lesson02.py::test_job_script_on_local_cluster",
    "sbatch lessons/03_ddp_mnist/job.sh": "tests/test_demo.py::test_make_demo",
    "sbatch lessons/03_ddp_mnist/job.sh 1":
        "tests/test_cluster_student.py::test_student_runs_lesson03_from_own_copy",
    "CHECKPOINT=checkpoints/mine.pt sbatch lessons/03_ddp_mnist/job.sh":
        "tests/test_cluster_student.py::test_student_runs_lesson03_readme_then_stops_and_resumes",
    "SUBSET=2048 sbatch lessons/03_ddp_mnist/job.sh":
        "tests/test_lesson03.py::test_quick_first_run_as_the_readme_types_it",
    "sbatch lessons/04_torchrun_enroot/run_script.sh": "tests/test_lesson04.py::test_static_job",
    "ENROOT_DRY_RUN=1 sbatch lessons/04_torchrun_enroot/run_script.sh":
        "tests/test_lesson04.py::test_container_branch_prints_the_enroot_commands",
    "sbatch lessons/04_torchrun_enroot/run_charliecloud.sh": "tests/test_lesson04_charliecloud.py::"
        "test_torchrun_in_charliecloud_with_torch_only_in_the_image",
    "sbatch lessons/05_fault_tolerance/requeue.sh":
        "tests/test_lesson05.py::test_warning_then_preemption_then_resume",
    "sbatch lessons/05_fault_tolerance/preempt.sh":
        "tests/test_lesson05.py::test_warning_then_preemption_then_resume",
    "sbatch lessons/05_fault_tolerance/chain.sh":
        "tests/test_lesson05.py::test_chain_of_array_links_and_a_dependent_job",
    "sbatch lessons/05_fault_tolerance/crash.sh 2 --crash-rank 3": CRASHED,
    "sbatch lessons/05_fault_tolerance/crash.sh 1 --faulty-node node2 --crash-in-epoch 1": CRASHED,
    "sbatch --nodes=1 --exclude=node2 lessons/05_fault_tolerance/crash.sh 1": CRASHED,
    "sbatch lessons/07_fsdp_sharding/memory.sh":
        "tests/test_lesson07.py::test_memory_job_runs_worlds_of_1_2_and_4",
    "sbatch lessons/07_fsdp_sharding/job.sh": FSDP_JOB,
    "sbatch lessons/08_data_pipeline/job.sh": "tests/test_site_profiles.py::test_shared_tmp_site",
    "sbatch lessons/08_data_pipeline/scaling.sh":
        "tests/test_lesson08.py::test_bench_probe_and_scaling_jobs_run",
    "sbatch lessons/09_beyond_data_parallel/tp.sh": "tests/test_lesson09.py::test_tp_job",
    "sbatch lessons/09_beyond_data_parallel/pp.sh": "tests/test_lesson09.py::test_pp_job",
    "sbatch lessons/09_beyond_data_parallel/2d.sh":
        "tests/test_lesson09.py::test_2d_job_and_a_tp_group_across_nodes",
    "sbatch lessons/09_beyond_data_parallel/compare.sh": "tests/test_lesson09.py::test_compare_job",
    "python lessons/10_fit_and_keep/fit.py --model llama3-8b --world 8,16,64 --bf16 "
    "--gpu-mem 80GiB": "tests/test_lesson10.py::test_fit_answers_for_llama3_8b",
    "sbatch lessons/10_fit_and_keep/fit.sh": "tests/test_lesson10.py::test_fit_job",
    "sbatch lessons/10_fit_and_keep/keep.sh": "tests/test_lesson10.py::test_keep_job",
    "sbatch lessons/10_fit_and_keep/reshard.sh": "tests/test_lesson10.py::test_reshard_job",
}
# Tests run through a make target: the test -> the target (its recipe's sbatch is the job).
MAKE_TARGETS = {"tests/test_demo.py::test_make_demo": "demo"}

# Why a command is not run at all here (its skip reason starts with one; summary() counts them).
NEEDS_JOB = "needs a job id"
NEEDS_ROOT = "needs root"
LONG_RUN = "runs longer than a quick command"
UNTIL_STOPPED = "runs until stopped"

# Commands not run here nor as written by a test: command -> (why, what it is, the test that
# runs the same with what it needs (a job, a temporary folder, fewer steps) or "").
NOT_RUN = {
    "make test": (LONG_RUN, "the whole suite, about 9 minutes: CI's first lane", ""),
    ".venv/bin/jupyter lab lessons/": (UNTIL_STOPPED, "a server", ""),
    "sudo bash cluster/up.sh": (NEEDS_ROOT, "restarts the shared cluster", UP_DOWN),
    "sudo bash cluster/down.sh": (NEEDS_ROOT, "stops the shared cluster", UP_DOWN),
    "scontrol update NodeName=node2 State=RESUME": (
        NEEDS_ROOT, "changes a node of the shared cluster (root or SlurmUser)", ""),
    "make container": (NEEDS_ROOT, "builds a 5.6 GB image; make test's setup runs it",
                       "tests/test_lesson04_charliecloud.py::"
                       "test_torchrun_in_charliecloud_with_torch_only_in_the_image"),
    "sacct -j <jobid> --format=JobID,State,ExitCode,Elapsed,MaxRSS": (
        NEEDS_JOB, "a finished job's", "tests/test_cluster_accounting.py::"
        "test_sacct_lists_a_finished_job_and_its_steps"),
    "srun --jobid=987 --overlap bash -c 'echo \"inside job $SLURM_JOB_ID, step $SLURM_STEP_ID, "
    "on $(hostname)\"'": (NEEDS_JOB, "the one busy.sh got",
                          "tests/test_lesson00.py::test_busy_job_overlap_step_and_scancel"),
    "scancel 987": (NEEDS_JOB, "the one busy.sh got",
                    "tests/test_lesson00.py::test_busy_job_overlap_step_and_scancel"),
    "sweep=$(sbatch --parsable lessons/00_slurm_basics/sweep.sh)": (
        NEEDS_JOB, "the next line's: an array job and its report",
        "tests/test_lesson00.py::test_array_then_dependent_report"),
    "sbatch --dependency=afterok:$sweep lessons/00_slurm_basics/report.sh $sweep": (
        NEEDS_JOB, "the sweep's", "tests/test_lesson00.py::test_array_then_dependent_report"),
    "scancel --signal=USR1 --batch <jobid>": (
        NEEDS_JOB, "a running requeue.sh's or job.sh's", "tests/test_lesson05.py::"
        f"test_warning_then_preemption_then_resume {FSDP_JOB}"),
    "scontrol show job <jobid> | grep -E 'JobState|Restarts|EligibleTime'": (
        NEEDS_JOB, "a requeued job's", "tests/test_lesson05.py::"
        "test_warning_then_preemption_then_resume"),
    "scontrol update JobId=<jobid> NumNodes=1 NumTasks=2 NumCPUs=8": (
        NEEDS_JOB, "a requeued job's", FSDP_JOB),
    "python lessons/07_fsdp_sharding/export.py checkpoints/fsdp-<jobid>": (
        NEEDS_JOB, "a job's checkpoints",
        "tests/test_lesson07.py::test_checkpoint_of_2_ranks_continues_on_3_and_on_1"),
    "python lessons/08_data_pipeline/plot_scaling.py scaling-<jobid>.out --png again.png": (
        NEEDS_JOB, "a scaling job's output",
        "tests/test_lesson08.py::test_plot_scaling_reads_the_stored_study"),
    "dep=()": (LONG_RUN, "a chain of three jobs, several minutes (with the next lines)",
               "tests/test_lesson05.py::test_chain_of_array_links_and_a_dependent_job"),
    'for link in 1 2 3; do\nid=$(sbatch --parsable --array="$link" "${dep[@]}" '
    "--export=ALL,CHAIN=mnist lessons/05_fault_tolerance/chain.sh)\n"
    'dep=(--dependency=afterany:"${id%%;*}")\ndone': (
        LONG_RUN, "a chain of three jobs, several minutes",
        "tests/test_lesson05.py::test_chain_of_array_links_and_a_dependent_job"),
    "torchrun --standalone --nproc-per-node 2 lessons/03_ddp_mnist/train.py --epochs 1": (
        LONG_RUN, "an epoch of 60,000 images, minutes here",
        "tests/test_lesson03.py::test_carried_train_py_runs_under_torchrun"),
    ".venv/bin/pytest tests/test_lesson04.py": (
        LONG_RUN, "the lesson's tests, a few minutes of jobs", "tests/test_lesson04.py"),
    "torchrun --standalone --nproc-per-node 2 "
    "lessons/09_beyond_data_parallel/tp.py --steps 20": (
        LONG_RUN, "20 steps of 2 processes",
        "tests/test_lesson09.py::test_tp_on_one_rank_counts_no_collective_in_the_model"),
    "torchrun --standalone --nproc-per-node 2 "
    "lessons/09_beyond_data_parallel/pp.py --microbatches 2,4": (
        LONG_RUN, "two pipeline schedules of 2 processes",
        "tests/test_lesson09.py::"
        "test_fewer_microbatches_than_stages_run_with_gpipe_and_interleaved"),
    "torchrun --standalone --nproc-per-node 4 "
    "lessons/09_beyond_data_parallel/compare.py --steps 3 --forms fsdp2": (
        LONG_RUN, "one form of 4 processes", "tests/test_lesson09.py::test_compare_job"),
    "python lessons/10_fit_and_keep/fit.py --model llama3-8b --world 8,16,64 --bf16 --ac "
    "--gpu-mem 80GiB": (LONG_RUN, "about 100 s on 2 cores",
                        "tests/test_lesson10.py::test_fit_answers_for_llama3_8b"),
    "python lessons/10_fit_and_keep/keep.py --check checkpoints/keep-<jobid>": (
        NEEDS_JOB, "a keep.sh job's checkpoint", "tests/test_lesson10.py::test_keep_job"),
    "torchrun --standalone --nproc-per-node 2 lessons/10_fit_and_keep/step.py --model tiny --ac": (
        LONG_RUN, "2 processes, about 15 s",
        "tests/test_lesson10.py::test_activation_checkpointing_same_numbers_fewer_activations"),
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
    "lessons/10_fit_and_keep/fit.sh": ("MODEL", "AC"),
    "lessons/10_fit_and_keep/keep.sh": ("MODEL",),
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
    """(class, detail): skip, quick, job or as written (by another test), not run; "" when it
    falls into none."""
    if command.mark in SKIPPED:
        return "skip", SKIPPED[command.mark]
    if command.text in QUICK:
        return "quick", "inside a job" if command.mark == INSIDE_JOB else ""
    job = job_of(command.text)
    if command.text in AS_WRITTEN_BY:
        return ("job", str(job)) if job else ("as written", AS_WRITTEN_BY[command.text])
    if command.text in NOT_RUN:
        return "not run", NOT_RUN[command.text][0]
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
        "lessons/03_ddp_mnist/README.md": 11, "lessons/04_torchrun_enroot/README.md": 18,
        "lessons/05_fault_tolerance/README.md": 11, "lessons/06_diagnosing_hangs/README.md": 6,
        "lessons/07_fsdp_sharding/README.md": 5, "lessons/08_data_pipeline/README.md": 7,
        "lessons/09_beyond_data_parallel/README.md": 7, "lessons/10_fit_and_keep/README.md": 8,
    }, counts
    assert Command("lessons/03_ddp_mnist/README.md", 49, "sbatch lessons/03_ddp_mnist/job.sh") \
        in commands
    assert Command("lessons/03_ddp_mnist/README.md", 51,
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
    """A command dropped from the READMEs goes from the tables too; a command is in one table."""
    texts = {c.text for c in all_commands()}
    tables = (QUICK, AS_WRITTEN_BY, NOT_RUN)
    stale = sorted((set().union(*tables) | set(QUICK_OUTPUT) | set(QUICK_TMP_ENV)) - texts)
    assert not stale, stale
    assert sum(map(len, tables)) == len(set().union(*tables))
    submitted = sorted(t for t in NOT_RUN if job_of(t) and covering(job_of(t)))
    assert not submitted, f"a test submits these as written: AS_WRITTEN_BY, not NOT_RUN {submitted}"
    assert all(why in (NEEDS_JOB, NEEDS_ROOT, LONG_RUN, UNTIL_STOPPED)
               for why, _, _ in NOT_RUN.values())


def test_every_readme_command_has_a_class():
    def hint(c: Command) -> str:
        job = job_of(c.text)
        tests = covering(job) if job else []
        return f" (submitted as written by {', '.join(tests)}: AS_WRITTEN_BY)" if tests else ""

    unclassified = [f"{c.where}: {c.text}{hint(c)}" for c in all_commands() if not classify(c)[0]]
    assert not unclassified, (
        "README commands in no class (mark them, add them to QUICK, AS_WRITTEN_BY or NOT_RUN, or "
        "submit the same job in a test):\n" + "\n".join(unclassified))


@pytest.mark.parametrize("command", [_param(c) for c in all_commands()])
def test_readme_command(command):
    kind, detail = classify(command)
    if kind in ("job", "as written"):
        test = AS_WRITTEN_BY[command.text]
        lane = lane_of(test)
        job = job_of(command.text)
        if command.text.startswith("make "):
            assert runs_make(test, command.text.split()[1]), f"{test} does not run {command.text}"
        if job:
            assert submits(test, job), (
                f"{command.where}: {test} does not submit `{job}`; the tests submit "
                f"{job.script} as:\n" + "\n".join(sorted(
                    {f"{t}: {s}" for t, s in submissions() if s.script == job.script})))
        pytest.skip(f"{'submitted' if job else 'run'} as written by {test} ({lane})")
    elif kind == "not run":
        why, what, tests = NOT_RUN[command.text]
        job = job_of(command.text)
        if job:  # the tests named submit the same script, with other arguments
            assert set(tests.split()) <= {t for t, s in submissions() if s.script == job.script}, (
                f"{command.where}: {tests or 'no test'} does not submit {job.script}")
        ran = " and ".join(f"{t} ({lane_of(t)})" for t in tests.split())
        pytest.skip(f"{why}: {what}" + (f"; the same run by {ran}" if ran else ""))
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


# --------------------------------------------------------------------------- the other tests

# Which `make` lane runs a test, by its marks (tests/conftest.py); the rest run in make test.
LANES = (("lesson09", "make test-lesson09"), ("lesson10", "make test-lesson10"),
         ("scale", "make test-scale"), ("sites", "make test-sites"), ("long", "make test-long"),
         ("readme", "make test-readme"))
# Collects the files given (pytest --collect-only) and writes {test id: its marks} as JSON,
# a parametrized test under its function's id.
COLLECT = """
import json, sys
import pytest

class Found:
    tests = {}

    def pytest_collection_finish(self, session):
        for item in session.items:
            marks = self.tests.setdefault(item.nodeid.split("[")[0], [])
            marks += [m.name for m in item.iter_markers() if m.name not in marks]

found = Found()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[2:]],
                   plugins=[found])
with open(sys.argv[1], "w") as out:
    json.dump(found.tests, out)
sys.exit(code)
"""


@functools.cache
def collected() -> dict[str, list[str]]:
    """{test id: marks} of the tests the tables name, as pytest collects them (once, about two
    seconds): a test renamed or gone is not there."""
    files = sorted({t.split("::")[0] for t in [*AS_WRITTEN_BY.values(),
                                               *(t for _, _, ts in NOT_RUN.values()
                                                 for t in ts.split())]})
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        proc = subprocess.run([sys.executable, "-c", COLLECT, out.name, *files], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        found = json.loads(Path(out.name).read_text() or "{}")
    assert proc.returncode == 0 and found, proc.stdout[-3000:] + proc.stderr[-3000:]
    return found


def lane_of(test: str) -> str:
    """The make lane that runs TEST (file::function, or a file: its first test's lane); fails
    when pytest does not collect it."""
    marks = collected().get(test) or next(
        (m for t, m in collected().items() if t.startswith(f"{test}::")), None)
    assert marks is not None, f"pytest collects no {test}"
    return next((lane for mark, lane in LANES if mark in marks), "make test")


def submits(test: str, job: Job) -> bool:
    """Does TEST's source submit JOB (covering()), or run the make target whose recipe does?"""
    if test in covering(job):
        return True
    target = MAKE_TARGETS.get(test)
    return bool(target) and runs_make(test, target) and job in make_recipe_jobs(target)


def runs_make(test: str, target: str) -> bool:
    """Does TEST's function run ``["make", TARGET]``?"""
    path, _, name = test.partition("::")
    tree = ast.parse((ROOT / path).read_text())
    return any(isinstance(node, (ast.List, ast.Tuple)) and [getattr(e, "value", None)
               for e in node.elts] == ["make", target]
               for func in ast.walk(tree) if getattr(func, "name", None) == name
               for node in ast.walk(func))  # fmt: skip


def make_recipe_jobs(target: str) -> set[Job]:
    """The jobs the Makefile's recipe of TARGET submits (``sbatch ...`` up to ``)``, ``;``,
    ``|`` or ``&``)."""
    recipe = re.search(rf"(?ms)^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)",
                       (ROOT / "Makefile").read_text())
    calls = re.findall(r"\bsbatch\b[^);|&\n]*", recipe[1]) if recipe else []
    return {job for job in map(job_of, calls) if job}


def test_a_test_renamed_or_submitting_another_job_is_caught():
    """The checks behind the skips can fail: a test pytest does not collect, a test that submits
    another job; a make target's recipe is read."""
    with pytest.raises(AssertionError, match="pytest collects no"):
        lane_of("tests/test_lesson09.py::test_renamed")
    assert lane_of("tests/test_lesson09.py::test_tp_job") == "make test-lesson09"
    assert lane_of("tests/test_lesson01.py::test_job_script_on_local_cluster") == "make test"
    tp, pp = (job_of(f"sbatch lessons/09_beyond_data_parallel/{s}.sh") for s in ("tp", "pp"))
    assert submits("tests/test_lesson09.py::test_tp_job", tp)
    assert not submits("tests/test_lesson09.py::test_tp_job", pp)
    demo, one_epoch = job_of("sbatch lessons/03_ddp_mnist/job.sh"), job_of(
        "sbatch lessons/03_ddp_mnist/job.sh 1")
    assert make_recipe_jobs("demo") == {demo}
    assert submits("tests/test_demo.py::test_make_demo", demo)
    assert not submits("tests/test_demo.py::test_make_demo", one_epoch)
    assert not runs_make("tests/test_demo.py::test_make_demo", "demo2")


# --------------------------------------------------------------------------- the summary

RAN, SUBMITTED, RUN_BY = "ran", "submitted as written by ", "run as written by "


def summary(stats: dict) -> list[str]:
    """Lines for pytest's summary (tests/conftest.py): how many README commands ran here, how
    many other tests submit or run as written (by lane), how many were skipped, by reason."""
    def ours(key):
        return [r for r in stats.get(key, [])
                if getattr(r, "nodeid", "").split("@")[0].startswith(PARAM_ID)]

    skipped, by_lane, tests = {}, {}, set()
    for report in ours("skipped"):
        reason = report.longrepr[2] if isinstance(report.longrepr, (tuple, list)) else ""
        reason = reason.removeprefix("Skipped: ")
        if reason.startswith((SUBMITTED, RUN_BY)):
            test, lane = re.fullmatch(r".* by (\S+) \((.+)\)", reason).groups()
            kind = "jobs" if reason.startswith(SUBMITTED) else "commands"
            by_lane.setdefault(lane, {}).setdefault(kind, 0)
            by_lane[lane][kind] += 1
            tests.add(test)
        else:
            why = reason.split(":")[0]
            skipped[why] = skipped.get(why, 0) + 1
    counts = {k: len(ours(k)) for k in ("passed", "failed", "error", "skipped")}
    commands = all_commands()  # the total and the quick ones: a worker's deselection is not here
    quick = sum(classify(c)[0] == "quick" for c in commands)
    jobs = sum(k.get("jobs", 0) for k in by_lane.values())
    others = sum(k.get("commands", 0) for k in by_lane.values())
    lanes = ", ".join(f"{lane}: " + " + ".join(f"{n} {k[:-1] if n == 1 else k}"
                                               for k, n in sorted(kinds.items()))
                      for lane, kinds in sorted(by_lane.items()))  # fmt: skip
    parts = [f"{counts['passed']} ran here (of {quick} quick ones: make test-readme)"]
    if tests:
        parts.append(f"{jobs} submitted as jobs and {others} run as written by {len(tests)} "
                     f"other tests ({lanes})")
    parts += [f"{n} {what}" for n, what in (
        (sum(skipped.values()), "skipped"), (counts["failed"] + counts["error"], "failed"),
        (len(commands) - sum(counts.values()), "not in this run")) if n]  # fmt: skip
    lines = [f"README commands ({len(commands)}): " + ", ".join(parts)]
    lines += [f"  skipped, {why}: {n}" for why, n in sorted(skipped.items(), key=lambda x: -x[1])]
    return lines


PARAM_ID = f"tests/{Path(__file__).name}::test_readme_command["


def test_summary_counts_what_ran_was_submitted_and_why_skipped():
    def report(n, reason=None):
        longrepr = None if reason is None else ("f.py", 1, f"Skipped: {reason}")
        return SimpleNamespace(nodeid=f"{PARAM_ID}R.md:{n}-x]", longrepr=longrepr)

    stats = {
        "passed": [report(1), SimpleNamespace(nodeid="tests/test_other.py::test_x")],
        "skipped": [report(2, "submitted as written by t.py::a (make test)"),
                    report(3, "submitted as written by t.py::a (make test)"),
                    report(4, "run as written by t.py::b (make test-long)"),
                    report(5, "needs a job id: x; the same run by t.py::c (make test)"),
                    report(6, "GPU only: y"), report(7, "GPU only: z")],
        "failed": [report(8)],
    }
    total, quick = len(all_commands()), sum(classify(c)[0] == "quick" for c in all_commands())
    assert summary(stats) == [
        f"README commands ({total}): 1 ran here (of {quick} quick ones: make test-readme), 2 "
        "submitted as jobs and 1 run as written by 2 other tests (make test: 2 jobs, "
        "make test-long: 1 command), 3 skipped, 1 failed, "
        f"{total - 8} not in this run",
        "  skipped, GPU only: 2", "  skipped, needs a job id: 1"]


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


# Commands that use the cluster or read its state, run holding the cluster lock: the lane runs
# beside others whose tests restart the cluster in another shape or site (.ci/run).
NEEDS_CLUSTER = ("srun ", "salloc ", "sbatch ", "sinfo", "scontrol ", "squeue", "sacct",
                 "tail -n 50 /var/lib/course-cluster/")  # fmt: skip


@functools.cache
def run_quick(text: str, inside_job: bool = False) -> subprocess.CompletedProcess:
    """Run a README command with bash from the course root, holding the cluster lock when it
    uses the cluster; ``inside_job``: within an allocation of 2 nodes x 2 tasks."""
    cmd = ["bash", "-c", text]
    if inside_job:
        cmd = ["salloc", "--nodes=2", "--ntasks-per-node=2", "--time=2", *cmd]
    needs_cluster = inside_job or text.startswith(NEEDS_CLUSTER)
    lock = cluster_lock(timeout=LOCK_WAIT_S) if needs_cluster else contextlib.nullcontext()
    env = student_environ()
    if text in QUICK_TMP_ENV:
        env[QUICK_TMP_ENV[text]] = tempfile.mkdtemp(prefix="readme-command-")
    with lock:  # the wait for the lock (someone else's jobs) is not the command's time
        start = time.monotonic()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=QUICK_TIMEOUT_S, stdin=subprocess.DEVNULL)
    print(f"{time.monotonic() - start:.1f} s: {text}")
    return proc
