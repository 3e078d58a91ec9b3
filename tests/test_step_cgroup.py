"""common.env's sign that an srun task lost its SLURM_* variables, the step's cgroup, in the
names every Slurm version gives it: cgroup v1 and v2 by job id (`.../job_27/step_0/...`), and
Slurm 26.05's cgroup/v2 by the job's SLUID (`.../slurmstepd.scope/sEKNKTV3WPV500/step_0/user/
task_0`, cgroup.conf(5) CgroupJobIdPaths=no, the default).

The check reads a file (/proc/self/cgroup): first a table of such files, read by the check
itself; then a real process put in a cgroup v2 folder of each name (this machine's unified
hierarchy, /sys/fs/cgroup/unified, where root may make folders), whose own /proc/self/cgroup
says so, running `env -i python -m common.env` as `srun env -i ...` would. The local cluster's
cgroup/v1 run of the same is tests/test_env_cleared.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.env import LaunchError  # noqa: E402
from common.launch import check_slurm_variables_kept  # noqa: E402

SLUID = "sEKNKTV3WPV500"  # 's' and 13 Crockford base32 digits (Slurm's sluid2str)
V1_STEP = "6:freezer:/slurm_node1/uid_0/job_27/step_0\n4:memory:/slurm_node1/uid_0/job_27/step_0/task_0\n0::/\n"  # noqa: E501
V2_STEP = "0::/system.slice/slurmstepd.scope/job_31/step_2/user/task_0\n"
V2_SLUID_STEP = f"0::/system.slice/slurmstepd.scope/{SLUID}/step_0/user/task_0\n"
HYBRID_SLUID_STEP = f"9:name=systemd:/\n4:memory:/\n0::/slurmstepd.scope/{SLUID}/step_3/user/task_1\n"  # noqa: E501

# (id, /proc/self/cgroup, what the line names, or None for no refusal)
CASES = [
    ("v1-job-id", V1_STEP, "Slurm step 27.0"),
    ("v2-job-id", V2_STEP, "Slurm step 31.2"),
    ("v2-sluid-26.05", V2_SLUID_STEP, f"step 0 of the Slurm job with SLUID {SLUID}"),
    ("v2-sluid-hybrid", HYBRID_SLUID_STEP, f"step 3 of the Slurm job with SLUID {SLUID}"),
    ("v2-sluid-batch-script", V2_SLUID_STEP.replace("step_0", "step_batch"), None),
    ("v2-sluid-extern", V2_SLUID_STEP.replace("step_0/user/task_0", "step_extern/user/x"), None),
    ("v2-sluid-job-not-a-step", f"0::/system.slice/slurmstepd.scope/{SLUID}/user\n", None),
    ("not-a-sluid-too-short", V2_SLUID_STEP.replace(SLUID, SLUID[:-1]), None),
    ("not-a-sluid-letter-u", V2_SLUID_STEP.replace(SLUID, "sEKNKTV3WPV50U"), None),  # not base32
    ("no-slurm", "0::/user.slice/user-0.slice/session-1.scope\n", None),
]  # fmt: skip


@pytest.mark.parametrize("text, named", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_the_check_reads_each_name_from_the_file(tmp_path, text, named):
    cgroup = tmp_path / "cgroup"
    cgroup.write_text(text)
    if named is None:
        check_slurm_variables_kept({"PATH": "/usr/bin"}, None, cgroup_file=str(cgroup))
        return
    with pytest.raises(LaunchError) as info:
        check_slurm_variables_kept({"PATH": "/usr/bin"}, None, cgroup_file=str(cgroup))
    line = str(info.value)
    assert line.startswith(f"this process runs in {named} ({cgroup}"), line
    assert ") but has no SLURM_* variable" in line, line
    assert "\n" not in line and "--cleanenv" in line and "RANK=0 WORLD_SIZE=1" in line, line
    if named.startswith("step "):
        assert f"({cgroup}, which names no job id)" in line, line  # and shows none: it has none
    # the variables kept: no refusal, whatever the cgroup
    check_slurm_variables_kept({"SLURM_JOB_ID": "27"}, None, cgroup_file=str(cgroup))


UNIFIED = Path("/sys/fs/cgroup/unified")


def unified_writable() -> bool:
    return os.geteuid() == 0 and (UNIFIED / "cgroup.procs").exists() and os.access(UNIFIED,
                                                                                    os.W_OK)


@pytest.mark.skipif(not unified_writable(), reason="no cgroup v2 hierarchy that root may write")
@pytest.mark.parametrize("job, named", [
    (SLUID, f"step 0 of the Slurm job with SLUID {SLUID}"),
    ("job_31", "Slurm step 31.0"),
])  # fmt: skip
@pytest.mark.timeout(120)
def test_a_process_in_a_step_cgroup_without_its_variables_is_one_line(job, named):
    top = UNIFIED / f"course-test-{os.getpid()}"
    task = top / "slurmstepd.scope" / job / "step_0" / "user" / "task_0"
    task.mkdir(parents=True)
    try:
        # The shell moves itself into the task's cgroup, then becomes `env -i python ...`.
        proc = subprocess.run(
            ["sh", "-c", 'echo $$ > "$1/cgroup.procs" && exec env -i PYTHONPATH="$2" "$3" -m '
             'common.env', "sh", str(task), str(ROOT), sys.executable],
            cwd=ROOT, capture_output=True, text=True, timeout=90)  # fmt: skip
    finally:
        for folder in sorted((p for p in top.rglob("*") if p.is_dir()), reverse=True):
            folder.rmdir()
        top.rmdir()
    lines = [line for line in proc.stderr.splitlines() if line.startswith("common.env:")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stdout + proc.stderr
    assert f"this process runs in {named} (/proc/self/cgroup" in lines[0], lines[0]
    assert ") but has no SLURM_* variable" in lines[0], lines[0]
    assert "Traceback" not in proc.stderr, proc.stderr
