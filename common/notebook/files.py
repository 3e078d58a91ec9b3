"""The notebook files themselves: run one top to bottom and store its outputs (:func:`execute`),
normalised, and what makes one unfit to commit (:func:`problems`)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

KERNELSPEC = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
LANGUAGE_INFO = {
    "codemirror_mode": {"name": "ipython", "version": 3},
    "file_extension": ".py",
    "mimetype": "text/x-python",
    "name": "python",
    "nbconvert_exporter": "python",
    "pygments_lexer": "ipython3",
}
# Cell metadata worth keeping; everything else (execution timings, scroll state) is noise.
_CELL_METADATA = ("tags",)


def normalise(nb) -> None:
    """Drop what changes from run to run without meaning anything: timings, Python version,
    scroll state.  Execution counts become 1, 2, 3, ... in cell order."""
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": dict(LANGUAGE_INFO)}
    count = 0
    for cell in nb.cells:
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in _CELL_METADATA}
        if cell.cell_type == "code":
            count += 1
            cell.execution_count = count
            for out in cell.outputs:
                out.pop("transient", None)
                if "execution_count" in out:
                    out["execution_count"] = count


def problems(nb) -> list[str]:
    """Why this stored notebook is not fit to commit (empty list: it is fine)."""
    found = []
    if nb.metadata.get("kernelspec") != KERNELSPEC:
        found.append(f"kernelspec is {nb.metadata.get('kernelspec')}, expected {KERNELSPEC}")
    if nb.metadata.get("language_info") != LANGUAGE_INFO:
        found.append("language_info differs from the normalised one (e.g. a Python version)")
    extra = set(nb.metadata) - {"kernelspec", "language_info"}
    if extra:
        found.append(f"notebook metadata carries {sorted(extra)}")
    count = 0
    for index, cell in enumerate(nb.cells):
        extra = set(cell.metadata) - set(_CELL_METADATA)
        if extra:
            found.append(f"cell {index} metadata carries {sorted(extra)}")
        if cell.cell_type != "code":
            continue
        count += 1
        if cell.execution_count != count:
            found.append(
                f"cell {index}: execution_count {cell.execution_count}, expected "
                f"{count} (not executed top to bottom)"
            )
        if not cell.outputs:
            found.append(f"cell {index}: no output (not executed?)")
        for out in cell.outputs:
            if out.output_type == "error":
                found.append(f"cell {index}: stored with an error ({out.get('ename')})")
    return found


def execute(path: str | os.PathLike, timeout: float = 600) -> float:
    """Run a notebook top to bottom in its own folder, store outputs, normalise; seconds taken."""
    import nbformat
    from nbclient import NotebookClient

    path = Path(path).resolve()
    nb = nbformat.read(path, as_version=4)
    start = time.monotonic()
    NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    seconds = time.monotonic() - start
    normalise(nb)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return seconds


def _main(argv: Sequence[str]) -> int:
    import nbformat

    usage = "usage: python -m common.notebook execute|check NOTEBOOK.ipynb..."
    if len(argv) < 2 or argv[0] not in ("execute", "check"):
        print(usage, file=sys.stderr)
        return 2
    status = 0
    for name in argv[1:]:
        if argv[0] == "execute":
            print(f"{name}: executed in {execute(name):.1f} s", flush=True)
        else:
            found = problems(nbformat.read(name, as_version=4))
            for line in found:
                print(f"{name}: {line}")
            status |= bool(found)
    return status
