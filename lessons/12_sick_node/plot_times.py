"""Lesson 12: read a job's timing windows back from its output, and draw them.

train.py prints one line per window (``times step 60 | compute ms 14.1 14.1 143.8 147.3 | wait
ms 193.3 198.1 62.5 63.8`` in slurm-123.out: each rank's median compute and wait time, rank 0
first) and, when it names a node, a ``sick node:`` line. The notebook's figure comes from here:

    python lessons/12_sick_node/plot_times.py lessons/12_sick_node/slurm-123.out --png times.png
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

TIMES = re.compile(r"^times step (\d+) \| compute ms ([\d. ]+) \| wait ms ([\d. ]+)$", re.M)
SICK = re.compile(r"^sick node: (\S+) \(rank ([\d,]+)\): (.*?); checkpoint saved at step (\d+)",
                  re.M)
NODES = re.compile(r"world size \d+ on ([\w,]+),")


def read_times(text: str) -> list[dict]:
    """One row per window: the step it ends at, and each rank's compute and wait (ms)."""
    rows = []
    for m in TIMES.finditer(text):
        compute, wait = [list(map(float, g.split())) for g in (m[2], m[3])]
        if len(compute) != len(wait):
            raise ValueError(f"step {m[1]}: {len(compute)} compute times, {len(wait)} waits")
        rows.append({"step": int(m[1]), "compute": compute, "wait": wait})
    return rows


def read_verdict(text: str) -> dict | None:
    """The ``sick node:`` line: node, ranks, why, and the step it saved at (None if clean)."""
    m = SICK.search(text)
    if not m:
        return None
    return {"node": m[1], "ranks": [int(r) for r in m[2].split(",")], "why": m[3],
            "saved": int(m[4])}  # fmt: skip


def node_ratios(row: dict, ranks: list[int]) -> float:
    """What health.StragglerWatch compares: the fastest of RANKS over the others' median."""
    mine = [row["compute"][r] for r in ranks]
    others = [c for r, c in enumerate(row["compute"]) if r not in ranks]
    return min(mine) / statistics.median(others)


def draw(rows: list[dict], verdict: dict | None, title: str = ""):
    """Per rank, compute and wait per window; the named node's ranks in red."""
    import matplotlib.pyplot as plt

    sick = set(verdict["ranks"]) if verdict else set()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    steps = [r["step"] for r in rows]
    for rank in range(len(rows[0]["compute"])):
        style = {"color": "tab:red" if rank in sick else "tab:blue", "marker": "o", "ms": 3,
                 "label": f"rank {rank}" + (" (named)" if rank in sick else "")}  # fmt: skip
        axes[0].plot(steps, [r["compute"][rank] for r in rows], **style)
        axes[1].plot(steps, [r["wait"][rank] for r in rows], **style)
    for ax, what in zip(axes, ("computes", "waits for the others"), strict=True):
        ax.set_xlabel("step")
        ax.set_title(f"each rank {what} (ms, median of a window)", fontsize=10)
        if verdict:
            ax.axvline(verdict["saved"], color="grey", ls=":", lw=1)
    axes[0].set_ylabel("ms per step")
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("output", type=Path, help="a job's output (slurm-<jobid>.out)")
    p.add_argument("--png", type=Path, required=True, help="where the figure goes")
    args = p.parse_args(argv)
    try:
        text = args.output.read_text()
    except OSError as exc:
        print(f"error: cannot read {args.output}: {exc.strerror}", file=sys.stderr)
        return 2
    rows = read_times(text)
    if not rows:
        print(f"error: {args.output} has no 'times step' lines: give the output of a "
              f"lesson 12 job (train.py prints one every --check-every steps)", file=sys.stderr)
        return 2
    draw(rows, read_verdict(text), args.output.name).savefig(args.png, dpi=100)
    print(f"{len(rows)} windows of {len(rows[0]['compute'])} ranks drawn to {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
