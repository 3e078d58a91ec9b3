"""Lesson 05: a requeue's timeline, read back from requeue.sh's output: the job's start, the
signal, the checkpoint, the requeue, the hold, the next run's start and resume, the end; and a
figure of it (lesson.ipynb draws the stored runs').

The job script stamps its own lines with the time of day, UTC, to the second ("=== job 174
(ft-requeue) starts 2026-11-23 21:22:39 UTC ...", "=== 21:22:47 got SIGUSR1: ...", "=== 21:22:49
requeueing job 174 ..."), and slurmstepd the moment it signals the tasks ("*** STEP 186.0 ON node1
CANCELLED AT 2026-11-23T21:26:38 ***"). train.py's lines carry no time: its checkpoint falls
between the signal and the requeue (the script requeues once srun has ended), its resume after
its run's start.
"""

from __future__ import annotations

import re
from datetime import date, datetime, time, timedelta
from typing import NamedTuple

CLOCK = r"(\d\d:\d\d:\d\d)"
START = re.compile(rf"^=== (.+?) starts (\d{{4}}-\d\d-\d\d) {CLOCK} UTC"
                   r"(?:.*(SLURM_RESTART_COUNT=\d+))?")  # fmt: skip
SIGNAL = re.compile(rf"^=== {CLOCK} got (SIG\w+)")
TASKS_SIGNALLED = re.compile(rf"^slurmstepd\S*: error: \*\*\* (STEP \S+) ON \S+ CANCELLED AT "
                             rf"(\d{{4}}-\d\d-\d\d)T{CLOCK} \*\*\*$")  # fmt: skip
SAVED = re.compile(r"^stop requested \((.+?)\): checkpoint saved at (epoch \d+, step \d+)")
REQUEUE = re.compile(rf"^=== {CLOCK} (requeueing job \d+(?: \(after \w+\))?|job \d+ was "
                     r"requeued by Slurm itself)")  # fmt: skip
RESUMED = re.compile(r"^resumed from \S+ at (epoch \d+, step \d+)")
FINISHED = re.compile(rf"^=== {CLOCK} (.+? (?:finished(?: with status \d+)?|ends))$")


class Event(NamedTuple):
    what: str  # start, signal, saved, requeue, resumed, finished
    at: datetime | None  # UTC, to the second; None for train.py's lines, which carry no time
    detail: str
    line: int  # the line of the file it was read from, 1 for the first


def read_events(text: str) -> list[Event]:
    """The events of a requeue.sh output (and of any job script of the course that stamps its
    start and end the same way), in the file's order."""
    events: list[Event] = []
    day: date | None = None

    def clock(stamp: str) -> datetime:
        # A time of day only: on the day of the last start, or the next day once past midnight.
        at = datetime.combine(day, time.fromisoformat(stamp))
        last = max((e.at for e in events if e.at), default=at)
        return at + timedelta(days=1) if at < last - timedelta(hours=12) else at

    for n, line in enumerate(text.splitlines(), 1):
        if m := START.match(line):
            at = datetime.fromisoformat(f"{m[2]} {m[3]}")
            day = at.date()
            events.append(Event("start", at, ", ".join(filter(None, (m[1], m[4]))), n))
        elif day is None:
            continue
        elif m := SIGNAL.match(line):
            events.append(Event("signal", clock(m[1]), f"{m[2]} to the batch shell", n))
        elif m := TASKS_SIGNALLED.match(line):
            at = datetime.fromisoformat(f"{m[2]} {m[3]}")
            events.append(Event("signal", at, f"the tasks signalled ({m[1]} CANCELLED)", n))
        elif m := SAVED.match(line):
            events.append(Event("saved", None, f"at {m[2]} ({m[1]})", n))
        elif m := REQUEUE.match(line):
            events.append(Event("requeue", clock(m[1]), m[2], n))
        elif m := RESUMED.match(line):
            events.append(Event("resumed", None, f"at {m[1]}", n))
        elif m := FINISHED.match(line):
            events.append(Event("finished", clock(m[1]), m[2], n))
    return events


