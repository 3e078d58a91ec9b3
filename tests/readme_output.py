"""What each quick README command must print: what its README says it prints.

The expectation is read from the README at test time, so the README and the command cannot drift
apart unseen:

* a command in a prompt block (``$ command``, then lines a terminal printed): those lines, every
  one and nothing else, in any order (tasks print in the order they run); numbers that a run
  measures or is given (MEASURED: job ids, seconds) masked on both sides; the lines that say only
  that the job waited in the queue (WAITED) left out on both sides;
* a command whose trailing comment is a line of its output (``sinfo  # local* up ...``, listed in
  TRAILING): that line, blanks aside;
* a command whose output the README quotes in a ```text block of its own (QUOTED_BLOCK: the
  block's first line): every line of that block (an excerpt: it may print more), numbers masked
  as above;
* a command whose README text after it quotes phrases of its output in backticks (PHRASES):
  those phrases, each first found in that text, then in what the command printed; and where
  that text says "the exit status is N" of a line that ends ``echo "exit $?"``, ``exit N``;
* the rest, where the README quotes nothing of the output, by what they do (CHECKS).

Every quick command (tests/readme_tables.py, QUICK) has one of these; test_readme_commands.py
checks that none is left without.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from readme_commands import ROOT, Command
from readme_tables import IPYKERNEL

MEASURED = (re.compile(r"(?<=job )\d+"), re.compile(r"(?<=allocation )\d+"),
            re.compile(r"\(\d+ s\)"), re.compile(r"(?<=epoch_time )[\d.]+s"))  # fmt: skip
# Printed only when the job waited for its nodes (a queue, a slow node): the terminal the README
# copies had them; a run on an idle cluster may not. And one line printed only when a race goes
# one way (below).
WAITED = re.compile(r"^(salloc|srun): (Pending job allocation|job \S+ queued and waiting for "
                    r"resources|job \S+ has been allocated resources|Waiting for resource "
                    r"configuration|Nodes \S+ are ready for job)"  # fmt: skip
                    # Printed only when slurmctld's "job complete" reaches salloc before its own
                    # release returns (src/salloc/salloc.c: _job_complete_handler prints it
                    # unless allocation_state is already REVOKED, which the release sets after
                    # slurm_complete_job() returns): a race, one line or none.
                    r"|salloc: Job allocation \S+ has been revoked\.$")

# Commands whose tasks land where Slurm finds room: the node's name depends on what else runs
# (CI's other lanes), so it is masked on both sides; "node index" and "local index" still say
# how the tasks were laid out.
PLACED = {"srun --ntasks=3 bash lessons/00_slurm_basics/whoami.sh"}
NODE_NAME = re.compile(r"\bnode\d+\b")

TRAILING = ("sinfo",)
QUOTED_BLOCK = {"python lessons/10_fit_and_keep/fit.py": "model lesson:"}
PHRASES = {
    "python lessons/01_hello_allreduce/spawn_warmup.py --nprocs 2 --steps 3": (
        "weights before DDP", "weights after DDP"),
    'python lessons/01_hello_allreduce/hello_allreduce.py --nprocs 2 --break-rank 1; '
    'echo "exit $?"': ("WRONG", "FAILED: 1 of 2 ranks hold a wrong sum"),
    "torchrun --standalone --nproc-per-node 2 lessons/04_torchrun_enroot/train.py": (
        "rank 1/2 local_rank 1/2 node_rank 0/1 host",),
}


def masked(line: str) -> str:
    for pattern in MEASURED:
        line = pattern.sub("<n>", line)
    return line.rstrip()


def _readme_lines(command: Command) -> list[str]:
    return (ROOT / command.readme).read_text().splitlines()


def prompt_output(command: Command) -> list[str] | None:
    """The lines after ``$ command`` in its prompt block, up to the next ``$ `` or the fence;
    None when the command is not in a prompt block."""
    lines = _readme_lines(command)
    first = lines[command.line - 1].strip()
    if not first.startswith("$ "):
        return None
    quoted = []
    for line in lines[command.line:]:
        text = line.strip()
        if text.startswith(("$ ", "```", "~~~")):
            break
        quoted.append(text)
    return quoted


def quoted_block(command: Command, first: str) -> list[str]:
    """The ```text block of COMMAND's README whose first line starts with FIRST."""
    lines = _readme_lines(command)
    for i, line in enumerate(lines[:-1]):
        if line.strip().startswith("```") and lines[i + 1].startswith(first):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            return lines[i + 1:end]
    raise AssertionError(f"{command.readme} quotes no block starting {first!r}")


