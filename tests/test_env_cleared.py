"""common.env: a task of an srun step whose SLURM_* variables were cleared on the way
(`srun apptainer exec --cleanenv ...`, `srun env -i ...`) is refused, not run as rank 0 of 1.

The sign is the step's cgroup in /proc/self/cgroup: a table of what Slurm's cgroup plugins
write, then a real `srun env -i python -m common.env` on the local cluster (proctrack/cgroup).
"""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common.env import LaunchError, resolve_launch_env  # noqa: E402
from common.launch import check_launch, slurm_step_of_cgroup  # noqa: E402

V1_STEP = """9:name=systemd:/
6:freezer:/slurm_node1/uid_0/job_27/step_0
4:memory:/slurm_node1/uid_0/job_27/step_0/task_0
0::/
"""  # as a task of `srun env -i cat /proc/self/cgroup` printed it on the local cluster
V1_BATCH = V1_STEP.replace("step_0", "step_batch")
V2_STEP = "0::/system.slice/slurmstepd.scope/job_31/step_2/user/task_0\n"
V2_EXTERN = "0::/system.slice/slurmstepd.scope/job_31/step_extern/user/task_special\n"
NO_SLURM = "4:memory:/process_api/9b79a0cd\n0::/\n"
ALL_ROOT = "6:freezer:/\n4:memory:/\n0::/\n"  # proctrack/linuxproc, or a cgroup namespace

CGROUP_CASES = [
    ("v1-step", V1_STEP, ("27", "0")),
    ("v1-batch-script", V1_BATCH, None),
    ("v2-step", V2_STEP, ("31", "2")),
    ("v2-extern-step", V2_EXTERN, None),
    ("not-in-slurm", NO_SLURM, None),
    ("no-sign", ALL_ROOT, None),
    ("job-id-not-a-step", "6:freezer:/slurm/uid_0/job_27\n", None),
]


@pytest.mark.parametrize("text,expected", [pytest.param(*c[1:], id=c[0]) for c in CGROUP_CASES])
def test_slurm_step_of_cgroup(text, expected):
    assert slurm_step_of_cgroup(text) == expected


RESOLVE_CASES = [
    # (id, environ, cgroup, refused)
    ("cleared-in-a-step", {}, V1_STEP, True),
    ("cleared-in-a-v2-step", {"PATH": "/usr/bin"}, V2_STEP, True),
    ("kept-slurm-variables", {"SLURM_JOB_ID": "27"}, V1_STEP, False),
    ("batch-script", {}, V1_BATCH, False),
    ("torchrun-worker-in-a-cleared-step", {"RANK": "0", "WORLD_SIZE": "1"}, V1_STEP, False),
    ("plain-process", {}, NO_SLURM, False),
]


@pytest.mark.parametrize("environ,cgroup,refused",
                         [pytest.param(*c[1:], id=c[0]) for c in RESOLVE_CASES])  # fmt: skip
def test_a_cleared_step_is_refused(environ, cgroup, refused):
    if refused:
        with pytest.raises(LaunchError) as exc:
            check_launch(resolve_launch_env(environ, argv=["x"]), environ, proc_cgroup=cgroup)
        message = str(exc.value)
        assert "no SLURM_* variable" in message and "--cleanenv" in message, message
        assert "RANK=0 WORLD_SIZE=1" in message, message
    else:
        env = resolve_launch_env(environ, argv=["x"])
        check_launch(env, environ, proc_cgroup=cgroup)
        assert env.world_size == 1


PYTHON = sys.executable


@pytest.mark.timeout(240)
def test_srun_env_i_is_one_clear_line(srun):
    cleared = srun("-N1", "-n1", "env", "-i", f"PYTHONPATH={ROOT}", PYTHON, "-m", "common.env",
                   timeout=120)  # fmt: skip
    assert cleared.returncode != 0, cleared.stdout
    lines = [line for line in cleared.stderr.splitlines() if line.startswith("common.env:")]
    assert len(lines) == 1 and "no SLURM_* variable" in lines[0], cleared.stderr
    assert "Traceback" not in cleared.stderr
    kept = srun("-N1", "-n1", PYTHON, "-m", "common.env", env={"PYTHONPATH": str(ROOT)},
                timeout=120)  # fmt: skip
    assert kept.returncode == 0 and '"launcher": "slurm"' in kept.stdout, kept.stderr
