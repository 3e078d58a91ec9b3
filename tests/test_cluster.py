"""The local SLURM cluster (cluster/up.sh, cluster/down.sh): real munge, slurmctld and slurmd.

Flag checks run without daemons. Everything else runs on the cluster; the tests that stop or
reshape it hold the shared cluster lock and always leave it up in the default shape.
"""

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import job_environ, slurm_version

ROOT = Path(__file__).resolve().parents[1]
UP = ROOT / "cluster" / "up.sh"
DOWN = ROOT / "cluster" / "down.sh"
CLUSTER_ROOT = Path("/var/lib/course-cluster")
DAEMONS = ("slurmctld", "slurmd", "slurmstepd", "munged")
PYTHON = sys.executable


def run(*cmd, timeout=60, **kw):
    return subprocess.run(
        [str(c) for c in cmd], cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw
    )


def up(*args, timeout=300):
    proc = run("bash", UP, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def nodes():
    """{node: (state, gres, cpus, memory_mb)} from sinfo."""
    proc = run("sinfo", "-h", "-N", "-o", "%N|%t|%G|%c|%m", timeout=30)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("|") for line in proc.stdout.split()]
    return {name: (state, gres, int(cpus), int(mem)) for name, state, gres, cpus, mem in rows}


def live_processes(names=DAEMONS):
    """{pid: name} of running (not zombie) processes called one of ``names``, in this PID
    namespace (a cluster that cluster/apart.sh runs beside this one is not ours)."""
    found = {}
    ours = os.readlink("/proc/self/ns/pid")
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            if os.readlink(stat.parent / "ns" / "pid") != ours:
                continue
        except OSError:
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        state = text[text.rindex(")") + 2]
        if comm in names and state != "Z":
            found[int(stat.parent.name)] = comm
    return found


def recorded_daemons():
    path = CLUSTER_ROOT / "run" / "daemons"
    return path.read_text().split("\n") if path.exists() else []


