"""When Slurm requeues a requeueing job itself (lesson 05's requeue.sh, lesson 07's job.sh).

A preemption with no grace time (`GraceTime=0`, Slurm's default), a grace time that runs out
while the job saves, a node failure, an administrator's `scontrol requeue`: slurmctld requeues
the job at once (`_job_requeue_op` in src/slurmctld/job_mgr.c counts the restart), then signals
it. The batch shell then reads `JobState=COMPLETING` as after a plain `scancel`, but `Restarts`
above the `SLURM_RESTART_COUNT` the run started with (measured on 22.05.8, 24.11.5 and 26.05.5
with a probe job: COMPLETING and Restarts=1 in the batch shell's SIGTERM handler, both ways).
The job comes back by itself: the log must say so and give no `sbatch` command, which would
start a second job on the same checkpoint.

Both ways are played on the local cluster, as the README submits the scripts (SUBSET, one
epoch): an administrator's `scontrol requeue` of the running job, and a preemption by the
urgent partition with the job's partition set to `GraceTime=0` for the test (restored after,
under the cluster lock, so no other job sees it): what a site's partitions and its admins do to
a job, so marked `sites`. Lesson 05's job runs on 22.05 (make test-sites), lesson 07's on 26.05
(make test-slurm; tests/lanes.py's EVERY_SLURM): the two scripts share the rule
(common/job_env.sh). Both fail with the rule taken out ("cancelled with
scancel ... To go on later: ... sbatch ...").

And the gap between the state check and the requeue: a cancel that lands there must win.
`scontrol requeue Incomplete` leaves a job that is no longer running alone (it exits 0 either
way: measured on the three versions), and the restart count read again says which happened.
That test runs on every version (make test-sites on 22.05, make test-slurm on 24.11 and 26.05):
a cancel at a given moment is what a student or an admin does around a job, `sites` as above.
"""

import re
import shutil
import subprocess
from datetime import datetime

import pytest
from conftest import ROOT, job_record, slurm, slurm_version, wait_for, wait_job
from test_lesson05_cancel import SCRIPTS  # the same two job scripts, run as there

RUNS_ON = {"05": (22, 5), "07": (26, 5)}
# The first images of each set (SUBSET): enough steps left after the 10th for the requeue to land
# while the first run still trains (lesson 05's steps take a tenth of lesson 07's).
SUBSET = {"05": "12800", "07": "5120"}
SAID = "was requeued by Slurm itself"


def runs(job: str) -> list[tuple[datetime, datetime | None]]:
    """Each run of the job as accounting has it (sacct --duplicates: one row per run), oldest
    first: (start, end), end None while it runs."""
    out = slurm("sacct", "-j", job, "--duplicates", "-X", "-n", "-P", "-o", "Start,End")
    rows = []
    for line in out.split():
        start, end = line.split("|")
        rows.append((datetime.fromisoformat(start),
                     None if end in ("Unknown", "None") else datetime.fromisoformat(end)))
    return sorted(rows)


