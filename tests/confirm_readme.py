"""Which README commands a run proved: ``python tests/confirm_readme.py [RECORDS_DIR ...]``.

The READMEs' commands that the suite runs as written (tests/readme_tables.py: the quick ones,
which ``make test-readme`` runs, those another test runs or submits, and those NOT_RUN says a
test runs with what it needs) count as run only when the records of a run (tests/records.py;
default folder ``runs/records``, ``COURSE_RECORDS_DIR``) show it: a process started in the call
phase of the test named for it, with the same command, that ended as the README shows (exit
status 0, or QUICK's; a job: sbatch's 0 and the job, waited for by the test, COMPLETED or as
JOB_ENDS says), whose program was the course's own (the venv's python and torchrun, this
machine's sbatch, srun, bash..., or the clients cluster/up.sh writes for another Slurm version),
and that test passed.

The comparison is of the command as typed: ``python`` for any of the venv's interpreters, paths
relative to the course root (or to the course copy the test ran in), ``env``, ``runuser`` and
``sudo`` unwrapped, ``bash -c LINE`` read as LINE when LINE is the command and nothing else,
sbatch's options that only say where the output goes left out (``--chdir`` only into the
course), and of the variables besides the command's own only the harness's (HARNESS_ENV,
HARNESS_NAMES; those that name the course, COURSE_ROOT, COURSE_VENV, COURSE_SITE_FILE and
PYTHONPATH, only when they name it), those the job script's header offers for a shorter run, to
at most their default (SHORTER) and those that only say where its files are (WHERE). In a
command that is not a quick one, ``<jobid>``, ``$name`` and SHOWN_JOB_IDS stand for what the run
gives (an earlier line's job id); ``NAME=$(CMD)`` is CMD. A README
job run through a make target is confirmed by the test's ``make TARGET`` (exit 0: the recipe
exits with the job's status) and the target's recipe.

Prints what it confirmed and what it could not (and why, with the closest process the test
started), counting none of the latter as run; exits 1 when any command was not confirmed. CI
runs it last, on both clusters' records.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: the tests' modules

from readme_commands import Command, all_commands, classify, job_of, make_recipe_jobs  # noqa: E402
from readme_tables import (  # noqa: E402
    AS_WRITTEN_BY,
    HARNESS_ENV,
    HARNESS_NAMES,
    JOB_ENDS,
    MAKE_TARGETS,
    NOT_RUN,
    QUICK,
    SHORTER,
    SHOWN_JOB_IDS,
    WHERE,
)
from records import CLIENT_DIR, DEFAULT_DIR, RECORDS_ENV  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUICK_TEST = "tests/test_readme_commands.py::test_readme_command"
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
# Where this machine's own programs are (bash, make, sbatch...): not a folder a test makes.
SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
SLURM_CLIENTS = frozenset("sacct sacctmgr salloc sattach sbatch sbcast scancel scontrol sdiag "
                          "sinfo sprio squeue sreport srun sshare sstat strigger".split())
# Words a shell runs itself: no file to check.
BUILTINS = frozenset("source . cd echo exit export true false test [ eval exec set unset "
                     "for while if do done then fi case esac read wait".split())
# Variables that name the course (or a file of it): a value elsewhere runs another course.
COURSE_PLACES = ("COURSE_ROOT", "COURSE_VENV", "COURSE_SITE_FILE", "PYTHONPATH")
# In a NOT_RUN command: what a run fills in.
PLACEHOLDER = re.compile("|".join([r"<[^<>]+>", r"\$\{[^}]*\}", r"\$[A-Za-z_][A-Za-z0-9_]*",
                                    *(rf"\b{re.escape(i)}\b" for i in SHOWN_JOB_IDS)]))


@dataclass
class Process:
    test: str
    phase: str
    argv: list[str]
    cwd: str
    given: dict[str, str]  # the variables it got beyond the session's environment
    which: list[list[str]] | None = None  # [word, the file it ran], as found when it started
    on_path: list[list[str]] = field(default_factory=list)  # sbatch, python... on its PATH
    clients: list[str] = field(default_factory=list)  # those that are cluster/up.sh's clients
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
    """Every test run in the record files of FOLDERS (a line cut short at the end is skipped).
    A job's end goes to the latest process that submitted a job of that id and has no end yet
    (ids start again at 1 on a cluster made again)."""
    runs: dict[tuple[str, str], Ran] = {}
    for folder in folders:
        for path in sorted(folder.glob("*.jsonl")):
            started: dict[int, Process] = {}
            submitted: dict[str, list[Process]] = {}
            for line in path.read_text(errors="replace").splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                kind = event.get("event")
                if kind == "start":
                    proc = Process(event["test"], event["phase"], event["argv"], event["cwd"],
                                   event.get("set", {}), event.get("which"),
                                   event.get("on_path", []), event.get("clients", []))
                    started[event["n"]] = proc
                    run = runs.setdefault((str(path), proc.test), Ran(proc.test, str(path)))
                    run.processes.append(proc)
                elif kind == "end" and event["n"] in started:
                    started[event["n"]].status = event["status"]
                elif kind == "job_id" and event["n"] in started:
                    started[event["n"]].job = event["job"]
                    submitted.setdefault(event["job"], []).append(started[event["n"]])
                elif kind == "job":
                    waiting = [p for p in submitted.get(event["job"], []) if p.state is None]
                    if waiting:
                        waiting[-1].state = event["state"]
                elif kind == "outcome":
                    run = runs.setdefault((str(path), event["test"]),
                                          Ran(event["test"], str(path)))  # fmt: skip
                    run.outcomes[event["phase"]] = event["outcome"]
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
    (runuser, env, sudo, setsid, timeout) taken off; ``bash -c LINE`` is ``["<line>", LINE]``,
    and LINE's command too when LINE is one command and nothing else (no ``;``, ``&&``, ``|``...
    around it: its exit status is then the command's); ``salloc OPTIONS CMD`` is itself and CMD
    (a command typed ``# inside a job``)."""
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
        alone = _line_commands(words[2]) if _one_command(words[2]) else []
        return [*found, (env, ["<line>", words[2]])] + [
            (env | line_env, line_words) for line_env, line_words in alone]
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


