"""Which README commands a run proved: ``python tests/confirm_readme.py [RECORDS_DIR ...]``.

The READMEs' commands that the suite runs as written (tests/readme_tables.py: the quick ones,
which ``make test-readme`` runs, and those another test runs or submits) count as run only when
the records of a run (tests/records.py; default folder ``runs/records``, ``COURSE_RECORDS_DIR``)
show it: a process started in the call phase of the test named for it, with the same command,
and that test passed. The comparison is of the command as typed: ``python`` for any Python
interpreter, paths relative to the course root (or to the course copy the test ran in), ``env``,
``runuser`` and ``bash -c`` unwrapped, sbatch's options that only say where the output goes left
out, and of the variables besides the command's own only the harness's (HARNESS_ENV,
HARNESS_NAMES), those the job script's header offers for a shorter run (SHORTER) and those that
only say where its files are (WHERE). A README
job run through a make target is confirmed by the test's ``make TARGET`` and the target's recipe.

Prints what it confirmed and what it could not (and why, with the closest process the test
started), counting none of the latter as run; exits 1 when any command was not confirmed. CI
runs it last, on both clusters' records.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the tests' modules

from readme_commands import Command, all_commands, classify, job_of, make_recipe_jobs  # noqa: E402
from readme_tables import AS_WRITTEN_BY, HARNESS_ENV, HARNESS_NAMES, MAKE_TARGETS, SHORTER, WHERE  # noqa: E402, E501
from records import DEFAULT_DIR, RECORDS_ENV  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUICK_TEST = "tests/test_readme_commands.py::test_readme_command"
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PYTHON = re.compile(r"python(\d+(\.\d+)?)?")


@dataclass
class Process:
    test: str
    phase: str
    argv: list[str]
    cwd: str
    given: dict[str, str]  # the variables it got beyond the session's environment
    status: int | None = None
    job: str | None = None
    state: str | None = None


@dataclass
class Ran:
    test: str
    where: str  # the record file
    processes: list[Process] = field(default_factory=list)
    outcomes: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.outcomes.get("call") == "passed" and "failed" not in self.outcomes.values()


def load(folders: list[Path]) -> list[Ran]:
    """Every test run in the record files of FOLDERS (a line cut short at the end is skipped)."""
    runs: dict[tuple[str, str], Ran] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.jsonl")):
            started: dict[int, Process] = {}
            ends: dict[str, tuple[str, int]] = {}
            for line in path.read_text(errors="replace").splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                kind = event.get("event")
                if kind == "start":
                    proc = Process(event["test"], event["phase"], event["argv"], event["cwd"],
                                   event.get("set", {}))  # fmt: skip
                    started[event["n"]] = proc
                    run = runs.setdefault((str(path), proc.test), Ran(proc.test, str(path)))
                    run.processes.append(proc)
                elif kind == "end" and event["n"] in started:
                    started[event["n"]].status = event["status"]
                elif kind == "job_id" and event["n"] in started:
                    started[event["n"]].job = event["job"]
                elif kind == "job":
                    ends[event["job"]] = (event["state"], event["status"])
                elif kind == "outcome":
                    run = runs.setdefault((str(path), event["test"]),
                                          Ran(event["test"], str(path)))  # fmt: skip
                    run.outcomes[event["phase"]] = event["outcome"]
            for proc in started.values():
                proc.state = ends.get(proc.job or "", (None,))[0]
    return list(runs.values())


# --------------------------------------------------------------------------- normalising


def _relative(word: str, cwd: str) -> str:
    """A path as the README types it: relative to the course root (or the course copy the
    process ran in)."""
    if "/" not in word or word.startswith("-"):
        return word
    path = Path(word) if word.startswith("/") else Path(cwd) / word
    for base in (ROOT, Path(cwd)):
        try:
            return path.resolve().relative_to(base.resolve()).as_posix()
        except (ValueError, OSError):  # not under it, or not a path at all ("-c" code)
            continue
    return word


def _program(word: str) -> str:
    name = Path(word).name
    if PYTHON.fullmatch(name):
        return "python"
    return name if word.startswith("/") and Path(word).parent.name == "bin" else word


def typed(argv: list[str], given: dict[str, str], cwd: str) -> list[tuple[dict, list[str]]]:
    """The commands a process ran as a student would type them: (variables, words), wrappers
    (runuser, env, sudo, setsid, timeout) taken off, ``bash -c LINE`` read as LINE's commands;
    ``salloc OPTIONS CMD`` is itself and CMD (a command typed ``# inside a job``)."""
    env, words, found = dict(given), list(argv), []
    while words:
        name = Path(words[0]).name
        if name == "runuser" and "--" in words:
            words = words[words.index("--") + 1:]
        elif name == "sudo":
            words = words[1:]
            while words and words[0].startswith("-"):
                words = words[2:] if words[0] in ("-u", "-g") else words[1:]
        elif name == "env":
            words = words[1:]
            if words and words[0] in ("-i", "--ignore-environment"):
                env, words = {}, words[1:]
            while words and ASSIGNMENT.match(words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
        elif name in ("setsid", "nohup"):
            words = words[1:]
        elif name == "timeout" and len(words) > 2:
            words = [w for w in words[1:] if not w.startswith("-")][1:]
        elif name == "salloc" and len(words) > 1:
            found.append((env, [name, *words[1:]]))
            words = words[1:]
            while words and words[0].startswith("-"):
                words = words[1:]
        else:
            break
    if words[:2] in (["bash", "-c"], ["sh", "-c"], ["/bin/sh", "-c"], ["/bin/bash", "-c"]) \
            and len(words) > 2:
        return [*found, (env, ["<line>", words[2]])] + [
            (env | line_env, line_words) for line_env, line_words in _line_commands(words[2])]
    if not words:
        return found
    return [*found, (env, [_program(words[0]), *(_relative(w, cwd) for w in words[1:])])]


def _line_commands(line: str) -> list[tuple[dict, list[str]]]:
    """The simple commands of a shell line (split at ``;``, ``&&``, ``||``, ``|``, newlines),
    each with the ``NAME=value`` in front of it."""
    lexer = shlex.shlex(line.replace("\n", ";"), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    found, words = [], []
    try:
        tokens = list(lexer)
    except ValueError:
        return []
    for token in [*tokens, ";"]:
        if token and set(token) <= set(";&|"):
            env = {}
            while words and ASSIGNMENT.match(words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            if words:
                found.append((env, words))
            words = []
        else:
            words.append(token)
    return found


def readme_typed(text: str) -> tuple[dict, list[str]]:
    (env, words), *_ = _line_commands(text) or [({}, [])]
    return env, words


def _extra_allowed(name: str, script: str | None) -> bool:
    return (name.startswith(HARNESS_ENV) or name in HARNESS_NAMES
            or name in SHORTER.get(script, ()) or name in WHERE.get(script, ()))


def same_command(text: str, env: dict, words: list[str]) -> str:
    """"" when (ENV, WORDS) runs the README's TEXT as written, else how it differs."""
    if words[:1] == ["<line>"]:
        return "" if words[1] == text else "another line"
    readme_env, readme_words = readme_typed(text)
    job = job_of(text)
    if job:
        ran = job_of(shlex.join(words))
        if ran is None:
            return "not this job"
        if (ran.script, ran.options, ran.args) != (job.script, job.options, job.args):
            return "other options or arguments"
        script = job.script
    elif words != readme_words:
        return "other words"
    else:
        script = None
    wrong = [k for k, v in readme_env.items() if env.get(k) != v]
    extra = [k for k in env if k not in readme_env and not _extra_allowed(k, script)]
    if wrong or extra:
        return "other variables: " + " ".join(
            [f"{k}={env.get(k)!r} (not {v!r})" for k, v in readme_env.items() if k in wrong]
            + [f"{k}={env[k]}" for k in sorted(extra)])
    return ""


# --------------------------------------------------------------------------- confirming


def proving_test(command: Command) -> str:
    """The test whose run proves COMMAND: its own quick test, or the one the table names."""
    if classify(command)[0] == "quick":
        return f"{QUICK_TEST}[{command.where}-quick]"
    return AS_WRITTEN_BY[command.text]


def _is_run_of(run: Ran, test: str) -> bool:
    return run.test == test or run.test.startswith(f"{test}[")


@dataclass
class Verdict:
    command: Command
    test: str
    confirmed: bool
    why: str  # what ran (confirmed) or why not


def confirm(command: Command, runs: list[Ran]) -> Verdict:
    test = proving_test(command)
    mine = [r for r in runs if _is_run_of(r, test)]
    if not mine:
        return Verdict(command, test, False, f"{test} is not in the records")
    target = MAKE_TARGETS.get(test)
    job = job_of(command.text)
    closest, failed = "", []
    for run in mine:
        for proc in (p for p in run.processes if p.phase == "call"):
            for env, words in typed(proc.argv, proc.given, proc.cwd):
                made = target and words == ["make", target] and job in make_recipe_jobs(target)
                differs = "" if made else same_command(command.text, env, words)
                if differs and not closest and _same_program(command.text, words):
                    shown = " ".join([*(f"{k}={v}" for k, v in sorted(env.items())
                                        if not _extra_allowed(k, None)), *words])  # fmt: skip
                    closest = f"; closest: `{shown}` ({differs})"
                if differs:
                    continue
                if run.passed:
                    end = f", job {proc.job} {proc.state}" if proc.job and proc.state else ""
                    return Verdict(command, test, True, f"{run.test} (exit {proc.status}{end})")
                failed.append(f"{run.test} ran it but did not pass ({_outcome(run)})")
    if failed:
        return Verdict(command, test, False, failed[0])
    passed = any(r.passed for r in mine)
    return Verdict(command, test, False, f"{test} {'passed' if passed else _outcome(mine[0])} "
                   f"but started no such process in its call phase{closest}")


def _same_program(text: str, words: list[str]) -> bool:
    job = job_of(text)
    if job:
        ran = job_of(shlex.join(words))
        return bool(ran) and ran.script == job.script
    readme = readme_typed(text)[1]
    return words[:2] == readme[:2]


def _outcome(run: Ran) -> str:
    return ", ".join(f"{phase} {o}" for phase, o in run.outcomes.items()) or "no outcome"


def run_as_written() -> list[Command]:
    """The README commands that the suite runs as written: quick, job, as written."""
    return [c for c in all_commands() if classify(c)[0] in ("quick", "job", "as written")]


def main(argv: list[str]) -> int:
    if any(a.startswith("-") for a in argv):
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    folders = [Path(a) for a in argv] or [Path(os.environ.get(RECORDS_ENV) or DEFAULT_DIR)]
    missing = [str(f) for f in folders if not f.is_dir()]
    if missing:
        print(f"confirm_readme: no records folder {', '.join(missing)}: run the tests with "
              f"{RECORDS_ENV} set to it (default {DEFAULT_DIR})", file=sys.stderr)
        return 2
    runs = load(folders)
    commands = run_as_written()
    verdicts = [confirm(c, runs) for c in commands]
    quick = [v for v in verdicts if classify(v.command)[0] == "quick"]
    ok = [v for v in verdicts if v.confirmed]
    files = sum(len(list(f.glob("*.jsonl"))) for f in folders)
    print(f"README commands: {len(all_commands())}; {len(commands)} run as written by the suite "
          f"({len(quick)} quick, by make test-readme; {len(commands) - len(quick)} by other tests)")
    print(f"records: {files} files, {sum(len(r.processes) for r in runs)} processes of "
          f"{len(runs)} test runs ({', '.join(map(str, folders))})")
    for v in ok:
        print(f"  confirmed  {v.command.where}: {v.command.text.splitlines()[0]}  <- {v.why}")
    not_ok = [v for v in verdicts if not v.confirmed]
    for v in not_ok:
        print(f"  NOT confirmed  {v.command.where}: {v.command.text.splitlines()[0]}  -- {v.why}")
    print(f"confirmed by a run: {len(ok)} of {len(commands)} ({sum(v.confirmed for v in quick)} "
          f"of {len(quick)} quick, {len(ok) - sum(v.confirmed for v in quick)} of "
          f"{len(commands) - len(quick)} by other tests); not confirmed, counted as not run: "
          f"{len(not_ok)}")
    return 1 if not_ok else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
