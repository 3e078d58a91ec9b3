"""The commands a student types from the READMEs' fenced code blocks, and what each one is.

The commands are the lines of README.md, cluster/README.md and lessons/*/README.md: every line of
a ```bash (or ```sh) block that is not a comment, and the lines that start with ``$ `` in an
unlabelled (or ```console) block, whose other lines are output. A line ending in ``\\`` goes on
on the next one; a ``for``/``while``/``if`` runs to its ``done``/``fi``. The conventions that mark
a command (README.md, "Every command the lessons show"): a trailing comment ``# GPU only`` or
``# at your site`` (or such a comment as the first line of a block, for all of its commands);
``# inside a job`` for a command typed inside an allocation; a block whose first line is ``# in
the job script`` shows lines of a job script. Each command falls into one class of
tests/readme_tables.py (``classify``).
"""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from readme_tables import AS_WRITTEN_BY, INSIDE_JOB, JOB_SCRIPT, MARKS, NOT_RUN, QUICK, SKIPPED

ROOT = Path(__file__).resolve().parent.parent
READMES = ("README.md", "cluster/README.md",
           *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("lessons/*/README.md")))

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
    return word.endswith(".sh") and (ROOT / word).is_file()


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


def make_recipe_jobs(target: str) -> set[Job]:
    """The jobs the Makefile's recipe of TARGET submits (``sbatch ...`` up to ``)``, ``;``,
    ``|`` or ``&``): what a test's run of ``make TARGET`` submitted."""
    recipe = re.search(rf"(?ms)^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)+)",
                       (ROOT / "Makefile").read_text())
    calls = re.findall(r"\bsbatch\b[^);|&\n]*", recipe[1]) if recipe else []
    return {job for job in map(job_of, calls) if job}


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

