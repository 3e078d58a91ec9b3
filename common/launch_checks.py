"""Before the group: the checks of this machine that turn a later hang into one line now.

:func:`check_launch` is the one line of every lesson's set-up between who it is
(common.env.resolve_launch_env) and ``init_process_group``: rank 0's address resolves and, across
nodes, is no loopback; rank 0 runs on the node that address names; rank 0's port is free; an srun
task kept its SLURM_* variables.  Lesson 06's preflight (common/preflight/) runs them too.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence

from common.env import LaunchEnv, LaunchError, step_hosts


def check_launch(env: LaunchEnv, environ: Mapping[str, str] | None = None, *,
                 proc_cgroup: str | None = None) -> None:  # fmt: skip
    """What would fail later against this machine, in this order, for the ``env`` that
    resolve_launch_env found in ``environ`` (default ``os.environ``).  ``proc_cgroup``
    (/proc/self/cgroup's text, read when ``environ`` is None) shows whether an srun task lost
    its SLURM_* variables."""
    if environ is None or proc_cgroup is not None:  # an srun task's variables
        check_slurm_variables_kept(os.environ if environ is None else environ, proc_cgroup)
    environ = os.environ if environ is None else environ
    hosts = step_hosts(environ)
    # Under torchrun the agents have already met before starting the workers, and
    # MASTER_ADDR is the agent's host as torchrun names it: the loopback check is for
    # addresses people set.  The agent also holds the port already.
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    check_master_addr(env if not agent_store else dataclasses.replace(env, num_nodes=1))
    if hosts is not None and env.launcher in ("slurm", "mp.spawn"):
        check_rank0_here(env, environ, hosts)
    dist = sys.modules.get("torch.distributed")
    joined = dist is not None and dist.is_available() and dist.is_initialized()
    if env.rank == 0 and not agent_store and not joined:  # rank 0 will host the store
        check_port_free(env.master_port)


def check_master_addr(env: LaunchEnv) -> None:
    """The master address must resolve, and across nodes not to loopback (``localhost``, or a
    node name that /etc/hosts maps to 127.0.1.1): each node would wait for rank 0 on itself."""
    master = env.master_addr
    try:
        infos = socket.getaddrinfo(master, env.master_port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise LaunchError(
            f"MASTER_ADDR={master!r} does not resolve ({exc}); set MASTER_ADDR to a "
            f"host name or IP address of the node running rank 0."
        ) from None
    name = master.lower().rstrip(".")
    try:
        literal = ipaddress.ip_address(master.split("%")[0]).is_loopback
    except ValueError:
        literal = name in ("localhost", "localhost.localdomain", "ip6-localhost")
    # This node's own name passes: rank 0's store listens on every address here, and the other
    # nodes, which must not resolve it to loopback, check it themselves.
    own = bool(env.hostname) and name.split(".")[0] == env.hostname.lower().split(".")[0]
    addresses = [info[4][0] for info in infos]
    loopback = [a for a in addresses if ipaddress.ip_address(a.split("%")[0]).is_loopback]
    if env.num_nodes > 1 and loopback and (literal or not own):
        shown = master if master in loopback else f"{master} -> {loopback[0]}"
        raise LaunchError(
            f"MASTER_ADDR={master!r} is a loopback address ({shown}) but the job spans "
            f"{env.num_nodes} nodes: each node would look for rank 0 on itself. Use the first "
            f"node's name as SLURM gives it (scontrol show hostnames \"$SLURM_JOB_NODELIST\" | "
            f"head -n1) or unset MASTER_ADDR and let common.env pick it."
        )


def check_port_free(port: int) -> None:
    """Rank 0 is about to listen on ``port``; say so now if something else already does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store does
        try:
            sock.bind(("", port))
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
            raise LaunchError(
                f"MASTER_PORT={port} is already in use on this host ({exc.strerror}); "
                f"export MASTER_PORT=<another port>, e.g. a free one in 20000-30000."
            ) from None


# A process of an srun step is in the step's cgroup whatever its environment holds: cgroup v1
# ".../job_<id>/step_<n>/...", v2 ".../slurmstepd.scope/job_<id>/step_<n>/user/task_<t>".  From
# Slurm 26.05 on, cgroup/v2 names the job by its SLUID instead (CHANGELOG; cgroup.conf(5)
# CgroupJobIdPaths, default no, brings the job id back): "s" and 13 Crockford base32 digits
# (src/common/sluid.c: sluid2str), ".../slurmstepd.scope/sEKNKTV3WPV500/step_0/user/task_0".  The
# batch script is in step_batch, salloc's shell in step_interactive; without task/cgroup, or in
# a container with its own cgroup namespace, there is no such line: no sign either way.
_STEP_CGROUP = re.compile(r"/(?:job_([0-9]+)|(s[0-9A-HJKMNP-TV-Z]{13}))/step_([0-9]+)(?:/|$)")
PROC_CGROUP = "/proc/self/cgroup"


def slurm_step_of_cgroup(proc_cgroup: str) -> tuple[str, str] | None:
    """(job, step id) of the srun step whose cgroup /proc/self/cgroup names, or None; the job is
    its id, or its SLUID where cgroup/v2 names no id (Slurm 26.05)."""
    for line in proc_cgroup.splitlines():
        m = _STEP_CGROUP.search(line.split(":", 2)[-1])
        if m:
            return m[1] or m[2], m[3]
    return None


def check_slurm_variables_kept(environ: Mapping[str, str], proc_cgroup: str | None,
                               cgroup_file: str = PROC_CGROUP) -> None:  # fmt: skip
    """An srun task that lost every SLURM_* variable (``apptainer exec --cleanenv``, ``env -i``)
    would train alone as rank 0 of 1: say so instead (unless RANK/WORLD_SIZE say who it is).
    ``proc_cgroup``: the text of ``cgroup_file`` (read here when None)."""
    launcher_vars = ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    if any(name.startswith("SLURM_") or name in launcher_vars for name in environ):
        return
    if proc_cgroup is None:
        try:
            with open(cgroup_file) as f:
                proc_cgroup = f.read()
        except OSError:
            return
    found = slurm_step_of_cgroup(proc_cgroup)
    if found:
        job, step = found
        where = (f"Slurm step {job}.{step} ({cgroup_file})" if job.isdigit() else
                 f"step {step} of the Slurm job with SLUID {job} ({cgroup_file}, which names "
                 f"no job id)")  # fmt: skip
        raise LaunchError(
            f"this process runs in {where} but has "
            f"no SLURM_* variable, so every task would train alone as rank 0 of 1: something "
            f"between srun and Python cleared the environment (apptainer/singularity exec "
            f"--cleanenv or --containall, env -i). Drop that option, or pass the variables in "
            f"(apptainer --env-file, APPTAINERENV_SLURM_PROCID=...); for a deliberate single "
            f"process set RANK=0 WORLD_SIZE=1."
        )


def check_rank0_here(env: LaunchEnv, environ: Mapping[str, str], hosts: Sequence[str]) -> None:
    """Rank 0 hosts the store at MASTER_ADDR, and common.env numbers ranks node by node, so
    rank 0 runs on the step's first node.  A MASTER_ADDR naming another node of the step (set
    by hand, or exported by a batch script for a step on part of the job's nodes) would have
    every rank wait at a host where nothing listens until the timeout: say so in seconds.  (An
    address that is no node name of the step is left alone.)"""
    node = environ.get("SLURMD_NODENAME", "")
    if env.rank != 0 or not node or node == env.master_addr or env.master_addr not in hosts:
        return
    raise LaunchError(
        f"MASTER_ADDR={env.master_addr} but rank 0 runs on {node}, the first node of this step "
        f"(ranks are numbered node by node, as torchrun does): unset MASTER_ADDR, or export "
        f"MASTER_ADDR={node}."
    )
