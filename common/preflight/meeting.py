"""The preflight's TCP phase: every task connects to rank 0 at the master address and port,
measures its clock against rank 0's, and sends its report; rank 0 answers with the verdict."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import threading
import time
from collections.abc import Mapping

from common.env import LaunchEnv, LaunchError
from common.launch import check_port_free
from common.preflight.across import compare
from common.preflight.helpers import clock_offset, problem
from common.preflight.task import IFNAME_VARS, Facts

# Rehearsal only: pretend this task's clock is off by this many seconds, to see the check fire.
CLOCK_SHIFT_VAR = "COURSE_PREFLIGHT_CLOCK_SHIFT"


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())


def _now() -> float:
    return time.time() + float(os.environ.get(CLOCK_SHIFT_VAR) or 0)


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall((json.dumps(message) + "\n").encode())


def _recv(sock: socket.socket, buf: bytearray, deadline: Deadline) -> dict:
    """One newline-terminated JSON message; socket.timeout when the deadline passes."""
    while b"\n" not in buf:
        left = deadline.left()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.settimeout(left)
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the other side closed the connection")
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return json.loads(line)


def _token(env: LaunchEnv) -> str:
    """Both sides must agree on it, or we reached somebody else's service."""
    return f"course-preflight:{env.job_id}:{env.world_size}:{env.master_port}"


def _listen(port: int) -> socket.socket:
    """Rank 0 opens the master port on every address, as torch's TCPStore does."""
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


