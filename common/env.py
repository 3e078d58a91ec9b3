"""Who am I in this job?  Rank, local rank, world size, node, and where rank 0 listens.

:func:`resolve_launch_env` asks, in this order: torchrun / torch.distributed.launch (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ... set by hand: launcher "env"), srun (``SLURM_PROCID``,
``SLURM_LOCALID``, the step's ``SLURM_STEP_*``; ranks node by node as torchrun numbers them; also
where pyxis copied them into RANK/LOCAL_RANK), ``mp.spawn`` (the child's index and count), else
one plain process.  A variable missing, malformed or disagreeing, or a double spawn, raises
:class:`LaunchError` at once, naming the variable and the fix.  It reads variables only; the
machine is checked next, in one line of each lesson's set-up (common/launch.py).  ``srun python
-m common.env``: each task's view (its command line is common/env_cli.py).
"""

from __future__ import annotations

import dataclasses
import os
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
# Step ids of the batch script, the extern step, salloc's shell (slurm.h: 0xfffffffa-d): 22.05 to
# 25.11 export no SLURM_STEP_ID there, 26.05 prints them with "%d" (-5), or unsigned.
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
    """This process's place in the job; each field from torchrun / srun / mp.spawn / one process."""

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
    """``gpu[01-03,07],cpu5`` -> its host names (zero padding kept), by python-hostlist where
    installed, else :func:`_expand_hostlist`; ``variable`` is named in the error."""
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
    """SLURM's host lists where python-hostlist is not installed (NGC images, pyxis), as it reads
    them (tests/test_env_input.py): ValueError where it raises BadHostlist."""
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
    ``--local-rank=N`` unless ``--use-env``, then only its agent's command line tells."""
    if any(a.startswith(("--local-rank", "--local_rank")) for a in argv[1:]):
        return "torch.distributed.launch"
    if "TORCHELASTIC_RUN_ID" not in environ:
        return "env"
    return agent_launcher(ancestors) or "torchrun"


def _in_srun_step(environ: Mapping[str, str]) -> bool:
    """True in a task started by srun (the batch script, one process, also has SLURM_PROCID=0):
    a step id below the sentinels or, with none at all, srun's SLURM_STEP_NUM_TASKS."""
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
        """The rank counted node by node, as torchrun numbers workers: rank 0 on the first host,
        which every task names as MASTER_ADDR.  SLURM_PROCID is that only under block
        distribution (srun(1) ``--distribution``: cyclic, plane, arbitrary; 26.05's topology)."""
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
    (``srun A : B``), where it is the component's offset plus the node's index in it (exec_task,
    src/slurmd/slurmstepd/task.c) but srun sorts the host list by name (_reorder_het_job_recs,
    src/srun/srun.c; 22.05 to 26.05): the node's name (SLURMD_NODENAME) says where it is."""
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
    """RANK and LOCAL_RANK as pyxis sets them under ``srun --container-image`` with an image
    defining PYTORCH_VERSION (NGC's): SLURM_PROCID and SLURM_LOCALID (pyxis_slurmstepd.c,
    pytorch_setup); enroot's hook 50-slurm-pytorch.sh adds WORLD_SIZE=SLURM_NTASKS and
    MASTER_ADDR/PORT.  srun's own numbers under other names: read as srun's (rank_by_node)."""
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
               f"SLURM_LOCALID={step.localid}, as pyxis sets them (srun --container-image with an "
               f"image that defines PYTORCH_VERSION), which common.env reads as srun's own: unset "
               f"RANK, LOCAL_RANK and WORLD_SIZE before srun, or set all three by hand.")
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
                              f"variables) or make them agree (enroot's pyxis hook 50-slurm-"
                              f"pytorch.sh sets it to SLURM_NTASKS: no srun --preserve-env "
                              f"there).")  # fmt: skip
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
                       spawn_nprocs: int | None = None,
                       argv: Sequence[str] | None = None) -> LaunchEnv:  # fmt: skip
    """This process's place in the job, from ``environ`` (default ``os.environ``).  An
    ``mp.spawn`` child passes ``spawn_index`` and ``spawn_nprocs`` (processes per node);
    ``argv`` (default ``sys.argv``) shows torch.distributed.launch's ``--local-rank``."""
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
    return LaunchEnv(rank=rank, local_rank=local_rank, world_size=world_size,
                     local_world_size=local_world_size, node_rank=node_rank, num_nodes=num_nodes,
                     master_addr=_master_addr(environ, step, num_nodes),
                     master_port=_master_port(environ, job_id, world_size), launcher=launcher,
                     hostname=socket.gethostname(), job_id=job_id)  # fmt: skip


