"""Imports go one way: no module of common/ or lessons/ reaches back to one that imports it.

The graph is read from the code with ``ast``: every ``import`` and ``from ... import`` anywhere in
a module, inside functions too (an import at call time is an import), with ``common.x`` and
relative names resolved, and a lesson script's imports of its own folder's modules (``tinylm``,
``train``) resolved to those files.  A course module may not pick what it imports at run time
(``importlib.import_module(f"common.{name}")``): nothing could check that edge.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What a student carries home from lesson 03 besides train.py (README.md, "Taking it home"):
# the files of common/ it imports; tests/test_lesson03.py runs train.py with exactly these.
CARRIED = ("checkpoint.py", "env.py", "launch.py", "mnist.py")

# The one exception: code under ``if __name__ == "__main__":`` runs only when its file is run as a
# script, and that process's ``__main__`` is another module than the one the others import
# (``python -m common.env`` runs env.py as ``__main__``; the ``common.env`` it then imports, through
# common/env_cli.py, is a second module, which never imports env_cli).  Such a block's imports are
# the script's, not the module's.


def module_name(path: Path) -> str:
    """common/preflight/cli.py -> common.preflight.cli; lessons/09_x/tp.py -> lessons/09_x/tp."""
    rel = path.relative_to(ROOT).with_suffix("")
    if rel.parts[0] == "lessons":
        return "/".join(rel.parts)
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def course_modules() -> dict[str, Path]:
    files = [*(ROOT / "common").rglob("*.py"), *(ROOT / "lessons").glob("*/*.py")]
    return {module_name(p): p for p in sorted(files) if "__pycache__" not in p.parts}


def _is_main_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare)
            and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__"
                    for c in test.comparators))  # fmt: skip


def _walk(tree: ast.Module):
    """Every node of the module, less its top-level ``__main__`` blocks (see above)."""
    for top in tree.body:
        if _is_main_block(top):
            continue
        yield from ast.walk(top)


def _dynamic_import(node: ast.AST) -> ast.expr | None:
    """The name argument of importlib.import_module(...) / __import__(...), else None."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return node.args[0] if name in ("import_module", "__import__") else None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported course module, line) for every import in the file at ``path``."""
    package = name.rpartition(".")[0] if path.name != "__init__.py" else name
    lesson_dir = path.parent if name.startswith("lessons/") else None

    def resolve(dotted: str) -> str | None:
        if dotted in modules:
            return dotted
        if lesson_dir is not None and "." not in dotted:  # a sibling of a lesson script
            sibling = f"lessons/{lesson_dir.name}/{dotted}"
            return sibling if sibling in modules else None
        return None

    found = []
    for node in _walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(resolve(a.name), node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from pkg import mod` imports pkg.mod
                target = resolve(f"{base}.{alias.name}") if base else None
                found.append((target or resolve(base), node.lineno))
        elif (arg := _dynamic_import(node)) is not None:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append((resolve(arg.value), node.lineno))
            else:
                found.append(("<a name chosen at run time>", node.lineno))
    first = {}  # each imported module once, at its first import
    for target, line in found:
        if target and target != name:
            first.setdefault(target, line)
    return list(first.items())


def import_graph() -> dict[str, list[tuple[str, int]]]:
    modules = course_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, list[tuple[str, int]]]) -> list[tuple[str, int]] | None:
    """One cycle as [(module, line of its import of the next), ...], else None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[tuple[str, int]] = []

    def visit(node: str) -> list[tuple[str, int]] | None:
        state[node] = 1
        for target, line in graph.get(node, []):
            path.append((node, line))
            if state.get(target) == 1:
                start = next(i for i, (n, _) in enumerate(path) if n == target)
                return path[start:]
            if target in graph and not state.get(target):
                cycle = visit(target)
                if cycle:
                    return cycle
            path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if not state.get(node):
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def _file(name: str) -> str:
    if name.startswith("lessons/"):
        return f"{name}.py"
    path = course_modules().get(name)
    return str(path.relative_to(ROOT)) if path else name


def test_the_graph_sees_what_it_must():
    """The reader of the graph finds the imports these tests rely on (else it proves nothing)."""
    graph = import_graph()
    edges = {(a, b) for a, targets in graph.items() for b, _ in targets}
    assert ("lessons/03_ddp_mnist/train", "common.env") in edges
    assert ("lessons/09_beyond_data_parallel/tp", "lessons/09_beyond_data_parallel/tinylm") in edges
    assert ("common.mnist_prepare", "common.mnist") in edges
    assert any(a.startswith("common.preflight") and b == "common.env" for a, b in edges), edges


def test_no_module_picks_its_imports_at_run_time():
    found = [f"{_file(name)}:{line}" for name, targets in import_graph().items()
             for target, line in targets if target == "<a name chosen at run time>"]  # fmt: skip
    assert not found, f"an import whose module is chosen at run time: {', '.join(found)}"


def carried_set(graph) -> list[str]:
    """The modules of common/ that lesson 03's train.py imports, directly or through each other
    (README.md: what you carry)."""
    found, todo = [], ["lessons/03_ddp_mnist/train"]
    while todo:
        for target, _ in graph[todo.pop()]:
            if target.startswith("common.") and target not in found:
                found.append(target)
                todo.append(target)
    return sorted(found)


def test_what_a_student_carries_imports_nothing_else_of_the_course():
    """The files of common/ that lesson 03's train.py imports need nothing else of the course:
    env.py's host list reader, the checks, mnist.py's MD5 check are theirs.  Who am I (env.py)
    imports none of them; the checks (launch.py) import env.py, never the other way."""
    graph = import_graph()
    carried = carried_set(graph)
    assert carried == [f"common.{name[:-3]}" for name in CARRIED], carried
    found = [f"{_file(a)}:{line} imports {b}" for a in carried for b, line in graph[a]
             if b not in carried]  # fmt: skip
    assert not found, found
    assert graph["common.env"] == [], graph["common.env"]
    assert [b for b, _ in graph["common.launch"]] == ["common.env"], graph["common.launch"]


def test_imports_go_one_way():
    cycle = find_cycle(import_graph())
    if cycle:
        shown = " -> ".join(f"{name} ({_file(name)}:{line})" for name, line in cycle)
        pytest.fail(f"import cycle: {shown} -> {cycle[0][0]}")
