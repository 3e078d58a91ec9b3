"""One task of a two-node probe of the nodes' network, started by tests/test_cluster.py.

Node 0 listens on its loopback address and on its network address; node 1 connects to
``localhost`` (which on a separate host is itself, so nothing answers) and to node 0 by name.
Each task prints one JSON line: its name, addresses, interfaces and what it could reach.
"""

import json
import os
import socket
import subprocess
import time

PORT = int(os.environ["PROBE_PORT"])


def reach(host: str, wait_s: float) -> str:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host, PORT), timeout=2) as conn:
                return conn.recv(16).decode()
        except OSError as exc:
            if time.monotonic() > deadline:
                return type(exc).__name__
            time.sleep(0.2)


def main() -> None:
    node = int(os.environ["SLURM_NODEID"])
    report = {
        "node": node,
        "hostname": socket.gethostname(),
        "addresses": subprocess.run(
            ["hostname", "-I"], capture_output=True, text=True, check=True
        ).stdout.split(),  # fmt: skip
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
    }
    if node == 0:
        servers = []
        for host in ("127.0.0.1", socket.gethostname()):
            srv = socket.create_server((host, PORT))
            srv.settimeout(20)
            servers.append((host, srv))
        # node 1 connects to localhost first (nothing of ours there), then to us by name.
        host, srv = servers[1]
        conn, _ = srv.accept()
        conn.sendall(f"node0 via {host}".encode())
        conn.close()
    else:
        report["localhost"] = reach("localhost", 0)
        report["node1"] = reach("node1", 10)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
