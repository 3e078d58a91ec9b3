"""Small helpers shared by the lesson tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Variables through which a launcher tells a process its place; the suite itself may run
# inside a SLURM job or a torchrun worker, and must not pass those on to the worlds it starts.
_LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "RANK", "LOCAL_", "WORLD_SIZE", "GROUP_", "MASTER_")


def clean_environ(**extra: str) -> dict[str, str]:
    """This environment without launcher variables, with the course on PYTHONPATH."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_PREFIXES)}
    environ.update({"PYTHONPATH": str(ROOT), "COURSE_DIST_TIMEOUT": "30", "OMP_NUM_THREADS": "1"})
    # Shell scripts under test call `python`/`torchrun`: the ones of this interpreter's venv.
    environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environ.get('PATH', '')}"
    environ.update(extra)
    return environ


def sample_output(lesson: Path, job_name: str) -> Path:
    """The one stored sample output ``<job_name>-<jobid>.out`` of a lesson."""
    samples = [p for p in lesson.glob(f"{job_name}-*.out")
               if re.fullmatch(rf"{re.escape(job_name)}-\d+\.out", p.name)]
    assert len(samples) == 1, f"expected one sample output {job_name}-<jobid>.out in {lesson}"
    return samples[0]


def tidy(result) -> None:
    """Remove a passing job's output file when the job wrote it into the course root."""
    path = Path(result.output_path)
    if path.parent.resolve() == ROOT:
        path.unlink(missing_ok=True)
