"""The instructor notebooks (lessons/*/lesson.ipynb) are stored executed, clean and current.

Running them is nbval's job (see tests/nbval_sanitize.cfg for the command); these tests read
the stored files only, so they take a second:

* every lesson has exactly one notebook, lesson.ipynb;
* it was saved after running top to bottom (every code cell has its execution count and an
  output, no error) and carries no volatile metadata (timings, Python version);
* the lesson code it shows is the code in the lesson's files today.

After changing a lesson: `python -m common.notebook execute lessons/*/lesson.ipynb`.
"""

from __future__ import annotations

import ast
import copy
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import notebook  # noqa: E402

LESSONS = sorted(p for p in (ROOT / "lessons").iterdir() if p.is_dir() and p.name[:2].isdigit())
NOTEBOOKS = [lesson / "lesson.ipynb" for lesson in LESSONS]
FIX = "re-run: python -m common.notebook execute "


def _read(path: Path):
    return nbformat.read(path, as_version=4)


def test_every_lesson_is_there():
    assert [p.name for p in LESSONS] == [
        "00_slurm_basics",
        "01_hello_allreduce",
        "02_launch_vs_srun",
        "03_ddp_mnist",
        "04_torchrun_enroot",
        "05_fault_tolerance",
        "06_diagnosing_hangs",
        "07_fsdp_sharding",
        "08_data_pipeline",
        "09_beyond_data_parallel",
        "10_fit_and_keep",
        "11_torchft",
        "12_sick_node",
    ]


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.name)
def test_one_notebook_per_lesson(lesson):
    found = sorted(p.name for p in lesson.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
    assert found == ["lesson.ipynb"], f"{lesson.name}: expected only lesson.ipynb, found {found}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.parent.name)
def test_stored_executed_and_clean(path):
    nb = _read(path)
    nbformat.validate(nb)
    found = notebook.problems(nb)
    assert not found, f"{path.relative_to(ROOT)}: " + "; ".join(found) + f" ({FIX}{path.name})"


def _show_code_calls(source: str):
    """The constant arguments of every nb.show_code(...) call in a cell."""
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "show_code"
        ):
            yield [ast.literal_eval(arg) for arg in node.args]


COMPARED = "# NBVAL_CHECK_OUTPUT"
NOT_COMPARED = "# not compared: "


def uncompared_cells(nb) -> list[str]:
    """The code cells that nbval (--nbval-lax) does not compare and that do not say why."""
    found = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        lines = cell.source.splitlines()
        if COMPARED in lines or any(line.startswith(NOT_COMPARED) for line in lines):
            continue
        found.append(f"cell {cell.id} ({lines[0][:50] if lines else 'empty'!r})")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.parent.name)
def test_every_cell_is_compared_or_says_why_not(path):
    # nbval --nbval-lax compares only the cells marked NBVAL_CHECK_OUTPUT: a new cell is
    # compared unless its author writes down why it cannot be (a measurement, a figure).
    missing = uncompared_cells(_read(path))
    assert not missing, (
        f"{path.relative_to(ROOT)}: {'; '.join(missing)}: start the cell with {COMPARED!r}, or "
        f"with {NOT_COMPARED!r} and the reason (tests/nbval_sanitize.cfg masks what a run "
        f"measures)"
    )


