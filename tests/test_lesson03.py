"""Lesson 03 (DDP MNIST, checkpoints, preemption).

CPU smoke: train.py as a single-node gloo world (1 and 2 processes) on a subset of MNIST.
Resume: a run stopped after epoch k (or mid-epoch by SIGUSR1 to one rank) and resumed ends with
exactly the weights of an uninterrupted run with the same seed.
Cluster: job.sh for one epoch on the local 2 x 2 cluster; a preemption rehearsal (USR1 to the
batch shell -> checkpoint -> requeue -> resume -> done with SLURM_RESTART_COUNT=1).
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import clean_environ  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "lessons" / "03_ddp_mnist"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(LESSON))

import train  # noqa: E402  (lessons/03_ddp_mnist/train.py)

from common.mnist import prepare  # noqa: E402

TIMEOUT = 120
SUBSET = ["--train-subset", "2048", "--test-subset", "1000"]


@pytest.fixture(scope="module", autouse=True)
def mnist_ready():
    prepare(log=lambda *_: None)




def command(nprocs, *args):
    script = [str(LESSON / "train.py"), *args]
    if nprocs == 1:
        return [sys.executable, *script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nprocs}", *script]  # fmt: skip


def run_train(nprocs, *args):
    return subprocess.run(
        command(nprocs, *args), cwd=ROOT, env=clean_environ(), capture_output=True, text=True,
        timeout=TIMEOUT,
    )  # fmt: skip


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same_state(a, b):
    """Same weights, BatchNorm statistics and optimizer moments, bit for bit."""
    assert a["epoch"] == b["epoch"] and a["step"] == b["step"] == 0
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for key, moments in a["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, b["optimizer"]["state"][key][name]), (key, name)
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]


# --------------------------------------------------------------------------- CPU smoke


@pytest.mark.timeout(TIMEOUT + 30)
def test_smoke_single_process(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    proc = run_train(1, "--epochs", "1", *SUBSET, "--log-every", "4",
                     "--checkpoint", str(ckpt))  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "world size 1 (1 node(s) x 1), global batch 128 = 1 x 128" in out, out
    assert "backend gloo" in out and "device cpu" in out, out
    rows = train.parse_log(out)
    assert [r["epoch"] for r in rows] == [1], out
    assert rows[0]["test_acc"] > 50.0, out  # 16 steps on 2048 images: far above chance (10 %)
    assert rows[0]["samples_per_s"] > 0 and rows[0]["epoch_time"] > 0
    assert re.search(r"^step  epoch 1/1 \| batch 4/16 \| loss [\d.]+ \| lr \S+ \| \d+ samples/s$",
                     out, re.M), out  # fmt: skip
    assert f"done: test_acc {rows[0]['test_acc']:.2f}% after 1 epochs" in out
    state = load(ckpt)
    assert state["epoch"] == 1 and state["world_size"] == 1
    assert not list(tmp_path.glob(".*tmp*")), "temporary checkpoint file left behind"


# Two epochs of 33 steps on 3 ranks: the reference that the interrupted runs must reproduce.
# Three, not two: with two ranks any order of adding up gradients gives the same bits, with three
# it does not, so only three ranks show that a resumed run really repeats the same arithmetic.
N = 3
RESUME_ARGS = ["--epochs", "2", "--train-subset", "4096", "--test-subset", "1000",
               "--log-every", "4"]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("full") / "full.pt"
    proc = run_train(N, *RESUME_ARGS, "--checkpoint", str(ckpt))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, ckpt


@pytest.mark.timeout(TIMEOUT + 30)
def test_smoke_three_processes(uninterrupted):
    out, ckpt = uninterrupted
    assert "world size 3 (1 node(s) x 3), global batch 126 = 3 x 42, 33 steps" in out, out
    assert out.count("training 2 epochs") == 1, out  # rank 0 alone prints
    rows = train.parse_log(out)
    assert [r["epoch"] for r in rows] == [1, 2], out
    assert rows[-1]["test_acc"] > 90.0, out
    assert load(ckpt)["epoch"] == 2 and load(ckpt)["world_size"] == 3


@pytest.mark.timeout(TIMEOUT * 3 + 30)
def test_resume_after_epoch_gives_identical_weights(uninterrupted, tmp_path):
    full_log, full = uninterrupted
    part = tmp_path / "part.pt"
    stopped = run_train(N, *RESUME_ARGS, "--checkpoint", str(part), "--stop-after-epoch", "1")
    assert stopped.returncode != 0, stopped.stdout  # torchrun reports the workers' status 75
    assert "checkpoint saved after epoch 1; exiting with 75" in stopped.stdout, stopped.stdout
    assert load(part)["epoch"] == 1

    # A checkpoint only fits a run of the same shape: one process cannot continue it.
    copy = tmp_path / "copy.pt"
    copy.write_bytes(part.read_bytes())
    refused = run_train(1, *RESUME_ARGS, "--checkpoint", str(copy))
    assert refused.returncode != 0
    assert "world size 3, 33 steps per epoch" in refused.stderr, refused.stderr
    assert "this one has 1, 32 and 2" in refused.stderr, refused.stderr

    resumed = run_train(N, *RESUME_ARGS, "--checkpoint", str(part))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {part} at the start of epoch 2" in resumed.stdout, resumed.stdout
    assert [r["epoch"] for r in train.parse_log(resumed.stdout)] == [2]
    assert_same_state(load(full), load(part))
    # The log agrees: same loss and accuracy for epoch 2.
    want, got = train.parse_log(full_log)[1], train.parse_log(resumed.stdout)[0]
    for key in ("train_loss", "test_loss", "test_acc"):
        assert got[key] == want[key], key


def children(pid):
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


@pytest.mark.timeout(TIMEOUT * 2 + 30)
def test_usr1_to_one_rank_mid_epoch_then_resume_gives_identical_weights(uninterrupted, tmp_path):
    """The signal reaches one rank only; all ranks still stop at the same step and save."""
    full_log, full = uninterrupted
    part, log = tmp_path / "part.pt", tmp_path / "stopped.log"
    with open(log, "w") as out:
        launcher = subprocess.Popen(
            command(N, *RESUME_ARGS, "--checkpoint", str(part)), cwd=ROOT, env=clean_environ(),
            stdout=out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + TIMEOUT
            while "batch 4/33" not in log.read_text():
                assert launcher.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
            workers = children(launcher.pid)
            assert len(workers) == N, workers
            os.kill(workers[-1], signal.SIGUSR1)  # one rank only
            launcher.wait(timeout=TIMEOUT)
        finally:
            if launcher.poll() is None:
                launcher.kill()
    text = log.read_text()
    match = re.search(r"checkpoint saved at epoch (\d), step (\d+); exiting with 75", text)
    assert match, text
    epoch, step = int(match[1]), int(match[2])
    assert step % train.STOP_CHECK_EVERY == 0, text
    assert load(part)["epoch"] == epoch - 1 and load(part)["step"] == step

    resumed = run_train(N, *RESUME_ARGS, "--checkpoint", str(part))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {part} at epoch {epoch}, step {step}" in resumed.stdout, resumed.stdout
    assert_same_state(load(full), load(part))
    # The interrupted epoch's loss covers the steps before and after the stop.
    want = train.parse_log(full_log)[epoch - 1]
    got = train.parse_log(resumed.stdout)[0]
    assert got["epoch"] == epoch
    assert got["train_loss"] == pytest.approx(want["train_loss"], abs=2e-4)
    assert got["test_acc"] == want["test_acc"]


def test_parse_log_keeps_the_last_copy_of_an_epoch():
    line = ("epoch {}/3 | train_loss 0.5 | test_loss 0.1 | test_acc {}% | 100 samples/s "
            "| epoch_time 1.0s | time_left 2.0s")  # fmt: skip
    text = "\n".join([line.format(1, "97.00"), "noise", line.format(1, "97.50"),
                      line.format(2, "98.25")])  # fmt: skip
    rows = train.parse_log(text)
    assert [(r["epoch"], r["test_acc"]) for r in rows] == [(1, 97.5), (2, 98.25)]


def test_sample_outputs_in_the_lesson_folder():
    """The captured outputs the README shows: a full default run and a preempted, requeued one."""
    samples = {p.name: p.read_text() for p in LESSON.glob("slurm-*.out")}
    assert all(re.fullmatch(r"slurm-\d+\.out", name) for name in samples), sorted(samples)
    requeued = [name for name, text in samples.items() if "SLURM_RESTART_COUNT=1" in text]
    plain = [name for name in samples if name not in requeued]
    assert len(requeued) == 1 and len(plain) == 1, sorted(samples)
    for name, text in samples.items():
        job_id = re.fullmatch(r"slurm-(\d+)\.out", name)[1]
        assert f"=== job {job_id} (ddp-mnist) starts" in text, name
        rows = check_job_output(text, epochs=3, min_acc=99.0)
        assert rows[-1]["epoch"] == 3, name
    text = samples[requeued[0]]
    assert "got SIGUSR1" in text and "exiting with 75" in text and "resumed from" in text


# --------------------------------------------------------------------------- local cluster

JOB = "lessons/03_ddp_mnist/job.sh"


def check_job_output(text, epochs, min_acc):
    assert "world size 4 (2 node(s) x 2)" in text, text
    assert "backend gloo" in text or "backend nccl" in text, text
    rows = train.parse_log(text)
    assert [r["epoch"] for r in rows] == list(range(1, epochs + 1)), text
    assert rows[-1]["test_acc"] >= min_acc, text
    assert f"done: test_acc {rows[-1]['test_acc']:.2f}% after {epochs} epochs" in text, text
    assert re.search(r"MASTER_ADDR=node1 MASTER_PORT=\d+ WORLD_SIZE=4", text), text
    return rows


@pytest.mark.timeout(300)
def test_job_one_epoch_on_local_cluster(cluster, sbatch_wait, tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    result = sbatch_wait(
        JOB, f"--output={tmp_path}/slurm-%j.out", f"--export=ALL,EPOCHS=1,CHECKPOINT={ckpt}",
        timeout=240,
    )  # fmt: skip
    text = result.output
    assert result.returncode == 0, text
    check_job_output(text, epochs=1, min_acc=97.0)
    assert "SLURM_RESTART_COUNT=0" in text, text
    assert load(ckpt)["epoch"] == 1


def slurm(*args, timeout=30):
    # Without the SLURM_*/SBATCH_* variables of any allocation the suite itself may run in.
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=environ)
    assert proc.returncode == 0, f"{' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def job_fields(job_id):
    text = slurm("scontrol", "show", "job", str(job_id))
    return dict(re.findall(r"(\w+)=(\S*)", text))


def wait_for(what, predicate, timeout, poll=0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


def job_done(job_id):
    state = job_fields(job_id).get("JobState")
    return state if state not in ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", None) else None


@pytest.mark.timeout(400)
def test_preemption_checkpoint_requeue_resume(cluster, tmp_path):
    ckpt, out = tmp_path / "ckpt.pt", tmp_path / "slurm-%j.out"
    job_id = slurm(
        "sbatch", "--parsable", f"--output={out}", f"--export=ALL,EPOCHS=1,CHECKPOINT={ckpt}",
        str(ROOT / JOB),
    ).strip().split(";")[0]  # fmt: skip
    log = Path(str(out).replace("%j", job_id))
    try:
        # Mid-epoch, SIGUSR1 to the batch shell: what --signal=B:USR1@120 sends before the limit.
        wait_for("a progress line", lambda: log.exists() and "batch 100/" in log.read_text(), 180)
        slurm("scancel", "--signal=USR1", "--batch", job_id)
        # The job saves, requeues itself, and SLURM holds the requeued job for a while
        # (EligibleTime, about 2 minutes); release it at once.
        wait_for("the requeue", lambda: job_fields(job_id).get("Restarts") == "1", 120)
        wait_for("the hold", lambda: job_fields(job_id).get("JobState") == "PENDING", 60)
        # Not within the second of the requeue: SLURM revoked the first run's credential at that
        # second and refuses to start the job again with a credential of the same second.
        time.sleep(3)
        slurm("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        final = wait_for("the end of the job", lambda: job_done(job_id), 240)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    text = log.read_text()
    assert final == "COMPLETED", text
    stop = re.search(r"checkpoint saved at epoch 1, step (\d+); exiting with 75", text)
    assert stop, text
    assert "got SIGUSR1" in text and f"requeueing job {job_id}" in text, text
    assert f"resumed from {ckpt} at epoch 1, step {stop[1]}" in text, text
    # Both runs wrote into the same file (--open-mode=append), the second with restart count 1.
    assert "SLURM_RESTART_COUNT=0" in text and "SLURM_RESTART_COUNT=1" in text, text
    check_job_output(text, epochs=1, min_acc=97.0)
    assert load(ckpt)["epoch"] == 1 and load(ckpt)["step"] == 0
