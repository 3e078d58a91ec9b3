"""Small helpers shared by the lesson tests (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Variables through which a launcher tells a process its place; the suite itself may run
# inside a SLURM job or a torchrun worker, and must not pass those on to the worlds it starts.
_LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "RANK", "LOCAL_", "WORLD_SIZE", "GROUP_", "MASTER_")


def clean_environ(**extra: str) -> dict[str, str]:
    """This environment without launcher variables, with the course on PYTHONPATH."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    pythonpath = str(ROOT)
    if os.environ.get("COURSE_TEST_EXITFAST", "1") == "1":  # see tests/exitfast, tests/README.md
        pythonpath = f"{ROOT / 'tests' / 'exitfast'}{os.pathsep}{pythonpath}"
    environ.update({"PYTHONPATH": pythonpath, "COURSE_DIST_TIMEOUT": "30", "OMP_NUM_THREADS": "1"})
    # Shell scripts under test call `python`/`torchrun`: the ones of this interpreter's venv.
    environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environ.get('PATH', '')}"
    environ.update(extra)
    return environ


def start_ranks(nprocs: int, args: list[str], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                **extra: str) -> list[subprocess.Popen]:
    """Start NPROCS copies of ARGS as the ranks of one world on this machine, the way srun
    starts a step's tasks: one process per rank and no launcher process in between (which
    would cost one more torch import). Each learns its place from RANK, WORLD_SIZE, ..."""
    from common.env import find_free_port

    world = {"WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs),
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}  # fmt: skip
    return [
        subprocess.Popen(args, cwd=ROOT, stdout=stdout, stderr=stderr, text=True,
                         env=clean_environ(RANK=str(r), LOCAL_RANK=str(r), **world, **extra))
        for r in range(nprocs)
    ]  # fmt: skip


def kill_once_written(ranks, path: Path, log: Path, timeout: float) -> None:
    """Wait until PATH exists, every rank still running, then SIGKILL the ranks: a job killed
    with no goodbye right after it wrote its checkpoint. Fails with the ranks' LOG otherwise."""
    try:
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert all(r.poll() is None for r in ranks), log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
    finally:
        for r in ranks:
            r.kill()
            r.wait(timeout=30)


def run_ranks(nprocs: int, args: list[str], timeout: float, **extra: str):
    """start_ranks and wait: the ranks' outputs one after another (rank 0 first) and the first
    non-zero exit status (0 when every rank succeeded), as a CompletedProcess."""
    procs = start_ranks(nprocs, args, **extra)
    outs, errs = [], []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            outs.append(out)
            errs.append(err)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    status = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess(args, status, "".join(outs), "".join(errs))


