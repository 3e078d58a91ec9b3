"""What one task of the preflight sees by itself: its interfaces, versions, GPUs, the master
address from here, and the problems it finds alone (Facts, sent to rank 0)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import platform
import socket
import struct
from collections.abc import Mapping, Sequence

from common.env import LaunchEnv, LaunchError
from common.launch import check_master_addr, cuda_device_index
from common.preflight.helpers import (
    Problem,
    gloo_ifname_matches,
    is_loopback,
    nccl_ifname_matches,
    problem,
)

IFNAME_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


def interfaces() -> list[dict]:
    """This host's network interfaces: name, IPv4 address (or None), up, loopback.

    Read with the same ioctls ``ifconfig`` uses (Linux); elsewhere only the names are known.
    """
    found = []
    for _, name in socket.if_nameindex():
        entry = {"name": name, "ipv4": None, "netmask": None, "up": None,
                 "loopback": name == "lo"}  # fmt: skip
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError, AttributeError):
                flags = struct.unpack("H", fcntl.ioctl(s.fileno(), 0x8913, packed)[16:18])[0]
                entry["up"] = bool(flags & 0x1)  # IFF_UP  (SIOCGIFFLAGS = 0x8913)
                entry["loopback"] = bool(flags & 0x8)  # IFF_LOOPBACK
            with contextlib.suppress(OSError, AttributeError):
                addr = fcntl.ioctl(s.fileno(), 0x8915, packed)[20:24]  # SIOCGIFADDR
                entry["ipv4"] = socket.inet_ntoa(addr)
                mask = fcntl.ioctl(s.fileno(), 0x891B, packed)[20:24]  # SIOCGIFNETMASK
                entry["netmask"] = socket.inet_ntoa(mask)
        found.append(entry)
    return found


def route_to(address: str) -> str | None:
    """The local address this host would use to reach ``address`` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((address, 9))  # UDP connect only picks the route
            return s.getsockname()[0]
    except OSError:
        return None


