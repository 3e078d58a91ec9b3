"""Lesson 06's flight.py dumps the flight recorder of the backend it runs on.

torch keeps one recorder per event type: NCCL records into its CUDA one, which only
_dump_nccl_trace reads; gloo into the generic one, _dump_fr_trace's (flight.py's
dump_flight_recorder cites the source). Here, one real gloo process: after an all_reduce, the
dump flight.py writes for its own group (gloo) and for "gloo" holds the collective, the one it
writes for "nccl" holds none: which call is made follows the backend, and the wrong call finds
nothing. That NCCL's collectives land in the NCCL recorder is read in torch's source, not run:
this machine has no GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch.distributed as dist
from helpers import ROOT, clean_environ

LESSON = ROOT / "lessons" / "06_diagnosing_hangs"
ONE_RANK = """
import datetime, json, pickle, socket, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from flight import dump_flight_recorder
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
dist.all_reduce(torch.ones(8))
found = {}
for backend in json.loads(sys.argv[3]):
    with open(dump_flight_recorder(f"{sys.argv[2]}/{backend}_", 0, backend), "rb") as f:
        found[str(backend)] = [e["profiling_name"] for e in pickle.load(f)["entries"]]
dist.destroy_process_group()
print(json.dumps(found))
"""


@pytest.mark.skipif(not dist.is_nccl_available(), reason="a torch without NCCL: no NCCL recorder")
@pytest.mark.timeout(120)
def test_the_dump_follows_the_backend(tmp_path):
    backends = [None, "gloo", "nccl"]  # None: the group's own, as flight.py's main asks
    proc = subprocess.run([sys.executable, "-c", ONE_RANK, str(LESSON), str(tmp_path),
                           json.dumps(backends)], cwd=ROOT, capture_output=True, text=True,
                          env=clean_environ(TORCH_FR_BUFFER_SIZE="2000"), timeout=90)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {"None": ["gloo:all_reduce"], "gloo": ["gloo:all_reduce"], "nccl": []}, found
    assert sorted(p.name for p in tmp_path.iterdir()) == ["None_0", "gloo_0", "nccl_0"]
