"""The preflight's pure helpers: a problem and its line, rank ranges, loopback, the clock
offset, which interfaces NCCL_/GLOO_SOCKET_IFNAME select."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence

PREFIX = "preflight:"

# A problem found on one task: what is wrong, and the fix.  Problems that only matter when the
# tasks live on separate network hosts carry needs_separate_hosts=True (see compare, across.py).
Problem = dict


def problem(what: str, fix: str, *, needs_separate_hosts: bool = False) -> Problem:
    return {"what": what, "fix": fix, "separate": needs_separate_hosts}


def problem_line(host: str, ranks: Sequence[int], p: Mapping) -> str:
    """``preflight: PROBLEM on <hosts> (rank <ranks>): <what>. Fix: <fix>.``"""
    where = f" on {host}" if host else ""
    where += f" (rank {format_ranks(ranks)})" if ranks else ""
    fix = f" Fix: {p['fix']}." if p["fix"] else ""  # common.env's messages carry their own
    return f"{PREFIX} PROBLEM{where}: {p['what']}.{fix}"


def is_loopback(address: str) -> bool:
    """127.0.0.0/8, ::1 (and IPv4-mapped loopback)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def clock_offset(t0: float, t1: float, t2: float) -> tuple[float, float]:
    """Offset of the other clock and its error bound, from one request/reply (NTP's formula).

    We sent at ``t0`` (our clock), the other side stamped ``t1`` (its clock), the reply came
    back at ``t2`` (our clock).  If the two legs took equally long, the other clock is ahead of
    ours by ``t1 - (t0 + t2) / 2``; whatever the legs took, the error is at most half the
    round trip.
    """
    return t1 - (t0 + t2) / 2, (t2 - t0) / 2


def nccl_ifname_matches(spec: str, names: Iterable[str]) -> list[str]:
    """The interfaces NCCL_SOCKET_IFNAME=``spec`` selects among ``names``.

    NCCL's syntax (NCCL docs, "Environment Variables", NCCL_SOCKET_IFNAME): a comma-separated
    list of name *prefixes*; a leading ``^`` excludes the listed ones instead; a leading ``=``
    (after ``^`` if any) makes the names exact.  ``eth`` = eth0, eth1...; ``=eth0``; ``^docker``.
    """
    exclude = spec.startswith("^")
    rest = spec[1:] if exclude else spec
    exact = rest.startswith("=")
    rest = rest[1:] if exact else rest
    items = [i for i in rest.split(",") if i]

    def hit(name: str) -> bool:
        return any(name == i if exact else name.startswith(i) for i in items)

    return [n for n in names if hit(n) != exclude]


def gloo_ifname_matches(spec: str, names: Iterable[str]) -> list[str]:
    """The interfaces GLOO_SOCKET_IFNAME=``spec`` names: exact names, comma-separated."""
    wanted = [i.strip() for i in spec.split(",") if i.strip()]
    present = set(names)
    return [i for i in wanted if i in present]


def format_ranks(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    ranks = sorted(set(ranks))
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)
