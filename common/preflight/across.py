"""What rank 0 concludes from every task's report: ranks missing, versions, clocks and
networks that differ, the same problem on several tasks merged into one."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping

from common.preflight.helpers import (
    Problem,
    format_ranks,
    gloo_ifname_matches,
    nccl_ifname_matches,
    problem,
)


def compare(
    reports: Mapping[int, Mapping], world_size: int, max_skew: float
) -> tuple[list[tuple[str, list[int], Problem]], list[str]]:
    """What rank 0 concludes from every task's report (``reports``: rank -> Facts as dict).

    Returns (problems, notes): each problem as (host, ranks, problem) with identical problems of
    several ranks on one host merged; notes are informative lines.
    """
    found: list[tuple[str, int, Problem]] = []
    notes: list[str] = []
    ranks = sorted(reports)
    missing = [r for r in range(world_size) if r not in reports]
    if missing:
        found.append(("", -1, problem(
            f"rank(s) {format_ranks(missing)} of WORLD_SIZE={world_size} never reached rank 0's "
            f"port (their own PROBLEM lines, if any, say why)",
            "check that every task started (srun's errors), that WORLD_SIZE is the number of "
            "processes really started, and that MASTER_ADDR/MASTER_PORT are the same for all "
            "tasks and reachable from every node",
        )))  # fmt: skip

    shared = len({reports[r]["network"] for r in ranks}) == 1 and not missing
    for r in ranks:
        for p in reports[r]["problems"]:
            if p.get("separate") and shared:
                continue  # one network stack: loopback really reaches every task
            found.append((reports[r]["host"], r, p))
    if shared:
        downgraded: dict[str, list[str]] = {}
        for r in ranks:
            for p in reports[r]["problems"]:
                hosts = downgraded.setdefault(p["what"], []) if p.get("separate") else []
                if p.get("separate") and reports[r]["host"] not in hosts:
                    hosts.append(reports[r]["host"])
        notes.extend(
            f"fine here, where every task shares one network stack (one machine), but a "
            f"problem on separate nodes: on {','.join(hosts)}: {what}"
            for what, hosts in downgraded.items()
        )

    if not shared and 0 in reports:
        for r in ranks:
            if reports[r]["network"] != reports[0]["network"]:
                found += [(reports[r]["host"], r, p)
                          for p in named_networks(reports[r], reports[0])]  # fmt: skip

    # Versions: the same everywhere, else name each variant with where it runs.
    for key in ("torch", "cuda", "nccl", "python"):
        variants: dict[str, list[int]] = {}
        for r in ranks:
            variants.setdefault(str(reports[r]["versions"].get(key)), []).append(r)
        if len(variants) > 1:
            where = "; ".join(
                f"{v} on {_hosts_of(reports, rs)} (ranks {format_ranks(rs)})"
                for v, rs in variants.items()
            )
            found.append(("", -1, problem(
                f"{key} versions differ between tasks: {where}",
                "use one Python environment for every node (a venv on a shared filesystem, "
                "COURSE_VENV), or the same container image",
            )))  # fmt: skip

    # Clocks: offsets to rank 0, measured by each task over its connection.
    for r in ranks:
        clock = reports[r].get("clock")
        if clock and abs(clock["offset"]) - clock["error"] > max_skew:
            ahead = "ahead of" if clock["offset"] > 0 else "behind"
            found.append((reports[r]["host"], r, problem(
                f"clock is {abs(clock['offset']):.3f} s {ahead} rank 0's (+/- "
                f"{clock['error']:.3f} s), more than the {max_skew:g} s allowed",
                "synchronise the nodes' clocks (chrony/ntpd; ask the admins): log times, "
                "file times on the shared filesystem and timeouts stop agreeing",
            )))  # fmt: skip

    # The same problem on several tasks is one line naming all of them.
    merged: dict[tuple[str, str], tuple[list[str], list[int]]] = {}
    for host, r, p in found:
        hosts, rs = merged.setdefault((p["what"], p["fix"]), ([], []))
        if host and host not in hosts:
            hosts.append(host)
        if r >= 0:
            rs.append(r)
    problems = [
        (",".join(hosts), rs, {"what": what, "fix": fix})
        for (what, fix), (hosts, rs) in merged.items()
    ]
    return problems, notes


def _networks(report: Mapping, spec: str, var: str) -> list[ipaddress.IPv4Network]:
    """The IPv4 networks of the interfaces that ``var``=``spec`` selects in ``report``."""
    ifaces = [i for i in report["interfaces"] if i.get("ipv4") and i.get("netmask")]
    chosen = (nccl_ifname_matches if var.startswith("NCCL") else gloo_ifname_matches)(
        spec, [i["name"] for i in ifaces])
    return [ipaddress.IPv4Network(f"{i['ipv4']}/{i['netmask']}", strict=False)
            for i in ifaces if i["name"] in chosen]  # fmt: skip


def named_networks(report: Mapping, rank0: Mapping) -> list[Problem]:
    """A task on another node than rank 0 whose NCCL_/GLOO_SOCKET_IFNAME interface is on no
    network that rank 0's own choice is on: the backend's connections between them go over
    interfaces that do not see each other (existence alone was checked on each node)."""
    found = []
    for var, spec in report.get("ifname_vars", {}).items():
        mine = _networks(report, spec, var)
        theirs = _networks(rank0, rank0.get("ifname_vars", {}).get(var, spec), var)
        if mine and theirs and not set(mine) & set(theirs):
            found.append(problem(
                f"{var}={spec} selects {', '.join(map(str, mine))} here, but on rank 0's node "
                f"({rank0['host']}) it selects {', '.join(map(str, theirs))}: no network in "
                f"common, so the backend's connections between them may not get through",
                f"export {var}=<the interface on the network the nodes share> on every node "
                f"(if your site routes between these networks, check with the all_reduce below)",
                needs_separate_hosts=True,
            ))  # fmt: skip
    return found


def _hosts_of(reports: Mapping[int, Mapping], ranks: Iterable[int]) -> str:
    return ",".join(dict.fromkeys(reports[r]["host"] for r in ranks))
