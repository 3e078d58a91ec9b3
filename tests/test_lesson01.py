"""Lesson 01 (hello all_reduce).

CPU smoke: the lesson's Python runs as a single-node gloo world on this machine. The runs the
notebook shows (by_hand.py with each init method, spawn_warmup.py, hello_allreduce.py with 2
processes, agreeing and with one rank broken) are checked there, line by line, under `make test`
(lesson.ipynb, cells marked NBVAL_CHECK_OUTPUT); the tests here cover what it does not show.
Cluster: both job scripts are submitted to the local SLURM cluster and every line checked, and the
sample output kept in the lesson folder has the same shape as the fresh run.
"""

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import hostlist
import pytest
import torch
from helpers import clean_environ, sample_output, tidy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "lessons" / "01_hello_allreduce"
TIMEOUT = 120  # seconds for one local run; the rendezvous is bounded by COURSE_DIST_TIMEOUT

RANK_LINE = re.compile(
    r"^rank (?P<rank>\d+)/(?P<world>\d+) on (?P<host>\S+) \(node (?P<node>\d+), "
    r"local (?P<local>\d+)\): holds (?P<held>\[[^\]]*\]) expected (?P<expected>\[[^\]]*\]) "
    r"(?P<verdict>OK|WRONG)$"
)
WORLD_LINE = re.compile(
    r"^world: (?P<world>\d+) processes on (?P<nodes>\d+) node\(s\), started by (?P<launcher>\S+), "
    r"master (?P<addr>[^:\s]+):(?P<port>\d+), backend (?P<backend>\w+)$"
)
JOB_LINE = re.compile(r"^job (?P<job>\d+) on nodes (?P<nodes>\S+):")




