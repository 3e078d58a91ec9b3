"""``python -m common.preflight``: its options, the order of its phases, what each task prints,
and the exit status."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from common.env import LaunchEnv, LaunchError, find_free_port, resolve_launch_env
from common.launch import check_master_addr
from common.preflight.allreduce import allreduce_problem, nccl_allreduce, tiny_allreduce
from common.preflight.helpers import PREFIX, Problem, problem, problem_line
from common.preflight.meeting import Outcome, meet, summary
from common.preflight.task import local_facts

DEFAULT_TIMEOUT_S = 15.0
DEFAULT_MAX_CLOCK_SKEW_S = 1.0
TIMEOUT_VAR = "COURSE_PREFLIGHT_TIMEOUT"


def exported_by_hand(environ: Mapping[str, str]) -> list[Problem]:
    """WORLD_SIZE/RANK exported by the job script into an srun step (no torchrun around)."""
    if "SLURM_STEP_NUM_TASKS" not in environ or "TORCHELASTIC_RUN_ID" in environ:
        return []
    tasks = environ["SLURM_STEP_NUM_TASKS"]
    if "WORLD_SIZE" in environ and environ["WORLD_SIZE"].strip() != tasks.strip():
        return [problem(
            f"WORLD_SIZE={environ['WORLD_SIZE']} is set in the environment, but srun started "
            f"{tasks} tasks (SLURM_STEP_NUM_TASKS): with it, torch would wait for ranks that "
            f"never come",
            "remove `export WORLD_SIZE=...` (and RANK) from the job script; the number of "
            "tasks comes from srun (--nodes x --ntasks-per-node)",
        )]  # fmt: skip
    return []



def _timeout_default(environ: Mapping[str, str]) -> float:
    text = environ.get(TIMEOUT_VAR)
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise LaunchError(f"{TIMEOUT_VAR}={text!r} is not a number of seconds") from None
    if value <= 0:
        raise LaunchError(f"{TIMEOUT_VAR}={text!r} must be a positive number of seconds")
    return value


def _watchdog(seconds: float, rank: int) -> None:
    """The last resort against a hang: whatever is still running after ``seconds``, stop."""

    def fire():
        print(f"{PREFIX} PROBLEM (rank {rank}): the preflight itself did not finish within "
              f"{seconds:g} s and was stopped. Fix: read the lines above; raise --timeout if "
              f"the nodes are merely slow.", file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def say(text: str) -> None:
    # One write per line, all on stdout: the tasks share the job's output file, and lines of
    # one stream keep their order there.
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def port_beside_the_agent(env: LaunchEnv, timeout: float) -> int:
    """The port the tasks meet on under torchrun, whose agent holds MASTER_PORT: rank 0 takes
    a free port of its host (the kernel's choice) and posts it in the agent's store, where every
    worker is a client (TORCHELASTIC_USE_AGENT_STORE; torch's own env:// rendezvous connects
    the same way, torch/distributed/rendezvous.py ``_create_c10d_store``).  A fixed neighbour
    such as MASTER_PORT + 1 may be in use on a busy host."""
    import torch.distributed as dist

    store = dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))  # fmt: skip
    # One key per restart of the workers: the agent's store outlives them.
    key = f"course-preflight/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/port"
    if env.rank == 0:
        store.set(key, str(find_free_port()))
    return int(store.get(key))


def main(argv: Sequence[str] | None = None) -> int:
    """Run it with exactly the layout of the real job, inside its allocation, before the job
    itself (``srun python -m common.preflight || exit 1``).  Every task checks what it can see
    by itself (task.py), then all of them meet over TCP at the master address and port that the
    real job will use (meeting.py), and rank 0 prints one report (across.py):

    * the master address resolves, and not to a loopback address when the step spans several
      nodes (every node would talk to itself);
    * rank 0's node can bind the master port, and every task can connect to it within a
      deadline (refused, timed out and "someone else answered" are told apart);
    * clocks agree within ``--max-clock-skew`` seconds (measured over that connection,
      NTP-style);
    * the GPUs visible on a node match the tasks on it (SLURM_GPUS_ON_NODE,
      CUDA_VISIBLE_DEVICES);
    * torch, CUDA, NCCL and Python versions are the same on every node;
    * NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name interfaces that exist, and which interfaces
      could be named (the one that routes to the master first);
    * a tiny gloo all_reduce over all tasks completes and adds up right, and how long it took
      (allreduce.py; then NCCL's where torch sees CUDA).

    Each problem is one line that says what is wrong and how to fix it; the exit status is 1
    when there is any (0 otherwise).  Every wait is bounded (``--timeout``, default 15 s per
    phase, and a watchdog over the whole run), so it never hangs: a task nobody hears from is
    reported as missing.  The checks each process of a lesson runs before it joins its group
    are common/launch.py's; this runs them too."""
    parser = argparse.ArgumentParser(
        prog="python -m common.preflight",
        description="Check, before the real job, that the tasks of a distributed job can meet.",
    )
    parser.add_argument("--timeout", type=float, default=None,
                        help=f"seconds for each phase (default {TIMEOUT_VAR} or "
                             f"{DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--max-clock-skew", type=float, default=DEFAULT_MAX_CLOCK_SKEW_S,
                        help="seconds two clocks may differ (default %(default)s)")
    parser.add_argument("--no-allreduce", action="store_true", help="skip the gloo all_reduce")
    args = parser.parse_args(
        [a for a in (sys.argv[1:] if argv is None else argv)
         if not a.startswith(("--local-rank", "--local_rank"))]
    )  # fmt: skip
    started = time.monotonic()
    try:
        timeout = args.timeout if args.timeout is not None else _timeout_default(os.environ)
        if timeout <= 0:
            raise LaunchError(f"--timeout {timeout:g} must be a positive number of seconds")
        env = resolve_launch_env()
        # A master address that does not resolve, or that is loopback in a job spanning several
        # nodes, leaves nowhere to meet: stop now rather than wait out the timeout. (Under
        # torchrun the agents already met; common.env leaves its address alone, and so do we.)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            check_master_addr(env)
    except LaunchError as exc:
        # No world to meet in: every task stops; the first task of each node says why.
        if os.environ.get("SLURM_LOCALID", os.environ.get("LOCAL_RANK", "0")) == "0":
            for p in [*exported_by_hand(os.environ), problem(str(exc).rstrip("."), "")]:
                say(problem_line(socket.gethostname(), [], p))
        return 1
    _watchdog(3 * timeout + 15, env.rank)
    agent_port = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # Under torchrun its agent already listens on MASTER_PORT (which proves it can be
        # opened): meet on a port rank 0 takes and posts in the agent's store.
        agent_port = env.master_port
        try:
            env = dataclasses.replace(env, master_port=port_beside_the_agent(env, timeout))
        except Exception as exc:  # noqa: BLE001 - the agent's store did not answer in time
            what = " ".join(str(exc).split())[:200] or type(exc).__name__
            say(problem_line(env.hostname, [env.rank], problem(
                f"torchrun's store at MASTER_ADDR:MASTER_PORT={env.master_addr}:{agent_port} "
                f"did not answer within {timeout:g} s ({what})",
                "check that torchrun's agent still runs (its log), or raise --timeout")))
            return 1

    own = local_facts(env, os.environ)
    if env.world_size == 1:
        outcome = Outcome(
            problems=[(env.hostname, [0], p) for p in own.problems],
            run_allreduce=not own.problems,
        )
        outcome.notes.extend(summary(env, {0: dataclasses.asdict(own)}, timeout))
    else:
        outcome = meet(env, own, timeout, args.max_clock_skew)

    if outcome is None:  # a task that never got through: say why from here
        for p in own.problems:
            say(problem_line(env.hostname, [env.rank], p))
        return 1

    if env.rank == 0:
        if agent_port is not None:
            say(f"{PREFIX} torchrun's agent holds MASTER_PORT={agent_port}; the tasks meet on "
                f"port {env.master_port} instead")
        for line in outcome.notes:
            say(f"{PREFIX} {line}")
        for host, ranks, p in outcome.problems:
            say(problem_line(host, ranks, p))

    failed = bool(outcome.problems)
    if outcome.run_allreduce and not args.no_allreduce:
        seconds = min(timeout, 10.0)
        result = tiny_allreduce(env, seconds)
        if result.error or result.wrong_sum:
            failed = True
            if env.rank == 0 or env.world_size > 1:
                say(problem_line(env.hostname, [env.rank],
                                 allreduce_problem("gloo", result, seconds)))  # fmt: skip
        elif env.rank == 0:
            say(f"{PREFIX} {result.summary}")
        if not failed:
            result = nccl_allreduce(env, seconds)
            if result.error or result.wrong_sum:
                failed = True
                say(problem_line(env.hostname, [env.rank],
                                 allreduce_problem("nccl", result, seconds)))  # fmt: skip
            elif env.rank == 0:
                say(f"{PREFIX} {result.summary}")
    elif env.rank != 0 and not outcome.run_allreduce:
        failed = True  # rank 0 printed the problems

    if env.rank == 0:
        elapsed = time.monotonic() - started
        if failed:
            count = len(outcome.problems) or 1
            say(f"{PREFIX} FAILED: {count} problem(s), see the PROBLEM lines "
                f"({elapsed:.1f} s)")
        else:
            say(f"{PREFIX} all checks passed ({elapsed:.1f} s)")
    return 1 if failed else 0
