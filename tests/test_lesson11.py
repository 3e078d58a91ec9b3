"""Lesson 11 (torchft): replica groups that keep training when one dies.

On this machine (gloo on loopback, a real lighthouse, each group a process as srun starts it):
the lighthouse's address missing, malformed or not answering is one line in seconds naming
TORCHFT_LIGHTHOUSE; two groups train, one is killed (SIGKILL: no goodbye), the other steps on
alone, a new process of the killed group heals from it and then holds the same weights and
optimizer state, bit for bit. The cluster's version (a node set DOWN, the requeued job healing)
is tests/test_lesson11_cluster.py.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import clean_environ

pytest.importorskip("torchft", reason="torchft has wheels for Linux x86_64 only")
# Two processes training side by side for ~20 s on 2 cores: a lane of its own (make test-lesson11).
pytestmark = pytest.mark.lesson11

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "lessons" / "11_torchft"
TRAIN = LESSON / "train_ft.py"
HASH = re.compile(r"\[group (\d)\] step (\d+)/\d+ \|.* \| state (\w+)$", re.M)
HEALED = re.compile(r"\[group \d\] healed: step (\d+) -> (\d+)")
GUARD_S = 120  # a hang guard only: the slow kind of machine takes twice as long


def free_port() -> int:
    from common.env import find_free_port

    return find_free_port()


@pytest.mark.parametrize("args, env, says", [
    (["5"], {}, "the group index '5' is not one of 0..1"),
    (["0"], {"FT_GROUPS": "0"}, "FT_GROUPS='0' is not a whole number of groups"),
    (["0"], {"STEPS": "many"}, "STEPS='many' is not a whole number of steps"),
])  # fmt: skip
def test_group_sh_refuses_bad_input_in_one_line(args, env, says):
    proc = subprocess.run(["bash", str(LESSON / "group.sh"), *args], cwd=ROOT, timeout=60,
                          env=clean_environ(SLURM_SUBMIT_DIR=str(ROOT), **env),
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr


class Log:
    """A process's output file, read as it grows."""

    def __init__(self, path: Path):
        self.path = path

    def text(self) -> str:
        return self.path.read_text(errors="replace") if self.path.exists() else ""

    def wait_for(self, pattern: str, procs, timeout: float = GUARD_S) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := re.search(pattern, self.text(), re.M):
                return found
            dead = [p for p in procs if p.poll() is not None]
            assert not dead, f"{dead[0].args} exited {dead[0].returncode}:\n{self.text()}"
            time.sleep(0.1)
        pytest.fail(f"no {pattern!r} after {timeout} s in {self.path}:\n{self.text()}")


def lighthouse(tmp_path, procs, min_replicas: int) -> tuple[Log, dict[str, str]]:
    """A lighthouse on a free port of this machine, and the environment that names it."""
    binary = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    assert binary, "torchft_lighthouse is not in the venv"
    port = free_port()
    log = tmp_path / "lighthouse.log"
    with open(log, "w") as out:
        # A group silent for 2 s is dropped (5 s by default): the survivor waits less.
        procs.append(subprocess.Popen([binary, "--min_replicas", str(min_replicas),
                                       "--join_timeout_ms", "2000", "--heartbeat_timeout_ms",
                                       "2000", "--bind", f"127.0.0.1:{port}"],
                                      stdout=out, stderr=subprocess.STDOUT))  # fmt: skip
    Log(log).wait_for("Lighthouse listening", procs)
    return Log(log), clean_environ(TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}")