def _descendants(pids: list[int]) -> list[int]:
    """PIDS and every process below them (a shell's python, srun's task), parents first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses
            pid, rest = stat.read_text().split(" ", 1)
            children.setdefault(int(rest.rsplit(")", 1)[1].split()[1]), []).append(int(pid))
        except (OSError, IndexError, ValueError):
            continue  # a process that ended meanwhile
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop(0)
        if pid not in found:
            found.append(pid)
            todo += sorted(children.get(pid, []))
    return found


def stacks(procs, timeout: float = 60) -> str:
    """Where the processes of PROCS (Popen objects) that still run, and those they started,
    are: py-spy's dump of each one's Python threads, under its pid, state (/proc: S sleeping,
    R running, T stopped, ...) and command line; with --native (the C++/Rust frames below them)
    where py-spy can unwind them, else --nonblocking (without pausing it: a stopped process
    too). For a test's failure message before it kills them, so that a hang says where it was.
    Empty when none runs; one line saying why there are no stacks when py-spy is missing
    (requirements.txt installs it, as lesson 06 uses it) or cannot read a process."""
    return pid_stacks(_descendants([p.pid for p in procs if p.poll() is None]), timeout)


def pid_stacks(pids: list[int], timeout: float = 60) -> str:
    """stacks() of the processes PIDS (those of a job's steps, found by their command line)."""
    if not pids:
        return ""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if not spy:
        return (f"(no stacks of the processes still running, {pids}: py-spy is not installed; "
                f"pip install -r requirements.txt)")  # fmt: skip
    out = []
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # ended meanwhile
        text = ""
        for native in (["--native"], ["--nonblocking"]):
            try:
                dump = subprocess.run([spy, "dump", *native, "--pid", str(pid)],
                                      capture_output=True, text=True, timeout=timeout)  # fmt: skip
            except subprocess.TimeoutExpired:
                text = f"py-spy dump {' '.join(native)} did not answer within {timeout} s\n"
                continue
            if dump.returncode == 0:
                text = dump.stdout
                break
            first = (dump.stderr or dump.stdout).strip().splitlines()[:1]  # not Python, say
            text = f"py-spy: {first[0] if first else f'exit {dump.returncode}'}\n"
        out.append(f"--- pid {pid} (state {state}): {command.strip()}\n{text}")
    return "\n".join(out)


def run_or_dump(args: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(ARGS, capture_output=True, text=True, timeout=TIMEOUT, **KWARGS), except
    that a process still running after TIMEOUT fails the test with the stacks of it and of the
    processes it started (a shell script's python: stacks()), and all of them are killed (run()
    would kill the first only, and then wait for the pipes its children hold)."""
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          **kwargs) as proc:  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            where = stacks([proc])
            for pid in reversed(_descendants([proc.pid])):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"{args} still ran after {timeout} s; where it and the processes it "
                        f"started were:\n{where}\n--- its output:\n{out}{err}")  # fmt: skip
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def sample_output(lesson: Path, job_name: str) -> Path:
    """The one stored sample output ``<job_name>-<jobid>.out`` of a lesson."""
    samples = [p for p in lesson.glob(f"{job_name}-*.out")
               if re.fullmatch(rf"{re.escape(job_name)}-\d+\.out", p.name)]
    assert len(samples) == 1, f"expected one sample output {job_name}-<jobid>.out in {lesson}"
    return samples[0]


def tidy(result) -> None:
    """Remove a passing job's output file when the job wrote it into the course root."""
    path = Path(result.output_path)
    if path.parent.resolve() == ROOT:
        path.unlink(missing_ok=True)


def check_sampler_order(folder: Path, world_size: int, images: int, epochs: int) -> None:
    """What a training's ``--log-order FOLDER`` wrote (lessons 03 and 05: a line an epoch per
    rank, the epoch then the image indices): in every epoch the ranks' shares together hold
    every image, none on two ranks but the few DistributedSampler repeats so that the shares
    are equal, and every epoch each rank gets other images than in the epoch before."""
    order = {}
    for rank in range(world_size):
        for line in (folder / f"rank{rank}.txt").read_text().splitlines():
            epoch, *indices = map(int, line.split())
            order[rank, epoch] = indices
    assert sorted(order) == [(r, e) for r in range(world_size) for e in range(1, epochs + 1)], (
        f"lines (rank, epoch) {sorted(order)}")  # fmt: skip
    share = -(-images // world_size)  # ceil: the last share is padded with repeats
    for epoch in range(1, epochs + 1):
        shares = [order[rank, epoch] for rank in range(world_size)]
        assert [len(s) for s in shares] == [share] * world_size, f"epoch {epoch}: share sizes"
        assert set().union(*shares) == set(range(images)), f"epoch {epoch}: images left out"
        for a in range(world_size):
            for b in range(a + 1, world_size):
                both = set(shares[a]) & set(shares[b])
                assert len(both) <= share * world_size - images, (
                    f"epoch {epoch}: ranks {a} and {b} both train on {len(both)} images")
        if epoch > 1:
            for rank in range(world_size):
                assert set(order[rank, epoch]) != set(order[rank, epoch - 1]), (
                    f"rank {rank} trains on the same images in epochs {epoch - 1} and {epoch}: "
                    "not reshuffled")  # fmt: skip


def require_torchft() -> None:
    """At a lesson 11 test module's top: skip where requirements.txt installs no torchft (its
    marker: wheels for Linux x86_64, CPython 3.10-3.13 only), and fail, with the reason, where it
    does and the import breaks (a skip there would hide a broken install)."""
    from packaging.requirements import Requirement

    lines = (Path(__file__).resolve().parent.parent / "requirements.txt").read_text().splitlines()
    (line,) = [x for x in lines if x.startswith("torchft")]
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate():
        pytest.skip(f"requirements.txt installs no torchft here ({req.marker}): torchft 0.2.0 has "
                    "wheels for CPython 3.10-3.13 on Linux x86_64 only",
                    allow_module_level=True)  # fmt: skip
    try:
        import torchft  # noqa: F401
    except Exception as exc:  # noqa: BLE001  # any import failure is the message
        pytest.fail(f"requirements.txt installs torchft on this platform ({req}), and "
                    f"`import torchft` fails: {type(exc).__name__}: {exc}. Run make venv again",
                    pytrace=False)  # fmt: skip
