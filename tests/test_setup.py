"""The set-up every lesson script does itself, and what common/ answers for it: who the process
is (env.py); the checks of this machine, the GPU a process drives and GPUs that torch cannot
use, threads per process, the timeout and the one line a rank prints when the group cannot be
joined (launch.py).

The process tests start real gloo groups (plain processes on this machine), set up exactly as
lesson 03's train.py does.
"""

import ast
import datetime
import io
import re
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import launch  # noqa: E402
from common.env import LaunchEnv, LaunchError, find_free_port  # noqa: E402
from tests.helpers import clean_environ  # noqa: E402

# The lessons' set-up, as lesson 03's train.py writes it, at a script's top level (a test below
# compares it with lesson 03's, line by line).
SETUP = """
    import sys, torch, torch.distributed as dist
    from common.env import LaunchError, resolve_launch_env
    from common.launch import (check_cuda_usable, check_launch, cpu_threads, cuda_device_index,
                               dist_timeout, init_error_message)
    env = None
    try:
        env = resolve_launch_env()
        check_launch(env)
        torch.set_num_threads(cpu_threads(env))
        if torch.cuda.is_available():
            device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))
            torch.cuda.set_device(device)
        else:
            check_cuda_usable()
            device = torch.device("cpu")
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=dist_timeout(),
            device_id=device if device.type == "cuda" else None,
        )
    except LaunchError as exc:
        sys.exit(f"error: {exc}")
    except dist.DistError as exc:
        sys.exit(f"error: {init_error_message(env, exc)}")
"""


# --------------------------------------------------------------------------- the copies agree
# Every lesson script that asks common.env who it is repeats lesson 03's set-up on purpose
# (each file stands alone).  The copies are compared line by line as code: comments aside, and
# the one line a rank prints may start with the script's own name instead of "error".  Lesson
# 03's block, in the pieces the variants below are made of:
CHECK = "check_launch(env)"  # this machine: the address, the port, rank 0's node
WHO = ["env = None", "try:", "env = resolve_launch_env()", CHECK]
THREADS = ["torch.set_num_threads(cpu_threads(env))"]
DEVICE = [
    "if torch.cuda.is_available():",
    'device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))',
    "torch.cuda.set_device(device)",
    "else:",
    "check_cuda_usable()",
    'device = torch.device("cpu")',
]
GROUP = [
    "dist.init_process_group(",
    'backend="nccl" if device.type == "cuda" else "gloo",',
    'init_method=f"tcp://{env.master_addr}:{env.master_port}",',
    "rank=env.rank,",
    "world_size=env.world_size,",
    "timeout=dist_timeout(),",
    'device_id=device if device.type == "cuda" else None,',
    ")",
]
LAUNCH_ERROR = ["except LaunchError as exc:",
                'print(f"error: {exc}", file=sys.stderr, flush=True)', "return 2"]  # fmt: skip
GROUP_ERROR = ["except dist.DistError as exc:",
               'print(f"error: {init_error_message(env, exc)}", file=sys.stderr, flush=True)',
               "return 2"]  # fmt: skip
REFERENCE = [*WHO, *THREADS, *DEVICE, *GROUP, *LAUNCH_ERROR, *GROUP_ERROR]
DEVICE_END = len(WHO) + len(THREADS) + len(DEVICE)  # REFERENCE[:DEVICE_END]: up to the group
ANY = "..."  # any lines: the script's own work between two parts of its set-up

# Who am I first, alone; the script's own work; then the rest (as lesson 03 has it).
WHO_FIRST = ["try:", "env = resolve_launch_env()", CHECK, *LAUNCH_ERROR, ANY, "try:"]
# An mp.spawn child: its index makes its rank, and a launch mistake ends the child.
SPAWN = ["try:", "env = resolve_launch_env(spawn_index=index, spawn_nprocs=nprocs)", CHECK,
         *THREADS, *DEVICE, *LAUNCH_ERROR[:2], "raise SystemExit(2) from None", *GROUP]  # fmt: skip