def stop(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


BAD_ADDRESSES = [
    (None, "TORCHFT_LIGHTHOUSE is not set"),
    ("node1:29510", "is not http://<host>:<port>"),
    ("http://127.0.0.1:{port}", "does not answer (Connection refused)"),
]


def test_bad_lighthouse_or_too_few_groups_is_one_line(tmp_path):
    """The lighthouse's address missing, malformed or silent: checked before torchft, whose
    client would retry for its connect timeout (60 s). A lighthouse that wants 2 groups, and 1
    group: it says what it waits for and how long, then one line when the wait is over (torchft
    raises a TimeoutError from its Rust client). The four run side by side (each a process that
    imports torch)."""
    procs: list[subprocess.Popen] = []
    try:
        _, waiting_env = lighthouse(tmp_path, procs, min_replicas=2)
        waiting_env["COURSE_DIST_TIMEOUT"] = "4"
        runs = []
        for url, says in BAD_ADDRESSES:
            env = clean_environ()
            env.pop("TORCHFT_LIGHTHOUSE", None)
            if url:
                env["TORCHFT_LIGHTHOUSE"] = url.format(port=free_port())
            runs.append((env, says))
        runs.append((waiting_env, "no quorum within 4 s at step 0"))
        command = [sys.executable, str(TRAIN), "--group", "0", "--train-subset", "512"]
        started = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
                   for env, _ in runs]  # fmt: skip
        procs += started
        # A hang guard: torchft's own connect timeout would take 60 s.
        outputs = [proc.communicate(timeout=GUARD_S) for proc in started]
    finally:
        stop(procs)
    for (out, err), (_, says) in zip(outputs, runs, strict=True):
        lines = err.strip().splitlines()
        assert "Traceback" not in err and lines and says in lines[-1], out + err
    for proc, (_, err) in zip(started[:3], outputs, strict=False):
        assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("error: TORCHFT_LIGHTHOUSE") and "lighthouse.sh" in err, err
    out, err = outputs[3]
    assert started[3].returncode == 1, out + err
    assert "when its --min_replicas groups have asked; each step waits up to 4 s" in out, out
    assert "MIN_REPLICAS" in err.strip().splitlines()[-1], err


def hashes(text: str) -> dict[int, str]:
    return {int(m[2]): m[3] for m in HASH.finditer(text)}


def test_a_killed_group_is_replaced_and_heals_bit_for_bit(tmp_path):
    procs: list[subprocess.Popen] = []
    env = {}

    def start(args, name) -> Log:
        log = tmp_path / f"{name}.log"
        with open(log, "w") as out:
            procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=out,
                                          stderr=subprocess.STDOUT, text=True))  # fmt: skip
        return Log(log)

    def group(n: int, name: str) -> Log:
        # Far more steps than the test waits for: it stops them once they have compared.
        return start([sys.executable, str(TRAIN), "--group", str(n), "--steps", "100000",
                      "--log-every", "20", "--train-subset", "2048"], name)

    try:
        env.update(lighthouse(tmp_path, procs, min_replicas=1)[1])
        g0, g1 = group(0, "group0"), group(1, "group1")
        g1.wait_for(r"step 40/\d+ \| participants 2", procs)
        procs[2].send_signal(signal.SIGKILL)  # group 1 dies in the middle of a step
        procs[2].wait(timeout=30)
        survivor = procs[:2]
        gone = g0.wait_for(r"participants 2 -> 1 at step (\d+)", survivor)
        after = g0.wait_for(rf"step {int(gone[1]) // 20 * 20 + 40}/\d+ \| participants 1", survivor)
        assert after, g0.text()  # stepping alone
        g1b = group(1, "group1-replacement")
        healed = g1b.wait_for(HEALED.pattern, procs[:2] + procs[3:])
        assert int(healed[1]) == 0 and int(healed[2]) > int(gone[1]), g1b.text()
        # The first hash the replacement prints after healing, and the survivor's at that step.
        common = int(g1b.wait_for(HASH.pattern, procs[:2] + procs[3:])[2])
        g0.wait_for(rf"step {common}/\d+ \|", procs[:2] + procs[3:])
    finally:
        stop(procs)
    survivor_text, replacement_text = g0.text(), g1b.text()
    assert hashes(replacement_text)[common] == hashes(survivor_text)[common], (
        survivor_text, replacement_text)
    # Before the failure the two groups agreed too, at every step both logged (the group that
    # started second may have healed past the other's first logged steps: step 40, which the
    # test waited for with 2 participants, is always among them).
    before, alive = hashes(g1.text()), hashes(survivor_text)
    shared = sorted(before.keys() & alive.keys())
    assert 40 in shared and all(alive[s] == before[s] for s in shared), (g1.text(), survivor_text)
    assert "discarded" in survivor_text or "participants 2 -> 1" in survivor_text
