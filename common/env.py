"""Who am I in this job?  Rank, local rank, world size, node, and where rank 0 listens.

Who tells a process depends on who started it; we look, in this order:

1. torchrun / torch.distributed.launch: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
   ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``PORT``, ``TORCHELASTIC_RUN_ID``
   (``RANK``/``WORLD_SIZE`` set by hand: launcher "env");
2. srun: ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID`` and the step's ``SLURM_STEP_*``
   (the batch script is no task of any step: one process, however many tasks the job has);
3. ``torch.multiprocessing.spawn``: the caller passes the child's index and the count;
4. nothing: one plain process, rank 0 of 1.

What would make the job hang later (a variable missing, malformed or disagreeing with another,
a double spawn, a master address that does not resolve or is loopback across nodes, a busy
port) raises :class:`LaunchError` at once, naming the variable or flag and the fix.
``srun python -m common.env`` prints what each task sees (common/env_cli.py).
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
from pathlib import Path

try:  # python-hostlist reads SLURM's host list syntax in full (requirements.txt installs it)
    import hostlist
except ImportError:  # container images (NGC, pyxis) ship torch and not our packages
    hostlist = None

LAUNCHERS = ("torchrun", "torch.distributed.launch", "env", "slurm", "mp.spawn", "single")
DEFAULT_MASTER_PORT = 29500  # torch's own default
# Ports derived from a job id: unprivileged, and below Linux's ephemeral range (32768-60999,
# /proc/sys/net/ipv4/ip_local_port_range), so outgoing connections never take them.
MASTER_PORT_BASE, MASTER_PORT_SPAN = 15000, 15000
# Step ids of the batch script, the extern step and salloc's shell (slurm.h: 0xfffffffa ...
# 0xfffffffd).  Slurm 22.05-25.11 export no SLURM_STEP_ID there; 26.05 prints them with "%d"
# (the batch script sees SLURM_STEP_ID=-5).  The unsigned form is accepted as well.
SENTINEL_STEP_ID_MIN = 0xFFFFFFF0
_SENTINEL_STEP_ID = re.compile(r"-(?:[1-9]|1[0-6])")
# SLURM writes ASCII digits; int() would also take "1_0", "+3", " -2" or full-width digits.
_ASCII_INT = re.compile(r"[0-9]+")
_TASKS_PER_NODE = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
MAX_HOSTS = 100_000  # a longer host list is a malformed variable, not a job


class LaunchError(RuntimeError):
    """The launch environment is inconsistent; the message names the variable and the fix."""


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    rank: int  # global rank, 0 .. world_size-1
    local_rank: int  # rank among the processes on this node (selects the GPU)
    world_size: int  # number of processes in the job
    local_world_size: int  # number of processes on this node
    node_rank: int  # index of this node, 0 .. num_nodes-1
    num_nodes: int
    master_addr: str  # where rank 0 (or the torchrun agent) hosts the rendezvous store
    master_port: int
    launcher: str  # one of LAUNCHERS
    hostname: str
    job_id: str | None  # SLURM_JOB_ID, or None outside SLURM

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- readers


def _parse_int(text: str, name: str, *, hint: str = "", minimum: int = 0) -> int:
    """A whole number >= ``minimum`` in ASCII digits, else a LaunchError naming ``name``."""
    stripped = text.strip()
    if not _ASCII_INT.fullmatch(stripped):
        raise LaunchError(
            f"{name}={text!r} is not a whole number (ASCII digits 0-9 only). {hint}".strip()
        )
    if int(stripped) < minimum:
        raise LaunchError(f"{name}={int(stripped)} must be at least {minimum}. {hint}".strip())
    return int(stripped)


def _int_var(environ: Mapping[str, str], name: str, *, hint: str = "", minimum: int = 0) -> int:
    if name not in environ:
        raise LaunchError(f"{name} is not set. {hint}".strip())
    return _parse_int(environ[name], name, hint=hint, minimum=minimum)


def _opt_int_var(environ, name: str, *, hint: str = "", minimum: int = 0) -> int | None:
    return None if name not in environ else _parse_int(environ[name], name, hint=hint,
                                                       minimum=minimum)  # fmt: skip


def expand_hostlist(text: str, variable: str = "host list") -> list[str]:
    """``gpu[01-03,07],cpu5`` -> its host names (zero padding kept); ``variable`` is named in
    the error.  python-hostlist where installed, else :func:`_expand_builtin`."""
    try:
        hosts = hostlist.expand_hostlist(text) if hostlist else _expand_builtin(text)
    except RecursionError:  # python-hostlist recurses once per bracket group
        raise LaunchError(
            f"{variable} has too many bracket groups to be a host list ({text[:40]!r}...)"
        ) from None
    except (ValueError, getattr(hostlist, "BadHostlist", ValueError)) as exc:
        raise LaunchError(
            f"{variable}={text!r} is not a valid host list ({exc}); expected e.g. 'node[1-2],gpu05'"
        ) from None
    if not hosts:
        raise LaunchError(f"{variable} is empty; expected a host list such as 'node[1-2]'")
    return hosts


def _expand_builtin(text: str) -> list[str]:
    """SLURM's host list syntax for images without python-hostlist (tests check that the two
    agree): comma-separated names, each the product of its ``[ranges]`` groups."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
        if not 0 <= depth <= 1:
            raise ValueError("unbalanced or nested brackets")
    if depth:
        raise ValueError("'[' without ']'")
    items.append(text[start:])
    hosts: list[str] = []
    for item in filter(None, items):  # "a,,b" is a,b (as for python-hostlist)
        names = [""]
        # "rack[1-2]-gpu[08-09]" splits into "rack", "1-2", "-gpu", "08-09", "".
        for k, piece in enumerate(re.split(r"\[([^\[\]]*)\]", item)):
            names = [n + s for n in names for s in (_expand_ranges(piece) if k % 2 else [piece])]
            if len(hosts) + len(names) > MAX_HOSTS:
                raise ValueError(f"more than {MAX_HOSTS} hosts")
        hosts.extend(names)
    return hosts


