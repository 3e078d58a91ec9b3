"""What a test run started, as it ran: the evidence that a README's command was run as written.

tests/conftest.py calls ``install()`` once per pytest process (pytest's own and each xdist
worker) and ``outcome()`` for each phase's report. From then on every process that a test starts
through ``subprocess`` (``run``, ``Popen``, ``check_output``: sbatch, srun, salloc, make, python,
torchrun, ``runuser ... sbatch``) is recorded by ``subprocess.Popen`` itself, and the real
process still runs: nothing is replaced. A line of JSON per event, appended to a file of this
process's own under ``COURSE_RECORDS_DIR`` (default ``runs/records`` in the course root; CI
gives each cluster's lanes theirs, as it does the lock logs):

* ``start``: ``n`` (this file's count), ``test`` (pytest's id, an xdist group's ``@name``
  dropped), ``phase`` (setup, call or teardown), ``argv``, ``cwd``, ``set`` (the variables the
  process gets that differ from this pytest's environment when the session began: what the
  test set, ``NAME=value`` in front of a command), ``unset`` (the names it took away), ``which``
  (``[word, path]`` for each word of argv, and of a ``sh -c``/``bash -c`` script, that names an
  executable: ``shutil.which`` on the PATH in effect there when the process started, a
  ``PATH=...`` before it included; a word with a ``/``, the file it names), ``on_path`` (the
  same for the commands a make recipe or script of the course runs, ON_PATH, on the process's own
  PATH) and ``clients`` (those paths that are the course's own Slurm clients of another version,
  cluster/lib.sh's CLIENT_MARK in them);
* ``end``: ``n``, ``status`` (the exit status as Popen gives it);
* ``job_id``: ``n``, ``job`` (what an ``sbatch`` printed: ``--parsable``'s id or "Submitted
  batch job N");
* ``job``: ``job``, ``state``, ``status`` (how a job the test waited for ended:
  ``common.jobwait.wait``, which every job wait of the suite goes through);
* ``outcome``: ``test``, ``phase``, ``outcome`` (passed, failed, skipped).

tests/confirm_readme.py reads them. Processes started outside a test (collection, xdist's own)
are not recorded.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORDS_ENV = "COURSE_RECORDS_DIR"
DEFAULT_DIR = ROOT / "runs" / "records"
_IGNORED_ENV = ("PYTEST_",)  # pytest's own per-test variables

_lock = threading.Lock()
_state: dict = {"file": None, "n": 0, "base": None}


def records_dir() -> Path:
    return Path(os.environ.get(RECORDS_ENV) or DEFAULT_DIR)


def current_test() -> tuple[str, str] | None:
    """(test id, phase) of the test this process runs now, from PYTEST_CURRENT_TEST."""
    current = os.environ.get("PYTEST_CURRENT_TEST")
    if not current or not current.endswith(")"):
        return None
    nodeid, _, phase = current[:-1].rpartition(" (")
    return test_id(nodeid), phase


def test_id(nodeid: str) -> str:
    """pytest's id without the ``@group`` that xdist's loadgroup adds."""
    return re.sub(r"@[^\[\]/]*$", "", nodeid)


def write(event: str, **fields) -> None:
    line = json.dumps({"event": event, **fields}, default=str) + "\n"
    with _lock:
        if _state["file"] is None:
            folder = records_dir()
            name = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}.jsonl"
            try:
                folder.mkdir(parents=True, exist_ok=True)
                _state["file"] = open(folder / name, "a", buffering=1)  # noqa: SIM115
            except OSError as err:  # the tests run on; nothing of theirs is confirmed
                _state["file"] = False
                print(f"records: cannot write in {folder} ({err.strerror}): set {RECORDS_ENV} "
                      "to a writable folder to record this run", file=sys.stderr)
        if _state["file"]:
            _state["file"].write(line)


def _text(value) -> str:
    return os.fsdecode(value) if isinstance(value, (bytes, os.PathLike)) else str(value)


def _argv(args, shell: bool) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        return ["/bin/sh", "-c", _text(args)] if shell else [_text(args)]
    argv = [_text(a) for a in args]
    return ["/bin/sh", "-c", *argv] if shell else argv


def _environment(env) -> tuple[dict[str, str], list[str]]:
    """(set, unset) of ENV (None: this process's own) against the session's first environment."""
    base = _state["base"] or {}
    now = {_text(k): _text(v) for k, v in (os.environ if env is None else env).items()}
    changed = {k: v for k, v in now.items()
               if base.get(k) != v and not k.startswith(_IGNORED_ENV)}  # fmt: skip
    return changed, sorted(k for k in base if k not in now and not k.startswith(_IGNORED_ENV))


_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(.*)$", re.S)
_SHELLS = ("sh", "bash", "dash")
# cluster/lib.sh: the first lines of a client command that up.sh writes for another Slurm version.
CLIENT_DIR, CLIENT_MARK = "/usr/local/bin", "# course-cluster: Slurm client"
ON_PATH = ("sbatch", "srun", "salloc", "python", "python3", "torchrun")


def _executables(words: list[str], path: str, cwd: str, found: list) -> None:
    """Append [word, path] for each of WORDS that names an executable, as a shell would find it
    now: a ``PATH=...`` among them changes the PATH for what follows; the script of ``sh -c``
    (or bash) is read the same way, its words split as the shell would."""
    for i, word in enumerate(words):
        assigned = _ASSIGNMENT.match(word)
        if assigned:
            path = assigned[2] if assigned[1] == "PATH" else path
            continue
        if i >= 2 and words[i - 1] == "-c" and os.path.basename(words[i - 2]) in _SHELLS:
            lexer = shlex.shlex(word, posix=True, punctuation_chars=";&|()")
            lexer.whitespace_split = True
            try:
                _executables(list(lexer), path, cwd, found)
            except ValueError:  # unbalanced quotes: the shell refuses it too
                pass
            continue
        if not word or word.startswith("-"):
            continue
        if "/" in word:
            where = os.path.join(cwd, word)
            where = where if os.path.isfile(where) and os.access(where, os.X_OK) else None
        else:
            where = shutil.which(word, path=path)
            where = os.path.join(cwd, where) if where else None
        if where and [word, os.path.normpath(where)] not in found:
            found.append([word, os.path.normpath(where)])


def _is_client(path: str) -> bool:
    if os.path.dirname(path) != CLIENT_DIR:
        return False
    try:
        with open(path, "rb") as f:
            return CLIENT_MARK.encode() in f.read(200)
    except OSError:
        return False


_SIGNATURE = inspect.signature(subprocess.Popen.__init__)
_JOB_ID = re.compile(r"(?m)^(?:Submitted batch job )?(\d+)(?:;\S*)?\s*$")


def _wrap_popen() -> None:
    original_init = subprocess.Popen.__init__
    original_wait, original_poll = subprocess.Popen.wait, subprocess.Popen.poll
    original_communicate = subprocess.Popen.communicate

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        test = current_test()
        if test is None:
            return
        try:
            bound = _SIGNATURE.bind(self, *args, **kwargs).arguments
            argv = _argv(bound["args"], bool(bound.get("shell")))
            cwd = _text(bound["cwd"]) if bound.get("cwd") is not None else os.getcwd()
            changed, unset = _environment(bound.get("env"))
            env = bound.get("env")
            path = _text((os.environ if env is None else env).get("PATH", os.defpath))
            which: list = []
            if bound.get("executable") is not None:  # Popen's executable= runs instead of argv[0]
                exe = _text(bound["executable"])
                exe = shutil.which(exe, path=path) if "/" not in exe else exe
                which.append([argv[0], os.path.normpath(os.path.join(cwd, exe or ""))])
            _executables(argv, path, os.path.abspath(cwd), which)
            on_path: list = []
            _executables(list(ON_PATH), path, os.path.abspath(cwd), on_path)
            clients = sorted({p for _, p in which + on_path if _is_client(p)})
        except (TypeError, ValueError, OSError):  # unrecorded: then unconfirmed, never a failure
            return
        with _lock:
            _state["n"] += 1
            self._course_record = _state["n"]
        write("start", n=self._course_record, test=test[0], phase=test[1], argv=argv,
              cwd=os.path.abspath(cwd), set=changed, unset=unset, which=which, on_path=on_path,
              clients=clients, pid=self.pid, time=time.time())

    def _ended(self) -> None:
        n = getattr(self, "_course_record", None)
        if n and self.returncode is not None and not getattr(self, "_course_ended", False):
            self._course_ended = True
            write("end", n=n, status=self.returncode, time=time.time())

    @functools.wraps(original_wait)
    def wait(self, *args, **kwargs):
        try:
            return original_wait(self, *args, **kwargs)
        finally:
            _ended(self)

    @functools.wraps(original_poll)
    def poll(self):
        try:
            return original_poll(self)
        finally:
            _ended(self)

    @functools.wraps(original_communicate)
    def communicate(self, *args, **kwargs):
        out, err = original_communicate(self, *args, **kwargs)
        n = getattr(self, "_course_record", None)
        if n and out and "sbatch" in {Path(a).name for a in _argv(self.args, False)}:
            found = _JOB_ID.search(_text(out) if not isinstance(out, bytes) else out.decode())
            if found:
                write("job_id", n=n, job=found[1])
        return out, err

    subprocess.Popen.__init__ = __init__
    subprocess.Popen.wait, subprocess.Popen.poll = wait, poll
    subprocess.Popen.communicate = communicate


def _wrap_jobwait() -> None:
    from common import jobwait

    original = jobwait.wait

    @functools.wraps(original)
    def wait(job_id, *args, **kwargs):
        end = original(job_id, *args, **kwargs)
        test = current_test()
        write("job", job=str(job_id), state=end.state, status=end.status,
              test=test[0] if test else None, time=time.time())
        return end

    jobwait.wait = wait


def install() -> None:
    """Record from now on (once per process): the environment now is the one a test's
    variables are measured against."""
    if _state["base"] is not None:
        return
    # A pytest run by a test inherits that test's name: its own start is not that test's.
    os.environ.pop("PYTEST_CURRENT_TEST", None)
    _state["base"] = dict(os.environ)
    _wrap_popen()
    _wrap_jobwait()


def outcome(report) -> None:
    """A phase's report (pytest_runtest_makereport): how the test ended."""
    write("outcome", test=test_id(report.nodeid), phase=report.when, outcome=report.outcome,
          time=time.time())