def test_uncompared_cells_finds_an_unmarked_cell():
    cells = [
        nbformat.v4.new_code_cell(f"{COMPARED}\nprint(1)"),
        nbformat.v4.new_code_cell(f"{NOT_COMPARED}a figure\nplot()"),
        nbformat.v4.new_markdown_cell("text"),
        nbformat.v4.new_code_cell("print(2)  # NBVAL_CHECK_OUTPUT is not a marker here"),
    ]
    nb = nbformat.v4.new_notebook(cells=cells)
    assert uncompared_cells(nb) == [
        f"cell {cells[3].id} ('print(2)  # NBVAL_CHECK_OUTPUT is not a marker her')"
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.parent.name)
def test_shown_code_is_current(path):
    notebook.setup(ROOT)
    nb = _read(path)
    shown = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        calls = list(_show_code_calls(cell.source))
        stored = [
            o.data["text/markdown"] for o in cell.outputs if "text/markdown" in o.get("data", {})
        ]
        assert len(stored) == len(calls), f"{path.parent.name} cell {cell.id}: outputs missing"
        for args, text in zip(calls, stored, strict=True):
            header, code = notebook.code_excerpt(*args)
            assert header in text and code in text, (
                f"{path.parent.name}: the stored output of show_code{tuple(args)} is not the "
                f"current file ({FIX}{path.relative_to(ROOT)})"
            )
            shown += 1
    assert shown, f"{path.parent.name}: the notebook shows none of the lesson's code"


def test_problems_catches_unexecuted_and_noisy_notebooks():
    nb = _read(NOTEBOOKS[0])
    assert notebook.problems(nb) == []

    unexecuted = copy.deepcopy(nb)
    for cell in unexecuted.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    found = notebook.problems(unexecuted)
    assert any("no output" in p for p in found) and any("execution_count" in p for p in found)

    noisy = copy.deepcopy(nb)
    noisy.metadata["language_info"]["version"] = "3.11.7"
    noisy.cells[1].metadata["execution"] = {"iopub.execute_input": "2026-01-01T00:00:00Z"}
    found = notebook.problems(noisy)
    assert any("language_info" in p for p in found) and any("execution" in p for p in found)

    notebook.normalise(noisy)
    assert notebook.problems(noisy) == []


def test_order_by_rank_keeps_other_lines_in_place():
    text = "world\nrank 1/2: b\nrank 0/2: a\nrank 1/2: c\nrank 0/2: d\nend\n"
    assert notebook.order_by_rank(text) == (
        "world\nrank 0/2: a\nrank 0/2: d\nrank 1/2: b\nrank 1/2: c\nend\n"
    )


def test_slurm_task_examples_resolve_to_every_rank_once():
    # The made-up SLURM environments of the notebooks must be ones common.env accepts,
    # numbering the processes node by node.
    notebook.setup(ROOT)
    procs = notebook.layout(
        [notebook.slurm_task(2, 2, node, local) for node in range(2) for local in range(2)]
    )
    assert [(p["rank"], p["node_rank"], p["local_rank"]) for p in procs] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert {p["world_size"] for p in procs} == {4}
    spawned = notebook.layout(
        [
            (
                notebook.slurm_task(2, 1, node, 0, gpus_per_node=2),
                {"spawn_index": i, "spawn_nprocs": 2},
            )
            for node in range(2)
            for i in range(2)
        ]
    )
    assert spawned == [{**p, "launcher": "mp.spawn"} for p in procs]


def test_code_excerpt_of_shell_functions_takes_the_comment_above_and_the_closing_brace(tmp_path):
    a = "# what a does\n# and why\na() {\n    if x; then\n    fi\n}"
    script = tmp_path / "x.sh"
    script.write_text(f"#!/bin/bash\n# --- a section\n{a}\n\nb() {{\n    echo b\n}}\n")
    header, code = notebook.code_excerpt(script, "b", "a")
    assert header.endswith("lines 10-12, 3-8")
    assert code == "b() {\n    echo b\n}\n\n" + a
    with pytest.raises(ValueError, match="defines no c"):
        notebook.code_excerpt(script, "c")


@pytest.mark.timeout(120)
def test_run_kills_a_worker_in_its_own_session_at_its_timeout():
    # As torchrun does: the command's child runs in a session of its own, holds the output pipe
    # and does not end. The timeout must end it too, not wait on the pipe (a stuck lesson 08
    # worker once held a notebook for 10 minutes).
    child = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
             "'import time; time.sleep(300)'], start_new_session=True); time.sleep(300)")
    with pytest.raises(RuntimeError, match="did not finish within 2 s"):
        notebook.run([sys.executable, "-c", child], timeout=2, show=False)