def spans(events: list[Event], origin: datetime) -> list[tuple[str, float, float]]:
    """(kind, from, to), seconds after ``origin``: each run (start to its signal or its end),
    each stop (the first signal to the requeue: the ranks agree, rank 0 saves, srun ends) and
    each hold (the requeue to the next start)."""
    opens = {"start": "run", "signal": "stop", "requeue": "hold"}
    ends = {"run": ("signal", "finished"), "stop": ("requeue", "finished"), "hold": ("start",)}
    found, kind, since = [], None, None
    for e in (e for e in events if e.at):
        t = (e.at - origin).total_seconds()
        if kind and e.what in ends[kind]:
            found.append((kind, since, t))
            kind = None
        if kind is None:
            kind, since = opens.get(e.what), t
    return found


def draw(rows: list[tuple[str, list[Event], datetime]], title: str):
    """One row per (label, events, origin): the runs, stops and holds as bars, each event named
    at its moment (the checkpoint, which has no time, midway between the stamped events around
    it; the resume at its run's start), and under the bar where the run saved and resumed."""
    import matplotlib.pyplot as plt

    colors = {"run": "tab:green", "stop": "tab:red", "hold": "tab:gray"}
    fig, ax = plt.subplots(figsize=(10, 0.6 + 1.5 * len(rows)))
    last = max((e.at - origin).total_seconds() for _, events, origin in rows for e in events
               if e.at)  # fmt: skip
    per_char = 0.0065 * last  # the seconds of the axis a character of the labels takes, about
    for y, (_, events, origin) in enumerate(reversed(rows)):
        for kind, start, end in spans(events, origin):
            ax.broken_barh([(start, max(end - start, 0.2))], (y - 0.12, 0.24),
                           color=colors[kind], alpha=0.7)  # fmt: skip
        times = [(e.at - origin).total_seconds() if e.at else None for e in events]
        labels = []
        for k, e in enumerate(events):
            t = times[k]
            if t is None:
                before = [s for s in times[:k] if s is not None]
                after = [s for s in times[k + 1 :] if s is not None]
                t = before[-1] if e.what == "resumed" or not after else (before[-1] + after[0]) / 2
            else:
                ax.plot([t, t], [y - 0.16, y + 0.16], color="black", linewidth=1)
            signal = e.detail.split(" (")[0].removeprefix("the ")
            text = {"start": "start" if k == 0 else "start again", "finished": "end",
                    "signal": signal}.get(e.what, e.what)  # fmt: skip
            labels.append((t, text))
        ends: list[float] = []  # where the labels of each level end: a label takes the lowest
        for t, text in sorted(labels, key=lambda item: item[0]):  # level it does not overlap
            half = len(text) * per_char / 2
            level = next((n for n, end in enumerate(ends) if t - half > end), len(ends))
            ends[level:level + 1] = [t + half]
            ax.annotate(text, (t, y + 0.16), xytext=(0, 3 + 10 * level), textcoords="offset points",
                        ha="center", fontsize=7, arrowprops=dict(arrowstyle="-", linewidth=0.4,
                                                                  color="gray"))  # fmt: skip
        kept = [f"{e.what} {e.detail}" for e in events if e.what in ("saved", "resumed")]
        if kept:
            ax.text(min(t for t in times if t is not None), y - 0.2, "; ".join(kept), va="top",
                    fontsize=7)  # fmt: skip
    for kind, color in colors.items():
        ax.broken_barh([], (0, 0), color=color, alpha=0.7, label=kind)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in reversed(rows)], fontsize=8)
    ax.set_ylim(-0.5, len(rows) - 0.1)
    ax.set_xlabel("seconds after the job's first start (its lines' times: UTC, to the second)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right", ncols=3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
