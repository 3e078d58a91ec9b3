"""Who am I in this job?  Rank, local rank, world size, node, and where rank 0 listens.

:func:`resolve_launch_env` asks, in this order: torchrun / torch.distributed.launch (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``PORT``;
set by hand: launcher "env"), srun (``SLURM_LOCALID``, ``SLURM_NODEID``, the step's
``SLURM_STEP_*``; ranks numbered node by node as torchrun does; also where pyxis copied
SLURM_PROCID/SLURM_LOCALID into RANK/LOCAL_RANK; a heterogeneous step's node by its name),
``mp.spawn`` (the caller passes the child's index and count), else one plain process.  What
would make the job hang later (a variable missing, malformed or disagreeing, a double spawn)
raises :class:`LaunchError` at once, naming the variable and the fix.  The end holds the
set-up every lesson calls (GPU, threads, timeout, error line).  Between them, the launch checks:
what would fail later against this machine (the address, the port, the GPUs, a cleared
environment) stops here in one line; lesson 06's preflight runs them too.  ``srun python -m
common.env``: each task's view (its command line is common/env_cli.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import ipaddress
import os
import platform
import re
import socket
import sys
from collections.abc import Mapping, Sequence

try:  # python-hostlist reads SLURM's host list syntax in full (requirements.txt installs it)
    import hostlist
except ImportError:  # container images (NGC, pyxis) ship torch and not our packages:
    hostlist = None  # _expand_hostlist below reads it there

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
    """This process's place in the job.  Where each field comes from, launcher by launcher:
    torchrun's variable / srun's variable / mp.spawn / a plain process."""

    rank: int  # RANK / _SlurmStep.rank_by_node / task by node * nprocs + index / 0
    local_rank: int  # LOCAL_RANK / SLURM_LOCALID / ... ; rank on this node, picks the GPU
    world_size: int  # WORLD_SIZE / SLURM_STEP_NUM_TASKS / tasks * nprocs / 1
    local_world_size: int  # LOCAL_WORLD_SIZE / SLURM_STEP_TASKS_PER_NODE[node] / ... / 1
    node_rank: int  # GROUP_RANK / SLURM_NODEID / SLURM_NODEID / 0
    num_nodes: int  # GROUP_WORLD_SIZE / hosts in SLURM_STEP_NODELIST / ... / 1
    master_addr: str  # MASTER_ADDR, else the step's first host (_master_addr)
    master_port: int  # MASTER_PORT, else derived from SLURM_JOB_ID (_master_port)
    launcher: str  # one of LAUNCHERS (_torch_launcher, _in_srun_step)
    hostname: str
    job_id: str | None  # SLURM_JOB_ID, or None outside SLURM

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _parse_int(text: str, name: str, *, hint: str = "", minimum: int = 0) -> int:
    """A whole number >= ``minimum`` in ASCII digits, else a LaunchError naming ``name``."""
    value = text.strip()
    if not _ASCII_INT.fullmatch(value):
        raise LaunchError(f"{name}={text!r} is not a whole number (ASCII digits 0-9 only). "
                          f"{hint}".strip())  # fmt: skip
    if int(value) < minimum:
        raise LaunchError(f"{name}={int(value)} must be at least {minimum}. {hint}".strip())
    return int(value)


def _int_var(environ: Mapping[str, str], name: str, *, hint: str = "", minimum: int = 0) -> int:
    if name not in environ:
        raise LaunchError(f"{name} is not set. {hint}".strip())
    return _parse_int(environ[name], name, hint=hint, minimum=minimum)


def _opt_int_var(environ, name: str, *, hint: str = "", minimum: int = 0) -> int | None:
    return _int_var(environ, name, hint=hint, minimum=minimum) if name in environ else None


def expand_hostlist(text: str, variable: str = "host list") -> list[str]:
    """``gpu[01-03,07],cpu5`` -> its host names (zero padding kept); ``variable`` is named in
    the error.  python-hostlist where installed, else :func:`_expand_hostlist`."""
    try:
        hosts = (hostlist.expand_hostlist if hostlist else _expand_hostlist)(text)
    except RecursionError:  # python-hostlist recurses once per bracket group
        raise LaunchError(f"{variable} has too many bracket groups to be a host list "
                          f"({text[:40]!r}...)") from None  # fmt: skip
    except (ValueError, getattr(hostlist, "BadHostlist", ValueError)) as exc:
        raise LaunchError(f"{variable}={text!r} is not a valid host list ({exc}); expected e.g. "
                          f"'node[1-2],gpu05'") from None  # fmt: skip
    if not hosts:
        raise LaunchError(f"{variable} is empty; expected a host list such as 'node[1-2]'")
    return hosts


def _expand_hostlist(text: str) -> list[str]:
    """SLURM's host list syntax where python-hostlist is not installed (container images: NGC,
    pyxis; tests/test_env_input.py checks that the two agree): comma-separated names, each the
    product of its ``[ranges]`` groups; ValueError where python-hostlist raises BadHostlist."""
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
            raise LaunchError(f"{variable}={text!r} is not a SLURM task count list; expected "
                              f"e.g. '2(x3),1'")  # fmt: skip
        if len(counts) + int(match[2] or 1) > MAX_HOSTS:
            raise LaunchError(f"{variable}={text!r} counts more than {MAX_HOSTS} nodes.")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def master_port_for_job(job_id: int | str) -> int:
    """The same port on every task of a job, another for each job running beside it (ids
    15000 apart aside); an array's tasks have ids of their own (job 36's task 3 + 3 = job 39)."""
    return MASTER_PORT_BASE + _parse_int(str(job_id), "SLURM_JOB_ID", minimum=1) % MASTER_PORT_SPAN


def find_free_port() -> int:
    """A port that is free right now (for a parent about to start its children)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _torch_launcher(environ, argv: Sequence[str], ancestors: Sequence[str] | None = None) -> str:
    """torchrun and torch.distributed.launch set the same variables; the latter passes
    ``--local-rank=N`` unless ``--use-env``, and then only its agent's command line tells
    (``ancestors``, else /proc: :func:`agent_launcher`).  No agent: "env"."""
    if any(a.startswith(("--local-rank", "--local_rank")) for a in argv[1:]):
        return "torch.distributed.launch"
    if "TORCHELASTIC_RUN_ID" not in environ:
        return "env"
    return agent_launcher(ancestors) or "torchrun"


