"""Who am I in this job?  One place that answers it for every lesson.

A process in a distributed PyTorch job needs to know its global rank, its rank on the node,
how many processes there are, and where rank 0 listens (master address and port).  Who tells
it depends on who started it.  We look, in this order:

1. torchrun / ``python -m torch.distributed.launch``: their agent sets ``RANK``, ``LOCAL_RANK``,
   ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node), ``MASTER_ADDR``/``PORT`` and
   ``TORCHELASTIC_RUN_ID``.  ``RANK``/``WORLD_SIZE`` set by hand count here too (launcher "env").
2. srun: every SLURM task gets ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID`` and the
   description of its job step (``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_NODELIST``,
   ``SLURM_STEP_TASKS_PER_NODE``).  The batch script itself is not a task of any step: it is
   one process even when the job asked for many tasks.
3. ``torch.multiprocessing.spawn``: the child only knows its index; the caller passes it here
   together with the number of processes spawned per node.
4. Nothing: a single plain process, rank 0 of 1.

Each lookup below is a small function that says which variable it reads.  Anything that would
make the job hang later (a missing or malformed variable, sources that disagree, a master
address that does not resolve, a busy port, ...) raises :class:`LaunchError` at once, with a
message that names the variable or flag and how to fix it.

Run ``python -m common.env`` (e.g. ``srun python -m common.env``) to see what every task sees;
``python -m common.env --export`` prints ``export NAME=value`` lines for shell scripts.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import ipaddress
import json
import os
import re
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

try:  # python-hostlist reads SLURM's host list syntax in full (requirements.txt installs it)
    import hostlist
except ImportError:  # container images (NGC, pyxis) ship torch and not our packages
    hostlist = None

LAUNCHERS = ("torchrun", "torch.distributed.launch", "env", "slurm", "mp.spawn", "single")

# torch's own default rendezvous port, used when nothing else chooses one.
DEFAULT_MASTER_PORT = 29500

# Ports derived from a SLURM job id fall in [MASTER_PORT_BASE, MASTER_PORT_BASE + MASTER_PORT_SPAN):
# unprivileged (>= 1024) and below Linux's ephemeral range (32768-60999 by default, see
# /proc/sys/net/ipv4/ip_local_port_range), so the kernel never hands them out to outgoing
# connections.
MASTER_PORT_BASE = 15000
MASTER_PORT_SPAN = 15000


# Step ids that are not srun steps (slurm.h: SLURM_BATCH_SCRIPT 0xfffffffb, SLURM_EXTERN_CONT
# 0xfffffffc, SLURM_INTERACTIVE_STEP 0xfffffffa, SLURM_PENDING_STEP 0xfffffffd, ...): the batch
# script, the extern step and salloc's interactive shell also run "in a step". All sentinels lie
# at 0xfffffff0 and above. Slurm 22.05 to 25.11 export no SLURM_STEP_ID there (setup_env in
# src/common/env.c sets it only for a step id >= 0, and the sentinels are negative as an int);
# 26.05 exports every id but NO_VAL, printed with "%d": the batch script sees
# SLURM_STEP_ID=-5. The unsigned form (4294967291) is accepted as well.
SENTINEL_STEP_ID_MIN = 0xFFFFFFF0
_SENTINEL_STEP_ID = re.compile(r"-(?:[1-9]|1[0-6])")

# SLURM's ids and counts are plain ASCII digits; int() would also take "1_0", "+3", " -2",
# Arabic-Indic or full-width digits.
_ASCII_INT = re.compile(r"[0-9]+")
_TASKS_PER_NODE = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
# More hosts than any cluster has: a longer expansion is a malformed variable, not a job.
MAX_HOSTS = 100_000


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


# --------------------------------------------------------------------------- small readers


def _int_var(environ: Mapping[str, str], name: str, *, hint: str = "", minimum: int = 0) -> int:
    """Read a required integer variable; a missing or malformed one is a LaunchError."""
    if name not in environ:
        raise LaunchError(f"{name} is not set. {hint}".strip())
    return _parse_int(environ[name], name, hint=hint, minimum=minimum)


def _opt_int_var(
    environ: Mapping[str, str], name: str, *, hint: str = "", minimum: int = 0
) -> int | None:
    if name not in environ:
        return None
    return _parse_int(environ[name], name, hint=hint, minimum=minimum)


def _parse_int(text: str, name: str, *, hint: str = "", minimum: int = 0) -> int:
    """A whole number >= ``minimum`` written in ASCII digits, else a LaunchError naming ``name``."""
    stripped = text.strip()
    if not _ASCII_INT.fullmatch(stripped):
        raise LaunchError(
            f"{name}={text!r} is not a whole number (ASCII digits 0-9 only). {hint}".strip()
        )
    value = int(stripped)
    if value < minimum:
        raise LaunchError(f"{name}={value} must be at least {minimum}. {hint}".strip())
    return value


def expand_hostlist(text: str, variable: str = "host list") -> list[str]:
    """Expand a SLURM host list such as ``gpu[01-03,07],cpu5`` (zero padding is kept).

    ``variable`` names where the text came from, for the error message.  python-hostlist does
    the work where it is installed; inside a container without it, :func:`_expand_builtin`.
    """
    try:
        if hostlist is not None:
            hosts = hostlist.expand_hostlist(text)
        else:
            hosts = _expand_builtin(text)
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
    """SLURM's host list syntax without python-hostlist: ``a[1-2,5]-b[01-02],c``.

    Only for images that ship torch and nothing else (tests check that it agrees with
    python-hostlist): comma-separated names, each with any number of ``[ranges]`` groups whose
    product is taken, zero padding given by the lower bound.
    """
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
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
            suffixes = _expand_ranges(piece) if k % 2 else [piece]
            names = [n + s for n in names for s in suffixes]
            if len(hosts) + len(names) > MAX_HOSTS:
                raise ValueError(f"more than {MAX_HOSTS} hosts")
        hosts.extend(names)
    return hosts


def _expand_ranges(group: str) -> list[str]:
    """``01-03,7`` -> ``01 02 03 7`` (the width of a range's lower bound pads the numbers)."""
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
    """Expand SLURM's compressed task counts: ``2(x3),1`` means 2,2,2,1.

    (One regular expression: python-hostlist has the same function, but common/ must also run
    where python-hostlist is not installed.)
    """
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
    """A rendezvous port that every task of one SLURM job computes alike.

    ``port = MASTER_PORT_BASE + job_id % MASTER_PORT_SPAN``, i.e. a port in 15000-29999:
    unprivileged and below the Linux ephemeral range (32768-60999), so outgoing connections never
    occupy it.  Two jobs running at the same time get different ports unless their ids differ by
    a multiple of 15000.  Each task of a job array is a job with its own SLURM_JOB_ID, so the
    array needs no term of its own (adding SLURM_ARRAY_TASK_ID would make job 36's task 3
    collide with job 39).
    """
    return MASTER_PORT_BASE + _parse_int(str(job_id), "SLURM_JOB_ID", minimum=1) % MASTER_PORT_SPAN


def find_free_port() -> int:
    """A port that is free right now (for a parent that is about to mp.spawn its children)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------- which launcher


def _ancestor_cmdlines(depth: int = 3) -> list[str]:
    """Command lines of the parent, grandparent, ... read from /proc (empty where unreadable)."""
    lines = []
    pid = os.getppid()
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


def _torch_launcher(
    environ: Mapping[str, str], argv: Sequence[str], ancestors: Sequence[str]
) -> str:
    """torchrun and torch.distributed.launch set the same variables; tell them apart.

    Both start workers from an agent process.  ``torch.distributed.launch`` is run as
    ``python -m torch.distributed.launch`` (visible in the agent's command line) and, unless
    given ``--use-env``, passes ``--local-rank=N`` to the script.  Without an agent
    (no ``TORCHELASTIC_RUN_ID``) someone set ``RANK``/``WORLD_SIZE`` by hand: "env".
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
            return "torchrun"
    return "torchrun"


# --------------------------------------------------------------------------- SLURM step


@dataclasses.dataclass(frozen=True)
class _SlurmStep:
    """What srun says about the job step this process belongs to."""

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
    """True inside a task started by srun.

    The batch script itself (sbatch without srun) also has SLURM_PROCID=0, SLURM_NODEID=0 and
    job-wide counts such as SLURM_NTASKS=4, but it is one process.  Slurm 22.05 to 25.11 give it
    no step id; 26.05 exports the batch step's sentinel id as a signed number
    (SLURM_STEP_ID=-5, see SENTINEL_STEP_ID_MIN), as it does for salloc's interactive step (-6).
    So: a task is a process with SLURM_PROCID and a step id below the sentinels, or, without any
    step id, with the step description that only srun sets (SLURM_STEP_NUM_TASKS).
    """
    if "SLURM_PROCID" not in environ:
        return False
    step_id = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))
    if step_id is None:
        return "SLURM_STEP_NUM_TASKS" in environ
    step_id = step_id.strip()
    if _SENTINEL_STEP_ID.fullmatch(step_id):  # "-5": the batch script (26.05's "%d")
        return False
    return bool(_ASCII_INT.fullmatch(step_id)) and int(step_id) < SENTINEL_STEP_ID_MIN


