"""common/job_env.sh's course_same_request: the options with which a job that moves off a node
(lesson 11's group.sh, lesson 12's job.sh) submits the job that goes on in its place. Options
typed on sbatch's command line are not kept with the script; they must come back from
slurmctld's record. Each case runs a real job with some options given on sbatch's command line;
the job prints course_same_request's options, and a second job submitted with those alone must
get the same record as the first, field by field, as each job sees itself while it runs.
"""

import re

import pytest
from conftest import cluster_lock, slurm

# What a moved job must keep, as `scontrol show job` names it.
FIELDS = ("NumTasks", "CPUs/Task", "TresPerNode", "TresPerJob", "TresPerTask", "MinMemoryNode",
          "MinMemoryCPU", "MemPerTres", "TimeLimit", "Partition", "Account", "QOS", "Features",
          "Reservation", "OverSubscribe", "Exclusive")  # fmt: skip
RESERVATION = "course-same-request"
FEATURE = "samerequest"

PROBE = """#!/bin/bash
COURSE_ROOT=$SLURM_SUBMIT_DIR
source "$COURSE_ROOT/common/job_env.sh"
echo "record: $(scontrol show job -o "$SLURM_JOB_ID")"
course_same_request | sed 's/^/option: /'
"""

CASES = {
    # Memory per node, GPUs per node, CPUs and time as a student types them.
    "per-node": ["--mem=3G", "--gres=gpu:1", "--cpus-per-task=2", "--time=00:09:00"],
    # Memory per CPU, GPUs per task, nodes shared with this user's jobs alone.
    "per-cpu": ["--mem-per-cpu=1500M", "--ntasks=1", "--gpus-per-task=1", "--exclusive=user"],
    # Memory per GPU: the running job's record says MinMemoryNode=0, which is not --mem=0.
    "per-gpu": ["--gpus=1", "--mem-per-gpu=2G", "--time=00:08:00"],
    # A site's: a node feature, a reservation, whole nodes.
    "site": ["--constraint=" + FEATURE, "--reservation=" + RESERVATION, "--exclusive"],
}


def record_and_options(job) -> tuple[dict[str, str], list[str]]:
    assert job.returncode == 0, job.output + job.stderr
    line = re.search(r"^record: (.*)$", job.output, re.M)
    assert line, job.output
    record = dict(f.split("=", 1) for f in line[1].split() if "=" in f)
    return record, re.findall(r"^option: (\S+)$", job.output, re.M)


def compared(record, key):
    """RECORD's KEY; TresPerTask without the "cpu=N" that 26.05 adds for --cpus-per-task (which
    the moved job is always given, and CPUs/Task compares)."""
    value = record.get(key)
    if key == "TresPerTask" and value:
        value = ",".join(v for v in value.split(",") if not v.startswith("cpu=")) or None
    return value


@pytest.fixture
def site_options(cluster):
    """A node feature on both nodes and a reservation of node1 for this user (a job without it
    runs on node2), under the lock; both removed after (the cluster declares neither). The
    reservation lasts 5 minutes, so that a run killed before its cleanup frees node1 soon."""
    with cluster_lock():
        slurm("scontrol", "update", "NodeName=node[1-2]", f"AvailableFeatures={FEATURE}",
              f"ActiveFeatures={FEATURE}")  # fmt: skip
        try:
            slurm("scontrol", "create", "reservation", f"ReservationName={RESERVATION}",
                  "Nodes=node1", "Users=root", "StartTime=now", "Duration=5",
                  "Flags=IGNORE_JOBS")  # fmt: skip
            try:
                yield
            finally:
                slurm("scontrol", "delete", f"ReservationName={RESERVATION}")
        finally:
            slurm("scontrol", "update", "NodeName=node[1-2]", "AvailableFeatures=",
                  "ActiveFeatures=")  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_the_job_in_its_place_gets_what_this_one_got(case, request, sbatch_wait, tmp_path):
    if case == "site":
        request.getfixturevalue("site_options")
    probe = tmp_path / "probe.sh"
    probe.write_text(PROBE)
    with cluster_lock():
        first, options = record_and_options(sbatch_wait(probe, *CASES[case], timeout=120))
        # The callers give the number of tasks themselves (as group.sh and job.sh do).
        tasks = f"--ntasks={first.get('NumTasks')}"
        second, _ = record_and_options(sbatch_wait(probe, tasks, *options, timeout=120))
    got, want = ({k: compared(record, k) for k in FIELDS} for record in (second, first))
    differ = {k: (want[k], got[k]) for k in FIELDS if got[k] != want[k]}
    assert not differ, f"options {options}: (this job, the job in its place) {differ}"
    assert not any(o.startswith("--mem=0") for o in options), options
