"""Lesson 11: lesson 03's MNIST model trained by replica groups that survive one another.

Every replica group is a job of its own (group.sh) and runs this file as one process. The
groups meet through the lighthouse (lighthouse.sh), which forms a quorum of the groups alive
at each step; the Manager averages the gradients over that quorum, and torchft's Optimizer
steps only if this group got through the step (should_commit agrees across the ranks of one
group, not across groups: a group whose all-reduce failed discards the step on its own). A
group that dies is dropped from the next quorum, the others go on; a group that (re)joins, or
fell behind, copies the weights and the optimizer state from a live peer ("heals") and steps
with them. With --ckpt-dir, one group at a time saves the state every --ckpt-every steps (DCP, as
lesson 07; ft_checkpoint.py), and a group that starts loads the newest: if every group and the
lighthouse end at once, the next ones go on from there (with a live peer ahead of it, a group
heals from it). A group sent SIGTERM (scancel, a preemption, the time limit) leaves between two
steps and saves: the others lose no step, and the last to leave keeps the run.

Without SLURM, on one machine (CPU, gloo), from the course root with the venv active:
    torchft_lighthouse --min_replicas 1 --join_timeout_ms 2000 --bind 127.0.0.1:29510 &
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510
    python lessons/11_torchft/train_ft.py --group 0 --steps 300 --ckpt-dir runs/ft-ckpt &
    python lessons/11_torchft/train_ft.py --group 1 --steps 300 --ckpt-dir runs/ft-ckpt
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import logging
import os
import platform
import signal
import socket
import statistics
import sys
import time
import urllib.parse
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ft_checkpoint import newest_checkpoint, resume, save  # beside this file

from common.checkpoint import CheckpointError
from common.env import LaunchError, resolve_launch_env
from common.launch import check_launch, cpu_threads, dist_timeout
from common.mnist import MnistDataError, build_model, build_optimizer, load_data

LIGHTHOUSE_VAR = "TORCHFT_LIGHTHOUSE"
SICK_NODE_EXIT = 3  # "this group's node is slow: run the group elsewhere" (lesson 12)
STOPPED_EXIT = 75  # "left on SIGTERM, between two steps": as lesson 05's train.py


def say(text: str) -> None:
    """One line, in one write (the group's output is the job's; torchft's logs go beside)."""
    now = time.strftime("%H:%M:%S", time.gmtime())
    print(f"{now} [group {os.environ.get('FT_GROUP', '?')}] {text}\n", end="", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--group", type=int, default=int(os.environ.get("FT_GROUP", 0)),
                   help="this replica group's index (0 .. --groups - 1)")  # fmt: skip
    p.add_argument("--groups", type=int, default=2, help="how many groups share the data")
    p.add_argument("--steps", type=int, default=2000, help="train until the quorum's step N")
    p.add_argument("--batch-size", type=int, default=64, help="per group and step")
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate of the one-cycle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=25,
                   help="a line every N steps, with the hash of the state that groups share")
    p.add_argument("--train-subset", type=int, default=0, help="use only the first N images")
    p.add_argument("--ckpt-dir", type=Path, default=None,
                   help="shared folder for the groups' checkpoints (none: nothing is saved)")
    p.add_argument("--ckpt-every", type=int, default=100, help="a checkpoint every N steps")
    p.add_argument("--slow-factor", type=float, default=0.0,
                   help="leave when this group computes F times the others' median (lesson 12)")
    p.add_argument("--check-every", type=int, default=10, help="steps per timing window")
    p.add_argument("--slow-windows", type=int, default=3, help="windows in a row to be sure")
    args = p.parse_args(argv)
    if args.slow_factor and not args.slow_factor > 1:
        p.error(f"--slow-factor must be more than 1 (a ratio to the other groups), or 0 for no "
                f"check; got {args.slow_factor}")  # fmt: skip
    if args.check_every < 1 or args.slow_windows < 1:
        p.error("--check-every and --slow-windows must be at least 1")
    if not 0 <= args.group < args.groups:
        p.error(f"--group {args.group} is not one of the {args.groups} groups (0 .. "
                f"{args.groups - 1}): give --groups N for N groups")  # fmt: skip
    if args.steps < 1 or args.batch_size < 1 or args.ckpt_every < 1:
        p.error("--steps, --batch-size and --ckpt-every must be at least 1")
    os.environ["FT_GROUP"] = str(args.group)
    return args