def _in_srun_step(environ: Mapping[str, str]) -> bool:
    """True in a task started by srun.  The batch script also has SLURM_PROCID=0 and job-wide
    counts (SLURM_NTASKS=4) but is one process: a task has a step id below the sentinels or,
    with no step id at all, the step description only srun sets (SLURM_STEP_NUM_TASKS)."""
    if "SLURM_PROCID" not in environ:
        return False
    step_id = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    if step_id is None:
        return "SLURM_STEP_NUM_TASKS" in environ
    if _SENTINEL_STEP_ID.fullmatch(step_id.strip()):  # "-5": the batch script (26.05's "%d")
        return False
    return bool(_ASCII_INT.fullmatch(step_id.strip())) and int(step_id) < SENTINEL_STEP_ID_MIN


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

    @property
    def rank_by_node(self) -> int:
        """The rank counted node by node in the step's host list, as torchrun numbers its
        workers: rank 0 runs on the first host, which every task names as MASTER_ADDR.
        SLURM_PROCID is this only under srun's default block distribution: cyclic and plane
        deal tasks across nodes, arbitrary follows SLURM_HOSTFILE, and from Slurm 26.05 a
        topology plugin orders nodes by switch (srun(1) ``--distribution``)."""
        return sum(self.tasks_per_node[: self.nodeid]) + self.localid


