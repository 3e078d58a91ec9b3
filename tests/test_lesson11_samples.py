"""Lessons 11 and 12's stored runs as their READMEs quote them: every output a README shows is in
the stored file it names. Reads files only (no torchft), so it runs in `make test`; the runs
themselves are tests/test_lesson11.py, tests/test_lesson11_cluster.py and tests/test_lesson12.py.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAMED = re.compile(r"`([\w/-]+\.(?:out|txt))`")  # a file named in the prose, e.g. `slurm-374.out`
BLOCK = re.compile(r"^```text\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("lesson, quotes", [("11_torchft", 9), ("12_sick_node", 8)])
def test_readme_quotes_the_stored_outputs(lesson, quotes):
    """Every ```text block of the README is output copied from the stored files the prose names
    since the block before (the lesson's .out and .txt files, compare/ included): each of its
    lines is in one of them."""
    folder = ROOT / "lessons" / lesson
    readme = (folder / "README.md").read_text()
    blocks = list(BLOCK.finditer(readme))
    assert len(blocks) >= quotes, f"the README quotes {len(blocks)} outputs"
    since = 0
    for block in blocks:
        named = [n for n in NAMED.findall(readme[since: block.start()]) if (folder / n).is_file()]
        assert named, f"no stored file named before {block.group(1)[:80]!r}"
        texts = {name: (folder / name).read_text() for name in named}
        for line in block.group(1).splitlines():
            assert any(line in text for text in texts.values()), (
                f"README quotes {line!r}, in none of {named}")  # fmt: skip
        since = block.end()