# --------------------------------------------------------------------------- flags (no daemons)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "two"], "--nodes needs a whole number, got 'two'"),
        (["--gpus-per-node=1.5"], "--gpus-per-node needs a whole number, got '1.5'"),
        (["--cpus-per-node", "-4"], "--cpus-per-node needs a whole number, got '-4'"),
        (["--mem-per-node"], "--mem-per-node needs a value"),
        (["--nodes", "0"], "--nodes must be between 1 and 200, got 0"),
        (["--gpus"], "unknown option '--gpus'"),
        (["node1"], "unknown option 'node1'"),
        (["--site", "lenient"], "--site (or COURSE_CLUSTER_SITE) must be one of strict, "
                                "export-none, shared-tmp, rank0-elsewhere, pyxis, pyxis-hook, "
                                "no-requeue, got 'lenient'"),
    ],
)
def test_up_rejects_bad_flags_with_the_flag_named(args, message):
    proc = run("bash", UP, *args, timeout=30)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_a_second_up_waits_for_the_first_then_refuses_clearly():
    lock = Path(f"{CLUSTER_ROOT}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    # Someone else's up.sh holds the cluster's lock for longer than this one may wait. (Held
    # here, not by `flock FILE sleep 30`: killing flock would leave its sleep holding the lock,
    # and every up.sh of the next 30 s, the cluster tests' among them, would wait for it.)
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = run("bash", UP, "--check", timeout=30, env={**os.environ,
                   "COURSE_CLUSTER_LOCK_WAIT_S": "1"})  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "another cluster/up.sh or down.sh is running; waiting" in proc.stderr, proc.stderr
    assert "still holds /var/lib/course-cluster.lock after 1 s" in proc.stderr, proc.stderr


def test_up_and_down_help():
    proc = run("bash", UP, "--help", timeout=30)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--nodes N", "--gpus-per-node G", "--cpus-per-node C", "--mem-per-node MB"):
        assert flag in proc.stdout
    assert run("bash", DOWN, "--help", timeout=30).returncode == 0
    proc = run("bash", DOWN, "--force", timeout=30)
    assert proc.returncode != 0 and "unknown option '--force'" in proc.stderr


# --------------------------------------------------------------------------- default cluster


def test_sinfo_shows_two_nodes_with_two_gpus(cluster):
    found = nodes()
    assert sorted(found) == ["node1", "node2"], found
    for state, gres, cpus, mem in found.values():
        # Idle unless someone else's job runs there right now.
        assert state in ("idle", "mix", "alloc"), found
        assert gres == "gpu:2" and cpus == 64 and mem == 256000, found


def parse_tasks(text):
    """Lines "hostname node procid localid nodeid cvd gpus_on_node step_gpus" by procid."""
    tasks = {}
    for line in text.splitlines():
        host, node, procid, localid, nodeid, cvd, on_node, step = line.split()
        tasks[int(procid)] = {
            "host": host, "node": node, "localid": int(localid), "nodeid": int(nodeid),
            "cvd": cvd, "on_node": on_node, "step_gpus": step,
        }  # fmt: skip
    return tasks


TASK_REPORT = (
    'echo "$(hostname) $SLURMD_NODENAME $SLURM_PROCID $SLURM_LOCALID $SLURM_NODEID'
    ' ${CUDA_VISIBLE_DEVICES:-unset} ${SLURM_GPUS_ON_NODE:-unset} ${SLURM_STEP_GPUS:-unset}"'
)


@pytest.mark.parametrize(
    "gpu_args, gpus_on_node, task_gpus",
    [
        (["--gres=gpu:2"], "2", ["0,1", "0,1"]),
        (["--gpus-per-node=2"], "2", ["0,1", "0,1"]),
        (["--gres=gpu:1"], "1", ["0", "0"]),
        (["--gpus-per-task=1"], "2", ["0", "1"]),
    ],
)
def test_srun_two_nodes_two_tasks_each(srun, gpu_args, gpus_on_node, task_gpus):
    proc = srun("-N2", "--ntasks-per-node=2", *gpu_args, "bash", "-c", TASK_REPORT, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tasks = parse_tasks(proc.stdout)
    assert sorted(tasks) == [0, 1, 2, 3], proc.stdout
    for procid, t in tasks.items():
        # Each task sees its own node's name, as on a real cluster; block distribution.
        assert t["host"] == t["node"] == f"node{procid // 2 + 1}", t
        assert t["nodeid"] == procid // 2 and t["localid"] == procid % 2, t
        assert t["on_node"] == gpus_on_node, t
        assert t["cvd"] == t["step_gpus"] or gpu_args == ["--gpus-per-task=1"], t
    for node in ("node1", "node2"):
        on_node = sorted((t["localid"], t["cvd"]) for t in tasks.values() if t["node"] == node)
        assert on_node == [(0, task_gpus[0]), (1, task_gpus[1])], tasks


def test_more_gpus_than_a_node_has_is_refused(srun):
    proc = srun("-N1", "--gres=gpu:3", "true", timeout=120)
    assert proc.returncode != 0
    assert "Requested node configuration is not available" in proc.stderr, proc.stderr


@pytest.mark.sites  # how sites' users ask for GPUs; make test-sites (22.05), make test-slurm
def test_gres_and_gpus_per_node_mix_until_26_05(cluster, cluster_lock):
    """A step that asks for GPUs with --gres inside a job that asked with --gpus-per-node: up to
    25.11 it runs; from 26.05 the two forms are mutually exclusive, between a job and its steps
    too (CHANGELOG/slurm-26.05.md: "Make --gres=gpu:N and --gpus-per-node mutually exclusive").
    --gpus-per-task in the same job runs on every version (lesson 00, section 4)."""
    step = 'srun {} bash -c \'echo "gpus $CUDA_VISIBLE_DEVICES"\''
    results = []
    with cluster_lock():
        for form in ("--gres=gpu:1", "--gpus-per-task=1"):
            results.append(subprocess.run(
                ["salloc", "-N1", "-n1", "--gpus-per-node=2", "--time=1", "bash", "-c",
                 step.format(form)],
                capture_output=True, text=True, timeout=60, env=job_environ()))  # fmt: skip
    mixed, per_task = results
    # (which GPUs the step sees differs: 22.05 hands a one-task step of such a job both)
    assert per_task.returncode == 0 and per_task.stdout.startswith("gpus "), per_task
    if slurm_version() >= (26, 5):
        assert mixed.returncode != 0, mixed
        assert "srun: fatal: --gpus-per-node and --gres=gpu are mutually exclusive" in (
            mixed.stderr), mixed.stderr
    else:
        assert mixed.returncode == 0 and mixed.stdout.startswith("gpus "), mixed


def test_sbatch_wait_returns_the_job_exit_code(sbatch_wait, tmp_path):
    ok = tmp_path / "ok.sh"
    ok.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --gres=gpu:2 --cpus-per-task=8"
        " --mem=64G --time=00:05:00\nset -euo pipefail\n"
        'echo "batch on $(hostname)"\nsrun hostname | sort\n'
    )
    result = sbatch_wait(ok, timeout=240)
    assert result.returncode == 0, result.output
    assert result.output.split("\n") == ["batch on node1", "node1", "node2", ""], result.output
    assert result.output_path == tmp_path / f"slurm-{result.job_id}.out"

    failing = tmp_path / "fail.sh"
    failing.write_text("#!/bin/bash\necho about to fail\nexit 7\n")
    result = sbatch_wait(failing, timeout=240)
    assert result.returncode == 7, (result.returncode, result.output)
    assert result.output == "about to fail\n"

    step_fails = tmp_path / "step_fails.sh"
    step_fails.write_text("#!/bin/bash\nset -e\nsrun -N2 false\necho not reached\n")
    result = sbatch_wait(step_fails, "--nodes=2", timeout=240)
    assert result.returncode != 0 and "not reached" not in result.output, result.output



def test_srun_takes_cpus_per_task_from_the_job_from_23_11(sbatch_wait, tmp_path):
    """Slurm 22.05 to 23.02: a plain srun counts 1 CPU per task (it does not read the job's
    SLURM_CPUS_PER_TASK; SRUN_CPUS_PER_TASK or -c tell it); from 23.11 it takes the job's value
    again. A step of 4 tasks in a job of 2 tasks x 2 CPUs fits only when srun counts 1 each.
    24.11 also tells the job its per-task TRES (SLURM_TRES_PER_TASK)."""
    script = tmp_path / "cpus.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=1 --ntasks=2 --cpus-per-task=2 --time=00:05:00\n"
        "unset SRUN_CPUS_PER_TASK\n"
        'srun --ntasks=4 true 2>/dev/null && echo "plain: ran" || echo "plain: refused"\n'
        'SRUN_CPUS_PER_TASK=2 srun --ntasks=4 true 2>/dev/null && echo "told: ran" '
        '|| echo "told: refused"\n'
        'echo "SLURM_TRES_PER_TASK=${SLURM_TRES_PER_TASK:-unset}"\n'
    )
    result = sbatch_wait(script, timeout=240)
    assert result.returncode == 0, result.output
    inherits = slurm_version() >= (23, 11)
    assert f"plain: {'refused' if inherits else 'ran'}" in result.output, result.output
    assert "told: refused" in result.output, result.output
    if slurm_version() >= (24, 11):
        assert "SLURM_TRES_PER_TASK=cpu=2" in result.output, result.output
    elif slurm_version() < (23, 0):
        assert "SLURM_TRES_PER_TASK=unset" in result.output, result.output

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(480)
def test_gloo_all_reduce_between_nodes(srun):
    env = {"MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT)}
    proc = srun(
        "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", PYTHON,
        "tests/workers/cluster_allreduce.py", env=env, timeout=360,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda r: r["rank"])
    assert [r["rank"] for r in rows] == [0, 1], proc.stdout
    for r in rows:
        assert r["sum"] == 3.0 and r["world_size"] == 2, r
        assert r["hosts"] == ["node1", "node2"] and r["hostname"] == r["node"], r


@pytest.mark.timeout(240)
def test_nodes_are_separate_hosts_on_a_network(srun):
    """Each node has its own address and eth0, and its own loopback: localhost on node2 is
    node2, so only the name of node1 reaches a server on node1. (What that does to a script
    with MASTER_ADDR=localhost, with and without common/'s check, is lesson 06's localhost.sh
    job: tests/test_lesson06.py::test_master_addr_localhost.)"""
    proc = srun("-N2", "--ntasks-per-node=1", PYTHON, "tests/workers/net_probe.py",
                env={"PROBE_PORT": str(free_port())}, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    node0, node1 = sorted((json.loads(line) for line in proc.stdout.splitlines()),
                          key=lambda r: r["node"])  # fmt: skip
    assert [node0["hostname"], node1["hostname"]] == ["node1", "node2"]
    assert len(node0["addresses"]) == len(node1["addresses"]) == 1
    assert node0["addresses"] != node1["addresses"], (node0, node1)
    assert node0["interfaces"] == node1["interfaces"] == ["eth0", "lo"]
    assert socket.gethostbyname("node1") == node0["addresses"][0]
    assert node1["localhost"] == "ConnectionRefusedError", node1
    assert node1["node1"] == "node0 via node1", node1


def test_shape_limits_every_nodes_link_both_ways_then_lifts_it(cluster, cluster_lock):
    def qdiscs():  # both ends of each node's link: on the bridge, and the node's eth0
        ends = [["tc"], ["tc"], ["ip", "netns", "exec", "course-node1", "tc"],
                ["ip", "netns", "exec", "course-node2", "tc"]]  # fmt: skip
        devs = ["course-v1", "course-v2", "eth0", "eth0"]
        pairs = zip(ends, devs, strict=True)
        return [run(*end, "qdisc", "show", "dev", dev).stdout for end, dev in pairs]

    bad = run("bash", ROOT / "cluster" / "shape.sh", "fast")
    assert bad.returncode == 1 and "RATE 'fast' is not a number" in bad.stderr, bad.stderr
    with cluster_lock():
        try:
            proc = run("bash", ROOT / "cluster" / "shape.sh", "100mbit")
            assert proc.returncode == 0, proc.stderr
            assert all("tbf" in q and "rate 100Mbit" in q for q in qdiscs()), qdiscs()
        finally:
            proc = run("bash", ROOT / "cluster" / "shape.sh", "off")
        assert proc.returncode == 0 and not any("tbf" in q for q in qdiscs()), qdiscs()


# --------------------------------------------------------------------------- stop / reshape


@pytest.mark.timeout(600)
def test_up_is_idempotent_and_down_leaves_nothing(cluster, cluster_lock, srun, sbatch_wait,
                                                  tmp_path):  # fmt: skip
    script = tmp_path / "before.sh"
    script.write_text("#!/bin/bash\n#SBATCH --job-name=before-restart\nexit 4\n")
    with cluster_lock():
        try:
            up()
            old_job = sbatch_wait(script, timeout=240).job_id
            before = recorded_daemons()
            proc = up()
            assert "already up" in proc.stderr, proc.stderr
            assert recorded_daemons() == before  # same daemons, same pids: nothing changed

            ours = {int(line.split()[1]) for line in before if line}
            proc = run("bash", DOWN, timeout=120)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            assert not ours & set(live_processes()), live_processes()
            assert not live_processes(("slurmctld", "slurmd", "slurmstepd"))
            for stale in ("state", "spool", "run", "shape"):
                assert not (CLUSTER_ROOT / stale).exists(), stale
            assert "course-cluster" not in Path("/etc/hosts").read_text()  # names removed too
            # ... and the nodes' network: no namespace, veth pair or bridge of ours is left.
            assert "course-node" not in run("ip", "netns", "list").stdout
            assert "course-" not in run("ip", "-o", "link", "show").stdout
            # ... and nothing of the jobs' private /tmp (job_container/tmpfs) stays mounted.
            table = Path("/proc/self/mountinfo").read_text().splitlines()
            mounts = [line.split()[4] for line in table]
            assert not [m for m in mounts if m.startswith(f"{CLUSTER_ROOT}/")], mounts
            assert run("bash", DOWN, timeout=60).returncode == 0  # down twice is fine

            proc = up()
            assert "starting" in proc.stderr, proc.stderr
            assert {n: s[0] for n, s in nodes().items()} == {"node1": "idle", "node2": "idle"}
            out = srun("-N2", "hostname", timeout=120)
            assert sorted(out.stdout.split()) == ["node1", "node2"], out.stderr
            # The accounting database kept the job, and job ids go on counting.
            # (State and exit code: a job that ends before slurmctld reported its start is stored
            # under the placeholder name "allocation".)
            acct = run("sacct", "-n", "-P", "-X", "-j", old_job, "--format=State,ExitCode")
            assert acct.stdout.split() == ["FAILED|4:0"], acct.stdout + acct.stderr
            assert int(sbatch_wait(script, timeout=240).job_id) > int(old_job)
        finally:
            up()


def test_check_changes_nothing(cluster):
    before = recorded_daemons()
    assert run("bash", UP, "--check", timeout=60).returncode == 0
    proc = run("bash", UP, "--check", "--nodes", "3", timeout=60)
    assert proc.returncode == 1 and "not up in this shape" in proc.stderr, proc.stderr
    assert recorded_daemons() == before and sorted(nodes()) == ["node1", "node2"]


@pytest.mark.timeout(600)
def test_up_restarts_a_cluster_that_lost_a_daemon(cluster, cluster_lock, srun):
    with cluster_lock():
        try:
            up()
            slurmd = [int(line.split()[1]) for line in recorded_daemons()
                      if line.split()[:1] == ["slurmd"]]  # fmt: skip
            os.kill(slurmd[-1], signal.SIGKILL)  # node2's slurmd dies
            proc = up()
            assert "starting" in proc.stderr, proc.stderr
            out = srun("-N2", "hostname", timeout=120)
            assert sorted(out.stdout.split()) == ["node1", "node2"], out.stderr
        finally:
            up()


@pytest.mark.timeout(600)
def test_second_shape_three_nodes_one_gpu_then_default_again(cluster, cluster_lock, srun):
    with cluster_lock():
        try:
            up("--nodes", "3", "--gpus-per-node", "1", "--cpus-per-node", "8",
               "--mem-per-node", "16000")  # fmt: skip
            assert nodes() == {f"node{i}": ("idle", "gpu:1", 8, 16000) for i in (1, 2, 3)}
            proc = srun("-N3", "--gres=gpu:1", "bash", "-c", TASK_REPORT, timeout=120)
            assert proc.returncode == 0, proc.stderr
            tasks = parse_tasks(proc.stdout)
            assert [tasks[i]["host"] for i in sorted(tasks)] == ["node1", "node2", "node3"]
            assert all(t["cvd"] == "0" and t["on_node"] == "1" for t in tasks.values()), tasks
            # The declared size is enforced: a job asking for more memory is refused at once.
            proc = run("sbatch", "--mem=32000", "--wrap=true", timeout=30)
            assert proc.returncode != 0, proc.stdout
            assert "Requested node configuration is not available" in proc.stderr
        finally:
            up()
        assert nodes() == {n: ("idle", "gpu:2", 64, 256000) for n in ("node1", "node2")}