def _one_command(line: str) -> bool:
    """LINE is one simple command: no operator of the shell's (``;``, ``&``, ``|``, a newline)
    but a ``;`` at its end."""
    lexer = shlex.shlex(line.strip().rstrip(";").replace("\n", ";"), posix=True,
                        punctuation_chars=";&|")  # fmt: skip
    lexer.whitespace_split = True
    try:
        return not any(token and set(token) <= set(";&|") for token in lexer)
    except ValueError:
        return False


def readme_typed(text: str) -> tuple[dict, list[str]]:
    """A README command's variables and words (``sudo`` off: the tests run as root)."""
    (env, words), *_ = _line_commands(text) or [({}, [])]
    if words[:1] == ["sudo"]:
        words = words[1:]
    return env, words


def _extra_allowed(name: str, value: str, script: str | None) -> bool:
    if name in SHORTER.get(script, {}):
        most = SHORTER[script][name]
        return value.isdigit() and int(value) >= 1 and (most is None or int(value) <= most)
    return (name.startswith(HARNESS_ENV) or name in HARNESS_NAMES
            or name in WHERE.get(script, ()))  # fmt: skip


def _courses(cwd: str) -> set[Path]:
    """The course a process ran: this one, or the copy it ran in."""
    return {ROOT.resolve(), Path(cwd).resolve()}


