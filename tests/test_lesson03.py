"""Lesson 03 (DDP MNIST).

CPU: train.py as a single-node gloo world on a subset of MNIST; the two ranks train on two
halves of the images, reshuffled every epoch (--log-order); a run killed after its first
checkpoint resumes at the epoch boundary and ends like an uninterrupted one; a damaged checkpoint
or a flag that cannot work is one line, printed once, never a traceback.
Carried: train.py with three files of common/ in a directory of its own trains under torchrun
and under srun. Cluster: bad input refused before srun; the README's quick first run (SUBSET=2048,
make test-long). job.sh itself runs for one epoch on the local 2 x 2 cluster as the ordinary
user `student` (tests/test_cluster_student.py, with check_job_output).
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import submit_job
from helpers import check_sampler_order, clean_environ, kill_once_written, run_ranks, start_ranks
from test_imports import CARRIED  # what a student copies: train.py's files of common/

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "lessons" / "03_ddp_mnist"
sys.path.insert(0, str(ROOT))
from common.mnist import build_model, default_data_dir  # noqa: E402
from common.mnist_prepare import prepare  # noqa: E402
from common.notebook import parse_log  # noqa: E402

TIMEOUT = 120
SUBSET = ["--train-subset", "2048", "--test-subset", "1000"]


@pytest.fixture(scope="module", autouse=True)
def mnist_ready():
    prepare(log=lambda *_: None)


def command(*args):
    return [sys.executable, str(LESSON / "train.py"), *args]


def run_train(nprocs, *args):
    # One process per rank, as srun starts them in job.sh (no launcher in between).
    return run_ranks(nprocs, command(*args), timeout=TIMEOUT)


def torchrun_train(nprocs, *args):
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nprocs}", *command(*args)[1:]],
        cwd=ROOT, env=clean_environ(), capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip


def load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


# --------------------------------------------------------------------------- CPU


@pytest.mark.timeout(TIMEOUT * 2 + 30)
def test_smoke_single_process_then_nothing_to_do(tmp_path):
    ckpt = tmp_path / "ckpt.pt"
    proc = run_train(1, "--epochs", "1", *SUBSET, "--log-every", "4", "--checkpoint", str(ckpt))
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "world size 1 (1 node(s) x 1), global batch 128 = 1 x 128, 16 steps" in out, out
    assert "backend gloo" in out and "device cpu" in out, out
    rows = parse_log(out)
    assert [r["epoch"] for r in rows] == [1], out
    assert rows[0]["test_acc"] > 50.0, out  # 16 steps on 2048 images: far above chance (10 %)
    assert rows[0]["samples_per_s"] > 0 and rows[0]["epoch_time"] > 0
    assert re.search(r"^step  epoch 1/1 \| batch 4/16 \| loss [\d.]+ \| lr \S+$", out, re.M), out
    assert f"done: test_acc {rows[0]['test_acc']:.2f}% after 1 epochs" in out
    assert load(ckpt)["epoch"] == 1
    assert not list(tmp_path.glob(".*tmp*")), "temporary checkpoint file left behind"

    again = run_train(1, "--epochs", "1", *SUBSET, "--checkpoint", str(ckpt))
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {ckpt} after epoch 1" in again.stdout, again.stdout
    assert "nothing to do" in again.stdout and not parse_log(again.stdout)


RESUME = ["--epochs", "2", "--train-subset", "2048", "--test-subset", "1000", "--log-every", "8"]


@pytest.mark.timeout(TIMEOUT * 3 + 30)
def test_killed_after_first_checkpoint_resumes_at_the_epoch_boundary(tmp_path):
    full_ckpt, part = tmp_path / "full.pt", tmp_path / "part.pt"
    full = run_train(2, *RESUME, "--checkpoint", str(full_ckpt), "--log-order", str(tmp_path))
    assert full.returncode == 0, full.stdout + full.stderr
    assert "world size 2 (1 node(s) x 2), global batch 128 = 2 x 64" in full.stdout
    assert full.stdout.count("training 2 epochs") == 1, full.stdout  # rank 0 alone prints
    # What the ranks trained on: two halves of the 2,048 images, reshuffled in epoch 2.
    check_sampler_order(tmp_path, 2, 2048, 2)

    # The same run, killed (SIGKILL, no goodbye) as soon as its epoch-1 checkpoint exists.
    log = tmp_path / "killed.log"
    with open(log, "w") as out:
        ranks = start_ranks(2, command(*RESUME, "--checkpoint", str(part)), stdout=out,
                            stderr=subprocess.STDOUT)  # fmt: skip
        kill_once_written(ranks, part, log, TIMEOUT)
    assert load(part)["epoch"] == 1, log.read_text()

    resumed = run_train(2, *RESUME, "--checkpoint", str(part))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {part} after epoch 1" in resumed.stdout, resumed.stdout
    got, want = parse_log(resumed.stdout), parse_log(full.stdout)
    assert [r["epoch"] for r in got] == [2] and [r["epoch"] for r in want] == [1, 2]
    # Same data order (sampler seeded by epoch), same optimizer and schedule: epoch 2 repeats.
    for key in ("train_loss", "test_loss", "test_acc"):
        assert got[0][key] == pytest.approx(want[1][key], abs=2e-4), key
    a, b = load(full_ckpt)["model"], load(part)["model"]
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(TIMEOUT * 2 + 30)
def test_rank_0_alone_decides_whether_to_resume(tmp_path):
    """A checkpoint that rank 1 sees and rank 0 does not (a shared filesystem whose caches
    disagree, made here with two paths): rank 0 decides, and both start at epoch 1 together.
    Deciding each for itself, rank 1 would skip an epoch and the ranks' collectives would pair
    across epochs."""
    ckpt = tmp_path / "seen-by-rank-1.pt"
    done = run_train(1, "--epochs", "2", *SUBSET, "--checkpoint", str(ckpt), "--log-every", "99")
    assert done.returncode == 0 and ckpt.exists(), done.stdout + done.stderr
    torch.save({**load(ckpt), "epoch": 1}, ckpt)  # as if stopped after epoch 1
    from common.env import find_free_port

    world = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(find_free_port())}  # fmt: skip
    paths = [tmp_path / "not-there.pt", ckpt]
    ranks = [subprocess.Popen(command("--epochs", "2", *SUBSET, "--checkpoint", str(paths[r])),
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=clean_environ(RANK=str(r), LOCAL_RANK=str(r), **world))
             for r in range(2)]  # fmt: skip
    try:
        outs = [r.communicate(timeout=TIMEOUT) for r in ranks]
    finally:
        for r in ranks:
            r.kill()
    assert [r.returncode for r in ranks] == [0, 0], outs
    assert "resumed" not in outs[0][0] and [r["epoch"] for r in parse_log(outs[0][0])] == [1, 2]


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("kind", ["garbage", "another_run"])
def test_bad_checkpoint_is_one_line_printed_once(tmp_path, kind):
    ckpt = tmp_path / "ckpt.pt"
    if kind == "garbage":
        ckpt.write_bytes(b"\x00not a checkpoint" * 100)
    else:  # a finished 1-epoch run cannot be continued as a 2-epoch one (the schedule differs)
        torch.save({"model": {}, "optimizer": {}, "scheduler": {}, "epoch": 1, "epochs": 1}, ckpt)
    # Under torchrun, which stops every rank as soon as one exits: rank 0's line must still
    # come out (the other ranks wait for it).
    proc = torchrun_train(2, "--epochs", "2", *SUBSET, "--checkpoint", str(ckpt))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr  # rank 0 only
    assert str(ckpt) in errors[0] and "CHECKPOINT" in errors[0], errors
    assert "CheckpointError" not in proc.stderr and "Unpickling" not in proc.stderr, proc.stderr
    if kind == "another_run":
        assert "epochs=1, this run has epochs=2" in errors[0], errors


@pytest.mark.timeout(TIMEOUT + 30)
def test_sync_bn_on_cpu_is_refused_in_one_line():
    proc = run_train(1, "--epochs", "1", *SUBSET, "--sync-bn")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --sync-bn needs GPUs (SyncBatchNorm has no CPU kernel); drop it on CPU"
    ], proc.stderr


def test_sync_bn_converts_every_batchnorm():
    plain, synced = build_model(), build_model(sync_bn=True)
    count = sum(isinstance(m, torch.nn.BatchNorm2d) for m in plain.modules())
    assert count == 3
    assert sum(isinstance(m, torch.nn.SyncBatchNorm) for m in synced.modules()) == count


def test_parse_log_keeps_the_last_copy_of_an_epoch():
    line = "epoch {}/3 | train_loss 0.5 | test_loss 0.1 | test_acc {}% | 100 samples/s " \
           "| epoch_time 1.0s"  # fmt: skip
    text = "\n".join([line.format(1, "97.00"), "noise", line.format(1, "97.50"),
                      line.format(2, "98.25")])  # fmt: skip
    rows = parse_log(text)
    assert [(r["epoch"], r["test_acc"]) for r in rows] == [(1, 97.5), (2, 98.25)]


# --------------------------------------------------------------------------- carried away



@pytest.fixture
def project(tmp_path):
    """A directory holding lesson 03's train.py and the carried files of common/, nothing else."""
    root = tmp_path / "project"
    (root / "common").mkdir(parents=True)
    shutil.copy(LESSON / "train.py", root)
    for name in CARRIED:
        shutil.copy(ROOT / "common" / name, root / "common")
    return root