def import_torchft():
    """torchft, or one line naming this platform: torchft 0.2.0 has wheels for CPython 3.10-3.13
    on Linux x86_64 only, and requirements.txt installs it nowhere else."""
    try:
        import torchft
    except ImportError as exc:
        here = f"CPython {platform.python_version()} on {platform.system()} {platform.machine()}"
        raise LaunchError(f"torchft does not import here ({here}: {exc}): torchft 0.2.0 has "
                          f"wheels for CPython 3.10-3.13 on Linux x86_64 only; run the groups "
                          f"on such nodes (pip install -r requirements.txt there)") from None
    return torchft


def lighthouse_address(timeout_s: float = 5.0) -> str:
    """TORCHFT_LIGHTHOUSE, checked now: torchft itself would retry a lighthouse that does not
    answer for its connect timeout (10 s as main() sets it; 60 s is the Manager's default) and
    then raise from its Rust client, with a traceback."""
    url = os.environ.get(LIGHTHOUSE_VAR, "")
    if not url:
        raise LaunchError(f"{LIGHTHOUSE_VAR} is not set: start the lighthouse first (sbatch "
                          f"lessons/11_torchft/lighthouse.sh) and export {LIGHTHOUSE_VAR}="
                          f"http://<its node>:<its port> (group.sh reads it from the file the "
                          f"lighthouse writes)")  # fmt: skip
    parts = urllib.parse.urlsplit(url)
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if parts.scheme != "http" or not host or not port:
        raise LaunchError(f"{LIGHTHOUSE_VAR}={url!r} is not http://<host>:<port>: give the "
                          f"address lighthouse.sh wrote, e.g. http://node1:15330")  # fmt: skip
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise LaunchError(f"{LIGHTHOUSE_VAR}={url} does not answer ({exc.strerror or exc}): is "
                          f"the lighthouse job running (squeue), and is that its address? "
                          f"Start it: sbatch lessons/11_torchft/lighthouse.sh") from None
    return url


def ipv6_hint() -> str:
    """Why torchft's servers may refuse IPv4 here: they bind [::], which takes IPv4 connections
    only while net.ipv6.bindv6only is 0 (Linux's default)."""
    try:
        with open("/proc/sys/net/ipv6/bindv6only") as f:
            if f.read().strip() == "1":
                return (" (this node has net.ipv6.bindv6only=1: torchft's servers bind [::], "
                        "which then takes no IPv4 connection; run the groups where it is 0)")
    except OSError:
        return (" (this node has no IPv6, /proc/sys/net/ipv6 is missing: torchft's servers "
                "bind [::])")
    return ""


