"""common.env against what real clusters hand it: other Slurm versions, containers without
python-hostlist, malformed numbers and host lists, GPU counts, loopback master addresses.

Each case is an environment as Slurm or torchrun writes it; the checks against this machine
(name resolution) use real sockets, and the container case runs a real interpreter that
cannot import python-hostlist.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import hostlist
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.env import (  # noqa: E402
    LaunchError,
    expand_hostlist,
    parse_tasks_per_node,
    resolve_launch_env,
)
from common.env import _expand_hostlist as _expand_builtin  # noqa: E402
from common.env_cli import GPU_DRIVER_FILES, _cuda_device_count, export_values  # noqa: E402
from common.launch import (  # noqa: E402
    check_cuda_usable,
    check_launch,  # noqa: E402
    cuda_device_index,
)
from tests.test_env_resolution import BATCH_SCRIPT, slurm_step, torchrun_worker  # noqa: E402

# A documentation address (RFC 5737): resolves without DNS, is never contacted here.
REMOTE = "192.0.2.1"


def resolve(environ, check=False, **kwargs):
    """resolve_launch_env, then (``check``) check_launch, as a lesson's set-up calls them."""
    kwargs.setdefault("argv", ["train.py"])
    env = resolve_launch_env(environ, **kwargs)
    if check:
        check_launch(env, environ)
    return env


# --------------------------------------------------------------------------- batch step vs task

# The batch script's step id as newer Slurm exports it (slurm.h: SLURM_BATCH_SCRIPT 0xfffffffb),
# and salloc's interactive step (SLURM_INTERACTIVE_STEP 0xfffffffa). Slurm 22.05 exports none.
BATCH_STEP_ID = str(0xFFFFFFFB)
INTERACTIVE_STEP_ID = str(0xFFFFFFFA)

BATCH_CASES = [
    ("slurm-22.05-batch", BATCH_SCRIPT),
    (
        "newer-batch-sentinel",
        {**BATCH_SCRIPT, "SLURM_STEP_ID": BATCH_STEP_ID, "SLURM_STEPID": BATCH_STEP_ID},
    ),  # fmt: skip
    ("interactive-step", {**BATCH_SCRIPT, "SLURM_STEP_ID": INTERACTIVE_STEP_ID}),
    ("signed-sentinel", {**BATCH_SCRIPT, "SLURM_STEP_ID": "-5"}),
]


@pytest.mark.parametrize("environ", [c[1] for c in BATCH_CASES], ids=[c[0] for c in BATCH_CASES])
def test_the_batch_script_is_one_process(environ):
    env = resolve(environ)
    assert (env.launcher, env.rank, env.world_size) == ("single", 0, 1)
    # --export in a job script serves the whole job and is no "double spawn"
    exports = export_values(env, {**environ, "SLURM_GPUS_ON_NODE": "2"})
    assert (exports["NNODES"], exports["NODE_RANK"], exports["NPROC_PER_NODE"]) == (2, 0, 2)


def test_an_srun_task_is_a_task_with_or_without_a_step_id():
    step = slurm_step(3, 1, 1, 4, "node[1-2]", "2(x2)")
    assert resolve(step).launcher == "slurm"
    no_id = {k: v for k, v in step.items() if k != "SLURM_STEP_ID"}
    assert resolve(no_id).launcher == "slurm"  # the step description alone
    assert resolve({**step, "SLURM_STEP_ID": "12"}).rank == 3


# --------------------------------------------------------------------------- numbers

BAD_NUMBERS = [
    ("SLURM_PROCID", "1_0"),
    ("SLURM_PROCID", "+3"),
    ("SLURM_PROCID", "\u0663"),  # ARABIC-INDIC DIGIT THREE: int() would take it
    ("SLURM_PROCID", "\uff13"),  # FULLWIDTH DIGIT THREE
    ("SLURM_LOCALID", "-1"),
    ("SLURM_JOB_ID", "-7"),
    ("SLURM_JOB_ID", "0"),
    ("SLURM_STEP_NUM_TASKS", "0"),
    ("SLURM_GPUS_ON_NODE", "-2"),
]


@pytest.mark.parametrize("name,value", BAD_NUMBERS, ids=[f"{n}={v!r}" for n, v in BAD_NUMBERS])
def test_malformed_numbers_name_the_variable(name, value):
    environ = {**slurm_step(1, 1, 0, 2, "node1", "2"), name: value}
    with pytest.raises(LaunchError, match=name):
        resolve(environ)


BAD_TORCHRUN = [("RANK", " -1"), ("WORLD_SIZE", "2.0"), ("LOCAL_WORLD_SIZE", "0"),
                ("GROUP_WORLD_SIZE", "-3")]  # fmt: skip