# The copies that differ, and why; every other script has REFERENCE.
VARIANTS = {
    "lessons/01_hello_allreduce/spawn_warmup.py": ("an mp.spawn child", SPAWN),
    "lessons/01_hello_allreduce/hello_allreduce.py": (
        "an mp.spawn child, or an srun task (no index)",
        ["try:", "if index is None:", "env = resolve_launch_env()", "else:", *SPAWN[1:]]),
    "lessons/02_launch_vs_srun/hello.py": (
        "checks --local-rank against LOCAL_RANK before the group",
        [*WHO_FIRST, *REFERENCE[len(WHO):]]),
    "lessons/06_diagnosing_hangs/step.py": (
        "its pid file and its crash come before the group", [*WHO_FIRST, *REFERENCE[len(WHO):]]),
    "lessons/06_diagnosing_hangs/flight.py": (
        "reads the flight recorder's settings first; its shard comes before the group",
        [*WHO_FIRST[:1], "prefix = recorder_settings()", *WHO_FIRST[1:], *REFERENCE[len(WHO):]]),
    "lessons/08_data_pipeline/train.py": (
        "this rank's CPUs are shared between torch's threads and the DataLoader's workers",
        [*WHO, "cpus = process_cpus(env)", *REFERENCE[len(WHO) + 1:]]),
    "lessons/08_data_pipeline/augment_probe.py": (
        "only small Python objects travel: gloo, no device",
        [*WHO, GROUP[0], 'backend="gloo",', *GROUP[2:6], ")", *LAUNCH_ERROR, *GROUP_ERROR]),
    "lessons/03_ddp_mnist/benchmark.py": (
        "measures this machine's CPU: mp.spawn children on gloo",
        ["env = resolve_launch_env(spawn_index=index, spawn_nprocs=nprocs)", CHECK,
         'dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",',
         "rank=env.rank, world_size=env.world_size, timeout=dist_timeout())"]),
    **{f"lessons/09_beyond_data_parallel/{name}": (
        "the shapes are checked before the device; one thread per rank",
        [*WHO_FIRST, *DEVICE[:4], DEVICE[5], *LAUNCH_ERROR, "torch.set_num_threads(1)", ANY,
         *GROUP]) for name in ("tp.py", "pp.py", "compare.py")},
    "lessons/10_fit_and_keep/step.py": (
        "checks its arguments before the group; rank 0 alone says a launch error",
        [*REFERENCE[:DEVICE_END], ANY, *GROUP, LAUNCH_ERROR[0], "if env is None or env.rank == 0:",
         *LAUNCH_ERROR[1:], *GROUP_ERROR]),
    "lessons/10_fit_and_keep/reshard.py": (
        "checks its arguments against the world size before the group",
        [*REFERENCE[:DEVICE_END], ANY, *REFERENCE[DEVICE_END:]]),
    # This file's SETUP, run as a script's top level: sys.exit says the line.
    "lessons/11_torchft/train_ft.py": (
        "a replica group is one process on the CPU and joins no group itself (torchft's Manager"
        " builds one across the groups); torchft's import, the lighthouse and the data are checked"
        " in the same try",
        ["try:", "import_torchft()", "env = resolve_launch_env()", CHECK,
         "if env.world_size != 1:", ANY, *THREADS,
         "lighthouse = lighthouse_address()", 'device = torch.device("cpu")',
         "data = load_data(device, args.train_subset)[:2]",
         "except (LaunchError, MnistDataError) as exc:", *LAUNCH_ERROR[1:]]),
    "lessons/11_torchft/train_ft_fsdp.py": (
        "torchft's import, the lighthouse and the data are checked in the same try, before the "
        "group's own process group",
        ["env = None", "try:", "import_torchft()", "env = resolve_launch_env()", CHECK, ANY,
         *THREADS, "lighthouse = lighthouse_address()", *DEVICE,
         "data = load_data(device, args.train_subset)[:2]", *GROUP,
         "except (LaunchError, MnistDataError) as exc:", *LAUNCH_ERROR[1:], *GROUP_ERROR]),
    "tests/test_setup.py:SETUP": (
        "a script's top level", [*REFERENCE[:-6], "except LaunchError as exc:",
                                 'sys.exit(f"error: {exc}")', "except dist.DistError as exc:",
                                 'sys.exit(f"error: {init_error_message(env, exc)}")']),
}  # fmt: skip
# Where each name of the set-up comes from: who am I; the checks of this machine, the GPU and
# the settings.
SET_UP_NAMES = {
    **dict.fromkeys(("LaunchError", "resolve_launch_env"), "common.env"),
    **dict.fromkeys(("check_launch", "cpu_threads", "process_cpus", "dist_timeout",
                     "init_error_message", "cuda_device_index", "check_cuda_usable"),
                    "common.launch"),
}  # fmt: skip


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)
                   and getattr(n.func, "attr", getattr(n.func, "id", None)) == name),
                  key=lambda n: n.lineno)  # fmt: skip


