"""Lesson 06 (diagnosing hangs): every failure reproduced, and named.

Local: step.py runs clean under torchrun; the all_reduce benchmark prints a table whose busbw
is nccl-tests' algbw x 2(n-1)/n.  Cluster: each failure's job script fails the way the lesson
says (the first error is the cause; the preflight names the setup problems; DETAIL names the
mismatched collective; py-spy and faulthandler show the stuck rank's line), with short
timeouts (COURSE_DIST_TIMEOUT=5) and, where the failure shows as well, one task per node (the
scripts ask for two), so the whole set stays near a minute and a half; the stored samples, runs
of the scripts as written, have the same shape.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import job_environ, wait_job
from helpers import ROOT, clean_environ, sample_output

LESSON = ROOT / "lessons" / "06_diagnosing_hangs"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(LESSON))

import allreduce_bench  # noqa: E402

JOB_TIMEOUT = 240  # the cluster lock may be held by someone else's job first
SHORT = {"COURSE_DIST_TIMEOUT": "5"}
PREFLIGHT_PASSED = "preflight: all checks passed"


def torchrun(*args, timeout=120, **env):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         *map(str, args)],
        cwd=ROOT, env=clean_environ(**env), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def first_line(text, pattern):
    """Index of the first line matching ``pattern`` (a regular expression); -1 if none."""
    return next((i for i, line in enumerate(text.splitlines()) if re.search(pattern, line)), -1)


# --------------------------------------------------------------------------- local


def test_sizes_and_busbw():
    assert allreduce_bench.parse_size("1K") == 1024
    assert allreduce_bench.parse_size("256M") == 256 << 20
    assert allreduce_bench.sizes(1024, 16384) == [1024, 4096, 16384]
    assert allreduce_bench.busbw(3.0, 4) == pytest.approx(4.5)  # 2(n-1)/n = 1.5
    assert allreduce_bench.busbw(3.0, 1) == 0  # one rank sends nothing (nccl-tests: 0 too)
    with pytest.raises(Exception, match="not a size"):
        allreduce_bench.parse_size("lots")


@pytest.mark.timeout(300)
def test_step_runs_clean_under_torchrun():
    proc = torchrun(LESSON / "step.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"rank {rank}/2 on" in proc.stdout and "step 2: all_reduce done" in proc.stdout


@pytest.mark.timeout(300)
def test_benchmark_prints_algbw_and_busbw():
    proc = torchrun(LESSON / "allreduce_bench.py", "--max-bytes", "16K")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = allreduce_bench.parse_table(proc.stdout)
    assert [r["size"] for r in rows] == [1024, 4096, 16384], proc.stdout
    for r in rows:
        assert r["count"] == r["size"] // 4 and r["time_us"] > 0
        # bandwidth = size / time, and for 2 ranks busbw = algbw x 2(2-1)/2 = algbw
        assert r["algbw"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9, rel=0.05,
                                           abs=2e-3)  # fmt: skip
        assert r["busbw"] == pytest.approx(r["algbw"], abs=1e-3)
    assert re.search(r"# memory copy on \S+ \(cpu, 16384 B, one process\): [0-9.]+ GB/s",
                     proc.stdout), proc.stdout  # fmt: skip


def test_benchmark_sample_is_a_full_run():
    text = sample_output(LESSON, "allreduce-bench").read_text()
    rows = allreduce_bench.parse_table(text)
    assert [r["size"] for r in rows] == allreduce_bench.sizes(1 << 10, 256 << 20), text
    assert "4 ranks on 2 node(s)" in text
    for r in rows:
        assert r["busbw"] == pytest.approx(r["algbw"] * 1.5, abs=2e-3)  # n = 4
    assert "# memory copy on node1" in text


# --------------------------------------------------------------------------- cluster


@pytest.fixture
def run_job(cluster, cluster_lock, tmp_path):
    """Submit a job script of the lesson and wait for it: (exit status, output text).

    The job's state is asked every 0.3 s (``sbatch --wait`` looks only after 2, 10 and 42 s),
    so the shared cluster is held no longer than the job runs.
    """

    def run(script, *sbatch_args, **env):
        with cluster_lock():
            proc = subprocess.run(
                ["sbatch", "--parsable", f"--output={tmp_path}/%x-%j.out", *sbatch_args,
                 str(LESSON / script)],
                cwd=ROOT, env=job_environ({**SHORT, **env}), capture_output=True, text=True,
                timeout=60,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr
            job_id = proc.stdout.strip().split(";")[0]
            try:
                _, status, _ = wait_job(job_id, JOB_TIMEOUT)
            except (TimeoutError, RuntimeError) as exc:
                subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
                pytest.fail(f"{exc} ({script}); cancelled")
        out = list(tmp_path.glob(f"*-{job_id}.out"))
        return status, out[0].read_text() if out else ""

    return run


# Most failures show with one task per node as well as with the scripts' two: those jobs run
# 2 nodes x 1 task here (half the processes to start), while the stored samples show the scripts
# as written, 2 x 2. The crash of rank 3 and the bare localhost step need two tasks per node.
ONE_PER_NODE = ("--ntasks-per-node=1", "--gres=gpu:1")


def same_shape(job_name, fresh, patterns):
    """Each pattern is found in the stored sample exactly when it is found in the fresh run."""
    sample = sample_output(LESSON, job_name).read_text()
    for pattern in patterns:
        assert bool(re.search(pattern, sample, re.M)) == bool(re.search(pattern, fresh, re.M)), (
            pattern)  # fmt: skip


def test_world_size_exported_wrong(run_job):
    status, text = run_job("world_size.sh", *ONE_PER_NODE)
    assert status != 0, text
    named = "WORLD_SIZE=8 is set in the environment, but srun started 2 tasks"
    assert re.search(rf"^preflight: PROBLEM on node1: {named}", text, re.M), text
    assert re.search(rf"^preflight: PROBLEM on node2: {named}", text, re.M), text
    assert "step: RANK is not set" in text and "all_reduce done" not in text, text
    same_shape("world-size", text, [r"WORLD_SIZE=8 is set in the environment, but srun started",
                                    "step: RANK is not set", "all_reduce done"])


def test_master_addr_localhost(run_job):
    # As written, 2 x 2: in the bare script's step a rank on node1 beside rank 0 joins it, so
    # rank 0 waits for the rest and says so; alone on node1, srun may end it before it does.
    status, text = run_job("localhost.sh")
    assert status == 0, text  # the script reports each step's failure and goes on
    named = r"MASTER_ADDR='localhost' is a loopback address \(localhost -> 127\.0\.0\.1\)"
    # The preflight and common.env stop at once, one line per node / per rank.
    assert re.search(rf"^preflight: PROBLEM on node1: {named}", text, re.M), text
    assert re.search(rf"^preflight: PROBLEM on node2: {named}", text, re.M), text
    assert len(re.findall(rf"^step: {named}", text, re.M)) == 4, text
    # Without the check: node2 knocks on its own localhost while rank 0 waits for it.
    plain = text.split("== the same mistake without common/")[1]
    assert re.search(r"trying to connect to \(localhost, \d+\)", plain), plain
    # ... and node1's ranks give up waiting for it, or, when node2's rank gives up first (both
    # wait COURSE_DIST_TIMEOUT), srun's --kill-on-bad-exit ends them: a matter of timing.
    assert re.search(r"clients joined|wait timeout after|node1: tasks? [0-9-]+: Terminated",
                     plain), plain  # fmt: skip
    assert not re.search(r"^rank \d joined", plain, re.M), plain
    patterns = [rf"^preflight: PROBLEM on node2: {named}", rf"^step: {named}",
                r"trying to connect to \(localhost"]  # fmt: skip
    same_shape("localhost", text, patterns)


def test_wrong_interface(run_job):
    status, text = run_job("wrong_interface.sh", *ONE_PER_NODE)
    assert status != 0, text
    named = "GLOO_SOCKET_IFNAME=lo selects only the loopback interface, which other nodes cannot"
    assert re.search(rf"^preflight: PROBLEM on node1,node2 \(rank 0-1\): {named}", text, re.M)
    assert "interfaces on node2: lo 127.0.0.1; eth0 10.213.0.2 <- route to master" in text, text
    job = text.split("== the job")[1]
    # The rendezvous worked (MASTER_ADDR is right); gloo's own connections go to 127.0.0.1.
    assert re.search(r"Gloo connectFullMesh failed .*(Connection refused|Connect timeout)", job)
    assert "all_reduce done" not in job, job
    same_shape("wrong-interface", text, [rf"^preflight: PROBLEM .*{named}",
                                         "Gloo connectFullMesh failed"])  # fmt: skip


def test_port_taken_on_one_node(run_job):
    # Port 29500 is fixed in the script: the test holds the cluster lock, so no other job of the
    # course uses it meanwhile.
    status, text = run_job("port_taken.sh")
    assert status == 0, text  # the script reports world B's failure and goes on
    assert "world A: joined, holding the port for 6 s" in text and "world A: done" in text, text
    assert re.search(r"^torch\.distributed\.DistNetworkError: .* port: 29500, .*name: EADDRINUSE",
                     text, re.M), text  # fmt: skip
    assert "world B: joined" not in text and "== world B failed (exit 1)" in text, text
    same_shape("port-taken", text, ["EADDRINUSE", "world A: done"])


def test_one_rank_crashes_the_others_time_out(run_job):
    status, text = run_job("rank_crash.sh")
    assert status != 0, text
    assert PREFLIGHT_PASSED in text, text  # the setup is fine: the bug is in the program
    plain, killed = text.split("== the job, srun --kill-on-bad-exit=1")
    # The cause comes first; the time-outs of the others follow it.
    crash = first_line(plain, r"^FileNotFoundError: /data/shard-3\.pt")
    timeout = first_line(plain, r"could not join the process group|wait timeout after 5000ms")
    assert 0 <= crash < timeout, plain
    # With --kill-on-bad-exit=1 srun ends the other ranks at once: no time-out at all.
    assert "FileNotFoundError: /data/shard-3.pt" in killed, killed
    assert not re.search(r"could not join the process group|wait timeout after", killed), killed
    assert re.search(r"srun: error: node\d: tasks? [\d-]+: Terminated", killed), killed
    same_shape("rank-crash", text, ["^FileNotFoundError", "Terminated", PREFLIGHT_PASSED])


def test_mismatched_collectives_named_by_detail(run_job):
    status, text = run_job("mismatch.sh", *ONE_PER_NODE)
    assert status != 0, text
    plain, detail = text.split("== the job, TORCH_DISTRIBUTED_DEBUG=DETAIL")
    assert "Timed out waiting 5000ms" in plain and "Detected mismatch" not in plain, plain
    assert re.search(r"Detected mismatch between collectives on ranks\. Rank \d is running "
                     r"collective: CollectiveFingerPrint\(SequenceNumber=2, OpType=(ALLREDUCE|"
                     r"BROADCAST)", detail), detail  # fmt: skip
    assert "OpType=BROADCAST" in detail and "Timed out waiting" not in detail, detail
    same_shape("mismatch", text, ["Timed out waiting", "Detected mismatch", PREFLIGHT_PASSED])


def test_hung_rank_seen_by_py_spy_and_faulthandler(run_job):
    # Long enough for the inspection to happen while the other ranks still wait.
    status, text = run_job("hung_rank.sh", *ONE_PER_NODE, COURSE_DIST_TIMEOUT="15")
    assert status != 0, text
    inspect, after = text.split("== faulthandler: scancel --signal=USR1")
    # py-spy, from outside: the stuck rank is in its own loop, the others in all_reduce.
    assert len(re.findall(r"^\s+wait_for_lock_forever \(step\.py:\d+\)", inspect, re.M)) == 1
    assert len(re.findall(r"^\s+all_reduce \(torch/distributed/distributed_c10d\.py:\d+\)",
                          inspect, re.M)) == 1, inspect  # fmt: skip
    # faulthandler, from inside: every rank printed its stack into the job's output.
    # srun --label: each line starts with its rank.
    assert sorted(re.findall(r"^(\d): Current thread 0x[0-9a-f]+ \(most recent call first\):",
                             after, re.M)) == ["0", "1"], after  # fmt: skip
    assert re.search(r'^1: +File ".*step\.py", line \d+ in wait_for_lock_forever', after, re.M)
    assert re.search(r"Timed out waiting 15000ms", after), after
    same_shape("hung-rank", text, ["wait_for_lock_forever", "Current thread", "Timed out"])
