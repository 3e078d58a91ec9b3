"""How this process joins its group, once it knows who it is (common.env.resolve_launch_env).

:func:`check_launch`, one line of every lesson's set-up, checks what would otherwise fail later
against this machine, as a hang, and says it in one line now: rank 0's address resolves and,
across nodes, is no loopback; rank 0 runs on the node that address names; rank 0's port is free;
an srun task kept its SLURM_* variables.  Lesson 06's preflight (common/preflight/) runs them
too.  Then the set-up's helpers: this process's CPU threads, how long a rank waits for the
others, and the one line a rank prints when the group cannot be joined.  The GPU a rank drives
is common/gpu_checks.py's.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import ipaddress
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence

from common.env import LaunchEnv, LaunchError, _opt_int_var, step_hosts


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


# --------------------------------------------------------------------------- the set-up's helpers


# Launchers that start several workers inside one SLURM task: they share the task's CPUs.
_WORKER_LAUNCHERS = ("torchrun", "torch.distributed.launch", "mp.spawn")


def usable_cpus() -> tuple[int, bool]:
    """(CPUs this process may run on, whether that is the whole machine): the affinity mask,
    which SLURM narrows to the task's CPUs when it binds tasks; macOS has none."""
    total = os.cpu_count() or 1
    if not hasattr(os, "sched_getaffinity"):
        return total, True
    mine = len(os.sched_getaffinity(0))
    return mine, mine >= total


def process_cpus(env: LaunchEnv, environ: Mapping[str, str] | None = None,
                 cpus: tuple[int, bool] | None = None) -> int:  # fmt: skip
    """This process's share of its task's CPUs (at least 1): a launcher's workers share their
    task's set; where nothing is bound the node's processes share the machine; capped by
    SLURM_CPUS_PER_TASK.  Split between torch's threads and DataLoader workers (lesson 08)."""
    mine, whole_machine = usable_cpus() if cpus is None else cpus
    per_task = env.local_world_size if env.launcher in _WORKER_LAUNCHERS else 1
    share = mine // (env.local_world_size if whole_machine else per_task)
    asked = _opt_int_var(os.environ if environ is None else environ, "SLURM_CPUS_PER_TASK",
                         minimum=1)  # fmt: skip
    return max(1, min(share, asked // per_task) if asked else share)


def cpu_threads(env: LaunchEnv, environ: Mapping[str, str] | None = None,
                cpus: tuple[int, bool] | None = None) -> int:  # fmt: skip
    """Threads for ``torch.set_num_threads``: OMP_NUM_THREADS if set, else :func:`process_cpus`;
    otherwise each process takes every core and they fight over them."""
    environ = os.environ if environ is None else environ
    hint = "Set it to a whole number of threads, e.g. 4, or unset it."
    return _opt_int_var(environ, "OMP_NUM_THREADS", minimum=1, hint=hint) or process_cpus(
        env, environ, cpus)  # fmt: skip


DEFAULT_TIMEOUT_S = 600  # torch's own default for NCCL; gloo's is 30 minutes
TIMEOUT_VAR = "COURSE_DIST_TIMEOUT"


def dist_timeout(environ: Mapping[str, str] | None = None) -> datetime.timedelta:
    """How long a rank waits for the others (rendezvous, every collective): COURSE_DIST_TIMEOUT
    seconds, else 600.  Minutes, since ranks legitimately wait (a checkpoint, a slow import);
    the failure demos and tests set a few seconds so that a hang ends quickly."""
    text = (os.environ if environ is None else environ).get(TIMEOUT_VAR, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise LaunchError(f"{TIMEOUT_VAR}={text!r} is not a positive number of seconds; "
                          f"set e.g. {TIMEOUT_VAR}=600 or unset it.")  # fmt: skip
    return datetime.timedelta(seconds=seconds)


def init_error_message(env: LaunchEnv, exc: BaseException) -> str:
    """One line, in place of torch's traceback, for a rank whose ``init_process_group`` failed
    (DistStoreError: the others did not come; DistNetworkError: rank 0's address did not answer)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if "Duplicate GPU detected" in text:
        return (f"rank {env.rank}: two ranks drive one GPU ({first}); give each task its own "
                f"GPU (--gpus-per-task=1) or start one process per GPU.")  # fmt: skip
    return (f"rank {env.rank}: could not join the process group at MASTER_ADDR={env.master_addr} "
            f"MASTER_PORT={env.master_port} ({first}). Check that all {env.world_size} processes "
            f"started and can reach that address (a longer wait: {TIMEOUT_VAR}=<seconds>).")