# A process of an srun step is in that step's cgroup, whatever its environment holds:
# cgroup v1 (proctrack/cgroup, task/cgroup) ".../slurm[_<node>]/uid_<uid>/job_<id>/step_<n>/...",
# cgroup v2 ".../slurmstepd.scope/job_<id>/step_<n>/user/task_<t>" (Slurm's cgroup/v1 and
# cgroup/v2 plugins). The batch script is in step_batch, salloc's shell in step_interactive,
# adopted ssh sessions in step_extern. With proctrack/linuxproc and no task/cgroup there is no
# such line, and a container with its own cgroup namespace sees "/" only: no sign either way.
_STEP_CGROUP = re.compile(r"/job_([0-9]+)/step_([0-9]+)(?:/|$)")


def slurm_step_of_cgroup(proc_cgroup: str) -> tuple[str, str] | None:
    """(job id, step id) of the srun step whose cgroup /proc/self/cgroup names, or None."""
    for line in proc_cgroup.splitlines():
        m = _STEP_CGROUP.search(line.split(":", 2)[-1])
        if m:
            return m[1], m[2]
    return None


def _check_slurm_variables_kept(environ: Mapping[str, str], proc_cgroup: str | None) -> None:
    """A task of an srun step that lost every SLURM_* variable would train alone as rank 0 of
    1: `srun apptainer exec --cleanenv` (or --containall), `srun env -i`. Say so instead."""
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
        job, step = found
        raise LaunchError(
            f"this process runs in Slurm step {job}.{step} (/proc/self/cgroup) but has no SLURM_* "
            f"variable, so every task would train alone as rank 0 of 1: something between srun "
            f"and Python cleared the environment (apptainer/singularity exec --cleanenv or "
            f"--containall, env -i). Drop that option, or pass the variables in "
            f"(apptainer --env-file, APPTAINERENV_SLURM_PROCID=...); for a deliberate single "
            f"process set RANK=0 WORLD_SIZE=1."
        )


