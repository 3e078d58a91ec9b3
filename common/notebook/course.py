"""The notebooks' course: where it lies (:func:`setup`), and its files shown as code
(:func:`show_code`) or imported (:func:`import_file`)."""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path

ROOT: Path | None = None


def find_root(start: Path | None = None) -> Path:
    """The course root: the first folder at or above ``start`` (default: cwd) with common/."""
    start = Path.cwd() if start is None else Path(start)
    for folder in (start, *start.parents):
        if (folder / "common" / "notebook").is_dir() and (folder / "lessons").is_dir():
            return folder.resolve()
    raise FileNotFoundError(f"no course root (a folder with common/ and lessons/) above {start}")


def setup(root: Path | None = None) -> Path:
    """Make the course importable here and in every command the notebook runs."""
    global ROOT
    ROOT = find_root() if root is None else Path(root).resolve()
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return ROOT


def _root() -> Path:
    return ROOT if ROOT is not None else setup()


def rel(path: str | os.PathLike) -> str:
    """``path`` relative to the course root where it lies inside it (for printing)."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(_root()))
    except ValueError:
        return str(p)


# --------------------------------------------------------------------------- show code


def _display_markdown(text: str) -> None:
    from IPython.display import Markdown, display

    display(Markdown(text))


def code_excerpt(path: str | os.PathLike, *names: str) -> tuple[str, str]:
    """The text of ``path`` (relative to the course root), or of its top-level definitions
    ``names`` (functions/classes, with their decorators; in a shell script its functions, with
    the comment above each) joined by blank lines.

    Returns (header, code).  A name that is not defined in the file is a ValueError, so a
    notebook notices when the lesson's code was renamed.
    """
    file = _root() / path
    text = file.read_text()
    if not names:
        return f"`{path}`", text.rstrip("\n")
    lines = text.splitlines()
    found = {}
    if file.suffix == ".sh":
        # A shell function: `name() {` at the start of a line, to the first `}` that closes
        # a line at the same place, with the comment lines right above it (not a #! line or
        # a section's `# ---` rule).
        for i, line in enumerate(lines):
            if m := re.match(r"(\w+)\(\) \{$", line):
                end = next(j for j in range(i + 1, len(lines)) if lines[j] == "}")
                first = i
                while (
                    first > 0
                    and lines[first - 1].startswith("#")
                    and not lines[first - 1].startswith(("#!", "# ---"))
                ):
                    first -= 1
                found[m[1]] = (first + 1, end + 1)
    else:
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                found[node.name] = (first, node.end_lineno)
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"{path} defines no {', '.join(missing)} (it has {', '.join(found)})")
    parts, spans = [], []
    for name in names:
        first, last = found[name]
        parts.append("\n".join(lines[first - 1 : last]))
        spans.append(f"{first}-{last}")
    return f"`{path}` lines {', '.join(spans)}", "\n\n".join(parts)


def show_code(path: str | os.PathLike, *names: str) -> None:
    """Show a lesson file (or some of its functions) as highlighted code, read from disk."""
    header, code = code_excerpt(path, *names)
    lang = {".py": "python", ".sh": "bash"}.get(Path(path).suffix, "")
    _display_markdown(f"{header}\n\n```{lang}\n{code}\n```")


def import_file(path: str | os.PathLike):
    """Import a lesson's script (relative to the course root) as a module, to use its helpers
    (its ``if __name__ == "__main__"`` part does not run)."""
    import importlib.util

    file = _root() / path
    name = "lesson_" + re.sub(r"\W", "_", str(Path(path).with_suffix("")))
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _show(fig) -> None:
    """Display a figure once (as a PNG) and close it, so the cell shows no second copy."""
    import matplotlib.pyplot as plt
    from IPython.display import display

    display(fig)
    plt.close(fig)
