"""Lesson 05 (fault tolerance).

CPU (gloo; the ranks start on this machine as srun starts them, one process each): every
epoch the ranks share the images out between them, reshuffled from the epoch before; a run
stopped by a signal that reaches one rank mid-epoch resumes there, stops again after the epoch,
resumes at the epoch boundary and ends with exactly the weights of an uninterrupted run; a
checkpoint of another world size is refused. A rank that crashes, restarted by torchrun and
resumed from the last checkpoint, is the notebook's crash cell (NBVAL_CHECK_OUTPUT: its output
is compared under `make test`).
Cluster: the time-limit warning and a real preemption (partition urgent) on one job, each
followed by a checkpoint, a requeue and a resume; a chain (array + afterany); a faulty node
that makes the job fail, named, then left out with --exclude.
"""

import importlib.util
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    job_record,
    restarts_after_a_kill_at_the_end_of_grace_time,
    slurm,
    wait_for,
    wait_job,
)
from helpers import check_sampler_order, run_ranks, start_ranks

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "lessons" / "05_fault_tolerance"
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("fault_tolerance", LESSON / "train.py")
ft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ft)

from common.notebook import parse_log  # noqa: E402

TIMEOUT = 120


def command(*args):
    return [sys.executable, str(LESSON / "train.py"), *args]


def run_train(nprocs, *args, **env):
    # The ranks start as srun starts them in requeue.sh: one process each, no launcher.
    return run_ranks(nprocs, command(*args), timeout=TIMEOUT, **env)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same_state(a, b):
    """Same weights, BatchNorm statistics and optimizer moments, bit for bit."""
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"])
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for key, moments in a["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, b["optimizer"]["state"][key][name]), (key, name)
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]