@pytest.mark.parametrize("name,value", BAD_TORCHRUN)
def test_malformed_torchrun_numbers(name, value):
    with pytest.raises(LaunchError, match=name):
        resolve({**torchrun_worker(0, 0, 2, 2, 0, 1), name: value})


@pytest.mark.parametrize("name", ["SLURM_JOB_NUM_NODES", "SLURM_NNODES"])
def test_negative_node_count_in_the_batch_script(name):
    environ = {k: v for k, v in BATCH_SCRIPT.items() if k not in ("SLURM_JOB_NUM_NODES",)}
    environ[name] = "-3"
    with pytest.raises(LaunchError, match=name):
        export_values(resolve(environ), environ)


# --------------------------------------------------------------------------- host lists

AGREE = ["node1", "node[1-2]", "gpu[01-03,07],cpu5", "n[001-002]", "rack[1-2]-gpu[08-09]",
         "a[1,3],b[09-10],c", "10.0.0.[1-2]", "n[8-11]", "x[0],y", "n[098-101]",
         "a,,b"]  # fmt: skip


@pytest.mark.parametrize("text", AGREE)
def test_builtin_host_list_agrees_with_python_hostlist(text):
    assert _expand_builtin(text) == hostlist.expand_hostlist(text)


@pytest.mark.parametrize("text", ["node[1-", "node[3-1]", "node]1[", "n[[1]]", "n[x]"])
def test_builtin_host_list_refuses_what_python_hostlist_refuses(text):
    with pytest.raises(hostlist.BadHostlist):
        hostlist.expand_hostlist(text)
    with pytest.raises(ValueError):
        _expand_builtin(text)


def test_a_deeply_nested_host_list_is_one_line_not_a_recursion_error():
    text = "n" + "[1]" * 1000
    with pytest.raises(LaunchError, match="SLURM_STEP_NODELIST"):
        expand_hostlist(text, "SLURM_STEP_NODELIST")
    with pytest.raises(LaunchError, match="SLURM_STEP_NODELIST"):
        resolve(slurm_step(0, 0, 0, 1, text, "1"))


@pytest.mark.parametrize("text", ["2(x0)", "0", "2(x", "\u0662", "1,,1", "2(x-1)"])
def test_bad_task_counts(text):
    with pytest.raises(LaunchError, match="SLURM_STEP_TASKS_PER_NODE"):
        parse_tasks_per_node(text)