def step_hosts(environ: Mapping[str, str]) -> list[str] | None:
    """The hosts of this srun task's step, rank 0's first; None outside an srun step."""
    return _slurm_step(environ).hosts if _in_srun_step(environ) else None


def _check_ranks(rank, world_size, local_rank, local_ws, node_rank, nodes):
    if not 0 <= rank < world_size:
        raise LaunchError(f"RANK={rank} is not below WORLD_SIZE={world_size}; ranks run from 0 "
                          f"to WORLD_SIZE-1.")  # fmt: skip
    if local_ws < 1 or not 0 <= local_rank < local_ws:
        raise LaunchError(f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_ws}.")
    if local_ws > world_size:
        raise LaunchError(f"LOCAL_WORLD_SIZE={local_ws} is larger than WORLD_SIZE={world_size}.")
    if not 0 <= node_rank < nodes:
        raise LaunchError(f"node rank {node_rank} (GROUP_RANK/SLURM_NODEID) is not below {nodes}.")


def gpus_on_node(environ: Mapping[str, str] | None = None) -> int:
    """GPUs SLURM gave this node (SLURM_GPUS_ON_NODE); 0 when none or outside SLURM."""
    return _opt_int_var(os.environ if environ is None else environ, "SLURM_GPUS_ON_NODE") or 0


def _master_addr(environ, step, num_nodes) -> str:
    """MASTER_ADDR, else the srun step's first host (rank 0's: rank_by_node), else this machine:
    its SLURM node name (SLURMD_NODENAME, which a batch script can hand on), else 127.0.0.1."""
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
    """MASTER_PORT, else from SLURM_JOB_ID, else a free port for one process, else torch's."""
    if environ.get("MASTER_PORT"):
        port = _parse_int(environ["MASTER_PORT"], "MASTER_PORT", hint="Use a port 1024-65535.")
        if not 1 <= port <= 65535:
            raise LaunchError(f"MASTER_PORT={port} is outside 1-65535; use e.g. 29500.")
        return port
    if job_id:
        return master_port_for_job(job_id)
    return find_free_port() if world_size == 1 else DEFAULT_MASTER_PORT


def ancestor_cmdlines(depth: int = 3) -> list[str]:
    """Command lines of the parent, grandparent, ... from /proc (empty where unreadable)."""
    lines, pid = [], os.getppid()
    while pid > 1 and len(lines) < depth:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                lines.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return lines


def agent_launcher(ancestors: Sequence[str] | None = None) -> str | None:
    """"torch.distributed.launch" or "torchrun" (or torch.distributed.run), whichever shows first
    in ``ancestors``, the parents' command lines nearest first (default /proc); else None."""
    for cmdline in ancestor_cmdlines() if ancestors is None else ancestors:
        program = cmdline.split()[:3]  # "python -m torch.distributed.launch", ".../bin/torchrun"
        if "torch.distributed.launch" in program:
            return "torch.distributed.launch"
        if "torch.distributed.run" in program or "torchrun" in map(os.path.basename, program):
            return "torchrun"
    return None


if __name__ == "__main__":  # python -m common.env [--export]: the command line is common/env_cli.py
    from common.env_cli import main

    sys.exit(main(sys.argv[1:]))