def _expand_ranges(group: str) -> list[str]:
    """``01-03,7`` -> ``01 02 03 7`` (a range's lower bound gives the width)."""
    out = []
    for part in group.split(","):
        low, _, high = part.partition("-")
        if not _ASCII_INT.fullmatch(low) or (high and not _ASCII_INT.fullmatch(high)):
            raise ValueError(f"bad range {part!r}")
        first, last = int(low), int(high or low)
        if last < first or last - first >= MAX_HOSTS:
            raise ValueError(f"bad range {part!r}")
        out += [f"{n:0{len(low)}d}" for n in range(first, last + 1)]
    return out


def parse_tasks_per_node(text: str, variable: str = "SLURM_STEP_TASKS_PER_NODE") -> list[int]:
    """SLURM's compressed task counts: ``2(x3),1`` means 2,2,2,1."""
    counts: list[int] = []
    for part in text.split(","):
        match = _TASKS_PER_NODE.fullmatch(part.strip())
        if not match or int(match[1]) < 1 or (match[2] and int(match[2]) < 1):
            raise LaunchError(
                f"{variable}={text!r} is not a SLURM task count list; expected e.g. '2(x3),1'"
            )
        repeat = int(match[2] or 1)
        if len(counts) + repeat > MAX_HOSTS:
            raise LaunchError(f"{variable}={text!r} counts more than {MAX_HOSTS} nodes.")
        counts += [int(match[1])] * repeat
    return counts


def master_port_for_job(job_id: int | str) -> int:
    """``MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN``: the same port on every task of a job,
    different for jobs running together unless their ids differ by a multiple of 15000.  A job
    array's tasks have ids of their own (adding SLURM_ARRAY_TASK_ID would make job 36's task 3
    collide with job 39)."""
    return MASTER_PORT_BASE + _parse_int(str(job_id), "SLURM_JOB_ID", minimum=1) % MASTER_PORT_SPAN


