"""How long `make test` takes here, and where the time goes (a benchmark, not a test).

    .venv/bin/python tests/budget.py            # the Makefile's test command, then the figures
    .venv/bin/python tests/budget.py --log F    # read the figures from an earlier run's log

It runs the same pytest command as `make test` (with --durations=0 added), with the local
cluster already up, and prints:

* the wall time and the CPU time of the whole machine over the run (from /proc/stat), and the
  CPU floor: CPU time / cores, what the run would take if every core were busy throughout;
* each lane's test time (the cluster tests run one after another on one pytest-xdist worker,
  everything else on the other, see tests/lanes.py) and its slowest tests;
* what one `import torch` costs on this machine, since most of the suite's CPU time is
  processes that start torch (every rank of every job and local run starts its own).

The course's budget is 10 minutes for `make test` on 2 cores.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 600


def make_test_command() -> str:
    """The pytest command line of the Makefile's `test` target, as `make -n` prints it."""
    out = subprocess.run(["make", "-n", "-o", "setup", "test"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    line = next((x for x in out.splitlines() if "pytest" in x), None)
    if line is None:
        sys.exit("budget.py: no pytest command in `make -n test`: is this the course's Makefile?")
    return line.strip()


def machine_cpu_s() -> tuple[float, float]:
    """CPU seconds all cores have spent busy since boot (user, nice, system, irq, softirq), and
    the seconds a virtual machine's hypervisor gave its cores to others (steal): the second
    makes two runs of the same tree differ."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    ticks = sum(int(fields[i]) for i in (1, 2, 3, 6, 7))
    return ticks / os.sysconf("SC_CLK_TCK"), int(fields[8]) / os.sysconf("SC_CLK_TCK")


def child_cpu_s(code: str, *args: str, rounds: int = 3, env: dict[str, str] | None = None) -> float:
    """Median CPU seconds of `python -c CODE ARGS` (user + system, the child's own, exit
    included)."""
    costs = []
    for _ in range(rounds):
        before = os.times()
        subprocess.run([sys.executable, "-c", code, *args], check=True, cwd=ROOT, env=env)
        after = os.times()
        costs.append((after.children_user - before.children_user)
                     + (after.children_system - before.children_system))  # fmt: skip
    return statistics.median(costs)


DURATION = re.compile(r"^(\d+\.\d+)s (setup|call|teardown)\s+(.+)$")


def lanes(log: str) -> dict[str, dict[str, float]]:
    """Per-test time (setup + call + teardown) from --durations=0, split into the two lanes."""
    per: dict[str, dict[str, float]] = {"cluster": collections.Counter(),
                                        "other": collections.Counter()}  # fmt: skip
    for line in log.splitlines():
        m = DURATION.match(line)
        if m:
            test, _, group = m[3].partition("@")
            lane = "cluster" if group == "cluster" else "other"
            # A notebook's cells run in order in one kernel: count the notebook as one.
            per[lane][re.sub(r"::Cell \d+$", " (all cells)", test)] += float(m[1])
    return per


def report(log: str, wall: float | None, cpu: float | None, steal: float | None, cores: int,
           top: int) -> None:  # fmt: skip
    summary = re.findall(r"^=+ (.*(?:passed|failed|error).*) in [\d.]+s", log, re.M)
    print(f"result: {summary[-1] if summary else 'no pytest summary in the log'}")
    if wall is not None and cpu is not None:
        print(f"wall: {wall:.0f} s ({wall / 60:.1f} min; budget {BUDGET_S / 60:.0f} min)")
        print(f"CPU, whole machine: {cpu:.0f} s on {cores} cores, "
              f"{cpu / wall:.2f} cores busy on average")  # fmt: skip
        print(f"CPU floor (CPU / cores): {cpu / cores:.0f} s")
        print(f"CPU taken by the hypervisor (steal): {steal:.0f} s")
    for lane, tests in lanes(log).items():
        print(f"{lane} lane: {sum(tests.values()):.0f} s of test time, {len(tests)} tests; "
              "slowest:")  # fmt: skip
        for test, seconds in sorted(tests.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {seconds:6.1f} s  {test}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log", type=Path, help="report on this log of an earlier run instead")
    p.add_argument("--top", type=int, default=8, help="slowest tests shown per lane")
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    if args.log:
        if not args.log.is_file():
            sys.exit(f"budget.py: --log {args.log}: no such file")
        report(args.log.read_text(errors="replace"), None, None, None, cores, args.top)
        return 0

    check = subprocess.run(["bash", "cluster/up.sh", "--check"], cwd=ROOT, capture_output=True)
    if check.returncode != 0:
        sys.exit("budget.py: the local cluster is not up: run `make cluster-up` first, so that "
                 "its start is not counted")  # fmt: skip
    torch_s = child_cpu_s("import torch")
    cmd = make_test_command() + " --durations=0"
    log_path = ROOT / "runs" / f"budget-{time.strftime('%Y%m%d-%H%M%S')}.log"
    log_path.parent.mkdir(exist_ok=True)
    print(f"$ {cmd}  (log: {log_path.relative_to(ROOT)})", flush=True)
    (cpu0, steal0), t0 = machine_cpu_s(), time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run(["bash", "-c", cmd], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT).returncode  # fmt: skip
    wall, (cpu1, steal1) = time.monotonic() - t0, machine_cpu_s()
    report(log_path.read_text(errors="replace"), wall, cpu1 - cpu0, steal1 - steal0, cores,
           args.top)  # fmt: skip
    print(f"import torch: {torch_s:.2f} CPU-s per process on this machine")
    return rc


if __name__ == "__main__":
    sys.exit(main())
