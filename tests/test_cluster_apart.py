"""cluster/apart.sh: a second local cluster beside this machine's, neither seeing the other
(CI runs the other Slurm versions' lane and the longest jobs so). Real daemons on both sides.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, job_environ, slurm

APART = ROOT / "cluster" / "apart.sh"
CLUSTER_ROOT = Path("/var/lib/course-cluster")
CGROUPS = Path("/sys/fs/cgroup")

# Run inside: its own cluster, a two-node step and a batch job using the job's private /tmp,
# and what the inside sees of this machine's cluster.
INSIDE = r"""
set -e
bash cluster/up.sh 2>&1 | tail -n 1
srun --nodes=2 --ntasks-per-node=1 hostname | sort
job=$(sbatch --parsable --output="$OUT_DIR/%j.out" --wrap 'echo private > /tmp/f; cat /tmp/f')
while squeue -h -j "$job" | grep -q .; do sleep 0.3; done
scontrol show job "$job" | grep -o 'JobState=[A-Z]*'
echo "processes named slurmctld: $(pgrep -cx slurmctld)"
echo "lock: $(ls /tmp/course-cluster.lock 2>&1 | head -c 60)"
echo ready
while [ ! -e "$OUT_DIR/go" ]; do sleep 0.2; done
after=$(timeout 60 srun --nodes=2 --ntasks-per-node=1 hostname | sort | tr '\n' ' ') || true
echo "after the restart beside: $after"
"""


def host_view():
    """What this machine's cluster is: its daemons' pids, the nodes' names and network."""
    daemons = (CLUSTER_ROOT / "run" / "daemons").read_text()
    hosts = Path("/etc/hosts").read_text()
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return daemons, hosts, sorted(netns.split("\n"))


def their_slurmds(apart_pid):
    """The slurmd processes of the second cluster that apart.sh (pid apart_pid) runs, as this
    machine's /proc shows them (in its cgroup course-apart-<pid>)."""
    pids = subprocess.run(["pgrep", "-x", "slurmd"], capture_output=True, text=True).stdout.split()
    group = f"course-apart-{apart_pid}"
    return [p for p in pids if group in re.split(r"[/:\n]", Path(f"/proc/{p}/cgroup").read_text())]


def test_second_cluster_beside_this_one_sees_nothing_of_it(cluster, cluster_lock, tmp_path):
    with cluster_lock():  # nothing else restarts this machine's cluster meanwhile
        before = host_view()
        env = job_environ({"OUT_DIR": str(tmp_path)})
        inside = subprocess.Popen(["bash", APART, tmp_path / "apart", "bash", "-c", INSIDE],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=env)  # fmt: skip
        try:
            lines = []
            for line in inside.stdout:  # until the second cluster is up and has run its jobs
                lines.append(line)
                if line == "ready\n" or len(lines) > 50:
                    break
            out = "".join(lines)
            assert out.endswith("ready\n"), out
            # Its daemons, cgroups and network leave this machine's cluster as it was, and a
            # restart of it meanwhile does not take them for strays of its own.
            assert host_view() == before
            # PIDs and namespace numbers are reused once freed: as if this cluster's records
            # named the other's slurmds (their pids, their nodes' UTS namespaces), which its
            # down.sh must still leave alone (CI saw it stop one).
            theirs = their_slurmds(inside.pid)
            assert len(theirs) == 2, theirs
            with open(CLUSTER_ROOT / "run" / "daemons", "a") as f:
                f.writelines(f"slurmd {pid}\n" for pid in theirs)
            with open(CLUSTER_ROOT / "run" / "uts", "a") as f:
                f.writelines(os.readlink(f"/proc/{pid}/ns/uts") + "\n" for pid in theirs)
            restart = subprocess.run(["bash", "-c", "bash cluster/down.sh && bash cluster/up.sh"],
                                     cwd=ROOT, capture_output=True, text=True,
                                     timeout=180)  # fmt: skip
            assert restart.returncode == 0, restart.stdout + restart.stderr
            assert sorted(slurm("srun", "--nodes=2", "hostname").split()) == ["node1", "node2"]
        finally:
            (tmp_path / "go").touch()
            rest, _ = inside.communicate(timeout=120)
        out += rest
        assert inside.returncode == 0, out
        assert "cluster: up in" in out and "node1\nnode2\n" in out, out
        assert "JobState=COMPLETED" in out, out
        assert "after the restart beside: node1 node2 \n" in out, out
        # One slurmctld inside (its own PID namespace), no lock of this machine's in its /tmp,
        # and down.sh ran at the end.
        assert "processes named slurmctld: 1\n" in out, out
        assert "lock: ls: cannot access" in out, out
        assert out.rstrip().endswith("cluster: down"), out
    # Nothing of the second cluster is left: no cgroup, mount or process.
    assert not list(CGROUPS.glob("*/course-apart-*"))
    assert str(tmp_path / "apart") not in Path("/proc/self/mountinfo").read_text()
    ps = subprocess.run(["pgrep", "-cx", "slurmctld"], capture_output=True, text=True)
    assert ps.stdout.strip() == "1", ps.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        ((), "cluster: error: usage: bash cluster/apart.sh DIR COMMAND..."),
        (("relative/dir", "true"), "cluster: error: DIR 'relative/dir' is not an absolute path"),
        (("/tmp/x", "true"), "cluster: error: DIR '/tmp/x': not under /tmp, /run"),
    ],
    ids=["no-arguments", "relative-dir", "dir-it-hides"],
)
def test_bad_arguments_are_one_line(args, message):
    proc = subprocess.run(["bash", APART, *args], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(message), proc.stderr
