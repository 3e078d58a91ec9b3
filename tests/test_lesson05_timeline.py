"""Lesson 05's timeline.py, whose events the notebook prints and draws, against the stored runs.

Each event is found again here by a marker that only its own line of the file holds; its time is
the one written on that line (train.py's lines carry none), taken from the job's first start;
the events come in the file's order. A parser that reads another line (the slurmstepd line
"... DUE TO JOB REQUEUE" for the requeue, a second signal, the wrong start) fails here, even
where that line's time is the same.
"""

from __future__ import annotations

import importlib.util
import re
from datetime import datetime
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "lessons" / "05_fault_tolerance"
_spec = importlib.util.spec_from_file_location("lesson05_timeline", LESSON / "timeline.py")
timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timeline)

RUN = [("start", "SLURM_RESTART_COUNT=0"), ("signal", None), ("saved", "checkpoint saved at"),
       ("requeue", "requeueing job"), ("start", "SLURM_RESTART_COUNT=1"),
       ("resumed", "resumed from"), ("finished", "finished with status 0")]  # fmt: skip
STORED = {  # file: (what, a marker only the event's line holds), in order
    "slurm-174.out": [(w, m or "got SIGUSR1") for w, m in RUN],  # the warning
    "slurm-186.out": [(w, m or "*** STEP 186.0 ON node1 CANCELLED AT") for w, m in RUN],
    "ft-urgent-187.out": [("start", "urgent job 187 starts"), ("finished", "job 187 finished")],
}
FIELDS = re.compile(r"SIG\w+|STEP \S+|epoch \d+, step \d+|job \d+|SLURM_RESTART_COUNT=\d+|"
                    r"status \d+|signal \d+")  # fmt: skip
CLOCK = re.compile(r"(\d{4}-\d\d-\d\d)?[ T]?(\d\d:\d\d:\d\d)")


@pytest.mark.parametrize("name", STORED)
def test_each_event_is_read_from_its_own_line(name):
    lines = (LESSON / name).read_text().splitlines()
    events = timeline.read_events("\n".join(lines))
    assert [e.what for e in events] == [what for what, _ in STORED[name]], events
    first = CLOCK.search(lines[0])
    origin = datetime.fromisoformat(f"{first[1]} {first[2]}")  # the date only the start gives
    for (what, marker), e in zip(STORED[name], events, strict=True):
        (n,) = [n for n, line in enumerate(lines, 1) if marker in line]
        line = lines[n - 1]
        assert e.line == n, f"{what} read from line {e.line}, not {n}: {line!r}"
        stamp = CLOCK.search(line)
        if stamp is None:  # train.py's lines
            assert e.at is None, (e, line)
        else:
            written = datetime.fromisoformat(f"{origin.date()} {stamp[2]}")
            assert (e.at - origin).total_seconds() == (written - origin).total_seconds(), line
        assert FIELDS.findall(e.detail) and all(f in line for f in FIELDS.findall(e.detail)), \
            (e.detail, line)  # fmt: skip
    assert [e.line for e in events] == sorted(e.line for e in events)


@pytest.mark.parametrize("name", STORED)
def test_spans_join_the_events_one_to_the_next(name):
    events = timeline.read_events((LESSON / name).read_text())
    origin = events[0].at
    timed = [(e.what, (e.at - origin).total_seconds()) for e in events if e.at]
    kind = {"start": "run", "signal": "stop", "requeue": "hold"}
    assert timeline.spans(events, origin) == [(kind[a], t, u) for (a, t), (_, u) in
                                              pairwise(timed)], timed  # fmt: skip


def test_the_stored_requeues_resume_where_they_saved():
    """What the notebook prints beside its figure: each run saved and resumed at the same step,
    and the hold of each stored requeue lasted 1 s (released with StartTime=now, README §1)."""
    for name in ("slurm-174.out", "slurm-186.out"):
        events = timeline.read_events((LESSON / name).read_text())
        (saved,) = [e.detail for e in events if e.what == "saved"]
        (resumed,) = [e.detail for e in events if e.what == "resumed"]
        assert saved.split(" (")[0] == resumed, (saved, resumed)
        holds = [b - a for kind, a, b in timeline.spans(events, events[0].at) if kind == "hold"]
        assert holds == [1.0], name


def test_a_time_of_day_past_midnight_is_on_the_next_day():
    text = ("=== job 7 (ft-requeue) starts 2026-11-23 23:59:58 UTC in partition local, "
            "SLURM_RESTART_COUNT=0\n=== 00:00:03 got SIGUSR1: asking the training to checkpoint"
            " and stop\n=== 00:00:05 requeueing job 7 (after SIGUSR1); it resumes from x.pt\n")
    events = timeline.read_events(text)
    assert [(e.what, (e.at - events[0].at).total_seconds()) for e in events] == [
        ("start", 0.0), ("signal", 5.0), ("requeue", 7.0)]  # fmt: skip


def test_the_figure_draws_the_spans():
    import matplotlib

    matplotlib.use("Agg")
    rows = []
    for name in ("slurm-174.out", "slurm-186.out"):
        events = timeline.read_events((LESSON / name).read_text())
        rows.append((name, events, events[0].at))
    fig = timeline.draw(rows, "test")
    bars = [p.get_extents().intervalx for c in fig.axes[0].collections for p in c.get_paths()]
    drawn = sorted((round(a, 6), round(b, 6)) for a, b in bars)
    wanted = [(a, b) for _, events, origin in rows for _, a, b in timeline.spans(events, origin)]
    assert drawn == sorted(wanted)