def find_free_port() -> int:
    """A port that is free right now (for a parent about to start its children)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- which launcher


def _ancestor_cmdlines(depth: int = 3) -> list[str]:
    """Command lines of the parent, grandparent, ... from /proc (empty where unreadable)."""
    lines, pid = [], os.getppid()
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                lines.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
    return lines


def _torch_launcher(environ, argv: Sequence[str], ancestors: Sequence[str]) -> str:
    """torchrun and torch.distributed.launch set the same variables; tell them apart.

    ``python -m torch.distributed.launch`` shows in the agent's command line and, without
    ``--use-env``, passes ``--local-rank=N``.  No agent (no ``TORCHELASTIC_RUN_ID``): "env".
    """
    if any(a.startswith(("--local-rank", "--local_rank")) for a in argv[1:]):
        return "torch.distributed.launch"
    if "TORCHELASTIC_RUN_ID" not in environ:
        return "env"
    for cmdline in ancestors:
        program = cmdline.split()[:3]  # "python -m torch.distributed.launch", ".../bin/torchrun"
        if "torch.distributed.launch" in program:
            return "torch.distributed.launch"
        if "torch.distributed.run" in program or any(
            os.path.basename(word) == "torchrun" for word in program
        ):
            break
    return "torchrun"


# --------------------------------------------------------------------------- SLURM step


@dataclasses.dataclass(frozen=True)
class _SlurmStep:
    procid: int  # SLURM_PROCID
    localid: int  # SLURM_LOCALID
    nodeid: int  # SLURM_NODEID
    ntasks: int  # SLURM_STEP_NUM_TASKS, else SLURM_NTASKS
    hosts: list[str]  # SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST
    tasks_per_node: list[int]  # SLURM_STEP_TASKS_PER_NODE, else SLURM_TASKS_PER_NODE

    @property
    def tasks_on_this_node(self) -> int:
        return self.tasks_per_node[self.nodeid]


def _in_srun_step(environ: Mapping[str, str]) -> bool:
    """True in a task started by srun.  The batch script also has SLURM_PROCID=0 and job-wide
    counts (SLURM_NTASKS=4) but is one process: a task has a step id below the sentinels or,
    with no step id at all, the step description only srun sets (SLURM_STEP_NUM_TASKS)."""
    if "SLURM_PROCID" not in environ:
        return False
    step_id = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    if step_id is None:
        return "SLURM_STEP_NUM_TASKS" in environ
    step_id = step_id.strip()
    if _SENTINEL_STEP_ID.fullmatch(step_id):  # "-5": the batch script (26.05's "%d")
        return False
    return bool(_ASCII_INT.fullmatch(step_id)) and int(step_id) < SENTINEL_STEP_ID_MIN


# A process of an srun step is in the step's cgroup whatever its environment holds: cgroup v1
# ".../job_<id>/step_<n>/...", v2 ".../slurmstepd.scope/job_<id>/step_<n>/user/task_<t>".  The
# batch script is in step_batch, salloc's shell in step_interactive; without task/cgroup, or in
# a container with its own cgroup namespace, there is no such line: no sign either way.
_STEP_CGROUP = re.compile(r"/job_([0-9]+)/step_([0-9]+)(?:/|$)")


def slurm_step_of_cgroup(proc_cgroup: str) -> tuple[str, str] | None:
    """(job id, step id) of the srun step whose cgroup /proc/self/cgroup names, or None."""
    for line in proc_cgroup.splitlines():
        m = _STEP_CGROUP.search(line.split(":", 2)[-1])
        if m:
            return m[1], m[2]
    return None


def _check_slurm_variables_kept(environ: Mapping[str, str], proc_cgroup: str | None) -> None:
    """An srun task that lost every SLURM_* variable (``apptainer exec --cleanenv``, ``env -i``)
    would train alone as rank 0 of 1: say so instead."""
    if any(name.startswith("SLURM_") for name in environ):
        return
    if proc_cgroup is None:
        try:
            with open("/proc/self/cgroup") as f:
                proc_cgroup = f.read()
        except OSError:
            return
    found = slurm_step_of_cgroup(proc_cgroup)
    if found:
        raise LaunchError(
            f"this process runs in Slurm step {found[0]}.{found[1]} (/proc/self/cgroup) but has "
            f"no SLURM_* variable, so every task would train alone as rank 0 of 1: something "
            f"between srun and Python cleared the environment (apptainer/singularity exec "
            f"--cleanenv or --containall, env -i). Drop that option, or pass the variables in "
            f"(apptainer --env-file, APPTAINERENV_SLURM_PROCID=...); for a deliberate single "
            f"process set RANK=0 WORLD_SIZE=1."
        )


def _slurm_step(environ: Mapping[str, str]) -> _SlurmStep:
    fix = "Start the job step with srun inside an sbatch/salloc allocation."
    procid = _int_var(environ, "SLURM_PROCID", hint=fix)
    localid = _int_var(environ, "SLURM_LOCALID", hint=fix)
    nodeid = _int_var(environ, "SLURM_NODEID", hint=fix)

    def step_or_job(step_var: str, job_var: str) -> str:
        return step_var if step_var in environ else job_var

    ntasks_var = step_or_job("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    ntasks = _int_var(environ, ntasks_var, hint=fix, minimum=1)
    nodes_var = step_or_job("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
    if nodes_var not in environ:
        raise LaunchError(f"SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are not set. {fix}")
    hosts = expand_hostlist(environ[nodes_var], nodes_var)
    tpn_var = step_or_job("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if tpn_var in environ:
        tasks_per_node = parse_tasks_per_node(environ[tpn_var], tpn_var)
    elif len(hosts) == 1:
        tasks_per_node = [ntasks]
    else:
        raise LaunchError(f"SLURM_STEP_TASKS_PER_NODE is not set. {fix}")

    mixed = "the SLURM variables come from different steps."
    if len(tasks_per_node) != len(hosts):
        raise LaunchError(f"{tpn_var}={environ[tpn_var]!r} lists {len(tasks_per_node)} nodes "
                          f"but {nodes_var} has {len(hosts)}; {mixed}")  # fmt: skip
    if sum(tasks_per_node) != ntasks:
        raise LaunchError(f"{ntasks_var}={ntasks} but {tpn_var}={environ[tpn_var]!r} adds up "
                          f"to {sum(tasks_per_node)}; {mixed}")  # fmt: skip
    if not 0 <= nodeid < len(hosts):
        raise LaunchError(f"SLURM_NODEID={nodeid} but {nodes_var} has only {len(hosts)} nodes.")
    if not 0 <= procid < ntasks:
        raise LaunchError(f"SLURM_PROCID={procid} is not below {ntasks_var}={ntasks}.")
    if not 0 <= localid < tasks_per_node[nodeid]:
        raise LaunchError(f"SLURM_LOCALID={localid} is not below the {tasks_per_node[nodeid]} "
                          f"tasks that {tpn_var} gives node {nodeid}.")  # fmt: skip
    return _SlurmStep(procid, localid, nodeid, ntasks, hosts, tasks_per_node)


# --------------------------------------------------------------------------- the resolvers


def _double_spawn_error(step: _SlurmStep, inner: str, inner_count: int) -> LaunchError:
    return LaunchError(
        f"double spawn: srun started {step.tasks_on_this_node} tasks on this node "
        f"(SLURM_STEP_TASKS_PER_NODE) and {inner} starts {inner_count} processes inside each of "
        f"them. Use one of the two: either srun --ntasks-per-node=1 with the launcher starting "
        f"the per-node processes, or srun --ntasks-per-node=N running the script directly."
    )


def _from_torch_launcher(environ, argv, ancestors, step):
    launcher = _torch_launcher(environ, argv, ancestors)
    fix = (
        "torchrun sets RANK and WORLD_SIZE for every worker; set both or neither by hand "
        "(a WORLD_SIZE exported by a shell script hides SLURM's variables: unset it)."
    )
    rank = _int_var(environ, "RANK", hint=fix)
    world_size = _int_var(environ, "WORLD_SIZE", hint=fix, minimum=1)
    local_rank = _opt_int_var(environ, "LOCAL_RANK")
    local_world_size = _opt_int_var(environ, "LOCAL_WORLD_SIZE", minimum=1)
    node_rank = _opt_int_var(environ, "GROUP_RANK")
    num_nodes = _opt_int_var(environ, "GROUP_WORLD_SIZE", minimum=1)

    if launcher == "env" and step is not None:  # RANK/WORLD_SIZE by hand in each srun task
        if world_size != step.ntasks:
            raise LaunchError(
                f"WORLD_SIZE={world_size} but srun started SLURM_STEP_NUM_TASKS={step.ntasks} "
                f"tasks; unset WORLD_SIZE (common.env reads SLURM's variables) or make them agree."
            )
        local_rank = step.localid if local_rank is None else local_rank
        local_world_size = step.tasks_on_this_node if local_world_size is None else local_world_size
        node_rank = step.nodeid if node_rank is None else node_rank
        num_nodes = len(step.hosts) if num_nodes is None else num_nodes
    elif step is not None:
        # torchrun under srun: one agent per task, each starting its workers, so WORLD_SIZE
        # (workers) legitimately differs from SLURM_STEP_NUM_TASKS (agents).
        if step.tasks_on_this_node > 1 and (local_world_size or 1) > 1:
            raise _double_spawn_error(step, f"{launcher} (LOCAL_WORLD_SIZE)", local_world_size)
        if num_nodes is not None and num_nodes != step.ntasks:
            raise LaunchError(
                f"{launcher} runs with GROUP_WORLD_SIZE={num_nodes} nodes (--nnodes) but srun "
                f"started SLURM_STEP_NUM_TASKS={step.ntasks} agents; pass --nnodes="
                f"{step.ntasks} (one agent per srun task)."
            )

    if (local_rank is None) != (local_world_size is None):
        raise LaunchError("Only one of LOCAL_RANK and LOCAL_WORLD_SIZE is set; set both or "
                          "neither.")  # fmt: skip
    if local_rank is None:  # one node, as with two processes started by hand
        local_rank, local_world_size = rank, world_size
    if node_rank is None:
        node_rank = rank // local_world_size
    if num_nodes is None:
        num_nodes = -(-world_size // local_world_size)
    return launcher, rank, local_rank, world_size, local_world_size, node_rank, num_nodes


def resolve_launch_env(
    environ: Mapping[str, str] | None = None,
    *,
    spawn_index: int | None = None,
    spawn_nprocs: int | None = None,
    argv: Sequence[str] | None = None,
    check: bool = True,
    proc_cgroup: str | None = None,
) -> LaunchEnv:
    """This process's place in the job, from ``environ`` (default ``os.environ``).

    In an ``mp.spawn`` child pass ``spawn_index`` and ``spawn_nprocs`` (processes spawned per
    node).  ``argv`` (default ``sys.argv``) shows torch.distributed.launch's ``--local-rank``.
    ``check=False`` skips the checks against this machine (the master address resolves, the
    port is free).  ``proc_cgroup``: /proc/self/cgroup's text (read when ``environ`` is None).
    """
    launcher_vars = ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    if (environ is None or proc_cgroup is not None) and not any(
        v in (os.environ if environ is None else environ) for v in launcher_vars
    ):
        _check_slurm_variables_kept(os.environ if environ is None else environ, proc_cgroup)
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    step = _slurm_step(environ) if _in_srun_step(environ) else None
    job_id = environ.get("SLURM_JOB_ID")
    if job_id is not None:
        job_id = str(_parse_int(job_id, "SLURM_JOB_ID", minimum=1))
    if spawn_index is not None and spawn_nprocs is None:
        raise LaunchError("spawn_index given without spawn_nprocs (the nprocs passed to mp.spawn).")

    if any(v in environ for v in launcher_vars):
        if spawn_nprocs is not None and spawn_nprocs > 1:
            raise LaunchError(
                f"double spawn: RANK/WORLD_SIZE are already set (by torchrun or by hand) and "
                f"mp.spawn starts {spawn_nprocs} more processes; use torchrun --nproc-per-node "
                f"or mp.spawn, not both."
            )
        launcher, rank, local_rank, world_size, local_world_size, node_rank, num_nodes = (
            _from_torch_launcher(environ, argv, _ancestor_cmdlines(), step)
        )
    elif step is not None and spawn_nprocs is None:
        launcher, rank, local_rank, world_size = "slurm", step.procid, step.localid, step.ntasks
        local_world_size, node_rank = step.tasks_on_this_node, step.nodeid
        num_nodes = len(step.hosts)
    elif spawn_nprocs is not None:
        launcher = "mp.spawn"
        if spawn_nprocs < 1 or not 0 <= spawn_index < spawn_nprocs:
            raise LaunchError(
                f"spawn_index={spawn_index} must lie in 0..spawn_nprocs-1 (spawn_nprocs="
                f"{spawn_nprocs}); pass the index mp.spawn gives and the nprocs it was called with."
            )
        task, tasks, node_rank, num_nodes, local_base, tasks_here = 0, 1, 0, 1, 0, 1
        if step is not None:
            # mp.spawn inside each srun task (normally one per node): rank = task * nprocs + index
            if step.tasks_on_this_node > 1 and spawn_nprocs > 1:
                raise _double_spawn_error(step, "mp.spawn (nprocs)", spawn_nprocs)
            task, tasks, node_rank = step.procid, step.ntasks, step.nodeid
            num_nodes = len(step.hosts)
            local_base, tasks_here = step.localid, step.tasks_on_this_node
        local_rank = local_base * spawn_nprocs + spawn_index
        local_world_size = tasks_here * spawn_nprocs
        rank, world_size = task * spawn_nprocs + spawn_index, tasks * spawn_nprocs
    else:
        launcher, rank, local_rank, world_size, local_world_size, node_rank, num_nodes = (
            "single", 0, 0, 1, 1, 0, 1)  # fmt: skip

    _check_ranks(rank, world_size, local_rank, local_world_size, node_rank, num_nodes)
    _check_gpus_on_node(environ, local_world_size)
    env = LaunchEnv(
        rank=rank, local_rank=local_rank, world_size=world_size,
        local_world_size=local_world_size, node_rank=node_rank, num_nodes=num_nodes,
        master_addr=_master_addr(environ, step, num_nodes),
        master_port=_master_port(environ, job_id, world_size),
        launcher=launcher, hostname=socket.gethostname(), job_id=job_id,
    )  # fmt: skip
    if check:
        # Under torchrun the agents have already met before starting the workers, and
        # MASTER_ADDR is the agent's host as torchrun names it: the loopback check is for
        # addresses people set.  The agent also holds the port already.
        agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        check_master_addr(env if not agent_store else dataclasses.replace(env, num_nodes=1))
        if step is not None and launcher in ("slurm", "mp.spawn"):
            _check_rank0_here(env, environ, step.hosts)
        dist = sys.modules.get("torch.distributed")
        joined = dist is not None and dist.is_available() and dist.is_initialized()
        if env.rank == 0 and not agent_store and not joined:  # rank 0 will host the store
            check_port_free(env.master_port)
    return env


def _check_ranks(rank, world_size, local_rank, local_world_size, node_rank, num_nodes):
    if world_size < 1:
        raise LaunchError(f"WORLD_SIZE={world_size}: a job needs at least one process.")
    if not 0 <= rank < world_size:
        raise LaunchError(
            f"RANK={rank} is not below WORLD_SIZE={world_size}; ranks run from 0 to WORLD_SIZE-1."
        )
    if local_world_size < 1 or not 0 <= local_rank < local_world_size:
        raise LaunchError(
            f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}."
        )
    if local_world_size > world_size:
        raise LaunchError(
            f"LOCAL_WORLD_SIZE={local_world_size} is larger than WORLD_SIZE={world_size}."
        )
    if not 0 <= node_rank < num_nodes:
        raise LaunchError(
            f"node rank {node_rank} (GROUP_RANK/SLURM_NODEID) is not below {num_nodes}."
        )


def gpus_on_node(environ: Mapping[str, str] | None = None) -> int:
    """GPUs SLURM gave this node (SLURM_GPUS_ON_NODE); 0 when none or outside SLURM."""
    return _opt_int_var(os.environ if environ is None else environ, "SLURM_GPUS_ON_NODE") or 0


def _check_gpus_on_node(environ: Mapping[str, str], local_world_size: int) -> None:
    """More processes on a node than its GPUs: refused, CUDA or not.  On a GPU cluster two ranks
    would share a GPU; on bookkeeping GPUs the job would run with another world size (and
    global batch) than the one it is written for."""
    gpus = gpus_on_node(environ)
    if gpus and local_world_size > gpus:
        raise LaunchError(
            f"{local_world_size} processes on this node but SLURM gave it SLURM_GPUS_ON_NODE="
            f"{gpus} GPU(s): one process per GPU, so ask for --ntasks-per-node={gpus} (or "
            f"--nproc-per-node={gpus}) or for --gres=gpu:{local_world_size}."
        )


def _master_addr(environ, step, num_nodes) -> str:
    """MASTER_ADDR, else the first host of the srun step, else this machine: its SLURM node
    name (SLURMD_NODENAME, which a batch script can hand to other nodes), else 127.0.0.1."""
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    if step is not None or _arbitrary(environ):  # (the batch script of such a job: its steps)
        return _rank0_host(environ, step)
    if num_nodes == 1:
        return environ.get("SLURMD_NODENAME") or "127.0.0.1"
    raise LaunchError(
        f"MASTER_ADDR is not set and the job spans {num_nodes} nodes; export MASTER_ADDR=<host "
        f"of rank 0> (or start the job with srun, which names the hosts)."
    )


def _arbitrary(environ: Mapping[str, str]) -> bool:
    return environ.get("SLURM_DISTRIBUTION", "").split(":")[0] == "arbitrary"


def _rank0_host(environ: Mapping[str, str], step: _SlurmStep | None) -> str:
    """The node of the step's task 0, which hosts the rendezvous under ``env://``.

    srun's block, cyclic and plane distributions put task 0 on the first node of the step.
    ``--distribution=arbitrary`` places task i on the i-th host of the file SLURM_HOSTFILE names
    (srun(1)), so task 0 can be on any node: the file says which. (Slurm 26.05 with a topology
    plugin also orders tasks by topology; rank 0 checks where it really runs, in
    resolve_launch_env, and refuses there.)
    """
    if not _arbitrary(environ):
        return step.hosts[0]
    path = environ.get("SLURM_HOSTFILE", "")
    fix = "put the host file where every node can read it, or export MASTER_ADDR=<rank 0's node>"
    try:
        entries = Path(path).read_text().replace(",", " ").split() if path else []
    except OSError as exc:
        raise LaunchError(
            f"tasks are placed by --distribution=arbitrary, so rank 0 may run on any node, and "
            f"SLURM_HOSTFILE={path!r}, which says where, cannot be read here ({exc.strerror}): "
            f"{fix}."
        ) from None
    if not entries:
        raise LaunchError(
            f"tasks are placed by --distribution=arbitrary but SLURM_HOSTFILE={path!r} names no "
            f"host, so where rank 0 runs is unknown: {fix}."
        )
    return expand_hostlist(entries[0], "SLURM_HOSTFILE")[0]


def _check_rank0_here(env: LaunchEnv, environ: Mapping[str, str], hosts: Sequence[str]) -> None:
    """Rank 0 hosts the store at MASTER_ADDR: when that is another node of the step (picked
    from the step, or exported by the batch script, while the tasks ran in an order srun's
    variables do not show), every rank would wait at the wrong host until the timeout. Say so
    in seconds instead. (An address that is no node name of the step is left alone.)"""
    node = environ.get("SLURMD_NODENAME", "")
    if env.rank != 0 or not node or node == env.master_addr or env.master_addr not in hosts:
        return
    raise LaunchError(
        f"rank 0 runs on {node}, not on {env.master_addr}, the node every rank was told to meet "
        f"it at (tasks not in block order: SLURM_DISTRIBUTION="
        f"{environ.get('SLURM_DISTRIBUTION', '')!r}); start the step with --distribution=block, "
        f"or export MASTER_ADDR=<rank 0's node>."
    )


def _master_port(environ, job_id, world_size) -> int:
    """MASTER_PORT, else derived from SLURM_JOB_ID, else any free port for a job of one
    process (nobody has to agree on it), else torch's default."""
    if environ.get("MASTER_PORT"):
        port = _parse_int(environ["MASTER_PORT"], "MASTER_PORT", hint="Use a port 1024-65535.")
        if not 1 <= port <= 65535:
            raise LaunchError(f"MASTER_PORT={port} is outside 1-65535; use e.g. 29500.")
        return port
    if job_id:
        return master_port_for_job(job_id)
    return find_free_port() if world_size == 1 else DEFAULT_MASTER_PORT


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


