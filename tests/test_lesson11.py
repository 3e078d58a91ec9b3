"""Lesson 11 (torchft): replica groups that keep training when one dies.

On this machine (gloo on loopback, a real lighthouse, each group a process as srun starts it):
the lighthouse's address missing, malformed or not answering is one line in seconds naming
TORCHFT_LIGHTHOUSE, and so are an address file whose lighthouse job is not running, torchft
missing (the platforms it has no wheels for) and a node whose [::] takes no IPv4; two groups
train, one is killed (SIGKILL: no goodbye), the other steps on alone, a new process of the
killed group heals from it and then holds the same weights and optimizer state, bit for bit.
The cluster's version (a node set DOWN, the requeued job healing) is
tests/test_lesson11_cluster.py.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import clean_environ, require_torchft, run_or_dump, stacks

require_torchft()  # skipped where requirements.txt installs none, failed where it breaks
# Two processes training side by side for ~20 s on 2 cores: a lane of its own (make test-lesson11).
pytestmark = pytest.mark.lesson11

ROOT = Path(__file__).resolve().parent.parent
LESSON = ROOT / "lessons" / "11_torchft"
TRAIN = LESSON / "train_ft.py"
HASH = re.compile(r"\[group (\d)\] step (\d+)/\d+ \|.* \| state (\w+)$", re.M)
HEALED = re.compile(r"\[group \d\] healed: step (\d+) -> (\d+)")
LOSS = re.compile(r"\[group 0\] step (\d+)/\d+ \| participants \d \| loss ([\d.]+) \|")
GUARD_S = 120  # a hang guard only: the slow kind of machine takes twice as long


def free_port() -> int:
    from common.env import find_free_port

    return find_free_port()


@pytest.mark.parametrize("args, env, address, says", [
    (["5"], {}, None, "the group index '5' is not one of 0..1"),
    (["0"], {"FT_GROUPS": "0"}, None, "FT_GROUPS='0' is not a whole number of groups"),
    (["0"], {"STEPS": "many"}, None, "STEPS='many' is not a whole number of steps"),
    (["0"], {"SUBSET": "all"}, None, "SUBSET='all' is not a whole number of images"),
    (["0"], {"FT_WAIT_S": "soon"}, None, "FT_WAIT_S='soon' is not a whole number of seconds"),
    (["0"], {"CKPT_EVERY": "often"}, None, "CKPT_EVERY='often' is not a whole number of steps"),
    (["0"], {"FT_WAIT_S": "1"}, None, "no lighthouse address in {dir}/lighthouse after 1 s"),
    # An address whose lighthouse job has ended (or never was): squeue does not list it running.
    (["0"], {"FT_WAIT_S": "1"}, "http://node1:15001 999999\n",
     "names http://node1:15001 of lighthouse job 999999, which is not running (squeue: "),
    (["0"], {"FT_WAIT_S": "1"}, "http://node1:15001\n", "holds 'http://node1:15001' and no job id"),
], ids=["index", "groups", "steps", "subset", "wait", "ckpt-every", "no-file", "job-not-running",
        "no-job-id"])  # fmt: skip
def test_group_sh_refuses_bad_input_in_one_line(args, env, address, says, tmp_path):
    if address:
        (tmp_path / "lighthouse").write_text(address)
    proc = run_or_dump(["bash", str(LESSON / "group.sh"), *args], cwd=ROOT, timeout=60,
                       env=clean_environ(SLURM_SUBMIT_DIR=str(ROOT), FT_DIR=str(tmp_path), **env))
    says = says.format(dir=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr


class Log:
    """A process's output file, read as it grows; PROCS: every process the test started, whose
    stacks a hang's failure shows (the list as it is then: it may grow after this)."""

    def __init__(self, path: Path, procs: list[subprocess.Popen]):
        self.path = path
        self.procs = procs

    def text(self) -> str:
        return self.path.read_text(errors="replace") if self.path.exists() else ""

    def wait_for(self, pattern: str, procs, timeout: float = GUARD_S) -> re.Match:
        """The first match of PATTERN in the file; fails if one of PROCS ends first, and after
        TIMEOUT with the stacks of every process of the test still running (py-spy)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := re.search(pattern, self.text(), re.M):
                return found
            dead = [p for p in procs if p.poll() is not None]
            assert not dead, f"{dead[0].args} exited {dead[0].returncode}:\n{self.text()}"
            time.sleep(0.1)
        where = stacks(self.procs)
        pytest.fail(f"no {pattern!r} after {timeout} s in {self.path}:\n{self.text()}\n"
                    f"--- where the processes still running were:\n{where}")  # fmt: skip


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
    Log(log, procs).wait_for("Lighthouse listening", procs)
    return Log(log, procs), clean_environ(TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{port}")


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
    client would retry for its connect timeout (train_ft.py's 10 s; 60 s by default) and raise
    with a traceback. A lighthouse that wants 2 groups, and 1 group: it says what it waits for
    and how long, then one line when the wait is over (torchft raises a TimeoutError from its
    Rust client). torchft that does not import (a stand-in package that raises ImportError, as
    on CPython 3.14 or aarch64, where requirements.txt leaves it out): one line naming this
    platform. A group of two processes: one line. The six run side by side (each a process that
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
        stand_in = tmp_path / "no-torchft" / "torchft"
        stand_in.mkdir(parents=True)
        (stand_in / "__init__.py").write_text('raise ImportError("no wheel for this platform")')
        here = f"CPython {platform.python_version()} on {platform.system()} {platform.machine()}"
        env = clean_environ()
        env["PYTHONPATH"] = f"{stand_in.parent}{os.pathsep}{env['PYTHONPATH']}"
        runs.append((env, f"torchft does not import here ({here}: no wheel for this platform): "
                          "torchft 0.2.0 has wheels for CPython 3.10-3.13 on Linux x86_64 only"))
        # A group of two processes (as srun --ntasks=2 would start it): refused before torchft.
        runs.append((clean_environ(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2",
                                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())),
                     "train_ft.py's replica groups are one process each, this one has 2: a "
                     "group of several ranks runs train_ft_fsdp.py"))  # fmt: skip
        command = [sys.executable, str(TRAIN), "--group", "0", "--train-subset", "512"]
        started = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
                   for env, _ in runs]  # fmt: skip
        procs += started
        # A hang guard (each ends in seconds, the one that waits for a quorum in 4).
        try:
            outputs = [proc.communicate(timeout=GUARD_S) for proc in started]
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{exc.cmd} still ran after {GUARD_S} s; where the processes still "
                        f"running were:\n{stacks(procs)}")  # fmt: skip
    finally:
        stop(procs)
    for (out, err), (_, says) in zip(outputs, runs, strict=True):
        lines = err.strip().splitlines()
        assert "Traceback" not in err and lines and says in lines[-1], out + err
    for proc, (_, err) in zip(started[:3], outputs, strict=False):
        assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("error: TORCHFT_LIGHTHOUSE") and "lighthouse.sh" in err, err
    for proc, (out, err) in zip(started[4:], outputs[4:], strict=True):
        assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, out + err
    out, err = outputs[3]
    assert started[3].returncode == 1, out + err
    assert "when its --min_replicas groups have asked; each step waits up to 4 s" in out, out
    assert "MIN_REPLICAS" in err.strip().splitlines()[-1], err


# A node whose [::] takes no IPv4 connection (net.ipv6.bindv6only=1), in a network namespace of
# its own: a lighthouse on 127.0.0.1 there, and a group whose Manager binds its server to [::] and
# then reaches it through its host name, an IPv4 address.
V6ONLY = """
ip link set lo up
sysctl -qw net.ipv6.bindv6only=1
"$1" --min_replicas 1 --join_timeout_ms 1000 --bind 127.0.0.1:29510 &
for _ in $(seq 50); do (: </dev/tcp/127.0.0.1/29510) 2>/dev/null && break; sleep 0.2; done
TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 "$2" "$3" \
    --group 0 --steps 20 --train-subset 512
