"""Lesson 02 (torch.distributed.launch vs torchrun vs srun).

CPU smoke: hello.py alone, as srun-style tasks and through the per-node helper script, as
single-node gloo worlds on this machine (hello.py under torchrun and torch.distributed.launch is
the notebook's run, checked line by line there under `make test`: lesson.ipynb, NBVAL_CHECK_OUTPUT).
Cluster: every job script is submitted to the local SLURM cluster and its output checked; the
pitfall job fails with common/'s double-spawn message; the sample outputs kept in the lesson
folder have the same shape as a fresh run.
"""

import re
import socket
import subprocess
import sys
from pathlib import Path

import hostlist
import pytest
from helpers import clean_environ, sample_output, tidy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.env import find_free_port  # noqa: E402

LESSON = ROOT / "lessons" / "02_launch_vs_srun"
HELLO = str(LESSON / "hello.py")
TIMEOUT = 120  # seconds for one local run; the rendezvous is bounded by COURSE_DIST_TIMEOUT

HELLO_LINE = re.compile(
    r"^\[(?P<addr>[^\]\s]+):(?P<port>\d+)\] hello from (?P<host>[^:\s]+):(?P<backend>\w+) "
    r"process (?P<rank>\d+)/(?P<world>\d+)$"
)
NODE_LINE = re.compile(
    r"^node_launch: (?P<host>\S+) is node (?P<node>\d+) of (?P<nodes>\d+), starting "
    r"(?P<nproc>\d+) process\(es\) with (?P<launcher>\S+), master (?P<addr>[^:\s]+):(?P<port>\d+)$"
)
JOB_LINE = re.compile(r"^job (?P<job>\d+) on nodes (?P<nodes>\S+):")
DOUBLE_SPAWN = "double spawn: srun started 2 tasks on this node"