def _elsewhere(name: str, value: str, cwd: str) -> bool:
    """VALUE of a variable that names the course (COURSE_PLACES) names something else: another
    folder as the course, its venv or its site file; a PYTHONPATH folder other than the course
    and tests/exitfast (the suite's one difference, tests/README.md). Empty is unset."""
    courses = _courses(cwd)
    allowed = {
        "COURSE_ROOT": courses,
        "COURSE_VENV": {c / ".venv" for c in courses},
        "COURSE_SITE_FILE": {c / "site.sh" for c in courses},
        "PYTHONPATH": courses | {c / "tests" / "exitfast" for c in courses},
    }[name]
    parts = value.split(os.pathsep) if name == "PYTHONPATH" else [value]
    return any(p and (Path(cwd) / p).resolve() not in allowed for p in parts)


def _pattern(word: str, placeholders: bool) -> re.Pattern:
    """WORD as a regular expression: itself, or with its placeholders standing for any text."""
    if not placeholders:
        return re.compile(re.escape(word))
    parts = PLACEHOLDER.split(word)
    return re.compile(r"\S+?".join(re.escape(p) for p in parts) if len(parts) > 1
                      else re.escape(word))  # fmt: skip


def _same_words(readme: list[str] | tuple, ran: list[str] | tuple, placeholders: bool,
                any_order: bool = False) -> bool:
    if len(readme) != len(ran):
        return False
    if not any_order:
        return all(_pattern(r, placeholders).fullmatch(w) for r, w in zip(readme, ran, strict=True))
    left = list(ran)
    for r in readme:
        match = next((w for w in left if _pattern(r, placeholders).fullmatch(w)), None)
        if match is None:
            return False
        left.remove(match)
    return True


def command_text(text: str) -> str:
    """The command of a README line: CMD of ``NAME=$(CMD)`` (a job id kept for the next line)."""
    assigned = re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\$\((.*)\)", text, re.S)
    return assigned[1] if assigned else text


def same_command(text: str, env: dict, words: list[str], cwd: str = str(ROOT),
                 placeholders: bool = False) -> str:
    """"" when (ENV, WORDS), run in CWD, runs the README's TEXT as written, else how it differs.
    PLACEHOLDERS: TEXT's <jobid>, $name and SHOWN_JOB_IDS stand for any word (but in a quick
    one)."""
    text = command_text(text)
    readme_env, readme_words = readme_typed(text)
    job = job_of(text)
    if words[:1] == ["<line>"]:  # the line's own variables are in it
        if not _pattern(text, placeholders).fullmatch(words[1]):
            return "another line"
        readme_env, script = {}, None
    elif job:
        ran = job_of(shlex.join(words))
        if ran is None:
            return "not this job"
        if ran.script != job.script or not _same_words(job.options, ran.options, placeholders,
                                                       any_order=True) \
                or not _same_words(job.args, ran.args, placeholders):  # fmt: skip
            return "other options or arguments"
        chdir = [w.partition("=")[2] for w in words if w.startswith("--chdir=")]
        if any((Path(cwd) / d).resolve() not in _courses(cwd) for d in chdir):
            return f"--chdir={chdir[-1]}: elsewhere than the course"
        script = job.script
    elif not _same_words(readme_words, words, placeholders):
        return "other words"
    else:
        script = None
    wrong = [k for k, v in readme_env.items()
             if not (k in env and _pattern(v, placeholders).fullmatch(env[k]))]  # fmt: skip
    extra = [k for k in env if k not in readme_env and not _extra_allowed(k, env[k], script)]
    away = [k for k in COURSE_PLACES if k in env and _elsewhere(k, env[k], cwd)]
    if wrong or extra or away:
        return "other variables: " + " ".join(
            [f"{k}={env.get(k)!r} (not {v!r})" for k, v in readme_env.items() if k in wrong]
            + [f"{k}={env[k]}" for k in sorted(extra)]
            + [f"{k}={env[k]} (elsewhere than the course)" for k in away])
    return ""


# --------------------------------------------------------------------------- confirming