def state_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 over the parameters and the optimizer's state (AdamW's moments and step
    counts): what every group must hold alike. BatchNorm's running statistics are left out:
    each group updates its own from its own batches (they are buffers, not gradients)."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().cpu().numpy().tobytes())
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            digest.update(f"{index}.{key}".encode())
            digest.update(torch.as_tensor(value).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


class SlowGroupWatch:
    """Lesson 12's straggler check, across the replica groups: the group whose steps compute
    ``factor`` times longer than the median of the other groups', ``windows`` windows in a row,
    leaves (its job ends with SICK_NODE_EXIT; group.sh submits a replacement elsewhere), and the
    others go on without waiting for it. Compute is from the quorum to the gradients' all-reduce:
    the wait inside the all-reduce ends every group's step at the same moment, so only this part
    names the slow one (lessons/12_sick_node/health.py's StepTimer says why).

    Each group's compute time rides with its gradients, in a slot of its own at the end of the
    all-reduced buffer (zeros in the others' slots), so every group learns every group's time
    without a collective of its own to keep in step across groups (the slots lengthen the
    buffer: give --slow-factor to every group or to none); a group outside the quorum adds 0
    and is not judged."""

    def __init__(self, group: int, groups: int, factor: float, windows: int):
        self.group, self.groups, self.factor, self.windows = group, groups, factor, windows
        self.rows: list[list[float]] = []  # per step: every group's compute seconds
        self.streak, self.seen = 0, []

    def slots(self, seconds: float) -> torch.Tensor:
        mine = torch.zeros(self.groups)
        mine[self.group] = seconds
        return mine

    def add(self, averaged: torch.Tensor, participants: int) -> None:
        self.rows.append((averaged * participants).tolist())  # the all-reduce's average undone

    def judge(self) -> str | None:
        """At a window's end, in every group: why this group leaves now, or None."""
        rows, self.rows = self.rows, []
        medians = {g: statistics.median(ts) for g in range(self.groups)
                   if (ts := [row[g] for row in rows if row[g] > 0])}  # fmt: skip
        if len(medians) < 2:  # nobody to compare with
            self.streak, self.seen = 0, []
            return None
        ratio = {g: t / statistics.median(v for h, v in medians.items() if h != g)
                 for g, t in medians.items()}  # fmt: skip
        slow = max(ratio, key=ratio.get)
        if ratio[slow] < self.factor:
            self.streak, self.seen = 0, []
            return None
        self.streak, self.seen = self.streak + 1, [*self.seen, f"{ratio[slow]:.1f}x"]
        say(f"slow: group {slow} computes {ratio[slow]:.1f}x the other groups' median "
            f"({medians[slow] * 1e3:.1f} ms a step), window {self.streak} of {self.windows}")
        if slow != self.group or self.streak < self.windows:
            return None
        return (f"this group's node {os.environ.get('SLURMD_NODENAME', socket.gethostname())} "
                f"computes {' '.join(self.seen)} the other groups' median")


def train(args, manager, model, optimizer, scheduler, data, ft_optimizer, stop) -> int:
    from torchft import DistributedSampler

    train_x, train_y = data
    # The data is split over the groups, not over the quorum: group g always reads shard g
    # (torchft's DistributedSampler: replica_rank=g of num_replica_groups). While a group is
    # missing, the batches of its shard for those steps are simply not seen; the steps go on
    # with the others' batches. A batch is picked by the quorum's step, so a group that heals
    # at step s reads its shard's batch for step s, as it would have had it never died.
    sampler = DistributedSampler(range(len(train_x)), replica_rank=args.group,
                                 num_replica_groups=args.groups, group_rank=0, num_replicas=1,
                                 shuffle=True, seed=args.seed)  # fmt: skip
    per_epoch = len(sampler) // args.batch_size
    epoch, shard = -1, None

    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    watch = SlowGroupWatch(args.group, args.groups, args.slow_factor, args.slow_windows)
    participants, t_mark, step_mark = 0, time.perf_counter(), manager.current_step()
    # Every wait in a step has a limit of its own (the quorum and should_commit
    # COURSE_DIST_TIMEOUT, gloo's 10 s, each read of a heal COURSE_DIST_TIMEOUT): a step still
    # running after three of them waits where none applies. Then every thread's Python stack
    # goes into this group's output (faulthandler, lesson 06), and again at each such interval.
    stuck_s = 3 * dist_timeout().total_seconds() + 10
    while manager.current_step() < args.steps:
        if stop:  # SIGTERM came: leave here, between two steps, where this group holds the
            # state of a whole step (committed or discarded), and no peer waits on it inside
            # an all-reduce: they drop it after the heartbeat timeout and lose no step.
            say(f"{stop[0]} (scancel, a preemption, the time limit): leaving between steps "
                f"{manager.current_step()} and {manager.current_step() + 1} | state "
                f"{state_hash(model, optimizer)}; the other groups go on without it")
            if args.ckpt_dir:  # every group that stops saves: the last to stop keeps the run
                t_save = time.perf_counter()
                path = save(args.ckpt_dir, args, manager, model, optimizer, scheduler)
                say(f"checkpoint {path} in {time.perf_counter() - t_save:.2f} s (on {stop[0]})")
            return STOPPED_EXIT
        faulthandler.dump_traceback_later(stuck_s, repeat=True)  # re-armed every step
        before = manager.current_step()
        ft_optimizer.zero_grad()  # the quorum for this step: joins, drops, heals happen here
        step = manager.current_step()
        if step != before:
            say(f"healed: step {before} -> {step} from a live peer (weights, optimizer, "
                f"schedule), {manager.num_participants()} participants")  # fmt: skip
            t_mark, step_mark = time.perf_counter(), step
        if manager.num_participants() != participants:
            say(f"participants {participants} -> {manager.num_participants()} at step {step}")
            participants = manager.num_participants()
        if step // per_epoch != epoch:  # a new shuffle per epoch, the same in every group
            epoch = step // per_epoch
            sampler.set_epoch(epoch)
            shard = torch.tensor(list(sampler))
        idx = shard[(step % per_epoch) * args.batch_size:][: args.batch_size]
        t_quorum = time.perf_counter()
        loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
        loss.backward()
        # The gradients averaged over the quorum's groups, in one all-reduce of one flat
        # buffer (torchft's DistributedDataParallel does it per bucket, but in torchft 0.2.0 its
        # hook fails on an assertion when a peer dies during the all-reduce). wait() is False
        # when a peer failed during it: the buffer is then garbage, and the step is discarded.
        # With --slow-factor, this group's compute time goes along in its slot (lesson 12).
        timing = [watch.slots(time.perf_counter() - t_quorum)] if args.slow_factor else []
        grads = torch.cat([p.grad.reshape(-1) for p in params] + timing)
        ok = manager.allreduce(grads).wait()
        *parts, times = grads.split([*sizes, grads.numel() - sum(sizes)])
        if ok:
            for p, g in zip(params, parts, strict=True):
                p.grad.copy_(g.view_as(p))
        ft_optimizer.step()  # should_commit: steps only if this group got through, else discards
        if manager.current_step() == step:
            say(f"step {step} discarded ({manager.num_participants()} participants, one failed "
                f"during it); the next quorum decides who goes on")  # fmt: skip
            continue
        scheduler.step()
        step += 1
        leave = None
        if args.slow_factor:  # the step went through: its times are every group's
            watch.add(times, manager.num_participants())
            if step % args.check_every == 0:
                leave = watch.judge()
        if step % args.log_every == 0 or step == args.steps:
            rate = (step - step_mark) / (time.perf_counter() - t_mark)
            say(f"step {step}/{args.steps} | participants {participants} | loss "
                f"{loss.item():.4f} | {rate:.1f} steps/s | state {state_hash(model, optimizer)}")
            t_mark, step_mark = time.perf_counter(), step
        if args.ckpt_dir and (step % args.ckpt_every == 0 or step == args.steps) \
                and manager.participating_rank() == 0:  # fmt: skip
            t_save = time.perf_counter()
            path = save(args.ckpt_dir, args, manager, model, optimizer, scheduler)
            say(f"checkpoint {path} in {time.perf_counter() - t_save:.2f} s (this group is the "
                f"quorum's first)")  # fmt: skip
        if leave:
            say(f"leaving at step {step}: {leave}; the other groups go on, and group.sh submits "
                f"a replacement that avoids this node and heals from them")  # fmt: skip
            return SICK_NODE_EXIT
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    # torchft's own (Rust) log, read when torchft is imported: warnings only, else every quorum.
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import_torchft()  # one line on a platform without torchft's wheels
        # Who am I? A group is one process here: rank 0 of a world of 1, its own host and a
        # port derived from its own job id (common/env.py), for the group's own TCPStore.
        env = resolve_launch_env()
        check_launch(env)  # the store's address and port: one line now, not a hang
        if env.world_size != 1:
            raise LaunchError(f"train_ft.py's replica groups are one process each, this one has "
                              f"{env.world_size}: a group of several ranks runs train_ft_fsdp.py "
                              f"(group.sh picks it for a job of several tasks)")  # fmt: skip
        torch.set_num_threads(cpu_threads(env))
        lighthouse = lighthouse_address()
        device = torch.device("cpu")
        data = load_data(device, args.train_subset)[:2]
    except (LaunchError, MnistDataError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2

    from torchft import Manager, Optimizer, ProcessGroupGloo

    logging.basicConfig(level=logging.WARNING)
    # DCP warns that it saves and loads "in a single process" with no default process group:
    # that is the intent, one process writes its group's copy (save() says why).
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    timeout = dist_timeout()
    # The group's own store, as torchrun's agent would host it: torchft's Manager connects to
    # it (is_master=False). On each new quorum every group rebuilds the process group across
    # the groups under a prefix of one group's store: the first (by replica id) of the groups at
    # the highest step (compute_quorum_results in torchft's src/manager.rs).
    store = dist.TCPStore(env.master_addr, env.master_port, is_master=True,
                          wait_for_workers=False, timeout=timeout)  # fmt: skip

    torch.manual_seed(args.seed)  # same initial weights in every group
    model = build_model()
    optimizer, scheduler = build_optimizer(model, args.lr, args.steps)

    def state_dict():  # what a healing group receives from a live peer
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}  # fmt: skip

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])

    # The Manager starts its own server on [::] (TORCHFT_MANAGER_PORT, else a port the kernel
    # picks) and announces it to the lighthouse under `hostname`; its checkpoint server, which
    # a healing peer fetches the state from, is a second one on [::] and a port of its own.
    try:
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),  # a dead peer: an error in 10 s
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=1,  # step on with one group left
            use_async_quorum=False,  # heal before the forward pass: a batch is picked by the step
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timedelta(seconds=10),  # the Manager's default: 60 s
            rank=env.rank,
            world_size=env.world_size,
            store_addr=env.master_addr,
            store_port=env.master_port,
            lighthouse_addr=lighthouse,
            replica_id=f"group{args.group}",
            hostname=socket.gethostname(),  # where the other groups reach this group's server
        )
    except RuntimeError as exc:  # from torchft's Rust client: its server, or the lighthouse
        print(f"error: torchft's Manager did not start: {(str(exc) or repr(exc)).splitlines()[0]}"
              f"{ipv6_hint()}", file=sys.stderr, flush=True)  # fmt: skip
        return 2
    ft_optimizer = Optimizer(manager, optimizer)
    say(f"on {socket.gethostname()}, lighthouse {lighthouse}, store {env.master_addr}:"
        f"{env.master_port}, shard {args.group} of {args.groups}, batch {args.batch_size}")
    say(f"asking for a quorum: the lighthouse forms one when its --min_replicas groups have "
        f"asked; each step waits up to {timeout.total_seconds():.0f} s (COURSE_DIST_TIMEOUT)")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks on demand: kill -USR1
    # scancel, the time limit and a preemption send SIGTERM (SIGKILL follows after KillWait).
    # Python would end at once, inside a step: the peers' all-reduce would break and they would
    # discard it. The handler only notes it (it runs between two bytecodes of the main thread,
    # after the call in flight returns); train() leaves at the next step's start.
    stop: list[str] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signal.Signals(signum).name))
    try:
        if args.ckpt_dir and (resumed := resume(args.ckpt_dir, args, manager, model, optimizer,
                                                scheduler)):  # fmt: skip
            say(f"resumed from {resumed}: step {manager.current_step()} | state "
                f"{state_hash(model, optimizer)}")  # fmt: skip
        status = train(args, manager, model, optimizer, scheduler, data, ft_optimizer, stop)
    except TimeoutError:  # raised from torchft's Rust client, with a traceback of threads
        newest = args.ckpt_dir and newest_checkpoint(args.ckpt_dir)
        kept = (f"; the newest checkpoint, {newest}, is where new groups resume" if newest
                else "; no checkpoint kept (--ckpt-dir): new groups start at step 0")
        print(f"error: no quorum within {timeout.total_seconds():.0f} s at step "
              f"{manager.current_step()}: is the lighthouse job still running, and have as many "
              f"groups as its MIN_REPLICAS started? (a longer wait: COURSE_DIST_TIMEOUT=<seconds>)"
              f"{kept}", file=sys.stderr, flush=True)  # fmt: skip
        return 1
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        faulthandler.cancel_dump_traceback_later()
        manager.shutdown(wait=False)
        del store
    if status == 0:
        say(f"done at step {manager.current_step()}")
    return status


if __name__ == "__main__":
    sys.exit(main())