def _code_lines(text: str) -> dict[int, str]:
    """Line number -> its code, comments and surrounding blanks removed (lines with code only)."""
    cut = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            cut[tok.start[0]] = tok.start[1]
    lines = {}
    for number, line in enumerate(text.splitlines(), 1):
        code = line[: cut.get(number, len(line))].strip()
        if code:
            lines[number] = code
    return lines


def set_up_block(text: str, stem: str) -> list[tuple[int, str]]:
    """The set-up of a script: from the ``try`` (and ``env = None``) around its first
    resolve_launch_env() to its init_process_group() and the handlers of the ``try`` around
    that (a script that joins no group itself: to the end of that first ``try``);
    [(line number, code)]."""
    tree = ast.parse(text)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def enclosing_try(node):
        while node in parents and not isinstance(node, ast.Try):
            node = parents[node]
        return node if isinstance(node, ast.Try) else None

    who = _calls(tree, "resolve_launch_env")[0]
    group = next((c for c in _calls(tree, "init_process_group") if c.lineno > who.lineno), who)
    start, end = who.lineno, group.end_lineno
    if (opening := enclosing_try(who)) is not None:
        start = opening.lineno
        body = getattr(parents[opening], "body", [])
        before = body[body.index(opening) - 1] if opening in body and body.index(opening) else None
        if before is not None and ast.unparse(before) == "env = None":
            start = before.lineno
    if (closing := enclosing_try(group)) is not None:
        end = max(end, closing.end_lineno)
    own_name = re.compile(rf'^(print|sys\.exit)\(f"(?:{re.escape(stem)}(?:\.py)?): ')
    return [(n, own_name.sub(r'\1(f"error: ', code))
            for n, code in _code_lines(text).items() if start <= n <= end]  # fmt: skip


def first_difference(got: list[tuple[int, str]], want: list[str]) -> str:
    """'' when ``got`` is ``want`` line by line (ANY: any lines up to the next wanted one)."""
    i = 0
    for k, line in enumerate(want):
        if line == ANY:
            while i < len(got) and got[i][1] != want[k + 1]:
                i += 1
            continue
        if i == len(got):
            return f"the set-up ends where lesson 03's has {line!r}"
        if got[i][1] != line:
            return f"line {got[i][0]}: {got[i][1]!r} where lesson 03's has {line!r}"
        i += 1
    return f"line {got[i][0]}: {got[i][1]!r} after the set-up's end" if i < len(got) else ""


def set_up_copies():
    """(name, text) of every lesson script that asks common.env who it is (all but one then join
    a group; lesson 11's leaves that to torchft), lesson 03's train.py first, then this file's
    SETUP."""
    found = []
    for path in sorted((ROOT / "lessons").glob("*/*.py")):
        text = path.read_text()
        if _calls(ast.parse(text), "resolve_launch_env"):
            found.append((str(path.relative_to(ROOT)), text))
    found.sort(key=lambda item: item[0] != "lessons/03_ddp_mnist/train.py")
    return [*found, ("tests/test_setup.py:SETUP", textwrap.dedent(SETUP))]


@pytest.mark.parametrize("name,text", set_up_copies(), ids=[n for n, _ in set_up_copies()])
def test_the_set_up_copies_agree_line_by_line(name, text):
    """Each copy of the set-up is lesson 03's, line by line, or one of the VARIANTS (where the
    script differs on purpose, and why); its names come from common/, torch's imported."""
    why, want = VARIANTS.get(name, ("lesson 03's own", REFERENCE))
    stem = Path(name.split(":")[0]).stem
    got = set_up_block(text, stem)
    difference = first_difference(got, want)
    assert not difference, f"{name}, {difference} (allowed here: {why}; tests/test_setup.py)"
    tree = ast.parse(text)
    imported = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                for a in n.names}  # fmt: skip
    used = {w for _, code in got for w in re.findall(r"\w+", code)} & set(SET_UP_NAMES)
    missing = sorted(f"{SET_UP_NAMES[w]}.{w}" for w in used if (SET_UP_NAMES[w], w) not in imported)
    assert not missing, f"{name}: not imported: {missing}"
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {"torch", "torch.distributed"} <= modules, f"{name}: imports {sorted(modules)}"