def import_lesson(script):
    """A lesson script as a module (its ``if __name__ == "__main__"`` part does not run)."""
    spec = importlib.util.spec_from_file_location(f"lesson01_{script[:-3]}", LESSON / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_lesson(script, *args, **extra):
    return subprocess.run(
        [sys.executable, str(LESSON / script), *args],
        cwd=ROOT, env=clean_environ(**extra), capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip


def the_sum(world):
    """What every rank must hold: rank r contributes [r, 1]."""
    return [float(sum(range(world))), float(world)]


def rank_lines(text):
    return [m.groupdict() for m in map(RANK_LINE.match, text.splitlines()) if m]


def check_allreduce_output(text, world, nodes, hosts=None):
    """Every rank 0..world-1 exactly once, holding the right sum, on the right node."""
    lines = rank_lines(text)
    assert sorted(int(r["rank"]) for r in lines) == list(range(world)), text
    per_node = world // nodes
    for r in lines:
        rank = int(r["rank"])
        assert int(r["world"]) == world, text
        assert r["held"] == r["expected"] == str(the_sum(world)), text
        assert r["verdict"] == "OK", text
        # global rank = node index x processes per node + local index
        assert rank == int(r["node"]) * per_node + int(r["local"]), text
        if hosts is not None:
            assert r["host"] == hosts[int(r["node"])], text
    worlds = [m.groupdict() for m in map(WORLD_LINE.match, text.splitlines()) if m]
    assert len(worlds) == 1, text  # printed by rank 0 only
    assert int(worlds[0]["world"]) == world and int(worlds[0]["nodes"]) == nodes, text
    assert f"all {world} ranks hold the expected sum" in text.splitlines(), text
    return worlds[0]


# --------------------------------------------------------------------------- CPU smoke


@pytest.mark.timeout(TIMEOUT + 30)
def test_hello_allreduce_alone_is_a_world_of_one():
    proc = run_lesson("hello_allreduce.py", "--nprocs", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    world = check_allreduce_output(proc.stdout, world=1, nodes=1, hosts=[socket.gethostname()])
    assert world["launcher"] == "single"
    assert world["backend"] == "gloo" and world["addr"] == "127.0.0.1"


@pytest.mark.timeout(120)
def test_hello_allreduce_refuses_to_spawn_inside_a_task_per_gpu_step():
    """srun already started 2 tasks on this node; spawning 2 more each is the double spawn."""
    host = socket.gethostname()
    step = dict(
        SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_LOCALID="0",
        SLURM_NODEID="0", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST=host,
        SLURM_STEP_TASKS_PER_NODE="2",
    )  # fmt: skip
    proc = run_lesson("hello_allreduce.py", "--nprocs", "2", **step)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "double spawn: srun started 2 tasks on this node" in proc.stderr
    assert "rank " not in proc.stdout  # refused before any process started


# --------------------------------------------------------------------------- local cluster

JOBS = {
    # script: (job name = --output prefix, nodes, processes per node, launcher seen by rank 0)
    "job.sh": ("hello-allreduce", 2, 2, "mp.spawn"),
    "job_task_per_gpu.sh": ("hello-allreduce-task-per-gpu", 2, 2, "slurm"),
}


def job_header(text):
    m = next(filter(None, map(JOB_LINE.match, text.splitlines())), None)
    assert m, text
    return m["job"], hostlist.expand_hostlist(m["nodes"])


def shape(text):
    """What must not change from run to run: the lesson's own lines, ranks, worlds, nodes.

    Job ids and ports are left out, and so is anything else (e.g. a library's log line).
    """
    job_id, hosts = job_header(text)
    lines = text.splitlines()
    own = [line for line in lines
           if RANK_LINE.match(line) or WORLD_LINE.match(line) or JOB_LINE.match(line)
           or line.startswith(("{", "all ", "FAILED"))]
    return {
        "lines": len(own),
        "ranks": sorted((int(r["rank"]), int(r["world"]), r["host"], r["verdict"])
                        for r in rank_lines(text)),
        "worlds": [(m["world"], m["nodes"], m["launcher"], m["addr"], m["backend"])
                   for m in map(WORLD_LINE.match, lines) if m],
        "hosts": hosts,
        "json_lines": sum(line.startswith("{") for line in lines),
        "summary": [line for line in lines if line.startswith(("all ", "FAILED"))],
        "tracebacks": sum(line.startswith("Traceback") for line in lines),
        "sysinfo": sorted(re.sub(r"\(.*", "", line) for line in lines
                          if re.match(r"^node\d+: (python|torch|backends)", line)),
    }




@pytest.mark.timeout(600)
@pytest.mark.parametrize("script", sorted(JOBS))
def test_job_script_on_local_cluster(cluster, sbatch_wait, script):
    job_name, nodes, per_node, launcher = JOBS[script]
    result = sbatch_wait(f"lessons/01_hello_allreduce/{script}", timeout=240)
    text = result.output
    assert result.returncode == 0, text
    job_id, hosts = job_header(text)
    assert job_id == str(result.job_id)
    assert len(hosts) == nodes
    world = check_allreduce_output(text, world=nodes * per_node, nodes=nodes, hosts=hosts)
    # The master is the job's first node; all ranks agreed on the port derived from the job.
    assert world["addr"] == hosts[0], text
    assert world["launcher"] == launcher and world["backend"] in ("gloo", "nccl")
    if script == "job.sh":
        # common.sysinfo once per node, each node's lines together: torch and its backends.
        report = [line.split(": ", 1) for line in text.splitlines()
                  if re.match(r"^node\d+: ", line)]  # fmt: skip
        assert [host for host, _ in report] == sorted(host for host, _ in report), text
        assert sorted({host for host, _ in report}) == sorted(hosts), text
        for host in hosts:
            assert f"{host}: torch {torch.__version__} (git " in text, text
            assert re.search(rf"^{host}: backends: gloo yes, nccl (yes|no), mpi (yes|no)", text,
                             re.M), text  # fmt: skip
    # The stored sample is what this script printed on the local cluster: same shape.
    sample = sample_output(LESSON, job_name)
    assert shape(sample.read_text()) == shape(text), f"{sample} vs {result.output_path}"
    tidy(result)  # only when every check passed: a failed run keeps its file


# --------------------------------------------------------------------------- by hand

BY_HAND_LINE = re.compile(
    r"^rank (?P<rank>\d+)/(?P<world>\d+) on (?P<host>\S+) \(node (?P<node>\d+), "
    r"local (?P<local>\d+)\): sum (?P<sum>\S+) expected (?P<expected>\S+) (?P<verdict>OK|WRONG)$"
)


def check_by_hand(text, world, init_prefix):
    lines = [m.groupdict() for m in map(BY_HAND_LINE.match, text.splitlines()) if m]
    assert sorted(int(r["rank"]) for r in lines) == list(range(world)), text
    expected = f"{world * (world - 1) / 2:g}"
    for r in lines:
        assert (r["world"], r["sum"], r["expected"], r["verdict"]) == (
            str(world), expected, expected, "OK"), text  # fmt: skip
    heads = re.findall(r"^init_method=(\S+): (\d+) processes, backend (\w+)$", text, re.M)
    assert len(heads) == 1 and heads[0][0].startswith(init_prefix), text
    assert int(heads[0][1]) == world, text
    return lines


@pytest.mark.timeout(120)
def test_by_hand_says_what_is_missing(monkeypatch, capsys):
    proc = run_lesson("by_hand.py")  # no SLURM variables at all
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout
    assert proc.stderr == ("by_hand.py: SLURM_NODEID is not set: start this script with srun "
                           "inside a job (sbatch lessons/01_hello_allreduce/by_hand.sh)\n")
    # The other stops, through the script's main() in this process (a SystemExit with a
    # message is what the command line showed above: exit status 1, the message on stderr).
    by_hand = import_lesson("by_hand.py")

    def stop(*argv, **task):
        for name in ("MASTER_ADDR", "MASTER_PORT", *(k for k in os.environ if k[:6] == "SLURM_")):
            monkeypatch.delenv(name, raising=False)
        for name, value in task.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as stopped:
            by_hand.main(list(argv))
        return stopped.value.code

    task = dict(SLURM_NODEID="0", SLURM_LOCALID="0", SLURM_PROCID="0", SLURM_NTASKS="1",
                SLURM_NNODES="1", SLURM_STEP_ID="0")  # fmt: skip
    message = stop(**task)
    assert "MASTER_ADDR and MASTER_PORT must be set" in message and "\n" not in message
    # 3 tasks on 2 nodes: node 1's only task is rank 2, the formula would say 1 * 1 + 0 = 1.
    uneven = dict(SLURM_NODEID="1", SLURM_LOCALID="0", SLURM_PROCID="2", SLURM_NTASKS="3",
                  SLURM_NNODES="2", SLURM_STEP_ID="0")  # fmt: skip
    assert "is not the same number of tasks on every node" in stop(**uneven)
    capsys.readouterr()
    assert stop("--init", "file", **task) == 2  # argparse's usage error
    assert "--init file needs --dist-file PATH" in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("step_id", [None, "-5"], ids=["up-to-25.11", "from-26.05"])
def test_by_hand_refuses_the_batch_script(step_id):
    """What `python by_hand.py` sees in a batch script of by_hand.sh's shape, without srun.

    sbatch sets SLURM_PROCID, SLURM_LOCALID and SLURM_NODEID to 0 and the job's counts there, so
    the rank formula agrees (0 * 2 + 0 = 0) and, unrefused, the script would wait as rank 0 of
    4. The batch script has no SLURM_STEP_ID up to Slurm 25.11, SLURM_STEP_ID=-5 from 26.05.
    """
    from common.env import find_free_port

    batch = dict(SLURM_JOB_ID="117", SLURM_JOB_NODELIST="node[1-2]", SLURM_NNODES="2",
                 SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2", SLURM_PROCID="0",
                 SLURM_LOCALID="0", SLURM_NODEID="0", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(find_free_port()))  # fmt: skip
    if step_id is not None:
        batch.update(SLURM_STEP_ID=step_id, SLURM_STEPID=step_id)
    # --timeout 5: a script that does not refuse fails after 5 s of waiting, not 60.
    proc = run_lesson("by_hand.py", "--timeout", "5", **batch)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr == (f"by_hand.py: SLURM_STEP_ID={step_id or '<not set>'}: not a task of an "
                           "srun step (the batch script itself?): start this script with srun\n")


@pytest.mark.timeout(600)
def test_by_hand_job_on_local_cluster(cluster, sbatch_wait):
    result = sbatch_wait("lessons/01_hello_allreduce/by_hand.sh", timeout=240)
    text = result.output
    assert result.returncode == 0, text
    header = re.match(r"^job (\d+) on nodes (\S+): 2 node\(s\) x 2 tasks, MASTER_ADDR=(\S+) "
                      r"MASTER_PORT=(\d+)$", text.splitlines()[0])  # fmt: skip
    assert header and header[1] == str(result.job_id), text
    hosts = hostlist.expand_hostlist(header[2])
    assert header[3] == hosts[0], text  # scontrol show hostnames | head -n 1
    assert int(header[4]) == 15000 + int(result.job_id) % 15000, text
    sections = re.split(r"^== init_method (\w+)$", text, flags=re.M)
    assert sections[1::2] == ["env", "tcp", "file"], text
    for method, part in zip(sections[1::2], sections[2::2], strict=True):
        prefix = {"env": "env://", "tcp": f"tcp://{hosts[0]}:{header[4]}",
                  "file": f"file://{ROOT}/runs/by-hand-{result.job_id}.init"}[method]  # fmt: skip
        for r in check_by_hand(part, 4, prefix):
            # rank = node index x tasks per node + local index, on the node SLURM named
            assert int(r["rank"]) == int(r["node"]) * 2 + int(r["local"]), part
            assert r["host"] == hosts[int(r["node"])], part
    assert not (ROOT / f"runs/by-hand-{result.job_id}.init").exists()  # removed after use
    sample = sample_output(LESSON, "by-hand").read_text()
    assert re.split(r"^== init_method (\w+)$", sample, flags=re.M)[1::2] == ["env", "tcp", "file"]
    assert sum(bool(BY_HAND_LINE.match(line)) for line in sample.splitlines()) == 3 * 4, sample
    tidy(result)