def proving_tests(command: Command) -> list[str]:
    """The tests whose run proves COMMAND: its own quick test, the one AS_WRITTEN_BY names, or
    those NOT_RUN names."""
    kind = classify(command)[0]
    if kind == "quick":
        return [f"{QUICK_TEST}[{command.where}-quick]"]
    if kind == "not run":
        return NOT_RUN[command.text][2].split()
    return [AS_WRITTEN_BY[command.text]]


def _is_run_of(run: Ran, test: str) -> bool:
    # Under --dist loadgroup pytest-xdist ends each id with "@<its group>" (tests/lanes.py).
    name = run.test[:run.test.rfind("@")] if run.test.rfind("@") > run.test.rfind("]") else run.test
    return name == test or name.startswith(f"{test}[")


@dataclass
class Verdict:
    command: Command
    test: str
    confirmed: bool
    why: str  # what ran (confirmed) or why not


def confirm(command: Command, runs: list[Ran]) -> Verdict:
    tests = proving_tests(command)
    test = " ".join(tests)
    mine = [r for r in runs if any(_is_run_of(r, t) for t in tests)]
    if not mine:
        return Verdict(command, test, False, f"{test} is not in the records")
    # A quick command runs as its text (the shell fills in its $names); in another, <jobid> and
    # $name stand for what an earlier line gave (``lh=$(sbatch --parsable ...)``, then ``$lh``).
    placeholders = classify(command)[0] != "quick"
    target = next((MAKE_TARGETS[t] for t in tests if t in MAKE_TARGETS), None)
    job = job_of(command.text)
    closest, failed = "", []
    for run in mine:
        for proc in (p for p in run.processes if p.phase == "call"):
            for env, words in typed(proc.argv, proc.given, proc.cwd):
                made = bool(target) and words == ["make", target] and job in make_recipe_jobs(
                    target)  # fmt: skip
                differs = "" if made else same_command(command.text, env, words, proc.cwd,
                                                       placeholders)  # fmt: skip
                if differs and not closest and _same_program(command.text, words):
                    shown = " ".join([*(f"{k}={v}" for k, v in sorted(env.items())
                                        if not _extra_allowed(k, v, None)), *words])  # fmt: skip
                    closest = f"; closest: `{shown}` ({differs})"
                if differs:
                    continue
                unproved = _unproved(command, proc, words, made)
                if unproved:
                    failed.append(f"{run.test} ran it, but {unproved}")
                elif run.passed:
                    end = f", job {proc.job} {proc.state}" if proc.job and proc.state else ""
                    return Verdict(command, test, True, f"{run.test} (exit {proc.status}{end})")
                else:
                    failed.append(f"{run.test} ran it but did not pass ({_outcome(run)})")
    if failed:
        return Verdict(command, test, False, failed[0])
    passed = any(r.passed for r in mine)
    return Verdict(command, test, False, f"{test} {'passed' if passed else _outcome(mine[0])} "
                   f"but started no such process in its call phase{closest}")


def _unproved(command: Command, proc: Process, words: list[str], made: bool) -> str:
    """Why PROC's run of COMMAND (WORDS, as typed) proves nothing, or "": it did not end as the
    README shows, or its program was not the course's own."""
    text = command_text(command.text)
    expected = QUICK.get(command.text, 0)
    if proc.status is None:
        return "its exit status is not in the records"
    if proc.status != expected:
        return f"it exited {proc.status}, not {expected}"
    if job_of(text) and not made:
        end = JOB_ENDS.get(command.text, "COMPLETED")
        if proc.job is None:
            return "sbatch's job id is not in the records"
        if proc.state is None:
            return f"job {proc.job}'s end is not in the records (the test did not wait for it)"
        if proc.state != end:
            return f"job {proc.job} ended {proc.state}, not {end}"
    if proc.which is None:
        return "which executables it ran is not in the records"
    programs = [proc.argv[0]]
    if words[:1] == ["<line>"]:
        programs += [w[0] for _, w in _line_commands(words[1])]
    else:
        programs.append(words[0])
    found_on = proc.which + (proc.on_path if made else [])  # the recipe's sbatch: on make's PATH
    for name in {_program(p) for p in programs + (["sbatch"] if made else [])}:
        found = [path for word, path in found_on if _program(word) == name]
        if not found and Path(name).name not in BUILTINS:
            return f"no {name} on its PATH"
        wrong = [path for path in found if not _real(name, path, proc)]
        if wrong:
            return f"its {name} was {wrong[0]}, not the course's own"
    return ""