status=$?
kill %1
exit $status
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="a network namespace of its own: unshare --net, as root")
def test_a_node_whose_ipv6_wildcard_takes_no_ipv4_is_one_line():
    """torchft's Manager binds its server to [::] (and its checkpoint server too): with
    net.ipv6.bindv6only=1 that takes no IPv4 connection, and the group cannot reach its own
    server through its host name. torchft says so after its connect timeout (train_ft.py's 10
    s), with a traceback; train_ft.py in one line naming the setting."""
    binary = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent))
    proc = run_or_dump(["unshare", "--net", "bash", "-c", V6ONLY, "v6only", binary,
                        sys.executable, str(TRAIN)], cwd=ROOT, env=clean_environ(),
                       timeout=GUARD_S)  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert lines[-1].startswith("error: torchft's Manager did not start: failed to connect to "
                                "http://"), proc.stderr  # fmt: skip
    assert "this node has net.ipv6.bindv6only=1" in lines[-1], proc.stderr


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
        return Log(log, procs)

    def group(n: int, name: str) -> Log:
        # Far more steps than the test waits for: it stops them once they have compared.
        return start([sys.executable, str(TRAIN), "--group", str(n), "--steps", "100000",
                      "--log-every", "20", "--train-subset", "2048"], name)

    try:
        env.update(lighthouse(tmp_path, procs, min_replicas=1)[1])
        g0, g1 = group(0, "group0"), group(1, "group1")
        # Group 1 may step alone for a while before group 0 has started (CI's load: step 51):
        # the first logged step from 40 on with both groups is the one both logs must agree on.
        together = int(g1.wait_for(r"step ([4-9]\d|\d{3,})/\d+ \| participants 2", procs)[1])
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
    # started second may have healed past the other's first logged steps: the step the test
    # waited for with 2 participants is always among them).
    before, alive = hashes(g1.text()), hashes(survivor_text)
    shared = sorted(before.keys() & alive.keys())
    assert together in shared and all(alive[s] == before[s] for s in shared), (
        g1.text(), survivor_text)
    assert "discarded" in survivor_text or "participants 2 -> 1" in survivor_text
    # The groups learn, not only agree: the survivor's losses from step 60 on (each one batch
    # of 64 images; at least steps 60 and 80 are logged), averaged. Measured 2026-12-02: 0.22
    # (0.09 to 0.39 at steps 60 to 200), from 2.3 (ln 10) untrained; with every image of a
    # group's batch paired with another's label (train_y[idx].roll(1), the same in both groups,
    # so their hashes still agree) 2.32 (2.28 to 2.36): the model learns nothing.
    late = [float(m[2]) for m in LOSS.finditer(survivor_text) if int(m[1]) >= 60]
    assert late and sum(late) / len(late) < 1.0, survivor_text