def carried_environ(project):
    # No PYTHONPATH: python puts the script's own directory first on sys.path, so the copied
    # common/ is what `import common.env` finds, as in the student's project.
    return {"PYTHONPATH": "", "MNIST_DIR": str(default_data_dir()), "COURSE_DIST_TIMEOUT": "30"}


@pytest.mark.timeout(TIMEOUT + 30)
def test_carried_train_py_runs_under_torchrun(project):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "train.py", "--epochs", "1", *SUBSET],
        cwd=project, env=clean_environ(**carried_environ(project)), capture_output=True,
        text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "world size 2 (1 node(s) x 2)" in proc.stdout, proc.stdout
    assert [r["epoch"] for r in parse_log(proc.stdout)] == [1], proc.stdout


@pytest.mark.timeout(TIMEOUT + 60)
def test_carried_train_py_runs_under_srun_on_two_nodes(project, srun):
    proc = srun("--nodes=2", "--ntasks-per-node=1", f"--chdir={project}", sys.executable,
                "train.py", "--epochs", "1", *SUBSET, env=carried_environ(project),
                timeout=TIMEOUT)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "world size 2 (2 node(s) x 1)" in proc.stdout, proc.stdout
    assert [r["epoch"] for r in parse_log(proc.stdout)] == [1], proc.stdout


