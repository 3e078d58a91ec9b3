"""Helpers for the lesson notebooks: find the course, show its files, run its commands and jobs.

Every lesson folder has one ``lesson.ipynb`` that an instructor runs top to bottom on a laptop
CPU.  The notebooks never keep a copy of the lesson's code: they read it from the lesson's
files (:func:`show_code`), run it as a small local gloo world (:func:`run`), show what a
SLURM task would see (:func:`whoami`, :func:`slurm_task`), and submit the real job script
when a SLURM cluster answers (:func:`submit_or_sample`).  A notebook imports this package as
``nb``; each idea is a module of its own, importing only those above it: course.py (where the
course lies, its files shown), commands.py (commands run as examples), tasks.py (what a task
sees, and pictures of it), jobs.py (training logs, jobs submitted or sampled), files.py (the
notebook files themselves).

The notebooks are stored with their outputs, so they read well on a code host.  Re-run them
after changing a lesson, from the course root:

    python -m common.notebook execute lessons/*/lesson.ipynb   # run, store outputs, normalise
    python -m common.notebook check lessons/*/lesson.ipynb     # unexecuted or noisy? exit 1

Run the execution under the cluster lock when others share the local cluster
(``flock /tmp/course-cluster.lock python -m common.notebook execute ...``), and set
``COURSE_NOTEBOOK_SUBMIT=0`` to show the stored sample outputs instead of submitting jobs.
Checked by nbval (outputs of the cells marked ``# NBVAL_CHECK_OUTPUT``):

    pytest lessons --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
"""

from common.notebook import course
from common.notebook.commands import Result, clean_environ, order_by_rank, run
from common.notebook.course import code_excerpt, find_root, import_file, rel, setup, show_code
from common.notebook.files import execute, normalise, problems
from common.notebook.jobs import (
    EPOCH_LINE,
    cluster_state,
    job_state,
    parse_log,
    plot_history,
    sample_outputs,
    submit,
    submit_or_sample,
)
from common.notebook.tasks import (
    layout,
    plot_layouts,
    show_whoami,
    slurm_task,
    torchrun_worker,
    whoami,
)

__all__ = [
    "EPOCH_LINE", "Result", "clean_environ", "cluster_state", "code_excerpt", "execute",
    "find_root", "import_file", "job_state", "layout", "normalise", "order_by_rank", "parse_log",
    "plot_history", "plot_layouts", "problems", "rel", "run", "sample_outputs", "setup",
    "show_code", "show_whoami", "slurm_task", "submit", "submit_or_sample", "torchrun_worker",
    "whoami",
]  # fmt: skip


def __getattr__(name: str):
    # nb.ROOT: the course root that setup() found, kept in course.py where setup() sets it.
    if name == "ROOT":
        return course.ROOT
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