def text_after(command: Command) -> str:
    """The README's text after COMMAND's code block, up to the next code block or heading."""
    lines = _readme_lines(command)
    i = command.line
    while i < len(lines) and not lines[i].strip().startswith("```"):
        i += 1
    text = []
    for line in lines[i + 1:]:
        if line.strip().startswith(("```", "#")):
            break
        text.append(line.strip())
    return " ".join(text)


def _compare(quoted: list[str], printed: list[str], whole: bool = True) -> list[str]:
    """Problems: quoted lines not printed, and (WHOLE: the quote is all of the output) printed
    lines not quoted."""
    want = sorted(masked(q) for q in quoted if q.strip() and not WAITED.match(q))
    got = sorted(masked(p) for p in printed if p.strip() and not WAITED.match(p))
    missing = [w for w in want if w not in got]
    extra = [g for g in got if g not in want] if whole else []
    return ([f"quoted, not printed: {m}" for m in missing]
            + [f"printed, not quoted: {e}" for e in extra])  # fmt: skip


# --------------------------------------------------------------------------- the rest


def _kernel_installed(command: Command, out: str) -> list[str]:
    """The kernel README.md's notebooks ask for: this venv's python, under the name shown."""
    where = re.search(r"(?m)^Installed kernelspec slurm-ddp-course in (\S+)$", out)
    if not where:
        return ["no line `Installed kernelspec slurm-ddp-course in ...`"]
    spec = json.loads((Path(where[1]) / "kernel.json").read_text())
    shutil.rmtree(Path(where[1]).parent.parent)  # the temporary JUPYTER_DATA_DIR
    shown = re.search(r'--display-name "([^"]+)"', command.text)[1]
    problems = [] if spec["display_name"] == shown else [f"display name {spec['display_name']}"]
    if Path(spec["argv"][0]).parent.resolve() != (ROOT / ".venv" / "bin").resolve():
        problems.append(f"the kernel runs {spec['argv'][0]}, not the venv's python")
    return problems


def _carry_count_as_said(command: Command, out: str) -> list[str]:
    """README.md says the lines a student carries from lesson 03: the figures wc prints now."""
    counts = {Path(name).name: int(n) for n, name in re.findall(r"(?m)^\s*(\d+) (\S+)$", out)}
    if "total" not in counts or "train.py" not in counts:
        return ["no `wc -l` lines for train.py and a total"]
    common = sum(n for name, n in counts.items() if name not in ("train.py", "total"))
    said = " ".join((ROOT / command.readme).read_text().split())
    wanted = [f"{counts['total']:,} lines, {counts['train.py']} of them train.py and {common:,}",
              *(f"`{name}` {n}" for name, n in counts.items() if name not in ("train.py", "total"))]
    return [f"README.md's count is stale; wc -l says: {w}" for w in wanted if w not in said]


def _lines(pattern: str, count: int | None = None, *, at_most: bool = False):
    """Every line printed matches PATTERN (and there are COUNT of them, when given; AT_MOST:
    COUNT or fewer, as `tail -n COUNT` of a log that a cluster just started has)."""
    def check(command: Command, out: str) -> list[str]:
        lines = out.splitlines()
        wrong = [line for line in lines if not re.fullmatch(pattern, line)]
        if count is not None and (len(lines) > count if at_most else len(lines) != count):
            wrong.append(f"{len(lines)} lines, not {'at most ' if at_most else ''}{count}")
        return [f"not {pattern!r}: {w}" for w in wrong[:5]] or (
            [] if lines or count == 0 else ["nothing"])
    return check


def _json_per_task(command: Command, out: str) -> list[str]:
    """``# one JSON line per task``: 2 nodes x 2 tasks, ranks 0 to 3."""
    try:
        ranks = sorted(json.loads(line)["rank"] for line in out.splitlines() if line.strip())
    except (ValueError, KeyError, TypeError) as err:
        return [f"not one JSON object with a rank per line: {err}"]
    return [] if ranks == [0, 1, 2, 3] else [f"ranks {ranks}, not [0, 1, 2, 3]"]


def _once_per_node(command: Command, out: str) -> list[str]:
    """One report per node of the allocation (2 nodes x 2 tasks), not one per task."""
    nodes = sorted(re.findall(r"(?m)^(node\d+): python ", out))
    return [] if nodes == ["node1", "node2"] else [f"reports from {nodes}, not node1 and node2"]