def check_job_output(text, epochs, min_acc):
    assert "world size 4 (2 node(s) x 2)" in text, text
    assert "2 nodes x 2 tasks = 4 processes; 2 GPU(s) per node, 4 CPUs per task" in text, text
    assert "backend gloo" in text or "backend nccl" in text, text
    rows = parse_log(text)
    assert [r["epoch"] for r in rows] == list(range(1, epochs + 1)), text
    assert rows[-1]["test_acc"] >= min_acc, text
    assert f"done: test_acc {rows[-1]['test_acc']:.2f}% after {epochs} epochs" in text, text
    assert re.search(r"MASTER_ADDR=node1 MASTER_PORT=\d+ WORLD_SIZE=4", text), text
    return rows


def test_sample_output_in_the_lesson_folder():
    """The captured output the README shows: the default job, 3 epochs, >= 99 %."""
    samples = {p.name: p.read_text() for p in LESSON.glob("slurm-*.out")}
    assert len(samples) == 1 and re.fullmatch(r"slurm-\d+\.out", *samples), sorted(samples)
    (name, text), = samples.items()  # fmt: skip
    assert f"=== job {name[6:-4]} (ddp-mnist) starts" in text, name
    assert "global batch 128 = 4 x 32, 469 steps per epoch" in text, text
    check_job_output(text, epochs=3, min_acc=99.0)


# --------------------------------------------------------------------------- local cluster

JOB = "lessons/03_ddp_mnist/job.sh"


def submit(cluster_lock, tmp_path, *job_args, env=None, timeout=240):
    """Submit JOB with JOB_ARGS and wait for its end; returns (exit status, output)."""
    return submit_job(tmp_path, JOB, *job_args, env=env, timeout=timeout)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "env, args, message",
    [
        ({}, ["-3"], "error: EPOCHS='-3' is not a whole number of epochs >= 1: pass e.g. 3"),
        ({"EPOCHS": "two"}, [], "error: EPOCHS='two' is not a whole number of epochs"),
        ({"SUBSET": "2k"}, ["1"], "error: SUBSET='2k' is not a whole number of images >= 1"),
        ({"MNIST_DIR": "/nonexistent/mnist"}, ["1"],
         "error: /nonexistent/mnist/MNIST/raw/train-images-idx3-ubyte is missing: prepare the "
         "data once, on the login node: python -m common.mnist"),
    ],
)  # fmt: skip
def test_job_refuses_bad_input_before_srun(cluster, cluster_lock, tmp_path, env, args, message):
    status, text = submit(cluster_lock, tmp_path, *args, env=env, timeout=60)
    lines = text.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith(message), text


@pytest.mark.long  # 3 epochs of 2,048 images on 2 nodes x 2 tasks, about 20 s (make test-long)
@pytest.mark.timeout(800)
def test_quick_first_run_as_the_readme_types_it(cluster, tmp_path):
    """§2's quick first run, `SUBSET=2048 sbatch lessons/03_ddp_mnist/job.sh`: the default
    3 epochs on the first 2,048 images of each set, saved in a checkpoint of the job's own."""
    status, text = submit_job(tmp_path, JOB, env={"SUBSET": "2048"}, timeout=300)
    saved = re.search(r"^epochs 3, checkpoint (\S+/checkpoints/ddp_mnist-\d+\.pt)$", text, re.M)
    try:
        assert status == 0 and saved, text
        assert "training 3 epochs on 2048 images" in text, text
        check_job_output(text, epochs=3, min_acc=50.0)  # it learns: 10 % is a guess
        assert load(saved[1])["epoch"] == 3
    finally:
        if saved:
            Path(saved[1]).unlink(missing_ok=True)