def network_identity() -> str:
    """Two tasks with the same value share one network stack: same kernel, same namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return f"{socket.gethostname()}:?"


def versions() -> dict:
    import torch

    nccl = None
    if torch.cuda.is_available():
        with contextlib.suppress(Exception):
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "python": platform.python_version(),
    }


def _visible_list(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [d for d in text.split(",") if d.strip()]


def gpu_facts(environ: Mapping[str, str]) -> dict:
    import torch

    return {
        "slurm_gpus_on_node": environ.get("SLURM_GPUS_ON_NODE"),
        "cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"),
        "torch_cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


def check_gpus(env: LaunchEnv, facts: Mapping, environ: Mapping[str, str]) -> list[Problem]:
    """Fewer GPUs than processes on a node is a problem; more is only idle GPUs.

    torch's own count decides when it sees CUDA; on a machine without CUDA the GPUs SLURM
    declared (CUDA_VISIBLE_DEVICES) are compared, as on the course's local cluster.
    """
    visible = facts["torch_cuda_devices"] or len(_visible_list(facts["cuda_visible_devices"]) or [])
    if not visible:
        return []  # no GPU anywhere: gloo on the CPU, nothing to match
    try:
        cuda_device_index(env, visible, environ)
    except LaunchError as exc:
        return [problem(str(exc).rstrip("."), "")]
    return []


def check_ifname_vars(
    environ: Mapping[str, str], ifaces: Sequence[Mapping], multi_node: bool
) -> list[Problem]:
    names = [i["name"] for i in ifaces]
    loopbacks = {i["name"] for i in ifaces if i["loopback"]}
    usable = ", ".join(i["name"] for i in ifaces if not i["loopback"] and i["ipv4"]) or "none"
    found = []
    for var in IFNAME_VARS:
        spec = environ.get(var)
        if not spec:
            continue
        chosen = (nccl_ifname_matches if var.startswith("NCCL") else gloo_ifname_matches)(
            spec, names
        )
        if not chosen:
            found.append(problem(
                f"{var}={spec} matches no interface on this node (it has {', '.join(names)})",
                f"export {var}=<one of: {usable}> or unset it",
            ))  # fmt: skip
        elif multi_node and set(chosen) <= loopbacks:
            found.append(problem(
                f"{var}={spec} selects only the loopback interface, which other nodes cannot "
                f"reach: each node would advertise 127.0.0.1 to the others",
                f"export {var}=<one of: {usable}> (the interface on the nodes' network)",
                needs_separate_hosts=True,
            ))  # fmt: skip
    return found


def check_master(env: LaunchEnv) -> tuple[list[str], list[Problem]]:
    """The master address's IPs, and what is wrong with it as seen from this task.

    common.launch's own check first (it resolves, and is not ``localhost`` or a literal loopback
    address in a multi-node job).  A *name* that resolves to loopback (Debian's 127.0.1.1 for a
    node's own name) is a problem only when the tasks really sit on separate network stacks: on
    the course's local cluster every node is this machine and ``node1`` is 127.0.0.1.
    """
    try:
        check_master_addr(env)
    except LaunchError as exc:
        return [], [problem(str(exc).rstrip("."), "")]
    infos = socket.getaddrinfo(env.master_addr, env.master_port, type=socket.SOCK_STREAM)
    ips = list(dict.fromkeys(info[4][0] for info in infos))
    if env.num_nodes > 1 and all(is_loopback(ip) for ip in ips):
        return ips, [problem(
            f"MASTER_ADDR={env.master_addr} resolves to {ips[0]}, a loopback address, but the "
            f"step spans {env.num_nodes} nodes: every node would look for rank 0 on itself",
            "give the nodes' names their network addresses (DNS, /etc/hosts), or export "
            "MASTER_ADDR=<rank 0's address on the nodes' network>",
            needs_separate_hosts=True,
        )]  # fmt: skip
    return ips, []


def check_hostname_for_gloo(environ: Mapping[str, str], multi_node: bool) -> list[Problem]:
    """Without GLOO_SOCKET_IFNAME, gloo binds to the address its host name resolves to."""
    if not multi_node or environ.get("GLOO_SOCKET_IFNAME"):
        return []
    name = socket.gethostname()
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError):
        ips = set()
    if not ips:
        return [problem(
            "the node's own name does not resolve; without GLOO_SOCKET_IFNAME gloo then "
            "falls back to the loopback address, which other nodes cannot reach",
            "export GLOO_SOCKET_IFNAME=<the interface on the nodes' network> (see the "
            "interfaces below), or add the name to DNS or /etc/hosts",
            needs_separate_hosts=True,
        )]  # fmt: skip
    if all(is_loopback(ip) for ip in ips):
        return [problem(
            f"the node's own name resolves to {sorted(ips)[0]} (loopback); without "
            f"GLOO_SOCKET_IFNAME gloo uses that address, which other nodes cannot reach",
            "export GLOO_SOCKET_IFNAME=<the interface on the nodes' network> (see the "
            "interfaces below), or fix /etc/hosts",
            needs_separate_hosts=True,
        )]  # fmt: skip
    return []


@dataclasses.dataclass
class Facts:
    """Everything one task reports to rank 0."""

    rank: int
    host: str
    node_rank: int
    network: str
    versions: dict
    gpus: dict
    local_world_size: int
    interfaces: list
    route: dict
    problems: list
    ifname_vars: dict = dataclasses.field(default_factory=dict)  # NCCL_/GLOO_SOCKET_IFNAME
    clock: dict | None = None  # this clock minus rank 0's, and the error bound, seconds
    connect_s: float | None = None


def local_facts(env: LaunchEnv, environ: Mapping[str, str]) -> Facts:
    multi = env.num_nodes > 1
    ips, found = check_master(env)
    ifaces = interfaces()
    route_ip = route_to(ips[0]) if ips else None
    route_if = next((i["name"] for i in ifaces if route_ip and i["ipv4"] == route_ip), None)
    gpus = gpu_facts(environ)
    found += check_gpus(env, gpus, environ)
    found += check_ifname_vars(environ, ifaces, multi)
    found += check_hostname_for_gloo(environ, multi)
    return Facts(
        rank=env.rank,
        host=env.hostname,
        node_rank=env.node_rank,
        network=network_identity(),
        versions=versions(),
        gpus=gpus,
        local_world_size=env.local_world_size,
        interfaces=ifaces,
        route={"master_ips": ips, "local_ip": route_ip, "iface": route_if},
        problems=found,
        ifname_vars={v: environ[v] for v in IFNAME_VARS if environ.get(v)},
    )
