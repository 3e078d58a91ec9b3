"""Lesson 08: the scaling study's table and plot, from the output of scaling.sh.

    python lessons/08_data_pipeline/plot_scaling.py scaling-<jobid>.out [--png scaling.png]
(scaling.sh runs it at its end.)

Speed-up is throughput over the 1-rank throughput of the same mode; efficiency is speed-up
over the number of ranks (1.0 = every added rank adds a whole rank's throughput). Strong
scaling keeps the global batch, so each rank's share shrinks as ranks are added; weak scaling
keeps each rank's batch, so the global batch grows with the ranks.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

CASE = re.compile(r"^SCALING mode=(\w+) nodes=(\d+) ranks_per_node=(\d+)")
RESULT = re.compile(
    r"THROUGHPUT ranks=(\d+) nodes=(\d+) per_rank_batch=(\d+) images_per_s=([\d.]+)"
)


def read_cases(text: str) -> list[dict]:
    cases, mode = [], None
    for line in text.splitlines():
        if m := CASE.search(line):
            mode = m.group(1)
        elif (m := RESULT.search(line)) and mode:
            ranks, nodes, batch, rate = int(m[1]), int(m[2]), int(m[3]), float(m[4])
            cases.append(dict(mode=mode, ranks=ranks, nodes=nodes, batch=batch, rate=rate))
    for c in cases:
        base = next((b["rate"] for b in cases if b["mode"] == c["mode"] and b["ranks"] == 1), None)
        c["speedup"] = c["rate"] / base if base else float("nan")
        c["efficiency"] = c["speedup"] / c["ranks"]
    return cases


def table(cases: list[dict]) -> str:
    lines = ["mode    ranks  nodes  batch/rank  global  images/s  speed-up  efficiency"]
    for c in cases:
        lines.append(
            f"{c['mode']:<7} {c['ranks']:>5}  {c['nodes']:>5}  {c['batch']:>10}  "
            f"{c['batch'] * c['ranks']:>6}  {c['rate']:>8.0f}  {c['speedup']:>8.2f}  "
            f"{c['efficiency']:>10.2f}"
        )
    return "\n".join(lines)


def plot(cases: list[dict], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a login node
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, mode in zip(axes, ("strong", "weak"), strict=True):
        these = [c for c in cases if c["mode"] == mode]
        for nodes, marker in ((1, "o"), (2, "s")):
            pts = sorted((c["ranks"], c["speedup"]) for c in these if c["nodes"] == nodes)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker=marker, label=f"{nodes} node(s)")
        top = max([c["ranks"] for c in these] or [1])
        ax.plot([1, top], [1, top], "k--", linewidth=1, label="ideal")
        ax.set_title(f"{mode} scaling")
        ax.set_xlabel("ranks")
        ax.set_xticks([1, 2, 4])
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("speed-up over 1 rank")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("output", type=Path, help="the output file of scaling.sh")
    p.add_argument("--png", type=Path, default=Path("scaling.png"))
    p.add_argument("--title", help="what the plot's title names (default: the file's name)")
    args = p.parse_args(argv)
    try:
        text = args.output.read_text()
    except OSError as exc:
        print(f"error: cannot read {args.output}: {exc.strerror}", file=sys.stderr)
        return 2
    cases = read_cases(text)
    if not cases:
        print(f"error: no THROUGHPUT lines in {args.output}: is it scaling.sh's output?",
              file=sys.stderr)  # fmt: skip
        return 2
    print(table(cases))
    name = args.title or args.output.name
    plot(cases, args.png, f"{name}: training throughput, MNIST CNN (lesson 08)")
    print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