# --------------------------------------------------------------------------- the set-up


def cuda_device_index(env: LaunchEnv, visible_gpus: int,
                      environ: Mapping[str, str] | None = None) -> int:  # fmt: skip
    """The ``N`` of ``cuda:N``: the local rank where each task sees all the node's GPUs (or one
    per local rank); 0 where it sees one of its own (``--gpus-per-task=1``, ``single:1``); its
    own set's devices in turn under ``--gpus-per-task=2``.  Tasks that share a set smaller than
    the node's (``--gpu-bind=closest``) are refused: which GPU is a task's depends on how srun
    spread the tasks over the sockets, cyclically by default (srun(1), ``--distribution``).  Two
    ranks on one GPU (``map_gpu:0,0``, too few GPUs) is a LaunchError too, before NCCL's
    "Duplicate GPU detected"."""
    environ = os.environ if environ is None else environ
    _check_gpu_map(environ, env.local_world_size)
    on_node = gpus_on_node(environ)
    if visible_gpus >= env.local_world_size:
        return env.local_rank
    if visible_gpus == 1 and on_node >= env.local_world_size:
        return 0
    if 1 < visible_gpus < on_node and on_node >= env.local_world_size:
        if environ.get("SLURM_GPUS_PER_TASK"):
            return env.local_rank % visible_gpus
        raise LaunchError(
            f"this task sees {visible_gpus} of the node's {on_node} GPUs (CUDA_VISIBLE_DEVICES="
            f"{environ.get('CUDA_VISIBLE_DEVICES')!r}, shared with other tasks: --gpu-bind="
            f"closest or SLURM_GPU_BIND={environ.get('SLURM_GPU_BIND', '')!r}), and which one "
            f"is its own depends on how srun spread the tasks over the sockets; give each task "
            f"one GPU: --gpu-bind=single:1 (keeps the closest) or --gpus-per-task=1."
        )
    raise LaunchError(
        f"{env.local_world_size} processes on this node (LOCAL_WORLD_SIZE) but only "
        f"{visible_gpus} visible GPUs (CUDA_VISIBLE_DEVICES="
        f"{environ.get('CUDA_VISIBLE_DEVICES')!r}, SLURM_GPUS_ON_NODE="
        f"{environ.get('SLURM_GPUS_ON_NODE')!r}): two ranks would share a GPU. Start one "
        f"process per GPU (--ntasks-per-node / --nproc-per-node) or ask for more GPUs "
        f"(--gpus-per-node)."
    )