def test_common_env_runs_where_python_hostlist_is_not_installed(tmp_path):
    """NGC / pyxis images ship torch without our packages: common.env must still work."""
    blocker = tmp_path / "hostlist.py"
    blocker.write_text('raise ModuleNotFoundError("no hostlist here", name="hostlist")\n')
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
    code = "import hostlist"
    proc = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr  # really not importable
    step = slurm_step(3, 1, 1, 4, f"{REMOTE[:-1]}[1-2]", "2(x2)", job_id="300")
    proc = subprocess.run([sys.executable, "-m", "common.env"], env={**environ, **step},
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert (info["rank"], info["world_size"], info["num_nodes"]) == (3, 4, 2)
    assert info["master_addr"] == REMOTE


def carried_alone(tmp_path, code: str, *args: str) -> list:
    """Run ``code`` where common/ holds env.py and its checks alone and python-hostlist cannot be
    imported (a project that took them home); its printed JSON list."""
    project = tmp_path / "project"
    (project / "common").mkdir(parents=True)
    (project / "common" / "__init__.py").write_text("")
    for name in ("env.py", "launch.py"):
        shutil.copy(ROOT / "common" / name, project / "common")
    (tmp_path / "hostlist.py").write_text(
        'raise ModuleNotFoundError("no hostlist here", name="hostlist")\n')
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{project}"
    proc = subprocess.run([sys.executable, "-c", code, *args], env=environ, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _answer(call, *args, **kwargs):
    """What a call of common.env answers: its result, else its LaunchError's message."""
    try:
        result = call(*args, **kwargs)
    except LaunchError as exc:
        return f"LaunchError: {exc}"
    return result.as_dict() if hasattr(result, "as_dict") else result


# The same, in the process that runs the carried env.py and its checks.
ANSWER = """
import json, sys
import common.env as cenv
import common.launch as gpu
from common.launch import check_launch
from common.env import LaunchError
def _answer(call, *args, **kwargs):
    try:
        result = call(*args, **kwargs)
    except LaunchError as exc:
        return f"LaunchError: {exc}"
    return result.as_dict() if hasattr(result, "as_dict") else result
"""

# Host lists that python-hostlist and env.py's own reading must read alike, a bad one included.
HOST_STEPS = [slurm_step(3, 1, 1, 4, "gpu[01-02]", "2(x2)"),
              slurm_step(0, 0, 0, 3, "rack[1-2]-gpu[08],cpu5", "1(x3)"),
              slurm_step(0, 0, 0, 2, "node[3-1]", "1(x2)")]  # fmt: skip


def test_env_py_alone_without_python_hostlist_reads_the_host_list(tmp_path):
    """A project that took env.py alone into an image without python-hostlist: every step's
    answer is the course's, where python-hostlist reads the list (a bad list: the same line)."""
    code = ANSWER + """
steps = json.loads(sys.argv[1])
assert cenv.hostlist is None
print(json.dumps([_answer(cenv.resolve_launch_env, s, argv=["train.py"])
                  for s in steps]))
"""
    got = carried_alone(tmp_path, code, json.dumps(HOST_STEPS))
    want = [_answer(resolve, step) for step in HOST_STEPS]
    for answers in (got, want):
        for answer in answers[:2]:
            answer.pop("hostname"), answer.pop("master_port")
        # The reason in brackets is the reader's own ("start > stop", "bad range '3-1'").
        answers[2] = re.sub(r"host list \(.*\); expected", "host list (...); expected", answers[2])
    assert got == want
    assert want[0]["master_addr"] == "gpu01", want
    assert want[2] == ("LaunchError: SLURM_STEP_NODELIST='node[3-1]' is not a valid host list "
                       "(...); expected e.g. 'node[1-2],gpu05'"), want[2]


def test_env_py_alone_checks_the_machine_as_the_course_does(tmp_path):
    """Taken home alone (env.py and its checks without the rest of common/): the same checks of
    this machine, in the same words: a loopback master address across nodes, two ranks on one
    GPU, SLURM's GPUs that torch cannot see."""
    (tmp_path / "nvidia0").touch()
    glob = str(tmp_path / "nvidia[0-9]*")
    loopback = slurm_step(3, 1, 1, 4, "localhost,n2", "2(x2)")
    code = ANSWER + """
step, glob = json.loads(sys.argv[1]), sys.argv[2]
env = cenv.resolve_launch_env(step, argv=["train.py"])
print(json.dumps([
    _answer(check_launch, env, step),
    _answer(gpu.cuda_device_index, env, 1, {"SLURM_GPUS_ON_NODE": "1"}),
    _answer(gpu.check_cuda_usable, {"SLURM_GPUS_ON_NODE": "2"}, glob),
]))
"""
    got = carried_alone(tmp_path, code, json.dumps(loopback), glob)
    env = resolve(loopback)
    want = [_answer(check_launch, env, loopback),
            _answer(cuda_device_index, env, 1, {"SLURM_GPUS_ON_NODE": "1"}),
            _answer(check_cuda_usable, {"SLURM_GPUS_ON_NODE": "2"}, glob)]  # fmt: skip
    assert got == want
    assert "is a loopback address" in want[0], want[0]
    assert "two ranks would share a GPU" in want[1], want[1]
    assert want[2].startswith("LaunchError: SLURM gave this node 2 GPU(s)"), want[2]


@pytest.mark.skipif(any(map(os.path.exists, GPU_DRIVER_FILES)), reason="a GPU driver is here")
def test_common_env_counts_no_gpus_without_importing_torch_where_no_driver_is(tmp_path):
    """Every job script runs `python -m common.env --export` before its srun; on a machine
    without a GPU driver it answers without torch's import (about 2 s of CPU each time)."""
    (tmp_path / "torch.py").write_text('raise ImportError("torch imported")\n')
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    environ["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{ROOT}"
    for args in (["--export"], []):
        proc = subprocess.run([sys.executable, "-m", "common.env", *args], env=environ,
                              capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["backend"] == "gloo"


def test_with_a_gpu_driver_file_torch_counts_the_gpus(tmp_path):
    driver = tmp_path / "nvidiactl"
    assert _cuda_device_count([str(driver)]) == 0  # no driver: 0 without asking torch
    driver.touch()
    import torch

    want = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert _cuda_device_count([str(driver)]) == want


# --------------------------------------------------------------------------- GPUs per node


@pytest.mark.parametrize(
    "environ",
    [
        slurm_step(0, 0, 0, 6, "node[1-2]", "3(x2)", SLURM_GPUS_ON_NODE="2"),
        torchrun_worker(3, 3, 8, 4, 0, 2, MASTER_ADDR=REMOTE, SLURM_GPUS_ON_NODE="2"),
    ],
    ids=["srun-3-tasks-2-gpus", "torchrun-4-workers-2-gpus"],
)
def test_more_processes_than_gpus_on_the_node_is_refused(environ):
    with pytest.raises(LaunchError, match="SLURM_GPUS_ON_NODE=2.*--ntasks-per-node=2"):
        resolve(environ)


def test_as_many_processes_as_gpus_is_fine():
    assert resolve(slurm_step(1, 1, 0, 4, "node[1-2]", "2(x2)", SLURM_GPUS_ON_NODE="2")).rank == 1
    # --gpus-per-task=1: each task sees one GPU, SLURM_GPUS_ON_NODE counts the node's
    assert resolve(slurm_step(1, 1, 0, 2, "node1", "2", SLURM_GPUS_ON_NODE="2")).rank == 1


# --------------------------------------------------------------------------- loopback


@pytest.mark.parametrize("addr", ["localhost", "127.0.0.1", "127.0.1.1", "::1"])
def test_loopback_master_across_nodes_fails_before_anything_waits(addr):
    environ = slurm_step(2, 0, 1, 4, "node[1-2]", "2(x2)", MASTER_ADDR=addr, MASTER_PORT="23005")
    with pytest.raises(LaunchError, match=f"MASTER_ADDR='{addr}' is a loopback.*2 nodes"):
        resolve(environ, check=True)


def test_loopback_master_is_fine_on_one_node():
    environ = slurm_step(1, 1, 0, 2, "node1", "2", MASTER_ADDR="localhost", MASTER_PORT="23006")
    assert resolve(environ, check=True).master_addr == "localhost"


def test_loopback_master_exported_by_the_batch_script():
    environ = {**BATCH_SCRIPT, "MASTER_ADDR": "localhost"}
    with pytest.raises(LaunchError, match="MASTER_ADDR='localhost'.*2 nodes"):
        export_values(resolve(environ), environ)


def test_torchruns_own_master_address_is_not_second_guessed():
    """torchrun's c10d rendezvous names the agent's host (socket.getfqdn()) for the workers;
    the agents already met, so a loopback name there is torchrun's business."""
    worker = torchrun_worker(2, 0, 4, 2, 1, 2, MASTER_ADDR="localhost", MASTER_PORT="23007")
    assert resolve(worker, check=True).master_addr == "localhost"
    by_hand = {k: v for k, v in worker.items() if not k.startswith("TORCHELASTIC")}
    with pytest.raises(LaunchError, match="loopback"):
        resolve(by_hand, check=True)


# A node name that /etc/hosts maps to loopback (Debian and Ubuntu write "127.0.1.1 <own name>").
# Each case runs a real interpreter with its own /etc/hosts and host name (mount and UTS
# namespaces), so the names resolve through the real resolver.
RESOLVE_CODE = """
import json, sys
from common.env import LaunchError, resolve_launch_env
from common.launch import check_launch
try:
    environ = json.loads(sys.argv[1])
    env = resolve_launch_env(environ, argv=["train.py"])
    check_launch(env, environ)
    print("ok", env.master_addr)
except LaunchError as exc:
    print("error", exc)
"""


def resolve_on_host(tmp_path, hostname, hosts_lines, environ):
    if os.geteuid() != 0:
        pytest.skip("needs root for a private /etc/hosts (mount namespace)")
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n" + hosts_lines + "\n")
    proc = subprocess.run(
        ["unshare", "--mount", "--uts", "sh", "-c",
         'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"',
         str(hosts), hostname, sys.executable, "-c", RESOLVE_CODE, json.dumps(environ)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize(
    "hostname, hosts_lines, expected",
    [
        # node2 resolves node1 to loopback: it would look for rank 0 on itself.
        (
            "node2",
            "127.0.1.1 node1",
            "error MASTER_ADDR='node1' is a loopback address (node1 -> 127.0.1.1)",
        ),
        # node1's own name on loopback: rank 0's store listens on every address there.
        ("node1", "127.0.1.1 node1", "ok node1"),
        ("node2", "192.0.2.1 node1", "ok node1"),
    ],
    ids=["other-node-on-loopback", "own-name-on-loopback", "network-address"],
)
def test_a_name_that_resolves_to_loopback(tmp_path, hostname, hosts_lines, expected):
    environ = slurm_step(2, 0, 1, 4, "node[1-2]", "2(x2)", MASTER_ADDR="node1",
                         MASTER_PORT="23008", PYTHONPATH=str(ROOT))  # fmt: skip
    assert resolve_on_host(tmp_path, hostname, hosts_lines, environ).startswith(expected)