# Three ranks, not two: with two, any order of adding up the gradients gives the same bits;
# with three it does not, so only three show that a resumed run repeats the same arithmetic.
N = 3
ARGS = ["--epochs", "2", "--train-subset", "2048", "--test-subset", "1000", "--log-every", "4"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run the others are compared with; ORDER: the images each rank trained on."""
    folder = tmp_path_factory.mktemp("full")
    ckpt, order = folder / "full.pt", folder / "order"
    proc = run_train(N, *ARGS, "--checkpoint", str(ckpt), "--log-order", str(order))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "world size 3, 17 steps per epoch" in proc.stdout, proc.stdout
    return proc.stdout, ckpt, order


@pytest.mark.timeout(TIMEOUT + 30)
def test_each_epoch_a_new_shuffle_shared_out_over_the_ranks(uninterrupted):
    """The sampler, seen from what the ranks trained on: every epoch the 3 ranks split all
    2,048 images between them (one repeated: 3 x 683), and each rank gets other images in
    epoch 2 than in epoch 1 (sampler.set_epoch)."""
    check_sampler_order(uninterrupted[2], N, 2048, 2)


@pytest.mark.timeout(TIMEOUT * 3 + 30)
def test_stopped_mid_epoch_then_resumed_twice_gives_identical_weights(uninterrupted, tmp_path):
    """Preemption's SIGTERM reaches one rank only; all ranks stop at the same step and save.
    The run resumes mid-epoch for one epoch (--epochs-per-run), then again at the epoch
    boundary, and ends with the weights and the log of the uninterrupted run."""
    full_log, full, _ = uninterrupted
    want = parse_log(full_log)
    part, log = tmp_path / "part.pt", tmp_path / "stopped.log"
    with open(log, "w") as out:
        ranks = start_ranks(N, command(*ARGS, "--checkpoint", str(part), "--log-every", "2"),
                            stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            deadline = time.monotonic() + TIMEOUT
            while "batch 2/17" not in log.read_text():
                assert all(r.poll() is None for r in ranks), log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
            ranks[-1].send_signal(signal.SIGTERM)  # one rank only
            codes = [r.wait(timeout=TIMEOUT) for r in ranks]
        finally:
            for r in ranks:
                if r.poll() is None:
                    r.kill()
    text = log.read_text()
    assert codes == [ft.REQUEUE_EXIT_CODE] * N, text
    # The ranks agree every 10 steps (--stop-check-every): at the first check after batch 2.
    match = re.search(r"checkpoint saved at epoch 1, step (\d+); exiting with 75", text)
    assert match and match[1] == "10", text
    step = int(match[1])
    assert (load(part)["epoch"], load(part)["step"]) == (0, step)

    # Mid-epoch: the rest of epoch 1, then stop at the epoch's end as a chain's link does.
    rest = run_train(N, *ARGS, "--checkpoint", str(part), "--epochs-per-run", "1")
    assert rest.returncode == 0, rest.stdout + rest.stderr
    assert f"resumed from {part} at epoch 1, step {step}" in rest.stdout, rest.stdout
    assert "this run's 1 epoch(s) done: 1/2" in rest.stdout, rest.stdout
    got = parse_log(rest.stdout)
    assert [r["epoch"] for r in got] == [1], rest.stdout
    assert (got[0]["test_loss"], got[0]["test_acc"]) == (want[0]["test_loss"], want[0]["test_acc"])
    # the epoch's loss is summed over two runs, in another order: equal up to rounding
    assert got[0]["train_loss"] == pytest.approx(want[0]["train_loss"], abs=2e-4)
    assert (load(part)["epoch"], load(part)["step"]) == (1, 0)

    # At the epoch boundary: epoch 2 repeats the uninterrupted one bit for bit.
    last = run_train(N, *ARGS, "--checkpoint", str(part))
    assert last.returncode == 0, last.stdout + last.stderr
    assert f"resumed from {part} at epoch 2, step 0" in last.stdout, last.stdout
    assert_same_state(load(full), load(part))
    got = parse_log(last.stdout)
    assert [r["epoch"] for r in got] == [2], last.stdout
    assert all(got[0][k] == want[1][k] for k in ("train_loss", "test_loss", "test_acc")), (
        got, want)  # fmt: skip


@pytest.mark.timeout(TIMEOUT + 30)
def test_checkpoint_of_another_shape_is_refused_in_one_line(uninterrupted, tmp_path):
    copy = tmp_path / "copy.pt"
    copy.write_bytes(uninterrupted[1].read_bytes())
    proc = run_train(1, *ARGS, "--checkpoint", str(copy))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: checkpoint {copy} was written with world_size=3, this run has world_size=1: "
        f"run with the same settings to continue it, or delete it (rm {copy}) to start afresh, "
        "or pass another CHECKPOINT (--checkpoint PATH)"
    ], proc.stderr


def test_sample_outputs_in_the_lesson_folder():
    texts = {p.name: p.read_text() for p in LESSON.glob("*.out")}
    warned = [t for t in texts.values() if "got SIGUSR1" in t]
    preempted = [t for t in texts.values() if "stop requested (signal 15)" in t]
    assert len(warned) == 1 and len(preempted) == 1, sorted(texts)
    for text in warned + preempted:
        assert "exiting with 75 to be requeued" in text and "SLURM_RESTART_COUNT=1" in text
        assert re.search(r"resumed from \S+ at epoch \d, step [1-9]\d*", text), text
        assert "done: test_acc" in text, text
    assert "urgent job" in texts[next(n for n in texts if n.startswith("ft-urgent"))]
    chain = [t for n, t in texts.items() if n.startswith("ft-chain-")]
    assert len(chain) == 1 and chain[0].count("=== link") == 3, sorted(texts)
    crashes = [t for t in texts.values() if "deliberate crash" in t]
    assert any("finished" in t for t in crashes) and any("failed" in t for t in crashes)


# --------------------------------------------------------------------------- local cluster






def release_after_requeue(job_id, restarts):
    """Wait for the requeue. SLURM holds a requeued job for AuthInfo's cred_expire (10 s here,
    cluster/slurm.conf.in says why it must not be released sooner), then starts it again. The
    count is what tells: by the time a preempting job has ended, the requeued job may already
    run again, so its state may never be seen PENDING."""
    wait_for(f"requeue {restarts}", lambda: (r := job_record(job_id)) and
             int(r.get("Restarts", 0)) >= restarts, 180)  # fmt: skip


# 110 steps: the two stops come at about steps 30 and 50-60, and the last run does the rest.
SMALL = ["--train-subset", "14000", "--test-subset", "2000", "--log-every", "20"]


@pytest.mark.long  # about 70 s of grace times and requeues alone: make test-long
@pytest.mark.timeout(1500)  # CI runs it beside other lanes: minutes where it takes seconds alone
def test_warning_then_preemption_then_resume(cluster, cluster_lock, tmp_path):
    """The README's §1 and §2 as written (requeue.sh: 3 epochs on 2 nodes x 2 ranks) on the
    first 12,800 images (SUBSET: 100 steps an epoch, a progress line at the last): warned,
    requeued, preempted by the urgent partition, requeued, finished."""
    out = tmp_path / "job.out"
    def log():
        return out.read_text() if out.exists() else ""

    with cluster_lock():
        job = slurm("sbatch", "--parsable", f"--output={out}", LESSON / "requeue.sh",
                    env={"SUBSET": "12800"})  # fmt: skip
        ckpt = ROOT / "checkpoints" / f"ft-{job}.pt"
        urgent = None
        try:
            # 1. The time-limit warning, sent now: what --signal=B:USR1@120 sends before the end.
            wait_for("a progress line", lambda: "batch 100/" in log(), 480)
            slurm("scancel", "--signal=USR1", "--batch", job)
            release_after_requeue(job, 1)
            # 2. Preemption: a job of partition urgent needs every GPU of both nodes.
            # (A progress line of the resumed run itself: a preemption while the resumed run is
            # still starting, before train.py's handler is in place, ends it with 143, not
            # requeued.)
            wait_for("the resumed run", lambda: re.search(
                r"batch \d+/", log().partition("SLURM_RESTART_COUNT=1")[2]), 480)  # fmt: skip
            urgent = slurm("sbatch", "--parsable", f"--output={tmp_path}/urgent.out",
                           LESSON / "preempt.sh")  # fmt: skip
            assert wait_job(urgent, timeout=240)[:2] == ("COMPLETED", 0)
            release_after_requeue(job, 2)
            # On 24.11 the end of the resumed run requeues the job once more: the flag that
            # preemption's SIGTERM set is still on (tests/test_cluster_preempt.py,
            # restarts_after_a_kill_at_the_end_of_grace_time; 22.05 and 26.05 do not); the
            # last run has nothing to do.
            restarts = 1 + restarts_after_a_kill_at_the_end_of_grace_time()
            if restarts == 3:
                release_after_requeue(job, 3)
            state, code, record = wait_job(job, timeout=480)
        finally:
            for j in (job, urgent):
                if j:
                    subprocess.run(["scancel", j], capture_output=True, timeout=30)
            ckpt.unlink(missing_ok=True)
    text = log()
    assert (state, code) == ("COMPLETED", 0), text
    assert record.get("Restarts") == str(restarts), record
    assert "world size 4, 100 steps per epoch" in text, text  # the script's 2 nodes x 2 ranks
    stops = re.findall(r"checkpoint saved at epoch (\d+), step (\d+); exiting with 75", text)
    assert len(stops) == 2 and [int(e) * 10**6 + int(s) for e, s in stops] == sorted(
        int(e) * 10**6 + int(s) for e, s in stops), text
    # The warning reaches the batch shell (B:), which passes it on; preemption signals the tasks.
    assert "got SIGUSR1" in text and "stop requested (signal 15)" in text, text
    for restart, (epoch, step) in enumerate(stops, 1):
        assert f"SLURM_RESTART_COUNT={restart}" in text, text
        assert f"resumed from {ckpt} at epoch {epoch}, step {step}" in text, text
    assert re.search(r"done: test_acc \d+\.\d+% after 3 epochs", text), text


def training_pids(job: str) -> list[int]:
    """The tasks of this job's step 0 running lesson 05's train.py: python processes whose
    environment says so (srun's own processes carry train.py on their command line too, and
    the job's id, but no SLURM_STEP_ID=0)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or gone
            continue
        if (f"SLURM_JOB_ID={job}".encode() in env and b"SLURM_STEP_ID=0" in env
                and Path(argv[0].decode(errors="replace")).name.startswith("python")
                and any(a.endswith(b"05_fault_tolerance/train.py") for a in argv)):  # fmt: skip
            pids.append(int(proc.name))
    return pids


@pytest.mark.long  # a requeue (cred_expire's hold) and a second run: make test-long
@pytest.mark.timeout(600)
def test_stop_while_python_starts_is_requeued(cluster, cluster_lock, tmp_path):
    """Preemption's SIGTERM reaches the tasks at once, maybe before train.py has set its
    handler (while Python imports torch): they end with 143 and nothing is saved. requeue.sh
    requeues the job all the same, and the next run trains from the beginning."""
    out, ckpt = tmp_path / "job.out", tmp_path / "ckpt.pt"
    with cluster_lock():
        job = slurm("sbatch", "--parsable", "--nodes=1", f"--output={out}",
                    f"--export=ALL,CHECKPOINT={ckpt}", LESSON / "requeue.sh", "1",
                    *SMALL)  # fmt: skip
        try:
            # Once both training processes exist (a step listed by squeue may not have started
            # its tasks yet, and a signal then reaches none), signal the tasks, not the batch
            # shell, as preemption does, while Python still imports torch.
            wait_for("both training processes", lambda: len(training_pids(job)) >= 2, 360,
                     poll=0.05)  # fmt: skip
            slurm("scancel", "--signal=TERM", job)
            release_after_requeue(job, 1)
            state, code, record = wait_job(job, timeout=300)
        finally:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
    text = out.read_text() if out.exists() else ""
    first = text.partition("SLURM_RESTART_COUNT=1")[0]
    assert "exiting with 75" not in first, "the handler was in place already: " + text
    assert re.search(r"the training ended with status 1(43|38), stopped before it could save",
                     first), text  # fmt: skip
    assert "it starts from the beginning (no checkpoint yet)" in first, text
    assert (state, code) == ("COMPLETED", 0), text
    assert record.get("Restarts") == "1", record
    assert re.search(r"done: test_acc \d+\.\d+% after 1 epochs", text), text


@pytest.mark.timeout(600)
def test_chain_of_array_links_and_a_dependent_job(cluster, cluster_lock, tmp_path):
    """The README's §3 as written, on the first 1,024 images of each set (SUBSET): the array's
    3 links, one at a time, each resuming the last; then a separate job of one more link
    (--array=4 replaces the script's 1-3%1) after the array (afterany), in the same chain
    (CHAIN=<the array's id>): it finds the training finished and says so."""
    out = tmp_path / "chain.out"
    subset = {"SUBSET": "1024"}
    with cluster_lock():
        array = slurm("sbatch", "--parsable", f"--output={out}", LESSON / "chain.sh",
                      env=subset)  # fmt: skip
        last = slurm("sbatch", "--parsable", "--array=4", f"--dependency=afterany:{array}",
                     f"--output={out}", f"--export=ALL,CHAIN={array}", LESSON / "chain.sh",
                     env=subset)  # fmt: skip
        try:
            state, code, _ = wait_job(f"{last}_4", timeout=240)
            # The README's array itself (ended before link 4 started): its 3 links COMPLETED.
            array_state = wait_job(array, timeout=60)[0]
        finally:
            subprocess.run(["scancel", array, last], capture_output=True, timeout=30)
            (ROOT / "checkpoints" / f"ft-chain-{array}.pt").unlink(missing_ok=True)
    text = out.read_text()
    assert (state, code, array_state) == ("COMPLETED", 0, "COMPLETED"), text
    links = re.findall(rf"=== link (\d) of chain {array} ", text)
    assert [int(n) for n in links] == [1, 2, 3, 4], text
    assert [r["epoch"] for r in parse_log(text)] == [1, 2, 3], text
    assert text.count("resumed from") == 3 and "done: test_acc" in text, text
    assert "nothing to do" in text.rpartition(f"=== link 4 of chain {array}")[2], text


@pytest.mark.long  # three 2-node jobs with restarts, about 70 s: make test-long
@pytest.mark.timeout(800)
def test_crashed_rank_restarted_then_faulty_node_named_then_excluded(cluster, cluster_lock,
                                                                    tmp_path):  # fmt: skip
    """The README's §4 as written, on the first 2,048 images of each set (SUBSET): rank 3
    fails once and torchrun restarts every worker; then every worker of node2 fails in every
    attempt, torchrun's report names node2, and the job without node2 runs."""
    subset, results = {"SUBSET": "2048"}, {}

    def finish(name: str, job: str) -> None:
        try:
            results[name] = (wait_job(job, timeout=300)[1], (tmp_path / f"{name}.out").read_text())
        finally:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
            (ROOT / "checkpoints" / f"ft-crash-{job}.pt").unlink(missing_ok=True)

    with cluster_lock():
        finish("crash", slurm("sbatch", "--parsable", f"--output={tmp_path}/crash.out",
                              LESSON / "crash.sh", "2", "--crash-rank", "3", env=subset))
        finish("faulty", slurm("sbatch", "--parsable", f"--output={tmp_path}/faulty.out",
                               LESSON / "crash.sh", "1", "--faulty-node", "node2",
                               "--crash-in-epoch", "1", env=subset))  # fmt: skip
        finish("without", slurm("sbatch", "--parsable", f"--output={tmp_path}/without.out",
                                "--nodes=1", "--exclude=node2", LESSON / "crash.sh", "1",
                                env=subset))  # fmt: skip
    status, text = results["crash"]
    assert status == 0 and "2 node(s) x 2 workers, torchrun --max-restarts 1" in text, text
    assert "deliberate crash of rank 3" in text and "resumed from" in text, text
    assert re.search(r"done: test_acc \d+\.\d+% after 2 epochs", text), text
    status, text = results["faulty"]
    assert status != 0, text
    # torchrun's report: the first failure, on its host, with the traceback @record saved in
    # its error file.
    root = text.partition("Root Cause (first observed failure)")[2]
    assert "error_file: /" in root and re.search(r"host +: node2", root), text
    assert re.search(r"RuntimeError: deliberate crash of rank [23] on node2", root), text
    assert "resubmit without it, sbatch --exclude=<host>" in text, text
    status, text = results["without"]
    assert status == 0, text
    assert "on node1: 1 node(s) x 2 workers" in text and "done: test_acc" in text, text
