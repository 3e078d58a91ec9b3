"""Limits enforced through cgroups on the local cluster, as on a real one: memory (--mem)."""

import re
import subprocess

from conftest import ROOT, job_environ

HOG = 'python3 -c \'b = b"x" * (1 << 30); print("survived with", len(b))\''


def test_job_over_its_memory_ends_out_of_memory(sbatch_wait, tmp_path):
    script = tmp_path / "oom.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=1 --mem=200M\n{HOG}\n")
    result = sbatch_wait(script, timeout=240)
    assert result.state == "OUT_OF_MEMORY" and result.returncode != 0, result
    assert "survived with 1073741824" not in result.output, result.output
    # Slurm's own message, from the job's slurmstepd.
    assert re.search(r"Detected \d+ oom[-_]kill event", result.output), result.output


def test_task_over_its_memory_is_killed_and_its_step_ends_out_of_memory(sbatch_wait, tmp_path):
    script = tmp_path / "oom_step.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --nodes=1 --mem=200M\nsrun {HOG}\n")
    result = sbatch_wait(script, timeout=240)
    assert result.state == "FAILED" and result.returncode != 0, result  # srun's exit status
    assert "srun: error: node1: task 0: Out Of Memory" in result.output, result.output
    assert re.search(r"Detected \d+ oom[-_]kill event.* StepId=\d+\.0", result.output)
    proc = subprocess.run(
        ["sacct", "-n", "-P", "-j", f"{result.job_id}.0", "--format=JobID,State"],
        capture_output=True, text=True, timeout=30, env=job_environ(),
    )  # fmt: skip
    assert proc.stdout.split() == [f"{result.job_id}.0|OUT_OF_MEMORY"], proc.stdout + proc.stderr


def test_a_job_under_its_memory_runs_on_two_nodes(sbatch_wait, tmp_path):
    script = tmp_path / "fits.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=2 --ntasks-per-node=1 --mem=16G\n"
        "srun python3 -c 'import socket; b = b\"x\" * (100 << 20); print(socket.gethostname())'\n"
    )
    result = sbatch_wait(script, timeout=240)
    assert result.state == "COMPLETED", result.output
    assert sorted(result.output.split()) == ["node1", "node2"], result.output


def test_a_job_without_mem_gets_a_default_per_cpu(cluster, tmp_path):
    proc = subprocess.run(
        ["sbatch", "--parsable", "--hold", "--cpus-per-task=2", f"--output={tmp_path}/x.out",
         "--wrap=true"], capture_output=True, text=True, timeout=30, cwd=ROOT, env=job_environ(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    try:
        record = subprocess.run(
            ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30
        ).stdout
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    assert "MinMemoryCPU=2G" in record, record