@pytest.mark.sites
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("way", ["scontrol-requeue", "preempted-without-grace"])
@pytest.mark.parametrize("lesson", sorted(SCRIPTS))
def test_a_job_slurm_requeued_says_so_and_comes_back_once(cluster, cluster_lock, tmp_path,
                                                          lesson, way):  # fmt: skip
    if slurm_version() != RUNS_ON[lesson]:
        major, minor = RUNS_ON[lesson]
        pytest.skip(f"lesson {lesson}'s job runs on Slurm {major}.{minor:02d}: both scripts "
                    "share the rule (common/job_env.sh)")  # fmt: skip
    script, args, variable, name = SCRIPTS[lesson]
    out, ckpt = tmp_path / "job.out", tmp_path / name

    def log():
        return out.read_text() if out.exists() else ""

    with cluster_lock():
        grace = re.search(r"GraceTime=(\d+)", slurm("scontrol", "show", "partition", "local",
                                                    "-o"))[1]  # fmt: skip
        job = slurm("sbatch", "--parsable", f"--output={out}", ROOT / script, *args,
                    env={"SUBSET": SUBSET[lesson], variable: str(ckpt)})  # fmt: skip
        urgent = None
        try:
            wait_for("a progress line", lambda: "batch 10/" in log(), 480)
            if way == "scontrol-requeue":
                slurm("scontrol", "requeue", job)
            else:
                slurm("scontrol", "update", "PartitionName=local", "GraceTime=0")
                urgent = slurm("sbatch", "--parsable", f"--output={tmp_path}/urgent.out",
                               ROOT / "lessons/05_fault_tolerance/preempt.sh")
                assert wait_job(urgent, timeout=480)[:2] == ("COMPLETED", 0)
            wait_for("the requeue", lambda: int((job_record(job) or {}).get("Restarts", 0)) >= 1,
                     240)  # fmt: skip
            slurm("scontrol", "update", f"GraceTime={grace}", "PartitionName=local")
            state, code, record = wait_job(job, timeout=900)
        finally:
            subprocess.run(["scontrol", "update", "PartitionName=local", f"GraceTime={grace}"],
                           capture_output=True, timeout=30)
            for j in (job, urgent):
                if j:
                    subprocess.run(["scancel", j], capture_output=True, timeout=30)
            every_run = runs(job)
            shutil.rmtree(ckpt, ignore_errors=True)
            ckpt.unlink(missing_ok=True)
    text = log()
    assert (state, code) == ("COMPLETED", 0), text
    assert record.get("Restarts") == "1", (record, text)
    said = [line for line in text.splitlines() if SAID in line]
    assert len(said) == 1, text
    assert "Restarts=1" in said[0] and f"squeue -j {job}" in said[0], said[0]
    assert "sbatch" not in said[0] and "To go on later" not in text, text
    # The requeued run went on from the saved checkpoint, and it alone trained after it.
    assert "SLURM_RESTART_COUNT=1" in text and f"resumed from {ckpt}" in text, text
    assert re.search(r"done: test_acc [\d.]+% after 1 epochs", text), text
    # Accounting: two runs, the second started after the first had ended (no two trainings on one
    # checkpoint at once).
    assert len(every_run) == 2, every_run
    (_, first_end), (second_start, _) = every_run
    assert first_end is not None and first_end <= second_start, every_run


GAP = """#!/bin/bash
#SBATCH --nodes=1 --ntasks=1 --requeue --open-mode=append
# course_requeue_or_end as a job script calls it after its training saved (status 75), with a
# cancel landing after its state check: the check is made to answer RUNNING, as it did a moment
# before the cancel, and the job's own SIGTERM is ignored, as a saving job does.
source "$COURSE_ROOT/common/job_env.sh"
echo "run ${SLURM_RESTART_COUNT:-0}"
if [[ ${SLURM_RESTART_COUNT:-0} != 0 ]]; then exit 0; fi
trap 'echo got SIGTERM' TERM
course_job_state() { echo "RUNNING ${SLURM_RESTART_COUNT:-0}"; }
scancel "$SLURM_JOB_ID"
sleep 2
course_requeue_or_end 75 "resumes" "sbatch again"
"""


@pytest.mark.sites
@pytest.mark.timeout(600)
def test_a_cancel_between_the_state_check_and_the_requeue_wins(cluster, cluster_lock, tmp_path):
    script = tmp_path / "gap.sh"
    script.write_text(GAP)
    out = tmp_path / "gap.out"
    with cluster_lock():
        job = slurm("sbatch", "--parsable", f"--output={out}", script,
                    env={"COURSE_ROOT": str(ROOT)})  # fmt: skip
        try:
            state, _, record = wait_job(job, timeout=240)
        finally:
            subprocess.run(["scancel", job], capture_output=True, timeout=30)
    text = out.read_text()
    assert state == "CANCELLED" and record.get("Restarts") == "0", (record, text)
    assert "run 1" not in text, text
    assert "ended before Slurm took the requeue" in text and "To go on later: sbatch again" in text