RESUMED = re.compile(r"\[group (\d)\] resumed from (\S+)/step-(\d+): step (\d+) \| state (\w+)$",
                     re.M)  # fmt: skip


LEFT = re.compile(r"\[group (\d)\] SIGTERM \(scancel, a preemption, the time limit\): leaving "
                  r"between steps (\d+) and \d+ \| state (\w+);")  # fmt: skip
SAVED = re.compile(r"\[group \d\] checkpoint (\S+) in [\d.]+ s \(on SIGTERM\)")


def test_a_group_sent_sigterm_leaves_between_steps_saves_and_no_step_is_lost(tmp_path):
    """SIGTERM, what scancel, a preemption and the time limit send first: the group ends the
    step in flight, leaves before the next one, saves that step's state, and exits 75. The
    survivor waits out the heartbeat timeout and goes on at that very step, with nothing
    discarded (SIGKILL, or no handler, breaks its all-reduce: the step is lost). The state
    saved is the survivor's at that step, bit for bit; and when the survivor is sent SIGTERM
    too, its own checkpoint is the one a new group resumes from: the last to leave keeps the
    run."""
    procs: list[subprocess.Popen] = []
    ckpt = tmp_path / "ckpt"
    env = {}

    def group(n: int, name: str, log_every: int) -> Log:
        log = tmp_path / f"{name}.log"
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, str(TRAIN), "--group", str(n), "--steps", "100000",
                 "--log-every", str(log_every), "--ckpt-every", "100000", "--ckpt-dir",
                 str(ckpt), "--train-subset", "2048"],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True))  # fmt: skip
        return Log(log, procs)

    def sigterm(proc: subprocess.Popen, log: Log) -> tuple[re.Match, re.Match, float]:
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=GUARD_S)
        took = time.monotonic() - t0
        text = log.text()
        assert proc.returncode == 75 and "Traceback" not in text, text
        left, saved = LEFT.search(text), SAVED.search(text)
        assert left and saved, text
        assert Path(saved[1]) == ckpt / f"step-{int(left[2]):08d}", text
        return left, saved, took

    try:
        env.update(lighthouse(tmp_path, procs, min_replicas=1)[1])
        # Group 0 logs every step: its state at whichever step group 1 leaves.
        g0, g1 = group(0, "group0", 1), group(1, "group1", 20)
        g1.wait_for(r"step ([4-9]\d|\d{3,})/\d+ \| participants 2", procs)
        left1, _, took1 = sigterm(procs[2], g1)
        step = int(left1[2])
        alone = g0.wait_for(r"participants 2 -> 1 at step (\d+)", procs[:2])
        g0.wait_for(rf"step {step + 20}/\d+ \| participants 1", procs[:2])  # stepping alone
        left0, _, took0 = sigterm(procs[1], g0)
        procs[1:] = []
        g0b = group(0, "group0-resumed", 20)
        resumed = g0b.wait_for(RESUMED.pattern, procs)
    finally:
        stop(procs)
    text0 = g0.text()
    # Group 0 went on at the step group 1 left before, nothing discarded, and the state group 1
    # saved is the one group 0 held at that step.
    assert int(alone[1]) == step and "discarded" not in text0, (g1.text(), text0)
    assert hashes(text0)[step] == left1[3], (g1.text(), text0)
    # The last to leave keeps the run: its step and state are what the new group loads.
    assert (int(resumed[3]), resumed[5]) == (int(left0[2]), left0[3]), (text0, g0b.text())
    print(f"group 1 ended {took1:.2f} s after SIGTERM (step {step}); group 0 "
          f"{took0:.2f} s after its own (step {left0[2]}); the new group loaded step "
          f"{int(resumed[3])}")  # fmt: skip


