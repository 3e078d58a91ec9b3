"""Preemption on the local cluster: a job in partition ``urgent`` takes the node of a running job
in the default partition ``local``, which gets SIGTERM, has GraceTime, is requeued and runs again.
"""

import contextlib
import re
import subprocess

import pytest
from conftest import (
    job_record,
    restarts_after_a_kill_at_the_end_of_grace_time,
    slurm,
    wait_for,
    wait_job,
)

VICTIM = r"""#!/bin/bash
#SBATCH --nodes=1 --nodelist=node1 --exclusive --open-mode=append --time=00:10:00
echo "run ${SLURM_RESTART_COUNT:-0} of job $SLURM_JOB_ID in partition $SLURM_JOB_PARTITION"
if [[ ${SLURM_RESTART_COUNT:-0} -gt 0 ]]; then
    echo "resumed"
    exit 0
fi
trap 'echo "batch script: SIGTERM"' TERM
# On SIGTERM the task saves its state, then goes on until Slurm kills it at the end of
# GraceTime and puts the job back in the queue. (A job that exits by itself within GraceTime
# has simply completed, and is not requeued.)
srun bash -c 'trap "echo task: SIGTERM, saving; sleep 1; echo task: saved" TERM
              echo task: running; while true; do sleep 0.2; done' &
wait
wait
echo "batch script: not reached"
"""


def test_partitions_local_default_and_urgent(cluster):
    text = slurm("scontrol", "show", "partition", "-o")
    parts = {m["PartitionName"]: m for m in (dict(re.findall(r"(\w+)=(\S*)", line))
                                             for line in text.splitlines())}  # fmt: skip
    assert set(parts) >= {"local", "urgent"}, text
    assert parts["local"]["Default"] == "YES" and parts["urgent"]["Default"] == "NO"
    assert int(parts["urgent"]["PriorityTier"]) > int(parts["local"]["PriorityTier"])
    assert parts["local"]["Nodes"] == parts["urgent"]["Nodes"]
    assert int(parts["local"]["GraceTime"]) > 0
    assert slurm("scontrol", "show", "config").count("preempt/partition_prio") == 1


# The victim waits out the whole GraceTime before Slurm kills and requeues it: this test uses a
# shorter one than the cluster's 30 s, so as not to sit idle (saving takes a second).
GRACE_S = 6


@contextlib.contextmanager
def short_grace_time(partition, seconds):
    """The partition's GraceTime set to ``seconds`` for a while (hold the cluster lock)."""
    text = slurm("scontrol", "show", "partition", partition, "-o")
    before = re.search(r"\bGraceTime=(\d+)", text)[1]
    slurm("scontrol", "update", f"PartitionName={partition}", f"GraceTime={seconds}")
    try:
        yield
    finally:
        slurm("scontrol", "update", f"PartitionName={partition}", f"GraceTime={before}")


@pytest.mark.long  # about 60 s of grace time and requeues: make test-long (and make test-slurm)
@pytest.mark.timeout(840)
def test_urgent_job_preempts_and_requeues_a_local_job(cluster, cluster_lock, tmp_path):
    script = tmp_path / "victim.sh"
    script.write_text(VICTIM)
    out = tmp_path / "victim.out"
    with cluster_lock(), short_grace_time("local", GRACE_S):
        victim = slurm("sbatch", "--parsable", f"--output={out}", script).split(";")[0].strip()
        urgent = None
        try:
            wait_for("the victim's task to run", lambda: out.exists()
                     and "task: running" in out.read_text(), 120)  # fmt: skip
            urgent = slurm(
                "sbatch", "--parsable", "--partition=urgent", "--nodes=1", "--nodelist=node1",
                "--exclusive", f"--output={tmp_path}/urgent.out", "--wrap",
                'echo "urgent job on $(hostname)"',
            ).split(";")[0].strip()  # fmt: skip
            state, code, _ = wait_job(urgent, timeout=360)
            assert (state, code) == ("COMPLETED", 0), (tmp_path / "urgent.out").read_text()
            assert (tmp_path / "urgent.out").read_text() == "urgent job on node1\n"

            # The victim was sent back to the queue; it starts again once its requeue hold
            # (cred_expire, 10 s here: cluster/slurm.conf.in) is over.
            restarts = restarts_after_a_kill_at_the_end_of_grace_time()
            wait_for("the victim's requeue", lambda: (r := job_record(victim))
                     and int(r.get("Restarts", 0)) >= 1 and r, 180)  # fmt: skip
            state, code, record = wait_job(victim, timeout=360)
        finally:
            for job in (victim, urgent):
                if job:
                    subprocess.run(["scancel", job], capture_output=True, timeout=30)
    text = out.read_text()
    assert (state, code) == ("COMPLETED", 0), text
    assert record["Restarts"] == str(restarts), record
    lines = text.splitlines()
    assert lines[0] == f"run 0 of job {victim} in partition local", text
    # The task got SIGTERM while it ran and had time to save before it was killed.
    assert "task: SIGTERM, saving" in lines and "task: saved" in lines, text
    assert "batch script: not reached" not in lines, text
    for n in range(1, restarts + 1):
        assert f"run {n} of job {victim} in partition local" in lines, text
    assert lines[-1] == "resumed" and lines.count("resumed") == restarts, text