class Server:
    """Rank 0: accept one connection per other rank, answer the clock probe, keep reports."""

    def __init__(self, env: LaunchEnv, sock: socket.socket, own: Facts):
        self.env, self.sock = env, sock
        self.reports: dict[int, dict] = {0: dataclasses.asdict(own)}
        self.conns: dict[int, tuple[socket.socket, bytearray]] = {}
        self.lock = threading.Lock()
        self.intruders: list[str] = []

    def gather(self, deadline: Deadline) -> None:
        threads = []
        self.sock.settimeout(0.2)
        while deadline.left() > 0 and len(self.reports) < self.env.world_size:
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            t = threading.Thread(target=self._serve, args=(conn, addr, deadline), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join(deadline.left() + 0.5)

    def _serve(self, conn: socket.socket, addr, deadline: Deadline) -> None:
        buf = bytearray()
        try:
            hello = _recv(conn, buf, deadline)
            if hello.get("token") != _token(self.env):
                with self.lock:
                    self.intruders.append(f"{addr[0]} sent {str(hello)[:80]}")
                conn.close()
                return
            _send(conn, {"t1": _now(), "host": self.env.hostname})
            report = _recv(conn, buf, deadline)
            rank = report["rank"]
            with self.lock:
                if rank in self.reports:
                    self.intruders.append(f"rank {rank} connected twice (from {addr[0]})")
                    conn.close()
                    return
                self.reports[rank] = report
                self.conns[rank] = (conn, buf)
        except (OSError, ValueError, KeyError):
            conn.close()

    def tell_all(self, message: dict) -> None:
        for conn, _ in self.conns.values():
            with contextlib.suppress(OSError):
                conn.settimeout(2)
                _send(conn, message)

    def close(self) -> None:
        for conn, _ in self.conns.values():
            conn.close()
        self.sock.close()


def connect(env: LaunchEnv, deadline: Deadline) -> tuple[socket.socket | None, str]:
    """Connect to rank 0, retrying while it may still be starting; (socket, '') or (None, why)."""
    why = "no attempt"
    while deadline.left() > 0:
        try:
            sock = socket.create_connection(
                (env.master_addr, env.master_port), timeout=min(2.0, deadline.left())
            )
            return sock, ""
        except socket.gaierror as exc:
            return None, f"MASTER_ADDR={env.master_addr} does not resolve ({exc})"
        except TimeoutError:
            why = "timed out (packets dropped: a firewall, or an address of the wrong network)"
        except ConnectionRefusedError:
            why = "connection refused (nothing listens there: rank 0 not started, or the " \
                  "address points to another host)"
        except OSError as exc:
            why = f"{exc.strerror or exc}"
        time.sleep(min(0.2, deadline.left()))
    return None, why


@dataclasses.dataclass
class Outcome:
    problems: list = dataclasses.field(default_factory=list)  # (host, ranks, problem)
    notes: list = dataclasses.field(default_factory=list)
    run_allreduce: bool = False


def meet(env: LaunchEnv, own: Facts, timeout: float, max_skew: float) -> Outcome | None:
    """The TCP phase.  Rank 0 returns the outcome for everyone; other ranks return what rank 0
    told them (None: they never got through, and printed their own problems)."""
    deadline = Deadline(timeout)
    if env.rank == 0:
        try:
            check_port_free(env.master_port)
            sock = _listen(env.master_port)
        except (LaunchError, OSError) as exc:
            what = str(exc).split("; ")[0] if isinstance(exc, LaunchError) else (
                f"cannot open MASTER_PORT={env.master_port} on {env.hostname} "
                f"({getattr(exc, 'strerror', None) or exc})")  # fmt: skip
            p = problem(what, "export MASTER_PORT=<a free port>, e.g. in 20000-30000, the same "
                        "for every task")
            return Outcome(problems=[(env.hostname, [0], p)])
        server = Server(env, sock, own)
        try:
            server.gather(deadline)
            problems, notes = compare(server.reports, env.world_size, max_skew)
            for text in server.intruders:
                problems.append((env.hostname, [0], problem(
                    f"an unexpected connection on MASTER_PORT={env.master_port}: {text}",
                    "give this job a port nobody else uses (MASTER_PORT), and the tasks "
                    "distinct ranks",
                )))  # fmt: skip
            outcome = Outcome(problems, notes, run_allreduce=not problems)
            # Stop listening before the others hear the verdict: they go on to the all_reduce's
            # store on this same port, and a connection left in this socket's backlog would be
            # reset when it closes (torch prints "recvValue failed ... Connection reset").
            server.sock.close()
            server.tell_all({"problems": len(problems), "allreduce": outcome.run_allreduce})
            outcome.notes[:0] = summary(env, server.reports, timeout)
            return outcome
        finally:
            server.close()

    start = time.monotonic()
    sock, why = connect(env, deadline)
    if sock is None:
        where = f"{env.master_addr}:{env.master_port}"
        own.problems.insert(0, problem(
            f"cannot reach rank 0 at MASTER_ADDR:MASTER_PORT={where} within {timeout:g} s: {why}",
            "check that rank 0 started and that MASTER_ADDR names rank 0's node on an address "
            "this node can reach (its network interface, not loopback)",
        ))  # fmt: skip
        return None
    connect_s = time.monotonic() - start
    buf = bytearray()
    try:
        with sock:
            t0 = _now()
            _send(sock, {"token": _token(env), "rank": env.rank})
            reply = _recv(sock, buf, deadline)
            t2 = _now()
            offset, error = clock_offset(t0, reply["t1"], t2)
            own.clock = {"offset": -offset, "error": error}  # > 0: this clock is ahead
            own.connect_s = connect_s
            _send(sock, dataclasses.asdict(own))
            verdict = _recv(sock, buf, Deadline(timeout + 5))
    except (OSError, ValueError, KeyError) as exc:
        own.problems.insert(0, problem(
            f"MASTER_ADDR:MASTER_PORT={env.master_addr}:{env.master_port} answered, but not as "
            f"this job's rank 0 ({exc})",
            "another program or job uses that port: export MASTER_PORT=<a free port>",
        ))  # fmt: skip
        return None
    return Outcome(run_allreduce=verdict["allreduce"])


def summary(env: LaunchEnv, reports: Mapping[int, Mapping], timeout: float) -> list[str]:
    """Rank 0's informative lines: who came, versions, GPUs, clocks, interfaces."""
    ranks = sorted(reports)
    hosts = list(dict.fromkeys(reports[r]["host"] for r in ranks))
    lines = [
        f"{len(ranks)}/{env.world_size} tasks on {len(hosts)} node(s) ({','.join(hosts)}) met "
        f"rank 0 at {env.master_addr}:{env.master_port} "
        f"({', '.join(reports[0]['route']['master_ips']) or '?'})"
    ]
    v = reports[0]["versions"]
    lines.append(f"versions: torch {v['torch']}, CUDA {v['cuda']}, NCCL {v['nccl']}, "
                 f"Python {v['python']}")
    for host in hosts:
        on = [r for r in ranks if reports[r]["host"] == host]
        g = reports[on[0]]["gpus"]
        lines.append(
            f"gpus on {host}: {len(on)} task(s), SLURM_GPUS_ON_NODE={g['slurm_gpus_on_node']}, "
            f"CUDA_VISIBLE_DEVICES={g['cuda_visible_devices']}, torch sees "
            f"{g['torch_cuda_devices']} CUDA device(s)"
        )
    clocks = [reports[r]["clock"] for r in ranks if reports[r].get("clock")]
    if clocks:
        worst = max(clocks, key=lambda c: abs(c["offset"]))
        lines.append(f"clocks: largest offset to rank 0 {worst['offset'] * 1000:+.1f} ms "
                     f"(+/- {worst['error'] * 1000:.1f} ms)")
    for host in hosts:
        first = next(r for r in ranks if reports[r]["host"] == host)
        rep = reports[first]
        names = [
            f"{i['name']} {i['ipv4']}" + (" <- route to master" if i["name"] ==
                                          rep["route"]["iface"] else "")
            for i in rep["interfaces"] if i["ipv4"]
        ]  # fmt: skip
        lines.append(f"interfaces on {host}: {'; '.join(names) or 'none with IPv4'}")
    set_vars = [f"{v}={os.environ[v]}" for v in IFNAME_VARS if os.environ.get(v)]
    lines.append("socket interface variables: " + (", ".join(set_vars) or "none set"))
    return lines