def run(cmd, **extra):
    proc = subprocess.run(
        cmd, cwd=ROOT, env=clean_environ(**extra), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def hellos(text):
    return [m.groupdict() for m in map(HELLO_LINE.match, text.splitlines()) if m]


def check_hellos(text, world, addr=None, hosts=None, per_node=None):
    """Each rank 0..world-1 exactly once, all in one world with one master, on the right host."""
    lines = hellos(text)
    assert sorted(int(h["rank"]) for h in lines) == list(range(world)), text
    assert {int(h["world"]) for h in lines} == {world}, text
    assert len({(h["addr"], h["port"]) for h in lines}) == 1, text  # everybody met at one place
    assert {h["backend"] for h in lines} <= {"gloo", "nccl"}, text
    if addr is not None:
        assert lines[0]["addr"] in ([addr] if isinstance(addr, str) else addr), text
    if hosts is not None:
        for h in lines:
            assert h["host"] == hosts[int(h["rank"]) // per_node], text
    return lines


# --------------------------------------------------------------------------- CPU smoke


@pytest.mark.timeout(TIMEOUT + 30)
def test_hello_alone_is_process_0_of_1():
    check_hellos(run([sys.executable, HELLO]), world=1, addr="127.0.0.1",
                 hosts=[socket.gethostname()], per_node=1)


@pytest.mark.timeout(TIMEOUT + 30)
def test_hello_as_srun_tasks():
    """What srun_native.sh does, with the variables srun would set for a 2-task step."""
    host, port = socket.gethostname(), str(find_free_port())
    step = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_NODEID="0",
                SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST=host,
                SLURM_STEP_TASKS_PER_NODE="2", MASTER_PORT=port)
    procs = [
        subprocess.Popen([sys.executable, HELLO], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         env=clean_environ(SLURM_PROCID=str(i), SLURM_LOCALID=str(i), **step))
        for i in range(2)
    ]
    out = ""
    for proc in procs:
        out += proc.communicate(timeout=TIMEOUT)[0]
        assert proc.returncode == 0, out
    check_hellos(out, world=2, addr=host, hosts=[host], per_node=2)


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("launcher", ["torchrun", "launch"])
def test_node_launch_helper_on_one_node(launcher):
    """node_launch.sh as srun would start it on a 1-node step with 2 GPUs."""
    host, port = socket.gethostname(), str(find_free_port())
    step = dict(SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_LOCALID="0",
                SLURM_NODEID="0", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_NODELIST=host,
                SLURM_STEP_TASKS_PER_NODE="1", SLURM_GPUS_ON_NODE="2", MASTER_PORT=port)
    out = run(["bash", str(LESSON / "node_launch.sh"), launcher, HELLO], **step)
    nodes = [m.groupdict() for m in map(NODE_LINE.match, out.splitlines()) if m]
    assert len(nodes) == 1, out
    assert nodes[0] == dict(host=host, node="0", nodes="1", nproc="2", launcher=launcher,
                            addr=host, port=port)
    lines = check_hellos(out, world=2, addr=host, hosts=[host], per_node=2)
    assert lines[0]["port"] == port


@pytest.mark.timeout(120)
def test_node_launch_helper_rejects_unknown_launcher():
    proc = subprocess.run(["bash", str(LESSON / "node_launch.sh"), "mpirun", HELLO], cwd=ROOT,
                          env=clean_environ(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "usage: node_launch.sh torchrun|launch" in proc.stderr


# --------------------------------------------------------------------------- local cluster

JOBS = {
    # script: (job name = --output prefix, nodes, processes per node, master address)
    # On one node the launchers' defaults put the master on the loopback address.
    "launch_nproc1.sh": ("launch-nproc1", 1, 1, "loopback"),
    "launch_nproc2.sh": ("launch-nproc2", 1, 2, "loopback"),
    "torchrun_nproc1.sh": ("torchrun-nproc1", 1, 1, "loopback"),
    "torchrun_nproc2.sh": ("torchrun-nproc2", 1, 2, "loopback"),
    "job.sh": ("launch-multinode", 2, 2, "first node"),
    "torchrun_multinode.sh": ("torchrun-multinode", 2, 2, "first node"),
    "srun_native.sh": ("srun-native", 2, 2, "first node"),
}
PITFALL = ("pitfall_double_spawn.sh", "pitfall-double-spawn")


def job_header(text):
    m = next(filter(None, map(JOB_LINE.match, text.splitlines())), None)
    assert m, text
    return m["job"], hostlist.expand_hostlist(m["nodes"])


def shape(text):
    """What must not change from run to run: the lessons' own lines, ranks, world, hosts.

    Job ids and ports are left out, and so are the launchers' log lines and warnings, whose
    number depends on timing (e.g. a retried connection to the rendezvous).
    """
    _, hosts = job_header(text)
    lines = text.splitlines()
    own = [line for line in lines if HELLO_LINE.match(line) or NODE_LINE.match(line)
           or JOB_LINE.match(line)]
    return {
        "lines": len(own),
        "hellos": sorted((int(h["rank"]), int(h["world"]), h["host"], h["addr"], h["backend"])
                         for h in hellos(text)),
        "nodes": sorted((n["host"], n["node"], n["nodes"], n["nproc"], n["launcher"], n["addr"])
                        for n in map(NODE_LINE.match, lines) if n),
        "hosts": hosts,
        "tracebacks": sum(line.startswith("Traceback") for line in lines),
    }




@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", list(JOBS))
def test_job_script_on_local_cluster(cluster, sbatch_wait, script):
    job_name, nodes, per_node, master = JOBS[script]
    result = sbatch_wait(f"lessons/02_launch_vs_srun/{script}", timeout=240)
    text = result.output
    assert result.returncode == 0, text
    job_id, hosts = job_header(text)
    assert job_id == str(result.job_id) and len(hosts) == nodes, text
    addr = hosts[0] if master == "first node" else ["127.0.0.1", "localhost", hosts[0]]
    check_hellos(text, world=nodes * per_node, addr=addr, hosts=hosts, per_node=per_node)
    helper = [m.groupdict() for m in map(NODE_LINE.match, text.splitlines()) if m]
    if script in ("job.sh", "torchrun_multinode.sh"):  # node_launch.sh: once per node
        assert sorted((h["host"], h["node"]) for h in helper) == [
            (host, str(i)) for i, host in enumerate(hosts)], text
        assert {(h["addr"], h["nodes"], h["nproc"]) for h in helper} == {
            (hosts[0], str(nodes), str(per_node))}, text
    sample = sample_output(LESSON, job_name)
    assert shape(sample.read_text()) == shape(text), f"{sample} vs {result.output_path}"
    tidy(result)  # only when every check passed: a failed run keeps its file


@pytest.mark.timeout(600)
def test_pitfall_double_spawn_fails_with_clear_message(cluster, sbatch_wait):
    script, job_name = PITFALL
    result = sbatch_wait(f"lessons/02_launch_vs_srun/{script}", timeout=240)
    text = result.output
    assert result.returncode != 0, text
    assert DOUBLE_SPAWN in text, text
    assert not hellos(text), text  # refused before any process group formed
    # Same shape as the stored sample: same nodes, same message, nobody said hello. (How many
    # workers got as far as the check before the step ended may differ between runs.)
    sample = sample_output(LESSON, job_name).read_text()
    assert DOUBLE_SPAWN in sample and not hellos(sample)
    assert job_header(sample)[1] == job_header(text)[1]
    tidy(result)  # only when every check passed: a failed run keeps its file
