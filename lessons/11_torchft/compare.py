"""Lesson 11: the figures of compare.sh's runs, read back from what they wrote, and a plot.

Every file in the folder is a job's output as compare.sh copied it, each line prefixed with the
time it was read (seconds since the epoch), and timeline.txt holds the DOWN and the node's
return on the same clock. Prints the figures and writes compare.png beside them:

    python lessons/11_torchft/compare.py lessons/11_torchft/compare
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

FT_STEP = re.compile(r"\[group (\d)\] step (\d+)/\d+ \| participants (\d) \| loss ([\d.]+) "
                     r"\| [\d.]+ steps/s \| state (\w+)")  # fmt: skip
L05_STEP = re.compile(r"^step  epoch (\d+)/\d+ \| batch (\d+)/(\d+) \| loss ([\d.]+)")
L05_RESUMED = re.compile(r"^resumed from .* at epoch (\d+), step (\d+)")
BATCH = 64  # per group and step (train_ft.py's default), as lesson 05's 128 over 2 ranks


def stamped(path: Path) -> list[tuple[float, str]]:
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        stamp, _, text = line.partition(" ")
        lines.append((float(stamp), text))
    return lines


def one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        sys.exit(f"error: {len(found)} files match {folder}/{pattern}, expected one: run "
                 f"lessons/11_torchft/compare.sh first")  # fmt: skip
    return found[0]


def event(timeline, word: str, after: float = 0.0) -> tuple[float, str]:
    return next((t, text) for t, text in timeline if word in text and t >= after)


def ft_steps(lines) -> list[tuple[float, int, int, float, str]]:
    """(time, step, participants, loss, state) of each step line."""
    return [(t, int(m[2]), int(m[3]), float(m[4]), m[5]) for t, text in lines
            if (m := FT_STEP.search(text))]  # fmt: skip


def torchft_figures(folder: Path, timeline) -> dict:
    g0 = stamped(one(folder, "ft-fail-g0-*.out"))
    g1 = stamped(one(folder, "ft-fail-g1-*.out"))
    t_down, down_text = event(timeline, "DOWN")
    t_back, back_text = event(timeline, "state of", after=t_down)
    # The lines are stamped when read (every 0.1 s): a step that ended just before the DOWN may
    # carry a later stamp, so "before" and "after" are split at the step the failure discarded,
    # or, when it came between two all-reduces (none discarded), where group 0 went on alone.
    cut = next(i for i, (t, text) in enumerate(g0) if t >= t_down
               and ("discarded" in text or "participants 2 -> 1" in text))  # fmt: skip
    before, after = ft_steps(g0[:cut]), ft_steps(g0[cut:])
    steps0 = before + after
    two = (before[-1][0] - before[-51][0]) / 50  # the mean step of the last 50 with 2 groups
    discarded = [text for t, text in g0 if t >= t_down and "discarded" in text]
    rerun = next(i for i, (_, text) in enumerate(g1) if " run 1 on " in text)
    t_heal, heal_text = next((t, text) for t, text in g1[rerun:] if "healed:" in text)
    together = next(s for s in ft_steps(g1[rerun:]))
    alone = [s for s in steps0 if s[2] == 1 and s[1] > 10]  # not the first steps' wait for 1
    common = sorted(set(s[1] for s in steps0) & set(s[1] for s in ft_steps(g1[rerun:])))
    same = {s[1]: s[4] for s in steps0}[common[0]] == {s[1]: s[4] for s in ft_steps(g1)}[common[0]]
    print(f"torchft, {down_text} at group 0's step {before[-1][1]}:")
    print(f"  node back by itself: {t_back - t_down:.2f} s after DOWN ({back_text})")
    redone = len(steps0) - len({s[1] for s in steps0})  # a step number logged twice
    print(f"  group 0's steps discarded: {len(discarded)}; its steps redone: {redone} "
          f"(its first step after the failure is step {after[0][1]}, after {before[-1][1]})")
    print(f"  group 0's wait, DOWN to its next step: {after[0][0] - t_down:.2f} s "
          f"(its mean step of the 50 before: {two:.3f} s)")
    print(f"  group 0 alone: {len(alone)} steps ({alone[0][1]}..{alone[-1][1]}), "
          f"{BATCH} images per step instead of {2 * BATCH}: {len(alone) * BATCH} images of "
          f"group 1's shard not seen; {(len(alone) - 1) / (alone[-1][0] - alone[0][0]):.1f} "
          f"steps/s alone, {1 / two:.1f} with 2 groups")  # fmt: skip
    healed = re.search(r"healed: step \d+ -> \d+", heal_text)[0]
    print(f"  the requeued group 1's job ran again {g1[rerun][0] - t_down:.2f} s after DOWN, "
          f"{healed} {t_heal - t_down:.2f} s after DOWN")
    print(f"  ... and stepped with group 0 {together[0] - t_down:.2f} s after DOWN "
          f"(step {together[1]}, {together[2]} participants)")
    print(f"  the two groups' states at step {common[0]}: {'equal' if same else 'DIFFERENT'}")
    return {"alone": (alone[0][1], alone[-1][1]), "fail": steps0, "last": before[-1]}


def lesson05_figures(folder: Path, timeline) -> None:
    lines = stamped(one(folder, "l05-fail-*.out"))
    t_down, down_text = event(timeline, "DOWN", after=event(timeline, "l05-fail")[0])
    t_back, back_text = event(timeline, "state of", after=t_down)
    steps, resumed_at, t_resumed = [], None, None
    for t, text in lines:
        if m := L05_STEP.search(text):
            steps.append((t, (int(m[1]) - 1) * int(m[3]) + int(m[2]), t_resumed is not None))
            per_epoch = int(m[3])
        elif m := L05_RESUMED.search(text):
            resumed_at, t_resumed = (int(m[1]) - 1) * per_epoch + int(m[2]), t
    t_again = next(t for t, text in lines if "SLURM_RESTART_COUNT=1" in text)
    first_run = [s for s in steps if not s[2]]
    before = [s for s in first_run if s[0] < t_down]
    second = [s for s in steps if s[2]]
    redone = sum(1 for s in first_run if s[1] > resumed_at)
    print(f"lesson 05, {down_text} at its step {before[-1][1]}:")
    print(f"  node back by itself: {t_back - t_down:.2f} s after DOWN ({back_text})")
    print(f"  steps after DOWN before the stop: {len(first_run) - len(before)} (to step "
          f"{first_run[-1][1]}: the tasks got SIGTERM, the next stop check saved)")  # fmt: skip
    print(f"  the requeued job ran again {t_again - t_down:.2f} s after DOWN, resumed from the "
          f"checkpoint at step {resumed_at}: steps redone {redone}")
    print(f"  every rank idle from its last step to the next: "
          f"{second[0][0] - first_run[-1][0]:.2f} s; DOWN to the next step "
          f"{second[0][0] - t_down:.2f} s")  # fmt: skip


def loss_figures(folder: Path, ft: dict) -> tuple:
    steady = ft_steps(stamped(one(folder, "ft-steady-g0-*.out")))
    loss_s = {s[1]: s[3] for s in steady}
    loss_f = {s[1]: s[3] for s in ft["fail"]}
    lo, hi = ft["alone"]
    last = max(loss_f)

    def mean(losses, first, end):
        return statistics.mean(losses[k] for k in range(first, end + 1) if k in losses)

    step, state = ft["last"][1], ft["last"][4]
    same = {s[1]: s[4] for s in steady}[step] == state
    print(f"group 0's state at step {step}, the last before the failure: "
          f"{'the same' if same else 'NOT the same'} in both runs")
    print("group 0's loss on its own batches (the same batches in both runs), mean:")
    for name, first, end in (("before the failure", 11, lo - 1), ("while alone", lo, hi),
                             ("after the heal", hi + 1, last), ("last 100 steps", last - 99,
                                                                last)):  # fmt: skip
        print(f"  {name:18} steps {first:3}..{end:3}: failure run {mean(loss_f, first, end):.4f}"
              f", undisturbed {mean(loss_s, first, end):.4f}")
    return loss_s, loss_f, lo, hi


def smooth(losses: dict[int, float], width: int = 25) -> tuple[list[int], list[float]]:
    steps = sorted(losses)
    values = [losses[k] for k in steps]
    out = [statistics.mean(values[max(0, i - width + 1): i + 1]) for i in range(len(values))]
    return steps, out


def plot(folder: Path, loss_s, loss_f, lo: int, hi: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.axvspan(lo, hi, color="tab:red", alpha=0.12, label=f"group 1 missing (steps {lo}-{hi})")
    for losses, colour, name in ((loss_s, "tab:blue", "two groups, undisturbed"),
                                 (loss_f, "tab:red", "group 1's node set DOWN")):  # fmt: skip
        steps = sorted(losses)
        ax.plot(steps, [losses[k] for k in steps], color=colour, alpha=0.18, linewidth=0.6)
        ax.plot(*smooth(losses), color=colour, linewidth=1.6, label=f"{name} (mean of 25)")
    ax.set_yscale("log")
    ax.set_xlabel("step (the quorum's)")
    ax.set_ylabel("group 0's training loss")
    ax.set_title("torchft, 2 replica groups of lesson 03's model: group 0's loss, same batches")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(folder / "compare.png", dpi=100)
    print("plot: compare.png")


def main(argv: list[str]) -> int:
    folder = Path(argv[1] if len(argv) > 1 else Path(__file__).parent / "compare")
    timeline_path = folder / "timeline.txt"
    if not timeline_path.exists():
        sys.exit(f"error: no {timeline_path}: run lessons/11_torchft/compare.sh first")
    timeline = stamped(timeline_path)
    ft = torchft_figures(folder, timeline)
    lesson05_figures(folder, timeline)
    plot(folder, *loss_figures(folder, ft))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