def test_every_group_and_the_lighthouse_lost_resume_from_the_checkpoint_bit_for_bit(tmp_path):
    """Everything ends at once (the lighthouse killed, as its time limit or its node would end
    it): each group waits for its quorum's timeout (COURSE_DIST_TIMEOUT, 8 s here), then says so
    in one line naming the newest checkpoint, and exits 1. A new lighthouse and two new groups
    resume from that checkpoint: the state they load is the one the groups logged at its step,
    and every step both runs logged after it is the same state again, bit for bit (the same
    batches, learning rate and AdamW moments: a resume that restarted the schedule, the
    sampler's epoch or the optimizer would differ). A group given another run's recipe on the
    same folder is refused in one line."""
    procs: list[subprocess.Popen] = []
    ckpt = tmp_path / "ckpt"
    env = {}

    def group(n: int, name: str, *extra: str) -> Log:
        log = tmp_path / f"{name}.log"
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, str(TRAIN), "--group", str(n), "--steps", "100000",
                 "--log-every", "5", "--ckpt-every", "40", "--ckpt-dir", str(ckpt),
                 "--train-subset", "2048", *extra],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True))  # fmt: skip
        return Log(log, procs)

    try:
        env.update(lighthouse(tmp_path, procs, min_replicas=1)[1], COURSE_DIST_TIMEOUT="8")
        first = [group(0, "first0"), group(1, "first1")]
        # The quorum's first group writes (either may be first).
        deadline = time.monotonic() + GUARD_S
        while not (ckpt / "step-00000080").is_dir():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), (
                first[0].text(), first[1].text())
            time.sleep(0.1)
        # Both stepping together, at a logged step (under load one group may step alone first).
        first[1].wait_for(r"step (9\d|\d{3,})/\d+ \| participants 2", procs)
        procs[0].kill()  # the lighthouse
        t_kill = time.monotonic()
        for proc in procs[1:3]:
            proc.wait(timeout=GUARD_S)
        waited = time.monotonic() - t_kill
        newest = max(p.name for p in ckpt.glob("step-*"))
        texts = [log.text() for log in first]
        for proc, text in zip(procs[1:3], texts, strict=True):
            last = text.strip().splitlines()[-1]
            assert proc.returncode == 1 and "Traceback" not in text, text
            assert last.startswith("error: no quorum within 8 s at step ") and last.endswith(
                f"the newest checkpoint, {ckpt / newest}, is where new groups resume"), text
        assert 8 <= waited < 8 + 30, waited  # the quorum's timeout, not a hang
        print(f"the groups ended {waited:.1f} s after the lighthouse, newest {newest}")

        procs.clear()
        # Both groups in the first quorum (min_replicas 2): with 1, the group that starts first
        # may step alone once (the other not yet heartbeating), and the two runs' steps differ.
        env.update(lighthouse(tmp_path, procs, min_replicas=2)[1])
        second = [group(0, "second0"), group(1, "second1")]
        resumed = [log.wait_for(RESUMED.pattern, procs) for log in second]
        step = int(newest.split("-")[1])
        before = hashes(texts[0])
        for found in resumed:
            assert (found[2], int(found[3]), int(found[4])) == (str(ckpt), step, step), found[0]
            assert found[5] == before[step], (found[0], texts[0])  # the state saved, loaded
        later = [s for s in before if s > step]
        assert later, texts[0]  # the first run logged steps past the checkpoint
        for log in second:
            log.wait_for(rf"step {max(later)}/\d+ \|", procs)
        # Another run's recipe (other --steps: another schedule) on the same folder.
        refused = run_or_dump([sys.executable, str(TRAIN), "--group", "0", "--steps", "500",
                               "--ckpt-dir", str(ckpt), "--train-subset", "2048"],
                              cwd=ROOT, env=env, timeout=GUARD_S)  # fmt: skip
    finally:
        stop(procs)
    for log in second:
        after = hashes(log.text())
        assert all(after[s] == before[s] for s in later), (texts[0], log.text())
        assert "healed" not in log.text(), log.text()  # both started from the checkpoint
    err = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(err) == 1 and "Traceback" not in refused.stderr, err
    assert "is from another run: steps=100000 (this run: 500); delete " in err[0], err