def _check_gpu_map(environ: Mapping[str, str], local_world_size: int) -> None:
    """``--gpu-bind=map_gpu:0,0`` (SLURM_GPU_BIND) binds local task i to the i-th GPU listed."""
    bind = environ.get("SLURM_GPU_BIND", "")
    if "map_gpu:" not in bind:
        return
    listed = []
    for item in bind.rpartition("map_gpu:")[2].split(",")[: max(1, local_world_size)]:
        name, _, repeat = item.partition("*")  # map_gpu:0*2,1 repeats GPU 0 twice
        listed += [name] * (int(repeat) if repeat.isdigit() else 1)
    listed = listed[:local_world_size]
    for i, gpu in enumerate(listed):
        if gpu in listed[:i]:
            raise LaunchError(
                f"SLURM_GPU_BIND={bind!r} binds local tasks {listed.index(gpu)} and {i} to the "
                f"same GPU {gpu}: NCCL needs one GPU per rank. Give each task its own "
                f"(--gpus-per-task=1, or a map_gpu list without repeats)."
            )


NVIDIA_DEVICE_GLOB = "/dev/nvidia[0-9]*"  # NVIDIA's per-GPU device files, whatever torch thinks


def check_cuda_usable(environ: Mapping[str, str] | None = None,
                      nvidia_glob: str = NVIDIA_DEVICE_GLOB) -> None:  # fmt: skip
    """For a process that found no CUDA device: stop if SLURM gave this node GPUs that exist.

    A CPU-only torch, or a container started without its GPUs, would otherwise train on the CPU
    and "succeed" hours later.  Where SLURM's GPUs are bookkeeping only (the course's local
    cluster has no /dev/nvidia*), the process goes on with gloo on the CPU.
    """
    import glob

    import torch  # the caller has imported it already

    gpus = gpus_on_node(environ)
    devices = sorted(glob.glob(nvidia_glob)) if gpus else []
    if not devices:
        return
    if torch.version.cuda is None:
        why = (f"this is a CPU-only build of torch: install the CUDA build (pip install "
               f"torch=={torch.__version__.split('+')[0]} --index-url "
               f"https://download.pytorch.org/whl/cu<version>, see README.md).")  # fmt: skip
    else:
        why = ("inside a container, start it with its GPUs (apptainer --nv, enroot/pyxis with the "
               "NVIDIA hook); otherwise the driver is older than this CUDA build needs (nvidia-smi "
               "shows the driver's CUDA version): install a torch built for it.")  # fmt: skip
    raise LaunchError(
        f"SLURM gave this node {gpus} GPU(s) (SLURM_GPUS_ON_NODE) and it has {len(devices)} "
        f"NVIDIA device(s) ({devices[0]}...), but torch {torch.__version__} sees no CUDA device "
        f"(torch.version.cuda={torch.version.cuda}): {why}"
    )