def _slurm_step(environ: Mapping[str, str]) -> _SlurmStep:
    fix = "Start the job step with srun inside an sbatch/salloc allocation."
    procid, localid, nodeid = (_int_var(environ, f"SLURM_{v}", hint=fix)
                               for v in ("PROCID", "LOCALID", "NODEID"))  # fmt: skip
    ntasks_var, nodes_var, tpn_var = (s if s in environ else j for s, j in (
        ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"),
        ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")))  # fmt: skip
    ntasks = _int_var(environ, ntasks_var, hint=fix, minimum=1)
    if nodes_var not in environ:
        raise LaunchError(f"SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are not set. {fix}")
    hosts = expand_hostlist(environ[nodes_var], nodes_var)
    if tpn_var in environ:
        tasks_per_node = parse_tasks_per_node(environ[tpn_var], tpn_var)
    elif len(hosts) == 1:
        tasks_per_node = [ntasks]
    else:
        raise LaunchError(f"SLURM_STEP_TASKS_PER_NODE is not set. {fix}")

    nodeid = _node_index(environ, hosts, nodeid)
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


def _node_index(environ: Mapping[str, str], hosts: list[str], nodeid: int) -> int:
    """This node's place in the step's host list: SLURM_NODEID, except in a heterogeneous step
    (``srun A : B``, ``srun --het-group=0,1``).  There slurmstepd sets SLURM_NODEID to the
    component's node offset plus the node's index in its component (exec_task,
    src/slurmd/slurmstepd/task.c), while srun sorts the combined host list and the task counts
    by name (_reorder_het_job_recs, src/srun/srun.c; Slurm 22.05 to 26.05), so the two disagree
    when a later component has the lower node names.  The node's name (SLURMD_NODENAME) then
    says where it is in that list; in any other step it names SLURM_NODEID's host."""
    node = environ.get("SLURMD_NODENAME", "")
    return hosts.index(node) if node in hosts else nodeid


def _double_spawn_error(step: _SlurmStep, inner: str, inner_count: int) -> LaunchError:
    # Lesson 00: in a job of 2 tasks per node, srun --ntasks-per-node=1 alone still starts 2
    # tasks per node (the job's task count wins); with --ntasks=$SLURM_NNODES, one.
    return LaunchError(f"double spawn: srun started {step.tasks_on_this_node} tasks on this node "
                       f"(SLURM_STEP_TASKS_PER_NODE) and {inner} starts {inner_count} processes "
                       f"inside each of them. Use one of the two: either srun --ntasks="
                       f"$SLURM_NNODES --ntasks-per-node=1 with the launcher starting the "
                       f"per-node processes, or srun --ntasks-per-node=N running the script "
                       f"directly.")  # fmt: skip


def _set_by_pyxis(environ: Mapping[str, str], argv: Sequence[str], step: _SlurmStep | None) -> bool:
    """RANK and LOCAL_RANK as pyxis sets them in every task of ``srun --container-image`` with
    an image that defines PYTORCH_VERSION (every NGC PyTorch image): SLURM_PROCID and
    SLURM_LOCALID, over whatever the task had (pyxis_slurmstepd.c, slurm_spank_task_init ->
    pytorch_setup, pytorch_remap_list).  enroot's optional hook 50-slurm-pytorch.sh adds
    WORLD_SIZE=SLURM_NTASKS, MASTER_ADDR (the step's first host) and MASTER_PORT.  No agent
    started this process, so these are srun's own numbers under other names, and the task is
    read as srun's: ranks node by node, since SLURM_PROCID puts rank 0 wherever srun placed
    task 0, not always on the first host, where MASTER_ADDR points (_SlurmStep.rank_by_node)."""
    if step is None or "TORCHELASTIC_RUN_ID" in environ or _torch_launcher(environ, argv) != "env":
        return False
    if any(v in environ for v in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")):
        return False  # set by hand, with more than pyxis knows
    return (environ.get("RANK", "").strip() == str(step.procid)
            and environ.get("LOCAL_RANK", "").strip() == str(step.localid)
            and environ.get("WORLD_SIZE", str(step.ntasks)).strip() == str(step.ntasks))


def _from_torch_launcher(environ, argv, step):
    launcher = _torch_launcher(environ, argv)
    fix = ("torchrun sets RANK and WORLD_SIZE for every worker; set both or neither by hand "
           "(a WORLD_SIZE exported by a shell script hides SLURM's variables: unset it).")
    if launcher == "env" and step is not None:  # an srun task, where pyxis may have set them
        fix = (f"In this srun task RANK={environ.get('RANK', '<not set>')} and LOCAL_RANK="
               f"{environ.get('LOCAL_RANK', '<not set>')} are not SLURM_PROCID={step.procid} and "
               f"SLURM_LOCALID={step.localid}, as pyxis sets them (srun --container-image with "
               f"an image that defines PYTORCH_VERSION), which common.env reads as srun's own: "
               f"unset RANK, LOCAL_RANK and WORLD_SIZE before srun, or set all three by hand.")
    rank = _int_var(environ, "RANK", hint=fix)
    world_size = _int_var(environ, "WORLD_SIZE", hint=fix, minimum=1)
    local_rank = _opt_int_var(environ, "LOCAL_RANK")
    local_world_size = _opt_int_var(environ, "LOCAL_WORLD_SIZE", minimum=1)
    node_rank = _opt_int_var(environ, "GROUP_RANK")
    num_nodes = _opt_int_var(environ, "GROUP_WORLD_SIZE", minimum=1)

    if launcher == "env" and step is not None:  # RANK/WORLD_SIZE by hand in each srun task
        if world_size != step.ntasks:
            raise LaunchError(f"WORLD_SIZE={world_size} but srun started SLURM_STEP_NUM_TASKS="
                              f"{step.ntasks} tasks; unset WORLD_SIZE (common.env reads SLURM's "
                              f"variables) or make them agree (enroot's pyxis hook "
                              f"50-slurm-pytorch.sh sets it to SLURM_NTASKS: no srun "
                              f"--preserve-env there).")  # fmt: skip
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
            raise LaunchError(f"{launcher} runs with GROUP_WORLD_SIZE={num_nodes} nodes (--nnodes)"
                              f" but srun started SLURM_STEP_NUM_TASKS={step.ntasks} agents; pass "
                              f"--nnodes={step.ntasks} (one agent per srun task).")  # fmt: skip

    if (local_rank is None) != (local_world_size is None):
        raise LaunchError("Only one of LOCAL_RANK and LOCAL_WORLD_SIZE is set; set both or "
                          "neither.")  # fmt: skip
    if local_rank is None:  # one node, as with two processes started by hand
        local_rank, local_world_size = rank, world_size
    node_rank = rank // local_world_size if node_rank is None else node_rank
    num_nodes = -(-world_size // local_world_size) if num_nodes is None else num_nodes
    return launcher, rank, local_rank, world_size, local_world_size, node_rank, num_nodes


def _from_spawn(step, spawn_index, spawn_nprocs):
    if spawn_nprocs < 1 or not 0 <= spawn_index < spawn_nprocs:
        raise LaunchError(f"spawn_index={spawn_index} must lie in 0..spawn_nprocs-1 (spawn_nprocs="
                          f"{spawn_nprocs}); pass the index mp.spawn gives and the nprocs it was "
                          f"called with.")  # fmt: skip
    if step is None:
        return "mp.spawn", spawn_index, spawn_index, spawn_nprocs, spawn_nprocs, 0, 1
    # mp.spawn inside each srun task (normally one per node): rank = task * nprocs + index
    if step.tasks_on_this_node > 1 and spawn_nprocs > 1:
        raise _double_spawn_error(step, "mp.spawn (nprocs)", spawn_nprocs)
    return ("mp.spawn", step.rank_by_node * spawn_nprocs + spawn_index,
            step.localid * spawn_nprocs + spawn_index, step.ntasks * spawn_nprocs,
            step.tasks_on_this_node * spawn_nprocs, step.nodeid, len(step.hosts))  # fmt: skip


def resolve_launch_env(environ: Mapping[str, str] | None = None, *, spawn_index: int | None = None,
                       spawn_nprocs: int | None = None, argv: Sequence[str] | None = None,
                       check: bool = True, proc_cgroup: str | None = None) -> LaunchEnv:
    """This process's place in the job, from ``environ`` (default ``os.environ``).  An
    ``mp.spawn`` child passes ``spawn_index`` and ``spawn_nprocs`` (processes per node);
    ``argv`` (default ``sys.argv``) shows torch.distributed.launch's ``--local-rank``;
    ``check=False`` skips the checks of this machine (:func:`check_launch`: the address
    resolves, rank 0 runs there, the port is free); ``proc_cgroup`` (/proc/self/cgroup's text,
    read when ``environ`` is None) shows whether an srun task lost its SLURM_* variables."""
    if environ is None or proc_cgroup is not None:  # an srun task's variables
        check_slurm_variables_kept(os.environ if environ is None else environ, proc_cgroup)
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    step = _slurm_step(environ) if _in_srun_step(environ) else None
    job_id = environ.get("SLURM_JOB_ID")
    if job_id is not None:
        job_id = str(_parse_int(job_id, "SLURM_JOB_ID", minimum=1))
    if spawn_index is not None and spawn_nprocs is None:
        raise LaunchError("spawn_index given without spawn_nprocs (the nprocs passed to mp.spawn).")

    by_launcher = any(v in environ for v in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"))
    if by_launcher and not _set_by_pyxis(environ, argv, step):
        if spawn_nprocs is not None and spawn_nprocs > 1:
            raise LaunchError(f"double spawn: RANK/WORLD_SIZE are already set (by torchrun or by "
                              f"hand) and mp.spawn starts {spawn_nprocs} more processes; use "
                              f"torchrun --nproc-per-node or mp.spawn, not both.")  # fmt: skip
        found = _from_torch_launcher(environ, argv, step)
    elif step is not None and spawn_nprocs is None:
        found = ("slurm", step.rank_by_node, step.localid, step.ntasks, step.tasks_on_this_node,
                 step.nodeid, len(step.hosts))  # fmt: skip
    elif spawn_nprocs is not None:
        found = _from_spawn(step, spawn_index, spawn_nprocs)
    else:
        found = ("single", 0, 0, 1, 1, 0, 1)
    launcher, rank, local_rank, world_size, local_world_size, node_rank, num_nodes = found

    _check_ranks(rank, world_size, local_rank, local_world_size, node_rank, num_nodes)
    gpus = gpus_on_node(environ)  # more ranks than GPUs: they would share one, or on the CPU
    if gpus and local_world_size > gpus:  # run another world size than the job asked for
        raise LaunchError(f"{local_world_size} processes on this node but SLURM gave it "
                          f"SLURM_GPUS_ON_NODE={gpus} GPU(s): one process per GPU, so ask for "
                          f"--ntasks-per-node={gpus} (or --nproc-per-node={gpus}) or for "
                          f"--gres=gpu:{local_world_size}.")  # fmt: skip
    env = LaunchEnv(
        rank=rank, local_rank=local_rank, world_size=world_size,
        local_world_size=local_world_size, node_rank=node_rank, num_nodes=num_nodes,
        master_addr=_master_addr(environ, step, num_nodes),
        master_port=_master_port(environ, job_id, world_size),
        launcher=launcher, hostname=socket.gethostname(), job_id=job_id,
    )  # fmt: skip
    if check:
        check_launch(env, environ, step.hosts if step else None)
    return env


def _check_ranks(rank, world_size, local_rank, local_world_size, node_rank, num_nodes):
    if not 0 <= rank < world_size:
        raise LaunchError(f"RANK={rank} is not below WORLD_SIZE={world_size}; ranks run from 0 "
                          f"to WORLD_SIZE-1.")  # fmt: skip
    if local_world_size < 1 or not 0 <= local_rank < local_world_size:
        raise LaunchError(f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE="
                          f"{local_world_size}.")  # fmt: skip
    if local_world_size > world_size:
        raise LaunchError(f"LOCAL_WORLD_SIZE={local_world_size} is larger than WORLD_SIZE="
                          f"{world_size}.")  # fmt: skip
    if not 0 <= node_rank < num_nodes:
        raise LaunchError(f"node rank {node_rank} (GROUP_RANK/SLURM_NODEID) is not below "
                          f"{num_nodes}.")  # fmt: skip


def gpus_on_node(environ: Mapping[str, str] | None = None) -> int:
    """GPUs SLURM gave this node (SLURM_GPUS_ON_NODE); 0 when none or outside SLURM."""
    return _opt_int_var(os.environ if environ is None else environ, "SLURM_GPUS_ON_NODE") or 0


def _master_addr(environ, step, num_nodes) -> str:
    """MASTER_ADDR, else the first host of the srun step (where rank 0 runs: rank_by_node),
    else this machine: its SLURM node name (SLURMD_NODENAME, which a batch script can hand to
    other nodes), else 127.0.0.1."""
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    if step is not None:
        return step.hosts[0]
    if num_nodes == 1:
        return environ.get("SLURMD_NODENAME") or "127.0.0.1"
    raise LaunchError(f"MASTER_ADDR is not set and the job spans {num_nodes} nodes; export "
                      f"MASTER_ADDR=<host of rank 0> (or start the job with srun, which names "
                      f"the hosts).")  # fmt: skip


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


# --------------------------------------------------------------------------- launch checks
# Checks of this machine and of the job's shape that turn a later hang, or a run on the wrong
# device, into one line now: resolve_launch_env (check=True) and the set-up below call them;
# lesson 06's preflight (common/preflight/) runs them too.


def check_launch(env: LaunchEnv, environ: Mapping[str, str], step_hosts: Sequence[str] | None):
    """What resolve_launch_env(check=True) checks against this machine, in this order."""
    # Under torchrun the agents have already met before starting the workers, and
    # MASTER_ADDR is the agent's host as torchrun names it: the loopback check is for
    # addresses people set.  The agent also holds the port already.
    agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    check_master_addr(env if not agent_store else dataclasses.replace(env, num_nodes=1))
    if step_hosts is not None and env.launcher in ("slurm", "mp.spawn"):
        check_rank0_here(env, environ, step_hosts)
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


def ancestor_cmdlines(depth: int = 3) -> list[str]:
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


def agent_launcher(ancestors: Sequence[str] | None = None) -> str | None:
    """For a worker of a torch agent (``_torch_launcher``): "torch.distributed.launch" when
    ``python -m torch.distributed.launch`` shows in the nearest agent's command line (it hides
    behind ``--use-env`` otherwise), "torchrun" for torchrun or torch.distributed.run, None when
    neither shows.  ``ancestors``: the parents' command lines, nearest first (default /proc)."""
    for cmdline in ancestor_cmdlines() if ancestors is None else ancestors:
        program = cmdline.split()[:3]  # "python -m torch.distributed.launch", ".../bin/torchrun"
        if "torch.distributed.launch" in program:
            return "torch.distributed.launch"
        if "torch.distributed.run" in program or "torchrun" in map(os.path.basename, program):
            return "torchrun"
    return None


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


def check_gpu_map(environ: Mapping[str, str], local_world_size: int) -> None:
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


def gpu_sharing_error(env: LaunchEnv, visible_gpus: int, on_node: int,
                      environ: Mapping[str, str]) -> LaunchError:  # fmt: skip
    """What cuda_device_index raises where no GPU is this task's own: tasks that
    share a set smaller than the node's (``--gpu-bind=closest``: which GPU is a task's depends
    on how srun spread the tasks over the sockets, cyclically by default, srun(1)
    ``--distribution``), or fewer GPUs than tasks (before NCCL's "Duplicate GPU detected")."""
    if 1 < visible_gpus < on_node and on_node >= env.local_world_size:
        return LaunchError(
            f"this task sees {visible_gpus} of the node's {on_node} GPUs (CUDA_VISIBLE_DEVICES="
            f"{environ.get('CUDA_VISIBLE_DEVICES')!r}, shared with other tasks: --gpu-bind="
            f"closest or SLURM_GPU_BIND={environ.get('SLURM_GPU_BIND', '')!r}), and which one "
            f"is its own depends on how srun spread the tasks over the sockets; give each task "
            f"one GPU: --gpu-bind=single:1 (keeps the closest) or --gpus-per-task=1."
        )
    return LaunchError(
        f"{env.local_world_size} processes on this node (LOCAL_WORLD_SIZE) but only "
        f"{visible_gpus} visible GPUs (CUDA_VISIBLE_DEVICES="
        f"{environ.get('CUDA_VISIBLE_DEVICES')!r}, SLURM_GPUS_ON_NODE="
        f"{environ.get('SLURM_GPUS_ON_NODE')!r}): two ranks would share a GPU. Start one "
        f"process per GPU (--ntasks-per-node / --nproc-per-node) or ask for more GPUs "
        f"(--gpus-per-node)."
    )


NVIDIA_DEVICE_GLOB = "/dev/nvidia[0-9]*"  # NVIDIA's per-GPU device files, whatever torch thinks


def check_cuda_usable(environ: Mapping[str, str] | None = None,
                      nvidia_glob: str | None = None) -> None:  # fmt: skip
    """For a process that found no CUDA device: stop if SLURM gave this node GPUs that exist
    (``nvidia_glob``, default :data:`NVIDIA_DEVICE_GLOB`).

    A CPU-only torch, or a container started without its GPUs, would otherwise train on the CPU
    and "succeed" hours later.  Where SLURM's GPUs are bookkeeping only (the course's local
    cluster has no /dev/nvidia*), the process goes on with gloo on the CPU.
    """
    import glob

    import torch  # the caller has imported it already

    environ = os.environ if environ is None else environ
    gpus = gpus_on_node(environ)
    devices = sorted(glob.glob(nvidia_glob or NVIDIA_DEVICE_GLOB)) if gpus else []
    if not devices:
        return
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if torch.version.cuda is not None and visible is not None and not visible.strip():
        raise LaunchError(
            f"SLURM gave this node {gpus} GPU(s) (SLURM_GPUS_ON_NODE) but this task's "
            f"CUDA_VISIBLE_DEVICES is empty, so torch sees none: the task was given no GPU (its "
            f"srun step asked for none, or the script emptied it). Ask srun for them "
            f"(--gpus-per-task=1, --gres=gpu:N), or do not set CUDA_VISIBLE_DEVICES=''.")
    if torch.version.cuda is None:
        fix = cpu_build_fix(torch.__version__, _installed("torchvision"), platform.machine())
        why = f"this is a CPU-only build of torch: install a CUDA build over it: {fix}"
    else:
        why = ("inside a container, start it with its GPUs (apptainer --nv, enroot/pyxis with the "
               "NVIDIA hook; a Charliecloud image needs the driver's libraries copied in once: "
               "ch-fromhost --nvidia <image>); otherwise the driver is older than this CUDA build "
               "needs (nvidia-smi shows the driver's CUDA version): install a torch built for "
               "it.")  # fmt: skip
    raise LaunchError(
        f"SLURM gave this node {gpus} GPU(s) (SLURM_GPUS_ON_NODE) and it has {len(devices)} "
        f"NVIDIA device(s) ({devices[0]}...), but torch {torch.__version__} sees no CUDA device "
        f"(torch.version.cuda={torch.version.cuda}): {why}"
    )


# The CUDA builds of torch 2.14 on download.pytorch.org, per host architecture: (index tag,
# oldest driver branch, compute capabilities it has kernels for, as 10 * major + minor).  The
# capabilities are torch 2.14.1's own table (PYTORCH_RELEASES_CODE_CC in torch/cuda/__init__.py,
# "kept in sync with .ci/manywheel/build_cuda.sh") and its release matrix (pytorch/pytorch#190355:
# CUDA 12.6 "Legacy" for Maxwell, Pascal, Volta; 13.0 and 13.2 from Turing on).  The drivers are
# NVIDIA's minor version compatibility (CUDA Compatibility guide, table 1): CUDA 12.x runs on
# driver 525 or newer, 13.x on 580 or newer.  2.15 drops the 12.6 build (pytorch/pytorch#190385).
TORCH_CUDA_BUILDS_RELEASE = "2.14"
TORCH_CUDA_BUILDS = {
    "x86_64": (("cu126", 525, (50, 60, 70, 75, 80, 86, 90)),
               ("cu130", 580, (75, 80, 86, 90, 100, 120))),
    "aarch64": (("cu126", 525, (80, 90)),
                ("cu130", 580, (80, 90, 100, 110, 120))),
}  # fmt: skip


def _installed(name: str) -> str | None:
    """The version of the installed distribution ``name``, None if it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def cuda_build_install(tag: str, torch_version: str, torchvision: str | None = None,
                       python: str | None = None) -> str:  # fmt: skip
    """The command that puts torch's ``tag`` build (cu126) into this Python's environment
    (``python``, default this interpreter), each version pinned with its label:
    torch==2.14.1+cu126.  A plain ==2.14.1 does nothing there, since the 2.14.1 already installed
    (PyPI's, or a +cpu build) satisfies it ("Requirement already satisfied"), and
    --force-reinstall would download every nvidia-* package of the build too."""
    pins = [f"torch=={torch_version.split('+')[0]}+{tag}"]
    if torchvision:
        pins.append(f"torchvision=={torchvision.split('+')[0]}+{tag}")
    return (f"{python or sys.executable} -m pip install {' '.join(pins)} --index-url "
            f"https://download.pytorch.org/whl/{tag}")


def cpu_build_fix(torch_version: str, torchvision: str | None, machine: str,
                  python: str | None = None) -> str:  # fmt: skip
    """What check_cuda_usable tells a CPU-only build of torch (2.14.1+cpu) to install: the CUDA
    builds of its release for this host (:data:`TORCH_CUDA_BUILDS`), newest first."""
    base = torch_version.split("+")[0]
    if ".".join(base.split(".")[:2]) != TORCH_CUDA_BUILDS_RELEASE:
        return (f"torch=={base}+cu<version> with --index-url https://download.pytorch.org/whl/"
                f"cu<version>, the label pinned (pytorch.org's install selector lists the "
                f"builds).")  # fmt: skip
    table = TORCH_CUDA_BUILDS.get(machine, TORCH_CUDA_BUILDS["x86_64"])
    (old, old_driver, old_codes), (new, driver, codes) = table[0], table[-1]
    return (f"{cuda_build_install(new, torch_version, torchvision, python)} (driver {driver} or "
            f"newer, sm_{codes[0]} to sm_{codes[-1]}; for an older driver or GPU the same with "
            f"{old}, driver {old_driver}, sm_{old_codes[0]} to sm_{old_codes[-1]}: README.md, "
            f"\"On a real cluster\").")


# Integrated GPUs (Jetson 5.3, 6.2, 7.2, 8.7; Thor 10.1, renamed 11.0): a discrete GPU's cubin of
# the same major does not run there, nor theirs elsewhere (torch's DEVICE_REQUIREMENT).  From CUDA
# 13.2 on, sm_70/80/86 cubins run on Jetson too (DEVICE_REQUIREMENT_POST_JETSON_SBSA_UNIFICATION).
_INTEGRATED_GPUS = frozenset({53, 62, 72, 87, 101, 110})


def arch_runs_on(arch: str, capability: int, cuda: tuple[int, ...] = (13, 0)) -> bool:
    """Whether code built for ``arch`` (an entry of ``torch.cuda.get_arch_list()``: ``sm_86``,
    ``sm_90a``, ``compute_120``) runs on a GPU of ``capability`` (10 * major + minor) under CUDA
    ``cuda``.  torch's own rule (torch/cuda/__init__.py in 2.14: ``_check_capability`` through
    ``_code_compatible_with_device`` and ``DEVICE_REQUIREMENT``): a cubin ``sm_XY`` runs on the
    same major at minor Y or above (sm_86 on 8.9, not on 9.0 nor 7.5); an ``a`` cubin (sm_90a) on
    that capability only.  torch treats ``compute_XY`` like ``sm_XY``; it is PTX, which the driver
    compiles for any newer GPU, majors included (CUDA C++ Programming Guide, "Binary
    Compatibility" and "PTX Compatibility"), so here it runs on XY and above."""
    match = re.fullmatch(r"(sm|compute)_(\d+)([af]?)", arch)
    if not match:
        return False
    code, suffix = int(match[2]), match[3]
    if suffix == "a":  # arch-specific features: neither forward nor family compatible
        return capability == code
    if match[1] == "compute":
        return capability >= code
    if {code, capability} == {101, 110}:
        return True
    if code in _INTEGRATED_GPUS:
        return capability == code
    if capability in _INTEGRATED_GPUS and not (cuda >= (13, 2) and code in (70, 80, 86)):
        return False
    return capability // 10 == code // 10 and capability >= code


def _cuda_tuple(version: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version or "")[:2])


def cuda_arch_error(name: str, capability: tuple[int, int], arch_list: Sequence[str], *,
                    torch_version: str, cuda: str | None, machine: str = "x86_64",
                    torchvision: str | None = None, index: int = 0,
                    python: str | None = None) -> str | None:  # fmt: skip
    """The one line that stops a rank whose GPU this torch has no kernels for, else None.  Its
    inputs are what torch reports (``get_device_name``, ``get_device_capability``,
    ``get_arch_list``, ``__version__``, ``version.cuda``), so every GPU can be tried without one.
    As torch does, a build with no CUDA or an empty arch list (ROCm, some source builds) passes."""
    if cuda is None or not arch_list:
        return None
    cc = capability[0] * 10 + capability[1]
    if any(arch_runs_on(arch, cc, _cuda_tuple(cuda)) for arch in arch_list):
        return None
    base = torch_version.split("+")[0]
    release = ".".join(base.split(".")[:2])
    table = TORCH_CUDA_BUILDS.get(machine, TORCH_CUDA_BUILDS["x86_64"])
    builds = [(tag, driver, codes) for tag, driver, codes in table
              if any(arch_runs_on(f"sm_{code}", cc) for code in codes)]  # fmt: skip
    if release != TORCH_CUDA_BUILDS_RELEASE:
        fix = (f"install a build of torch {base} that has sm_{cc} kernels (pytorch.org's install "
               f"selector lists each release's CUDA builds), or run on another GPU partition.")
    elif builds:
        tag, driver, codes = builds[0]
        runs = " ".join(f"sm_{c}" for c in codes if arch_runs_on(f"sm_{c}", cc))
        command = cuda_build_install(tag, base, torchvision, python)
        fix = (f"install the {tag} build of torch {release}, which has {runs} kernels and "
               f"needs driver {driver} or newer: {command} (README.md, \"On a real cluster\").")
    else:
        spans = ", ".join(f"{tag}: sm_{codes[0]} to sm_{codes[-1]}" for tag, _, codes in table)
        fix = (f"no CUDA build of torch {release} has kernels for it ({spans}): use an older "
               f"torch release, or another GPU partition.")
    return (f"GPU {index} ({name}) has compute capability {capability[0]}.{capability[1]} "
            f"(sm_{cc}), which torch {torch_version} cannot run: it was built for "
            f"{' '.join(arch_list)} (torch.cuda.get_arch_list()), so its first kernel or NCCL "
            f"call would fail with \"no kernel image is available\"; {fix}")  # fmt: skip


def check_cuda_arch(index: int) -> None:
    """Before ``torch.cuda.set_device``: stop in one line if this process's GPU is one the
    installed torch has no kernels for (a V100 under the CUDA 13 wheel).  torch itself only warns
    there (``_check_capability``, several lines at CUDA's first use), and every rank then dies at
    its first kernel or NCCL call.  Called by ``cuda_device_index``."""
    import warnings

    import torch  # the caller has imported it already

    if torch.version.cuda is None or not torch.cuda.is_available():
        return
    if not 0 <= index < torch.cuda.device_count():
        return  # two ranks on one GPU and the like: cuda_device_index's own refusals say it
    # The first call that needs CUDA initialised runs torch's queued checks, whose warning would
    # come before the one line below and say less: hold what the filters let through, and show
    # it where the GPU is fine.
    with warnings.catch_warnings(record=True) as held:
        capability = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
    error = cuda_arch_error(name, capability, torch.cuda.get_arch_list(),
                            torch_version=torch.__version__, cuda=torch.version.cuda,
                            machine=platform.machine(), torchvision=_installed("torchvision"),
                            index=index)  # fmt: skip
    if error:
        raise LaunchError(error)
    for warning in held:
        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)


# --------------------------------------------------------------------------- the set-up


def cuda_device_index(env: LaunchEnv, visible_gpus: int,
                      environ: Mapping[str, str] | None = None) -> int:  # fmt: skip
    """The ``N`` of ``cuda:N``: the local rank where each task sees all the node's GPUs (or one
    per local rank); 0 where it sees one of its own (``--gpus-per-task=1``, ``single:1``); its
    own set's devices in turn under ``--gpus-per-task=2``.  Any other sharing (two ranks on one
    GPU, ``--gpu-bind=closest``) is refused (:func:`gpu_sharing_error`), and so is a GPU the
    installed torch has no kernels for (a V100 under the CUDA 13 wheel): every lesson asks this
    before ``set_device`` and ``init_process_group``, so such a rank stops in one line instead
    of at its first kernel."""
    environ = os.environ if environ is None else environ
    index = _device_index(env, visible_gpus, environ)
    check_cuda_arch(index)
    return index


def _device_index(env: LaunchEnv, visible_gpus: int, environ: Mapping[str, str]) -> int:
    check_gpu_map(environ, env.local_world_size)
    on_node = gpus_on_node(environ)
    if visible_gpus >= env.local_world_size:
        return env.local_rank
    if visible_gpus == 1 and on_node >= env.local_world_size:
        return 0
    if 1 < visible_gpus < on_node and environ.get("SLURM_GPUS_PER_TASK") and (
            on_node >= env.local_world_size):  # fmt: skip
        return env.local_rank % visible_gpus
    raise gpu_sharing_error(env, visible_gpus, on_node, environ)


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


if __name__ == "__main__":  # python -m common.env [--export]: the command line is common/env_cli.py
    from common.env_cli import main

    sys.exit(main(sys.argv[1:]))
