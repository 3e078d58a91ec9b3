"""Where a run's time went on the cluster: python tests/lock_report.py LOG [TOP].

LOG is the file that tests/conftest.py's cluster_lock appends to when COURSE_LOCK_LOG names it
(.ci/run sets it): a line per hold of the cluster lock, "<taken> <released> <waited> <test>".
Every job of every lane takes that one lock, so the held seconds, added up, are the least time
those lanes can take one after another; the gaps between holds are time in which no lane used
the cluster. Prints both, and the longest holds and gaps with the tests around them.
"""

import sys


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print("usage: python tests/lock_report.py LOG [TOP]", file=sys.stderr)
        return 2
    top = int(sys.argv[2]) if len(sys.argv) == 3 else 12
    holds = []
    try:
        with open(sys.argv[1]) as log:
            for line in log:
                taken, released, waited, test = line.split(maxsplit=3)
                holds.append((float(taken), float(released), float(waited), test.strip()))
    except OSError as err:
        print(f"lock_report: cannot read {sys.argv[1]}: {err.strerror}", file=sys.stderr)
        return 1
    if not holds:
        print(f"lock_report: {sys.argv[1]} holds no line: no test took the cluster lock")
        return 0
    holds.sort()
    held = sum(r - t for t, r, _, _ in holds)
    span = holds[-1][1] - holds[0][0]
    pairs = zip(holds[:-1], holds[1:], strict=True)
    gaps = [(b[0] - a[1], a[3], b[3]) for a, b in pairs if b[0] > a[1]]
    print(f"cluster lock: {len(holds)} holds, {held:.0f} s held of {span:.0f} s from the first "
          f"to the last ({100 * held / span:.0f} %), {span - held:.0f} s free in "
          f"{len(gaps)} gaps")  # fmt: skip
    print("longest holds (s):")
    for t, r, w, test in sorted(holds, key=lambda h: h[0] - h[1])[:top]:
        print(f"  {r - t:7.1f}  {test}  (waited {w:.0f} s)")
    print("longest gaps (s), before -> after:")
    for gap, before, after in sorted(gaps, reverse=True)[:top]:
        print(f"  {gap:7.1f}  {before} -> {after}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
