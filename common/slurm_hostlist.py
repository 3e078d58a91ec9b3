"""SLURM's host list syntax, for images without python-hostlist (NGC, pyxis: torch only).

common/env.py reads SLURM_STEP_NODELIST with python-hostlist where it is installed (the course's
requirements.txt), else with this file; tests/test_env_input.py checks that the two agree.
"""

from __future__ import annotations

import re

from common.env import MAX_HOSTS

_ASCII_INT = re.compile(r"[0-9]+")  # as SLURM writes them


def expand_hostlist(text: str) -> list[str]:
    """``gpu[01-03,07],cpu5`` -> its host names: comma-separated names, each the product of
    its ``[ranges]`` groups; ValueError where python-hostlist raises BadHostlist."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
        if not 0 <= depth <= 1:
            raise ValueError("unbalanced or nested brackets")
    if depth:
        raise ValueError("'[' without ']'")
    items.append(text[start:])
    hosts: list[str] = []
    for item in filter(None, items):  # "a,,b" is a,b (as for python-hostlist)
        names = [""]
        # "rack[1-2]-gpu[08-09]" splits into "rack", "1-2", "-gpu", "08-09", "".
        for k, piece in enumerate(re.split(r"\[([^\[\]]*)\]", item)):
            names = [n + s for n in names for s in (_expand_ranges(piece) if k % 2 else [piece])]
            if len(hosts) + len(names) > MAX_HOSTS:
                raise ValueError(f"more than {MAX_HOSTS} hosts")
        hosts.extend(names)
    return hosts


def _expand_ranges(group: str) -> list[str]:
    """``01-03,7`` -> ``01 02 03 7`` (a range's lower bound gives the width)."""
    out = []
    for part in group.split(","):
        low, _, high = part.partition("-")
        if not _ASCII_INT.fullmatch(low) or (high and not _ASCII_INT.fullmatch(high)):
            raise ValueError(f"bad range {part!r}")
        first, last = int(low), int(high or low)
        if last < first or last - first >= MAX_HOSTS:
            raise ValueError(f"bad range {part!r}")
        out += [f"{n:0{len(low)}d}" for n in range(first, last + 1)]
    return out
