"""The stored samples' tracebacks and log locations point at today's files.

A sample is what a run printed. When the code it ran changes (a lesson's script, or torch
itself in another release), the file:line locations it shows go stale, and a reader who looks
them up finds other code: the sample was written by another version and must be captured again.
Two kinds of location are checked against the files of this checkout and of the venv's torch:

- a Python traceback frame, `File ".../lessons/05_fault_tolerance/train.py", line 150, in
  maybe_crash`, followed by the source line Python printed: that line must be line 150 of
  today's file;
- torch's log prefix, `W1123 21:12:42.482000 29414 .../torch/distributed/run.py:982] ...`: the
  line named must be a logging call of today's torch (the prefix names the call's first line).

A location that names a course file or a torch file that does not exist today is stale too
(the file was renamed or moved since). Samples written on another machine's torch say so in
their first line (the GPU samples, tests/test_gpu_samples.py) and are skipped; so are samples
that hold no location at all (nothing here to check).
"""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TORCH = Path(torch.__file__).parent
# srun --label's "3: " and torch's "[rank3]:" before a line
PREFIX = r"(?:\s*\d+: )?(?:\[rank\d+\]:)?"
FRAME = re.compile(PREFIX + r'\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)$')
LOG = re.compile("^" + PREFIX + r"[IWEF]\d{4} [\d:.]+ \d+ (?P<path>\S+\.py):(?P<line>\d+)\] ")
LOGGING_CALL = re.compile(r"\b(?:log|logger|logging|_log)\.(?:debug|info|warning|warn|error|"
                          r"exception|critical)\(|warnings\.warn\(")  # fmt: skip


def holds_location(path: Path) -> bool:
    return any(FRAME.search(line) or LOG.search(line)
               for line in path.read_text(errors="replace").splitlines())  # fmt: skip


SAMPLES = sorted(
    p
    for pattern in ("*.out", "*.log", "*.txt")
    for p in (ROOT / "lessons").rglob(pattern)
    if not p.name.startswith("gpu-") and holds_location(p)
)


def local_file(path: str) -> Path | None:
    """The file of this checkout (or of the venv's torch) that a path printed elsewhere names."""
    if "/site-packages/torch/" in path:
        return TORCH / path.split("/site-packages/torch/", 1)[1]
    for top in ("lessons/", "common/", "tests/"):
        if f"/{top}" in f"/{path}":
            return ROOT / (top + f"/{path}".split(f"/{top}", 1)[1])
    return None


def stale_locations(text: str) -> list[str]:
    """Every traceback frame or torch log location of ``text`` that today's files contradict."""
    lines = text.splitlines()
    stale = []
    for i, line in enumerate(lines):
        if frame := FRAME.search(line):
            file = local_file(frame["path"])
            if file is None:
                continue  # Python's own library, or a file of another machine
            if not file.is_file():
                stale.append(f"{frame['path']} in {frame['func']}: no such file today")
                continue
            n = int(frame["line"])
            source = file.read_text().splitlines()
            shown = re.sub("^" + PREFIX, "", lines[i + 1]).strip() if i + 1 < len(lines) else ""
            if shown.startswith(("File ", "Traceback", "^")) or not shown:
                continue  # Python printed no source line for this frame
            if n > len(source) or source[n - 1].strip() != shown:
                today = source[n - 1].strip() if n <= len(source) else "past the end"
                stale.append(f"{frame['path']}:{n} in {frame['func']} shows {shown!r}, today's "
                             f"line is {today!r}")  # fmt: skip
        elif log := LOG.search(line):
            file = local_file(log["path"])
            if file is None:
                continue
            if not file.is_file():
                stale.append(f"{log['path']}: no such file in today's torch")
                continue
            n = int(log["line"])
            source = file.read_text().splitlines()
            if n > len(source) or not LOGGING_CALL.search(source[n - 1]):
                stale.append(f"{log['path']}:{n} is not a logging call in today's torch")
    return sorted(set(stale))


def test_stale_locations_are_found():
    train = "lessons/05_fault_tolerance/train.py"
    source = (ROOT / train).read_text().splitlines()
    n = next(i for i, s in enumerate(source, 1) if s.strip().startswith("def "))
    good = f'  File "/elsewhere/{train}", line {n}, in x\n    {source[n - 1].strip()}\n'
    bad = f'[rank1]:   File "/elsewhere/{train}", line {n}, in x\n[rank1]:     pass_here()\n'
    run = TORCH / "distributed" / "run.py"
    call = next(i for i, s in enumerate(run.read_text().splitlines(), 1) if "logger.warning(" in s)
    log = "W1123 21:12:42.482000 29414 .venv/lib/python3.11/site-packages/torch/distributed/run.py:"
    assert stale_locations(good) == []
    assert stale_locations(f"{log}{call}] hello\n") == []
    assert len(stale_locations(bad)) == 1
    gone = f'  File "/elsewhere/lessons/05_fault_tolerance/trian.py", line {n}, in x\n    pass\n'
    assert stale_locations(gone) == [
        "/elsewhere/lessons/05_fault_tolerance/trian.py in x: no such file today"
    ]
    assert stale_locations(f"{log}{call + 1}] hello\n") == [
        f".venv/lib/python3.11/site-packages/torch/distributed/run.py:{call + 1} is not a logging "
        "call in today's torch"
    ]  # fmt: skip


def test_samples_with_locations_are_found():
    # The parametrized test below would pass vacuously on an empty list.
    assert len(SAMPLES) >= 10, SAMPLES


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: str(p.relative_to(ROOT / "lessons")))
def test_sample_locations_match_todays_files(sample):
    stale = stale_locations(sample.read_text(errors="replace"))
    assert not stale, (
        f"{sample.relative_to(ROOT)} was written by other code than today's (capture it again "
        "with today's code and torch): " + "; ".join(stale[:5])
    )