# Launchers that start several workers inside one SLURM task: they share the task's CPUs.
_WORKER_LAUNCHERS = ("torchrun", "torch.distributed.launch", "mp.spawn")


def usable_cpus() -> tuple[int, bool]:
    """(CPUs this process may run on, whether that is the whole machine): the affinity mask,
    which SLURM narrows to the task's CPUs when it binds tasks; macOS has none."""
    total = os.cpu_count() or 1
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is None:
        return total, True
    mine = len(affinity(0))
    return mine, mine >= total


def process_cpus(env: LaunchEnv, environ: Mapping[str, str] | None = None,
                 cpus: tuple[int, bool] | None = None) -> int:  # fmt: skip
    """This process's share of its task's CPUs (at least 1): a launcher's workers share their
    task's set; where nothing is bound the node's processes share the machine; capped by
    SLURM_CPUS_PER_TASK.  Split between torch's threads and DataLoader workers (lesson 08)."""
    environ = os.environ if environ is None else environ
    mine, whole_machine = usable_cpus() if cpus is None else cpus
    per_task = env.local_world_size if env.launcher in _WORKER_LAUNCHERS else 1
    share = mine // (env.local_world_size if whole_machine else per_task)
    asked = _opt_int_var(environ, "SLURM_CPUS_PER_TASK", minimum=1)
    if asked:
        share = min(share, asked // per_task)
    return max(1, share)


def cpu_threads(env: LaunchEnv, environ: Mapping[str, str] | None = None,
                cpus: tuple[int, bool] | None = None) -> int:  # fmt: skip
    """Threads for ``torch.set_num_threads``: OMP_NUM_THREADS if set (torchrun sets 1), else
    :func:`process_cpus`; otherwise each process takes every core and they fight over them."""
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
    text = (os.environ if environ is None else environ).get(TIMEOUT_VAR)
    if text is None:
        return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise LaunchError(f"{TIMEOUT_VAR}={text!r} is not a positive number of seconds; "
                          f"set e.g. {TIMEOUT_VAR}=600 or unset it.")  # fmt: skip
    return datetime.timedelta(seconds=value)


def init_error_message(env: LaunchEnv, exc: BaseException) -> str:
    """One line, in place of torch's traceback, for a rank whose ``init_process_group`` failed
    (DistStoreError: the others did not come; DistNetworkError: rank 0's address did not answer)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if "Duplicate GPU detected" in text:
        return (f"rank {env.rank}: two ranks drive one GPU ({first}); give each task its own "
                f"GPU (--gpus-per-task=1) or start one process per GPU.")  # fmt: skip
    return (
        f"rank {env.rank}: could not join the process group at MASTER_ADDR={env.master_addr} "
        f"MASTER_PORT={env.master_port} ({first}). Check that all {env.world_size} processes "
        f"started and can reach that address (a longer wait: {TIMEOUT_VAR}=<seconds>)."
    )


if __name__ == "__main__":  # python -m common.env [--export]: the command line is common/env_cli.py
    from common.env_cli import main

    sys.exit(main(sys.argv[1:]))