def _slurm_step(environ: Mapping[str, str]) -> _SlurmStep:
    fix = "Start the job step with srun inside an sbatch/salloc allocation."
    procid = _int_var(environ, "SLURM_PROCID", hint=fix)
    localid = _int_var(environ, "SLURM_LOCALID", hint=fix)
    nodeid = _int_var(environ, "SLURM_NODEID", hint=fix)

    ntasks_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    ntasks = _int_var(environ, ntasks_var, hint=fix, minimum=1)

    nodes_var = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in environ else "SLURM_JOB_NODELIST"
    if nodes_var not in environ:
        raise LaunchError(f"SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are not set. {fix}")
    hosts = expand_hostlist(environ[nodes_var], nodes_var)

    tpn_var = (
        "SLURM_STEP_TASKS_PER_NODE"
        if "SLURM_STEP_TASKS_PER_NODE" in environ
        else "SLURM_TASKS_PER_NODE"
    )
    if tpn_var in environ:
        tasks_per_node = parse_tasks_per_node(environ[tpn_var], tpn_var)
    elif len(hosts) == 1:
        tasks_per_node = [ntasks]
    else:
        raise LaunchError(f"SLURM_STEP_TASKS_PER_NODE is not set. {fix}")

    if len(tasks_per_node) != len(hosts):
        raise LaunchError(
            f"{tpn_var}={environ[tpn_var]!r} lists {len(tasks_per_node)} nodes but "
            f"{nodes_var} has {len(hosts)}; the SLURM variables come from different steps."
        )
    if sum(tasks_per_node) != ntasks:
        raise LaunchError(
            f"{ntasks_var}={ntasks} but {tpn_var}={environ[tpn_var]!r} adds up to "
            f"{sum(tasks_per_node)}; the SLURM variables come from different steps."
        )
    if not 0 <= nodeid < len(hosts):
        raise LaunchError(f"SLURM_NODEID={nodeid} but {nodes_var} has only {len(hosts)} nodes.")
    if not 0 <= procid < ntasks:
        raise LaunchError(f"SLURM_PROCID={procid} is not below {ntasks_var}={ntasks}.")
    if not 0 <= localid < tasks_per_node[nodeid]:
        raise LaunchError(
            f"SLURM_LOCALID={localid} is not below the {tasks_per_node[nodeid]} tasks that "
            f"{tpn_var} gives node {nodeid}."
        )
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

    if launcher == "env" and step is not None:
        # RANK/WORLD_SIZE set by hand in each srun task: both describe the same processes.
        if world_size != step.ntasks:
            raise LaunchError(
                f"WORLD_SIZE={world_size} but srun started SLURM_STEP_NUM_TASKS={step.ntasks} "
                f"tasks; unset WORLD_SIZE (common.env reads SLURM's variables) or make them agree."
            )
        local_rank = step.localid if local_rank is None else local_rank
        local_world_size = step.tasks_on_this_node if local_world_size is None else local_world_size
        node_rank = step.nodeid if node_rank is None else node_rank
        num_nodes = len(step.hosts) if num_nodes is None else num_nodes
    elif launcher != "env" and step is not None:
        # torchrun under srun: srun starts one agent per task, each agent its workers.
        # WORLD_SIZE (workers) legitimately differs from SLURM_STEP_NUM_TASKS (agents).
        if step.tasks_on_this_node > 1 and (local_world_size or 1) > 1:
            raise _double_spawn_error(step, f"{launcher} (LOCAL_WORLD_SIZE)", local_world_size)
        if num_nodes is not None and num_nodes != step.ntasks:
            raise LaunchError(
                f"{launcher} runs with GROUP_WORLD_SIZE={num_nodes} nodes (--nnodes) but srun "
                f"started SLURM_STEP_NUM_TASKS={step.ntasks} agents; pass --nnodes="
                f"{step.ntasks} (one agent per srun task)."
            )

    if (local_rank is None) != (local_world_size is None):
        raise LaunchError(
            "Only one of LOCAL_RANK and LOCAL_WORLD_SIZE is set; set both or neither."
        )
    if local_rank is None:  # one node, as with two processes started by hand
        local_rank, local_world_size = rank, world_size
    if node_rank is None:
        node_rank = rank // local_world_size if local_world_size else 0
    if num_nodes is None:
        num_nodes = -(-world_size // local_world_size) if local_world_size else 1
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
    """Work out this process's place in the job.

    ``environ`` defaults to ``os.environ``.  Inside a ``torch.multiprocessing.spawn`` child pass
    ``spawn_index`` (the index mp.spawn gives the function) and ``spawn_nprocs`` (how many
    processes were spawned on this node).  ``argv`` defaults to ``sys.argv`` (used to recognise
    ``torch.distributed.launch``'s ``--local-rank``).  ``check=False`` skips the checks against
    this machine (name resolution of the master address, whether the port is free).
    ``proc_cgroup`` is the text of /proc/self/cgroup (read when ``environ`` is not given).
    """
    launched = os.environ if environ is None else environ
    if (environ is None or proc_cgroup is not None) and not any(
        v in launched for v in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    ):
        _check_slurm_variables_kept(launched, proc_cgroup)
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    step = _slurm_step(environ) if _in_srun_step(environ) else None
    job_id = environ.get("SLURM_JOB_ID")
    if job_id is not None:
        job_id = str(_parse_int(job_id, "SLURM_JOB_ID", minimum=1))

    if spawn_index is not None and spawn_nprocs is None:
        raise LaunchError("spawn_index given without spawn_nprocs (the nprocs passed to mp.spawn).")

    if any(v in environ for v in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")):
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
        launcher = "slurm"
        rank, local_rank, world_size = step.procid, step.localid, step.ntasks
        local_world_size, node_rank, num_nodes = (
            step.tasks_on_this_node,
            step.nodeid,
            len(step.hosts),
        )
    elif spawn_nprocs is not None:
        launcher = "mp.spawn"
        if spawn_nprocs < 1 or not 0 <= spawn_index < spawn_nprocs:
            raise LaunchError(
                f"spawn_index={spawn_index} must lie in 0..spawn_nprocs-1 (spawn_nprocs="
                f"{spawn_nprocs}); pass the index mp.spawn gives and the nprocs it was called with."
            )
        if step is not None:
            # mp.spawn inside each srun task (normally one task per node): the spawned processes
            # are numbered per task, so rank = SLURM_PROCID * nprocs + index.
            if step.tasks_on_this_node > 1 and spawn_nprocs > 1:
                raise _double_spawn_error(step, "mp.spawn (nprocs)", spawn_nprocs)
            task, tasks, node_rank, num_nodes = (
                step.procid,
                step.ntasks,
                step.nodeid,
                len(step.hosts),
            )
            local_rank = step.localid * spawn_nprocs + spawn_index
            local_world_size = step.tasks_on_this_node * spawn_nprocs
        else:
            task, tasks, node_rank, num_nodes = 0, 1, 0, 1
            local_rank, local_world_size = spawn_index, spawn_nprocs
        rank, world_size = task * spawn_nprocs + spawn_index, tasks * spawn_nprocs
    else:
        launcher = "single"
        rank, local_rank, world_size, local_world_size, node_rank, num_nodes = 0, 0, 1, 1, 0, 1

    _check_ranks(rank, world_size, local_rank, local_world_size, node_rank, num_nodes)
    _check_gpus_on_node(environ, local_world_size)
    master_addr = _master_addr(environ, step, num_nodes)
    master_port = _master_port(environ, job_id, world_size)
    env = LaunchEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=master_addr,
        master_port=master_port,
        launcher=launcher,
        hostname=socket.gethostname(),
        job_id=job_id,
    )
    if check:
        # Under torchrun the agents have already met at their own rendezvous before starting
        # the workers, and MASTER_ADDR is the agent's host as torchrun names it (its FQDN):
        # the loopback check is for addresses people set, not for torchrun's.
        agent_store = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        check_master_addr(env if not agent_store else dataclasses.replace(env, num_nodes=1))
        if step is not None and launcher in ("slurm", "mp.spawn"):
            _check_rank0_here(env, environ, step.hosts)
        if _must_bind_store(env, environ):
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
    environ = os.environ if environ is None else environ
    return _opt_int_var(environ, "SLURM_GPUS_ON_NODE") or 0


def _check_gpus_on_node(environ: Mapping[str, str], local_world_size: int) -> None:
    """More processes on a node than the GPUs SLURM gave it: refuse, CUDA or not.

    On a GPU cluster two ranks would share a GPU (NCCL stops with "Duplicate GPU detected");
    on a CPU-only machine with bookkeeping GPUs the job would "work" with another world size
    (and another global batch) than the one it is written for.
    """
    gpus = gpus_on_node(environ)
    if gpus and local_world_size > gpus:
        raise LaunchError(
            f"{local_world_size} processes on this node but SLURM gave it SLURM_GPUS_ON_NODE="
            f"{gpus} GPU(s): one process per GPU, so ask for --ntasks-per-node={gpus} (or "
            f"--nproc-per-node={gpus}) or for --gres=gpu:{local_world_size}."
        )


def _master_addr(environ, step, num_nodes) -> str:
    """MASTER_ADDR if set, else the first host of the SLURM step, else this machine.

    "This machine" is its SLURM node name (SLURMD_NODENAME, set in a batch script) so that a
    shell script can hand it to processes on other nodes, else 127.0.0.1.
    """
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
    """MASTER_PORT if set, else derived from SLURM_JOB_ID, else a free one / torch's default."""
    if environ.get("MASTER_PORT"):
        port = _parse_int(environ["MASTER_PORT"], "MASTER_PORT", hint="Use a port 1024-65535.")
        if not 1 <= port <= 65535:
            raise LaunchError(f"MASTER_PORT={port} is outside 1-65535; use e.g. 29500.")
        return port
    if job_id:
        return master_port_for_job(job_id)
    if world_size == 1:
        return find_free_port()  # nobody else has to agree on it
    return DEFAULT_MASTER_PORT


def _must_bind_store(env: LaunchEnv, environ: Mapping[str, str]) -> bool:
    """Does this process open the rendezvous port itself?

    Rank 0 hosts the store, except under torchrun / torch.distributed.launch, whose agent already
    holds the port (TORCHELASTIC_USE_AGENT_STORE), and except when this process already did.
    """
    if env.rank != 0 or environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return False
    dist = sys.modules.get("torch.distributed")
    return not (dist is not None and dist.is_available() and dist.is_initialized())


def check_master_addr(env: LaunchEnv) -> None:
    """The master address must resolve, or every rank would wait for a host that is not there.

    When the job spans several nodes it must not be a loopback address either (``localhost``,
    ``127.x.x.x``, ``::1``, or another node's name that resolves to one here, as when a node's
    /etc/hosts maps that name to loopback): every node would look for rank 0 on itself and
    wait for the rendezvous timeout.
    """
    try:
        infos = socket.getaddrinfo(env.master_addr, env.master_port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise LaunchError(
            f"MASTER_ADDR={env.master_addr!r} does not resolve ({exc}); set MASTER_ADDR to a "
            f"host name or IP address of the node running rank 0."
        ) from None
    # A name is let through on its own node: rank 0's store listens on every address there, and
    # the other nodes, which must not resolve it to loopback, check it for themselves.
    if env.num_nodes > 1 and (_is_loopback_name(env.master_addr)
                              or not _is_own_name(env.master_addr, env.hostname)):  # fmt: skip
        check_not_loopback(env.master_addr, env.num_nodes, [info[4][0] for info in infos])


def _is_loopback_name(addr: str) -> bool:
    """``localhost`` or a literal loopback address."""
    if addr.lower().rstrip(".") in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def _is_own_name(addr: str, hostname: str) -> bool:
    """Is ``addr`` this machine's own name (short or fully qualified)?"""
    short = addr.lower().rstrip(".").split(".")[0]
    return bool(hostname) and short == hostname.lower().split(".")[0]


def check_not_loopback(master_addr: str, num_nodes: int, addresses: Sequence[str]) -> None:
    """A loopback MASTER_ADDR cannot bring ``num_nodes`` > 1 nodes together: LaunchError."""
    loopback = [a for a in addresses if ipaddress.ip_address(a.split("%")[0]).is_loopback]
    if num_nodes > 1 and loopback:
        shown = master_addr if master_addr in loopback else f"{master_addr} -> {loopback[0]}"
        raise LaunchError(
            f"MASTER_ADDR={master_addr!r} is a loopback address ({shown}) but the job spans "
            f"{num_nodes} nodes: each node would look for rank 0 on itself. Use the first node's "
            f'name as SLURM gives it (scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) '
            f"or unset MASTER_ADDR and let common.env pick it."
        )


def check_port_free(port: int) -> None:
    """Rank 0 is about to listen on ``port``; say so now if something else already does."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's store does
        try:
            sock.bind(("", port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                raise LaunchError(
                    f"MASTER_PORT={port} is already in use on this host ({exc.strerror}); "
                    f"export MASTER_PORT=<another port>, e.g. a free one in 20000-30000."
                ) from None
            raise


def cuda_device_index(
    env: LaunchEnv, visible_gpus: int, environ: Mapping[str, str] | None = None
) -> int:
    """Which of the GPUs this process sees it drives (the ``N`` of ``cuda:N``).

    - Every task sees all the GPUs SLURM gave the node (``--gres=gpu:4``, ``--gpus-per-node``;
      torchrun's workers), or at least one per local rank: local rank N drives cuda:N.
    - Each task sees one GPU of its own (``--gpus-per-task=1``, ``--gpu-bind=single:1``,
      ``map_gpu``): cuda:0. Each task has a set of its own (``--gpus-per-task=2``,
      SLURM_GPUS_PER_TASK): the local ranks take its devices in turn, ``local_rank % visible``.
    - Tasks share a set smaller than the node's (``--gpu-bind=closest``, or a site default in
      SLURM_GPU_BIND: the GPUs of the task's socket): which one is this task's depends on how
      srun spread the node's tasks over its sockets, cyclically by default (srun(1),
      ``--distribution``, second level), so no rule on the local rank alone is right for every
      job: LaunchError, with the binding that gives each task one GPU.
    - ``--gpu-bind=map_gpu:0,0`` (SLURM_GPU_BIND) gives two tasks one GPU; fewer visible GPUs
      than processes with no binding would also put two ranks on one GPU: LaunchError, before
      NCCL stops with "Duplicate GPU detected".
    """
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
    """``--gpu-bind=map_gpu:0,0`` (srun reads it from SLURM_GPU_BIND too) binds local task i to
    the i-th GPU of the list: the same GPU twice among this node's tasks is two ranks on one."""
    bind = environ.get("SLURM_GPU_BIND", "")
    if "map_gpu:" not in bind:
        return
    gpus = bind.rpartition("map_gpu:")[2]
    listed = []
    for item in gpus.split(",")[: max(1, local_world_size)]:
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


# NVIDIA's per-GPU device files: present on a GPU node whatever torch thinks of them.
NVIDIA_DEVICE_GLOB = "/dev/nvidia[0-9]*"


def check_cuda_usable(environ: Mapping[str, str] | None = None,
                      nvidia_glob: str = NVIDIA_DEVICE_GLOB) -> None:  # fmt: skip
    """For a process that found no CUDA device: stop if SLURM gave this node GPUs that exist.

    A CPU-only wheel of torch, or a container started without its GPUs, would otherwise train
    on the CPU and "succeed", hours later. Where SLURM's GPUs are bookkeeping only (the
    course's local cluster has no /dev/nvidia*), the process goes on with gloo on the CPU.
    """
    import glob

    import torch  # the caller has imported it already

    environ = os.environ if environ is None else environ
    gpus = gpus_on_node(environ)
    devices = sorted(glob.glob(nvidia_glob)) if gpus else []
    if not devices:
        return
    if torch.version.cuda is None:
        why = (
            f"this is a CPU-only build of torch: install the CUDA build (pip install "
            f"torch=={torch.__version__.split('+')[0]} --index-url "
            f"https://download.pytorch.org/whl/cu<version>, see README.md)."
        )
    else:
        why = (
            "inside a container, start it with its GPUs (apptainer --nv, enroot/pyxis with the "
            "NVIDIA hook); otherwise the driver is older than this CUDA build needs (nvidia-smi "
            "shows the driver's CUDA version): install a torch built for it."
        )
    raise LaunchError(
        f"SLURM gave this node {gpus} GPU(s) (SLURM_GPUS_ON_NODE) and it has {len(devices)} "
        f"NVIDIA device(s) ({devices[0]}...), but torch {torch.__version__} sees no CUDA device "
        f"(torch.version.cuda={torch.version.cuda}): {why}"
    )


# --------------------------------------------------------------------------- threads, timeout

# Launchers that start several worker processes inside one SLURM task: the workers share the
# task's CPUs (they inherit its affinity mask).
_WORKER_LAUNCHERS = ("torchrun", "torch.distributed.launch", "mp.spawn")


def usable_cpus() -> tuple[int, bool]:
    """(CPUs this process may run on, whether that set is the whole machine's).

    Linux tells through the affinity mask, which SLURM narrows to the task's own CPUs when it
    binds tasks (TaskPlugin=task/affinity or task/cgroup); macOS has no affinity call, and
    there every process may use every CPU.
    """
    total = os.cpu_count() or 1
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is None:
        return total, True
    mine = len(affinity(0))
    return mine, mine >= total


def process_cpus(env: LaunchEnv, environ: Mapping[str, str] | None = None,
                 cpus: tuple[int, bool] | None = None) -> int:  # fmt: skip
    """This process's share of the CPUs its task may run on (at least 1).

    SLURM binds each task to its own CPUs where the site binds (task/affinity, task/cgroup); a
    launcher's workers inherit their task's set and share it; where no binding is done (the set
    is the whole machine) the node's processes share it. SLURM_CPUS_PER_TASK, what the job asked
    for, caps it. A process splits this share between torch's threads and its DataLoader
    workers (lesson 08).
    """
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
    """How many threads torch should use in this process: ``torch.set_num_threads(...)``.

    OMP_NUM_THREADS, when set, wins (torchrun sets it to 1 for its workers unless it is set);
    else :func:`process_cpus`. Without this, each process starts one thread per core of the
    whole machine and the processes of a node fight over the same cores.
    """
    environ = os.environ if environ is None else environ
    hint = "Set it to a whole number of threads, e.g. 4, or unset it."
    omp = _opt_int_var(environ, "OMP_NUM_THREADS", minimum=1, hint=hint)
    if omp:
        return omp
    return process_cpus(env, environ, cpus)


DEFAULT_TIMEOUT_S = 600  # torch's own default for NCCL; gloo's is 30 minutes
TIMEOUT_VAR = "COURSE_DIST_TIMEOUT"


def dist_timeout(environ: Mapping[str, str] | None = None) -> datetime.timedelta:
    """How long a rank waits for the others, at the rendezvous and in every collective:
    COURSE_DIST_TIMEOUT seconds, else 600 s.

    Ranks legitimately wait for each other (rank 0 writing a checkpoint, a node importing torch
    from a slow shared filesystem), so the job's normal bound is minutes; the course's failure
    demos and tests set a few seconds so that a hang ends quickly.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(TIMEOUT_VAR)
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
    """One line for a rank whose ``init_process_group`` failed (torch raises DistStoreError
    when the others do not arrive in time, DistNetworkError when rank 0's address does not
    answer), in place of torch's traceback."""
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


# --------------------------------------------------------------------------- command line


def nproc_per_node(environ: Mapping[str, str] | None = None) -> int:
    """How many processes a per-node launcher (torchrun) should start here.

    The GPUs SLURM gave this node (SLURM_GPUS_ON_NODE), else the visible CUDA devices, else 1.
    """
    environ = os.environ if environ is None else environ
    gpus = gpus_on_node(environ)
    if gpus:
        return gpus
    return _cuda_device_count() or 1


def export_values(env: LaunchEnv, environ: Mapping[str, str] | None = None) -> dict:
    """What ``python -m common.env --export`` hands to a shell script that starts a launcher.

    MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK and NPROC_PER_NODE are exactly torchrun's
    ``--master-addr --master-port --nnodes --node-rank --nproc-per-node``; the launched world has
    NNODES * NPROC_PER_NODE processes.  In the batch script itself (no srun step) NNODES is the
    job's node count, and NODE_RANK (0) only holds for the node running the script.
    RANK and WORLD_SIZE are deliberately not exported: every process started later from that
    shell (srun python ..., torchrun's workers) would inherit them and take them for its own.
    """
    environ = os.environ if environ is None else environ
    nproc = nproc_per_node(environ)
    if env.launcher == "slurm" and env.local_world_size > 1:
        # These values are for ONE launcher per node. With several srun tasks here, each would
        # start a launcher claiming the same NODE_RANK and port: stop before they fight over it.
        raise LaunchError(
            f"double spawn: srun started {env.local_world_size} tasks on this node "
            f"(SLURM_STEP_TASKS_PER_NODE) and each would start a per-node launcher with "
            f"NPROC_PER_NODE={nproc} processes. A per-node launcher needs exactly one task per "
            f"node: srun --ntasks-per-node=1 (or drop the launcher and let srun start one task "
            f"per process)."
        )
    num_nodes = env.num_nodes
    if env.launcher == "single" and environ.get("SLURM_JOB_ID"):
        num_nodes = (
            _opt_int_var(environ, "SLURM_JOB_NUM_NODES", minimum=1)
            or _opt_int_var(environ, "SLURM_NNODES", minimum=1)
            or 1
        )
        if num_nodes > 1:  # the batch script hands these to processes on every node
            check_master_addr(dataclasses.replace(env, num_nodes=num_nodes))
    return {
        "MASTER_ADDR": env.master_addr,
        "MASTER_PORT": env.master_port,
        "NNODES": num_nodes,
        "NODE_RANK": env.node_rank,
        "NPROC_PER_NODE": nproc,
    }


# The device files through which torch reaches a GPU: NVIDIA's control device (CUDA), AMD's
# kernel driver (ROCm builds answer through torch.cuda too) and WSL2's GPU bridge. Where none
# exists no process can see a GPU, and asking torch would cost its import (about 2 s of CPU)
# in every `python -m common.env` of every job script.
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def _cuda_device_count(driver_files: Sequence[str] = GPU_DRIVER_FILES) -> int:
    if not any(os.path.exists(path) for path in driver_files):
        return 0
    import torch  # imported late: only a machine with a GPU driver pays for it

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _main(args: Sequence[str]) -> int:
    # torch.distributed.launch passes --local-rank=N to the module it starts; it is not ours.
    args = [a for a in args if not a.startswith(("--local-rank", "--local_rank"))]
    if args and args[0] in ("-h", "--help"):
        print("usage: python -m common.env [--export]\n\n" + (__doc__ or "").split("\n\n")[0])
        return 0
    if args and args != ["--export"]:
        print(
            f"common.env: unknown argument {args[0]!r}; usage: python -m common.env [--export]",
            file=sys.stderr,
        )
        return 2
    try:
        env = resolve_launch_env()
        gpus = _cuda_device_count()
        if gpus:
            cuda_device_index(env, gpus)
        if args == ["--export"]:
            for name, value in export_values(env).items():
                print(f"export {name}={shlex.quote(str(value))}")
        else:
            print(json.dumps({**env.as_dict(), "backend": "nccl" if gpus else "gloo"}))
    except LaunchError as exc:
        print(f"common.env: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