def test_every_variant_names_a_script_that_exists():
    """A variant left behind by a renamed or rewritten script is no longer an exception."""
    names = {name for name, _ in set_up_copies()}
    assert set(VARIANTS) <= names, sorted(set(VARIANTS) - names)


def run_ranks(code: str, world: int, timeout: float, **extra) -> list[subprocess.CompletedProcess]:
    """Run SETUP + ``code`` as ranks 0..world-1 (plain env:// variables), each bounded."""
    port = str(find_free_port())
    procs = []
    script = textwrap.dedent(SETUP) + textwrap.dedent(code)
    for rank in range(world):
        environ = clean_environ(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=port)  # fmt: skip
        environ.update(extra)
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=environ,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      cwd=ROOT))  # fmt: skip
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            proc.kill()
    return results


# --------------------------------------------------------------------------- timeout


@pytest.mark.parametrize(
    "value,seconds",
    [(None, launch.DEFAULT_TIMEOUT_S), ("5", 5), ("1800", 1800), ("0.5", 0.5)],
)
def test_dist_timeout(value, seconds):
    environ = {} if value is None else {launch.TIMEOUT_VAR: value}
    assert launch.dist_timeout(environ) == datetime.timedelta(seconds=seconds)


@pytest.mark.parametrize("bad", ["soon", "0", "-3", "nan", "inf", ""])
def test_bad_timeout_names_the_variable(bad):
    with pytest.raises(LaunchError, match=f"{launch.TIMEOUT_VAR}=.*positive number of seconds"):
        launch.dist_timeout({launch.TIMEOUT_VAR: bad})


@pytest.mark.timeout(120)
def test_a_late_rank_is_waited_for():
    """Rank 1 reaches the barrier 4 s late (rank 0 saving a checkpoint, say): the barrier
    waits for it, within the timeout."""
    code = """
        import time
        if env.rank == 1:
            time.sleep(4)
        t0 = time.monotonic()
        dist.barrier()
        print(f"waited {time.monotonic() - t0:.1f}")
        dist.destroy_process_group()
    """
    results = run_ranks(code, 2, 45, COURSE_DIST_TIMEOUT="30")
    for r in results:
        assert r.returncode == 0, r.stderr
    assert float(results[0].stdout.split()[-1]) >= 3


@pytest.mark.timeout(120)
def test_a_rendezvous_that_cannot_complete_is_one_line():
    """Rank 1 of 2 alone, rank 0 never comes: it gives up after COURSE_DIST_TIMEOUT with one
    line naming the address and the fix, and no traceback."""
    # run_ranks' 45 s is the hang guard: without the 3 s set here a rank waits 600 s.
    (result,) = run_ranks("", 1, 45, RANK="1", WORLD_SIZE="2", COURSE_DIST_TIMEOUT="3")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rank 1: could not join the process group"), line
    assert "MASTER_ADDR=127.0.0.1" in line and "COURSE_DIST_TIMEOUT" in line, line


def test_duplicate_gpu_from_nccl_is_said_plainly():
    env = LaunchEnv(1, 1, 2, 2, 0, 1, "n1", 29500, "slurm", "n1", "7")
    exc = RuntimeError("NCCL error: invalid usage, NCCL version 2.21.5\nDuplicate GPU detected :"
                       " rank 1 and rank 0 both on CUDA device 1000")  # fmt: skip
    message = launch.init_error_message(env, exc)
    assert message.startswith("rank 1: two ranks drive one GPU") and "\n" not in message
    assert "--gpus-per-task=1" in message


# --------------------------------------------------------------------------- every lesson


def lesson_scripts_that_join_a_group():
    for path in sorted((ROOT / "lessons").glob("*/*.py")):
        text = path.read_text()
        if "init_process_group(" in text:
            yield path.relative_to(ROOT), text


@pytest.mark.parametrize("path,text", list(lesson_scripts_that_join_a_group()),
                         ids=lambda v: str(v) if isinstance(v, Path) else "")  # fmt: skip
def test_every_lesson_script_shows_its_own_set_up(path, text):
    """A lesson script calls torch.distributed itself, with a timeout, with device_id on GPUs
    (benchmark.py measures this machine's CPU and joins gloo only), and leaves the group."""
    assert "common.dist" not in text and "init_distributed" not in text, path
    assert "timeout=" in text and "destroy_process_group()" in text, path
    if "nccl" in text:
        assert "torch.cuda.set_device(device)" in text, path
        assert "device_id=device if device.type == \"cuda\" else None" in text, path
