"""Lesson 10: fit.sh's output read back, every rank's estimate beside its measured peak, per rank
count, without and with activation checkpointing; a figure of them (lesson.ipynb draws it from
the stored fit-<jobid>.out).

fit.sh prints a header per step ("--- step: 2 node(s), 4 task(s), activation checkpointing on"),
then one line per rank from step.py ("rank 3: estimate 106.1 MiB | measured 109.1 MiB | ...").
"""

from __future__ import annotations

import re

CASE = re.compile(r"^--- step: (\d+) node\(s\), (\d+) task\(s\), "
                  r"activation checkpointing (on|off)$")
MODEL = re.compile(r"^model (\S+), ")
RANK = re.compile(r"^rank (\d+): estimate ([\d.]+) MiB \| measured ([\d.]+) MiB \|")
BOUND = 0.10  # the lesson's tests hold every rank's estimate to 10 % of its measured peak


def read_cases(text: str) -> list[dict]:
    """One dict per step of fit.sh, in the file's order: nodes, ranks, ac (activation
    checkpointing), model, estimate (MiB, as every rank printed it) and measured (MiB, by rank)."""
    cases = []
    for line in text.splitlines():
        if m := CASE.match(line):
            cases.append(dict(nodes=int(m[1]), ranks=int(m[2]), ac=m[3] == "on", model=None,
                              estimate=None, measured={}))  # fmt: skip
        elif cases and (m := MODEL.match(line)):
            cases[-1]["model"] = m[1]
        elif cases and (m := RANK.match(line)):
            case, estimate = cases[-1], float(m[2])
            if case["estimate"] not in (None, estimate):
                raise ValueError(f"rank {m[1]} printed estimate {estimate}, rank 0 "
                                 f"{case['estimate']}: not one step's ranks")  # fmt: skip
            case["estimate"] = estimate
            case["measured"][int(m[1])] = float(m[3])
    return cases


def within(estimate: float, measured: float) -> bool:
    """The estimate within BOUND of the measured peak (as the lesson's tests check it)."""
    return abs(estimate - measured) <= BOUND * measured


def draw(cases: list[dict], title: str):
    """Bars: the estimate per rank count (without and with activation checkpointing); dots: each
    rank's measured peak; grey: where a measured peak may lie for the estimate to be within BOUND
    of it."""
    import matplotlib.pyplot as plt

    counts = sorted({c["ranks"] for c in cases})
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.38
    for ac, color, shift in ((False, "tab:blue", -width / 2), (True, "tab:orange", width / 2)):
        label = "activation checkpointing " + ("on" if ac else "off")
        for c in (c for c in cases if c["ac"] == ac):
            x = counts.index(c["ranks"]) + shift
            est = c["estimate"]
            ax.bar(x, est, width * 0.9, color=color, alpha=0.5, label=f"estimate, {label}")
            ax.fill_between([x - width * 0.45, x + width * 0.45], est / (1 + BOUND),
                            est / (1 - BOUND), color="gray", alpha=0.25, linewidth=0,
                            label=f"a peak in here: the estimate within {BOUND:.0%} of it")
            measured = [c["measured"][r] for r in sorted(c["measured"])]
            offsets = [(i - (len(measured) - 1) / 2) * width * 0.18 for i in range(len(measured))]
            ax.plot([x + o for o in offsets], measured, "o", color="black", markersize=4,
                    label="measured peak, one dot per rank")  # fmt: skip
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))  # each label once
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper right")
    ax.set_xticks(range(len(counts)), [f"{n} rank{'s' if n > 1 else ''}" for n in counts])
    ax.set_ylabel("MiB per rank, peak of a step")
    ax.set_ylim(0, max(c["estimate"] for c in cases) * 1.35)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