def _real(name: str, path: str, proc: Process) -> bool:
    """PATH, found for NAME by a process of PROC's, is the course's own: the venv's for what
    the venv has (python, torchrun...; the venv of the course copy it ran in too), else this
    machine's (its realpath on SYSTEM_PATH's), or for a Slurm client the one cluster/up.sh
    wrote for another version (records.py saw its mark)."""
    base = Path(name).name
    venvs = {(c / ".venv" / "bin").resolve() for c in (ROOT, Path(proc.cwd))}
    if PYTHON.fullmatch(base) or (ROOT / ".venv" / "bin" / base).exists():
        return Path(path).parent.resolve() in venvs
    if base in SLURM_CLIENTS and path == f"{CLIENT_DIR}/{base}" and path in proc.clients:
        return True
    machine = shutil.which(base, path=SYSTEM_PATH)
    return bool(machine) and os.path.realpath(path) == os.path.realpath(machine)


def _same_program(text: str, words: list[str]) -> bool:
    text = command_text(text)
    job = job_of(text)
    if job:
        ran = job_of(shlex.join(words))
        return bool(ran) and ran.script == job.script
    readme = readme_typed(text)[1]
    return words[:2] == readme[:2]


def _outcome(run: Ran) -> str:
    return ", ".join(f"{phase} {o}" for phase, o in run.outcomes.items()) or "no outcome"


def run_as_written() -> list[Command]:
    """The README commands that the suite runs as written: quick, job, as written, and those
    not run here that NOT_RUN says a test runs with what it needs."""
    return [c for c in all_commands() if classify(c)[0] in ("quick", "job", "as written")
            or (classify(c)[0] == "not run" and NOT_RUN[c.text][2])]  # fmt: skip


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
    kinds = {"quick": "quick, by make test-readme", "other": "by other tests, as written",
             "not run": "not run here, run by other tests with what they need"}

    def kind(v: Verdict) -> str:
        return classify(v.command)[0] if classify(v.command)[0] in kinds else "other"

    files = sum(len(list(f.glob("*.jsonl"))) for f in folders)
    counts = ", ".join(f"{sum(kind(v) == k for v in verdicts)} {what}" for k, what in kinds.items())
    print(f"README commands: {len(all_commands())}; {len(commands)} that the suite runs "
          f"({counts})")
    print(f"records: {files} files, {sum(len(r.processes) for r in runs)} processes of "
          f"{len(runs)} test runs ({', '.join(map(str, folders))})")
    ok = [v for v in verdicts if v.confirmed]
    for v in ok:
        print(f"  confirmed  {v.command.where}: {v.command.text.splitlines()[0]}  <- {v.why}")
    not_ok = [v for v in verdicts if not v.confirmed]
    for v in not_ok:
        print(f"  NOT confirmed  {v.command.where}: {v.command.text.splitlines()[0]}  -- {v.why}")
    shares = ", ".join(f"{sum(v.confirmed for v in verdicts if kind(v) == k)} of "
                       f"{sum(kind(v) == k for v in verdicts)} {k}" for k in kinds)  # fmt: skip
    print(f"confirmed by a run: {len(ok)} of {len(commands)} ({shares}); not confirmed, counted "
          f"as not run: {len(not_ok)}")
    return 1 if not_ok else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
