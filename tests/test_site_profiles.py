"""The local cluster playing other sites (cluster/up.sh --site NAME), and the lessons' jobs there.

- ``export-none``: sbatch defaults to --export=NONE (a cli_filter, as sites set it): a job sees
  nothing of the submitting shell, and SLURM_EXPORT_ENV=NONE, which its srun steps inherit; an
  explicit --export (here SBATCH_EXPORT=ALL) still wins, and SBATCH_EXPORT=NONE on the default
  cluster starts a job the same way. Lessons 01 and 03's job scripts run to the end there:
  common/job_env.sh sets up what the job needs from the submit directory and hands it to the
  steps (SLURM_EXPORT_ENV=ALL), saying so in one line.
- ``shared-tmp``: no job_container/tmpfs, so every job sees the same /tmp. Lesson 08's job stages
  into a folder of its own there and leaves nothing behind; lessons 01 and 03 run to the end.
- ``rank0-elsewhere`` on Slurm 26.05: a topology plugin puts task 0 of a block distribution on
  the job's last node. Lessons 01 (its three jobs) and 03 run to the end, rank 0 on node1.

Each test starts the cluster in its profile under the cluster lock and puts it back in the
default profile at the end. Marked ``sites``: make test-sites.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
from conftest import ROOT, cluster_lock, run_up, slurm, submit_job, wait_job

pytestmark = pytest.mark.sites


@contextlib.contextmanager
def site(name, *up_args):
    with cluster_lock():
        run_up("--site", name, *up_args)
        try:
            yield
        finally:
            run_up()


NOTE = "note: this job was submitted with --export=NONE (a site default?)"


@pytest.mark.timeout(600)
def test_export_none_site(cluster, tmp_path):
    probe = tmp_path / "probe.sh"
    probe.write_text('#!/bin/bash\necho "COURSE_PROBE=${COURSE_PROBE:-unset} '
                     'SLURM_EXPORT_ENV=${SLURM_EXPORT_ENV:-unset}"\n')  # fmt: skip
    env = {"COURSE_PROBE": "from the shell"}
    # The way a user meets it on any site (SBATCH_EXPORT=NONE in a login profile) gives a job
    # the same start as the site's default below: the lessons' runs there stand for both.
    _, by_user = submit_job(tmp_path, probe, env={**env, "SBATCH_EXPORT": "NONE"}, timeout=240)
    with site("export-none"):
        _, default = submit_job(tmp_path, probe, env=env, timeout=240)
        _, explicit = submit_job(tmp_path, probe, env={**env, "SBATCH_EXPORT": "ALL"},
                                 timeout=120)  # fmt: skip
        status01, out01 = submit_job(tmp_path, ROOT / "lessons/01_hello_allreduce/job.sh",
                                     timeout=240)  # fmt: skip
        status03, out03 = submit_job(tmp_path, ROOT / "lessons/03_ddp_mnist/job.sh", "1",
                                     "--train-subset", "1024", "--test-subset", "256",
                                     timeout=300)  # fmt: skip
    assert by_user.strip() == default.strip() == "COURSE_PROBE=unset SLURM_EXPORT_ENV=NONE", (
        by_user, default)
    assert explicit.startswith("COURSE_PROBE=from the shell "), explicit
    # Each job says once why the shell's variables did not reach it; every step then found the
    # venv's python and the course (sysinfo on both nodes, common.env, the ranks).
    for out in (out01, out03):
        assert out.startswith(NOTE) and out.count("note:") == 1, out
        assert "execve()" not in out and "Traceback" not in out, out
    assert status01 == 0 and "all 4 ranks hold the expected sum" in out01, out01
    assert "node1: torch " in out01 and "node2: torch " in out01, out01
    assert out01.count('{"rank": ') == 2, out01
    saved = re.search(r"^epochs 1, checkpoint (\S+)$", out03, re.M)
    if saved:
        Path(saved[1]).unlink(missing_ok=True)
    assert status03 == 0 and "world size 4 (2 node(s) x 2)" in out03, out03
    assert "done: test_acc " in out03 and " after 1 epochs" in out03, out03


@pytest.mark.timeout(900)
def test_export_none_site_lesson12_moves_off_a_sick_node(cluster, tmp_path):
    """Lesson 12's job where sbatch defaults to --export=NONE: the job it submits to move off a
    sick node names what it hands on (--export=ALL,CHECKPOINT=...), which wins over the site's
    default, and resumes at the saved step on the other node. Its size and steps are given on
    the command line (variables of the shell would not reach the job here)."""
    with site("export-none"):
        first = slurm("sbatch", "--parsable", f"--output={tmp_path}/sick-%j.out", "--nodes=1",
                      "--nodelist=node1", "lessons/12_sick_node/job.sh", "--fault", "nan",
                      "--fault-node", "node1", "--steps", "100", "--train-subset", "2048",
                      "--test-subset", "2048")  # fmt: skip
        state1, status1, _ = wait_job(first, 300)
        text1 = (tmp_path / f"sick-{first}.out").read_text()
        moved = re.search(r"moved off node1: job (\d+) resumes", text1)
        assert (state1, status1) == ("FAILED", 3) and moved, text1[-3000:]
        state2, _, record = wait_job(moved[1], 300)
    text2 = (tmp_path / f"sick-{moved[1]}.out").read_text()
    # The first job started as the site starts every job; the one it submitted, as it asked.
    assert text1.startswith(NOTE) and NOTE not in text2, (text1[:300], text2[:300])
    assert state2 == "COMPLETED" and record["NodeList"] == "node2", text2[-3000:]
    assert re.search(r"^resumed from \S+ at step 53, on node2$", text2, re.M), text2[-3000:]
    assert re.search(r"^done: test_acc [\d.]+% after 100 steps", text2, re.M), text2[-3000:]
    (ROOT / "checkpoints" / f"sick-{first}.pt").unlink(missing_ok=True)


@pytest.mark.timeout(600)
def test_shared_tmp_site(cluster, tmp_path):
    writer = tmp_path / "writer.sh"
    writer.write_text("#!/bin/bash\necho seen >/tmp/course-site-probe-$SLURM_JOB_ID\n"
                      "echo $SLURM_JOB_ID\n")  # fmt: skip
    reader = tmp_path / "reader.sh"
    with site("shared-tmp"):
        status, out = submit_job(tmp_path, writer, timeout=240)
        job = out.strip()
        reader.write_text(f"#!/bin/bash\ncat /tmp/course-site-probe-{job}\n"
                          f"rm /tmp/course-site-probe-{job}\n")  # fmt: skip
        _, seen = submit_job(tmp_path, reader, timeout=240)
        # Lesson 08's job as its README submits it: an epoch, the packed files staged with sbcast.
        status08, out08 = submit_job(tmp_path, ROOT / "lessons/08_data_pipeline/job.sh",
                                     timeout=300)  # fmt: skip
        status01, out01 = submit_job(tmp_path, ROOT / "lessons/01_hello_allreduce/job.sh",
                                     timeout=240)  # fmt: skip
        status03, out03 = submit_job(tmp_path, ROOT / "lessons/03_ddp_mnist/job.sh", "1",
                                     "--train-subset", "1024", "--test-subset", "256",
                                     timeout=300)  # fmt: skip
    assert status == 0 and seen.strip() == "seen", (out, seen)  # one job's /tmp is the next's
    assert status01 == 0 and "all 4 ranks hold the expected sum" in out01, out01
    saved = re.search(r"^epochs 1, checkpoint (\S+)$", out03, re.M)
    if saved:
        Path(saved[1]).unlink(missing_ok=True)
    assert status03 == 0 and "world size 4 (2 node(s) x 2)" in out03, out03
    assert status08 == 0 and "test_acc " in out08, out08
    staged = re.search(r"(/tmp/mnist-files-\d+)", out08)
    assert staged, out08
    assert not Path(staged[1]).exists(), f"{staged[1]} left behind"


@pytest.mark.timeout(900)
def test_rank0_elsewhere_site(cluster, tmp_path):
    probe = tmp_path / "probe.sh"
    probe.write_text("#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=2\n"
                     "srun bash -c 'echo $SLURM_PROCID $(hostname) $SLURM_NODEID' | sort\n")
    lesson01 = ROOT / "lessons/01_hello_allreduce"
    with site("rank0-elsewhere", "--slurm", "26.05"):
        _, placed = submit_job(tmp_path, probe, timeout=240)
        runs01 = [submit_job(tmp_path, lesson01 / name, timeout=240)
                  for name in ("job.sh", "job_task_per_gpu.sh", "by_hand.sh")]  # fmt: skip
        status03, out03 = submit_job(tmp_path, ROOT / "lessons/03_ddp_mnist/job.sh", "1",
                                     "--train-subset", "1024", "--test-subset", "256",
                                     timeout=300)  # fmt: skip
    assert placed.splitlines()[0] == "0 node2 1", placed  # the profile moves task 0
    for status, out in runs01:
        assert status == 0, out
        assert re.search(r"^rank 0/4 on node1 \(node 0, local 0\)", out, re.M), out
    saved = re.search(r"^epochs 1, checkpoint (\S+)$", out03, re.M)
    if saved:
        Path(saved[1]).unlink(missing_ok=True)
    assert status03 == 0 and "world size 4 (2 node(s) x 2)" in out03, out03
    assert "MASTER_ADDR=node1 " in out03, out03