# Commands whose README quotes nothing of their output: what they do, checked.
CHECKS = {
    "source .venv/bin/activate": _lines(r"", 0),
    "srun --nodes 2 --ntasks-per-node 2 python -m common.env": _json_per_task,
    "wc -l lessons/03_ddp_mnist/train.py $(sed -n 's|^from common\\.\\([a-z_]*\\) import.*|"
    "common/\\1.py|p' lessons/03_ddp_mnist/train.py)": _carry_count_as_said,
    "scontrol show node node2 | grep -E 'State|Reason'": _lines(r"\s+State=IDLE .*", 1),
    "tail -n 50 /var/lib/course-cluster/log/slurmd-node2.log": _lines(r"\[\d{4}-\S+\] .*", 50,
                                                                at_most=True),
    "tail -n 50 /var/lib/course-cluster/log/slurmctld.log": _lines(r"\[\d{4}-\S+\] .*", 50,
                                                                at_most=True),
    'srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1 python -m common.sysinfo': _once_per_node,
    "python -m common.mnist_prepare": _lines(
        r"MNIST is ready in \S+/data/mnist/MNIST/raw \(4 files, MD5 verified\)", 1),
    "python lessons/08_data_pipeline/mnist_files.py": _lines(
        r"already prepared in \S+/data/mnist-files \(--force writes it again\)", 1),
    "python lessons/03_ddp_mnist/train.py --epochs 1 --train-subset 4096": lambda c, out: [] if (
        re.search(r"(?m)^done: test_acc [\d.]+% after 1 epochs$", out)) else ["no `done:` line"],
    IPYKERNEL: _kernel_installed,
    # Besides PHRASES: "at the end whether every replica holds the same weights".
    "torchrun --standalone --nproc-per-node 2 lessons/04_torchrun_enroot/train.py":
        lambda c, out: [] if "weights identical on all 2 ranks: True" in out.splitlines() else [
            "no line `weights identical on all 2 ranks: True`"],
    # "the checks run too": every window's weights compared, nothing flagged, all 200 steps.
    "torchrun --standalone --nproc-per-node 4 lessons/12_sick_node/train.py --steps 200 "
    "--train-subset 4096": lambda c, out: [] if (
        re.search(r"(?m)^clean: highest compute ratio [\d.]+ \(flag at 3\.0\), 0 step\(s\) "
                  r"skipped, weights equal on all 4 ranks \(compared 10 times", out)
        and re.search(r"(?m)^done: test_acc [\d.]+% after 200 steps", out)) else [
            "no `clean:` line with 10 comparisons and no skip, or no `done:` after 200 steps"],
}


def how_checked(command: Command) -> str:
    """Which of the ways above checks COMMAND's output ("" for none)."""
    if prompt_output(command) is not None:
        return "prompt"
    for name, table in (("trailing", TRAILING), ("block", QUOTED_BLOCK), ("phrases", PHRASES),
                        ("check", CHECKS)):  # fmt: skip (PHRASES before CHECKS: both may apply)
        if command.text in table:
            return name
    return ""


def check_output(command: Command, stdout: str, stderr: str) -> list[str]:
    """What COMMAND printed (stdout and stderr) against what its README says: the problems."""
    out = stdout + stderr
    printed = out.splitlines()
    how = how_checked(command)
    if how == "prompt":
        if command.text in PLACED:
            quoted = [NODE_NAME.sub("<node>", line) for line in prompt_output(command)]
            return _compare(quoted, [NODE_NAME.sub("<node>", line) for line in printed])
        return _compare(prompt_output(command), printed)
    if how == "trailing":
        comment = _readme_lines(command)[command.line - 1].split("#", 1)[1].split()
        return [] if comment in [line.split() for line in printed] else [
            f"no line `{' '.join(comment)}` (the README's comment)"]
    if how == "block":
        return _compare(quoted_block(command, QUOTED_BLOCK[command.text]), printed, whole=False)
    if how == "phrases":
        said = text_after(command)
        problems = [f"the README no longer says `{p}` after the command" for p in
                    PHRASES[command.text] if f"`{p}" not in said]
        problems += [f"not printed: {p}" for p in PHRASES[command.text] if p not in out]
        status = re.search(r"the exit status is (\d+)", said)
        if command.text.endswith('echo "exit $?"'):
            if not status:
                problems.append("the README no longer says `the exit status is N` after it")
            elif f"exit {status[1]}" not in printed:
                problems.append(f"no line `exit {status[1]}` (the exit status the README says)")
        return problems + (CHECKS[command.text](command, out) if command.text in CHECKS else [])
    if how == "check":
        return CHECKS[command.text](command, out)
    return ["nothing says what it prints: add it to tests/readme_output.py"]
