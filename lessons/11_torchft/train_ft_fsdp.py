"""Lesson 11, next step: replica groups of several ranks, the model sharded inside each group.

train_ft.py's groups are one process each. On a cluster a replica group is a node of GPUs, or
several nodes: its ranks share the model among themselves as lesson 07 does (FSDP2's
fully_shard over the group's own process group), and torchft averages across the groups, rank r
of a group with rank r of every other group (they hold the same shard). That is HSDP with the
replicated dimension made fault tolerant, as torchtitan runs torchft. Every rank has a Manager;
rank 0's speaks to the lighthouse for its group, so the group joins and leaves a quorum as one.
A rank that dies ends its group (srun --kill-on-bad-exit in group.sh); the other groups go on,
and when the group comes back each of its ranks heals its own shard from rank r of a live group.

Without SLURM, on one machine (CPU, gloo), from the course root with the venv active; two
groups of two ranks, each group a torchrun of its own (its own store port):
    torchft_lighthouse --min_replicas 1 --join_timeout_ms 2000 --bind 127.0.0.1:29510 &
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510
    torchrun --nproc-per-node 2 --master-port 29520 lessons/11_torchft/train_ft_fsdp.py \\
        --group 0 --steps 300 &
    torchrun --nproc-per-node 2 --master-port 29530 lessons/11_torchft/train_ft_fsdp.py \\
        --group 1 --steps 300

A group sent SIGTERM leaves between two steps, every rank at the same step. With --ckpt-dir the
checkpoint is train_ft.py's (ft_checkpoint.py), written by every rank of a group: each its own
shards (DCP, as lesson 07). Left to train_ft.py (the one-process form): lesson 12's slow-group
check.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ft_checkpoint import newest_checkpoint, resume, save  # beside this file
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from train_ft import STOPPED_EXIT, import_torchft, ipv6_hint, lighthouse_address  # beside this file
from train_ft import parse_args as group_args

from common.checkpoint import CheckpointError
from common.env import LaunchError, resolve_launch_env
from common.launch import (
    check_cuda_usable,
    check_launch,
    cpu_threads,
    cuda_device_index,
    dist_timeout,
    init_error_message,
)
from common.mnist import MnistDataError, build_model, build_optimizer, load_data


def say(text: str) -> None:
    """One line, in one write: every rank speaks (each heals its own shard)."""
    now = time.strftime("%H:%M:%S", time.gmtime())
    who = f"group {os.environ.get('FT_GROUP', '?')} rank {os.environ.get('FT_RANK', '?')}"
    print(f"{now} [{who}] {text}\n", end="", flush=True)


def parse_args(argv=None):
    """train_ft.py's options, for the same run: --batch-size is still per group and step, split
    over the group's ranks. Lesson 12's check (--slow-factor) is train_ft.py's alone."""
    args = group_args(argv)
    if args.slow_factor:
        print("error: --slow-factor is train_ft.py's (groups of one process): a group of several "
              "ranks runs without it", file=sys.stderr, flush=True)  # fmt: skip
        raise SystemExit(2)
    return args


def local(t):
    """A DTensor's own shard (this rank's part); any other value as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of this rank's shards of the parameters and of AdamW's state: rank r of every
    group must hold the same (BatchNorm's running statistics, buffers each rank updates from
    its own batches, are left out)."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(local(p.detach()).cpu().numpy().tobytes())
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            digest.update(f"{index}.{key}".encode())
            digest.update(torch.as_tensor(local(value)).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def train(args, env, data, manager, model, optimizer, scheduler, ft_optimizer, stop) -> int:
    from torchft import DistributedSampler

    train_x, train_y = data
    # Two splits: over the groups (shard g, fixed: while group g is missing its batches are
    # not seen) and inside the group over its ranks, as lesson 07's sampler does. A batch is
    # picked by the quorum's step, so a rank that heals at step s reads its batch for step s.
    sampler = DistributedSampler(range(len(train_x)), replica_rank=args.group,
                                 num_replica_groups=args.groups, group_rank=env.rank,
                                 num_replicas=env.world_size, shuffle=True,
                                 seed=args.seed)  # fmt: skip
    batch = args.batch_size // env.world_size  # this rank's part of the group's batch
    per_epoch = len(sampler) // batch
    epoch, shard = -1, None
    params = list(model.parameters())
    participants, t_mark, step_mark = 0, time.perf_counter(), manager.current_step()
    device = data[0].device
    while manager.current_step() < args.steps:
        # SIGTERM (scancel, a preemption, the time limit) reaches every rank at about the same
        # moment, not at the same step: the ranks agree here, in one small all-reduce inside
        # the group, to leave before the same step (a rank that left alone would leave the
        # others waiting in its collectives). The other groups drop this one after the
        # heartbeat timeout and lose no step.
        leaving = torch.tensor([1.0 if stop else 0.0], device=device)
        dist.all_reduce(leaving, op=dist.ReduceOp.MAX)
        if leaving.item():
            say(f"SIGTERM (scancel, a preemption, the time limit): the group leaves between "
                f"steps {manager.current_step()} and {manager.current_step() + 1} | shard "
                f"{shard_hash(model, optimizer)}; the other groups go on without it")
            if args.ckpt_dir:  # every group that stops saves: the last to stop keeps the run
                path = save(args.ckpt_dir, args, manager, model, optimizer, scheduler)
                say(f"checkpoint {path} (on SIGTERM)")
            return STOPPED_EXIT
        before = manager.current_step()
        ft_optimizer.zero_grad()  # the quorum: every rank of the group gets the same answer
        step = manager.current_step()
        if step != before:  # this rank fetched its shard from rank env.rank of a live group
            say(f"healed: step {before} -> {step} from rank {env.rank} of a live group (its "
                f"shard of the weights and of AdamW's state, the schedule), "
                f"{manager.num_participants()} groups")  # fmt: skip
            t_mark, step_mark = time.perf_counter(), step
        if manager.num_participants() != participants:
            say(f"groups {participants} -> {manager.num_participants()} at step {step}")
            participants = manager.num_participants()
        if step // per_epoch != epoch:
            epoch = step // per_epoch
            sampler.set_epoch(epoch)  # a new order each epoch, the same in every rank
            shard = torch.tensor(list(sampler))
        idx = shard[(step % per_epoch) * batch:][:batch]
        loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
        # FSDP2's backward reduce-scatters the gradients inside the group (its process
        # group): each rank gets its shard of the group's average.
        loss.backward()
        # Across the groups, rank r with rank r (the same shard): one all-reduce of this rank's
        # shards in one flat buffer, averaged over the quorum's groups. wait() is False when a
        # peer failed during it; then should_commit (in ft_optimizer.step) is False on every
        # rank of this group, and the whole group discards the step.
        grads = [local(p.grad) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if manager.allreduce(flat).wait():
            for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))
        ft_optimizer.step()
        if manager.current_step() == step:
            say(f"step {step} discarded (a peer failed during it); the next quorum decides")
            continue
        scheduler.step()
        step += 1
        if step % args.log_every == 0 or step == args.steps:
            rate = (step - step_mark) / (time.perf_counter() - t_mark)
            say(f"step {step}/{args.steps} | groups {participants} | loss {loss.item():.4f} | "
                f"{rate:.1f} steps/s | shard {shard_hash(model, optimizer)}")  # fmt: skip
            t_mark, step_mark = time.perf_counter(), step
        # Every rank of the quorum's first group writes its shards (the group's ranks got the
        # same quorum, so they agree); the other groups hold the same state and go on.
        if args.ckpt_dir and (step % args.ckpt_every == 0 or step == args.steps) \
                and manager.participating_rank() == 0:  # fmt: skip
            t_save = time.perf_counter()
            path = save(args.ckpt_dir, args, manager, model, optimizer, scheduler)
            say(f"checkpoint {path} in {time.perf_counter() - t_save:.2f} s (this group is the "
                f"quorum's first) | shard {shard_hash(model, optimizer)}")  # fmt: skip
    say(f"done at step {manager.current_step()}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust log: warnings only
    env = None
    try:
        import_torchft()  # one line on a platform without torchft's wheels
        # Who am I inside my group? Rank, local rank, the group's size, its rank 0's host and
        # port: srun's or torchrun's variables, checked (common/env.py). The group is the world.
        env = resolve_launch_env()
        check_launch(env)
        os.environ["FT_RANK"] = str(env.rank)
        if args.batch_size % env.world_size:
            raise LaunchError(f"--batch-size {args.batch_size} (per group) does not split over "
                              f"the group's {env.world_size} ranks: give a multiple of "
                              f"{env.world_size}")  # fmt: skip
        torch.set_num_threads(cpu_threads(env))
        lighthouse = lighthouse_address()
        if torch.cuda.is_available():
            device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))
            torch.cuda.set_device(device)  # before the group: NCCL, CUDA and FSDP use this GPU
        else:
            check_cuda_usable()  # GPUs that torch cannot see are an error, not a CPU run
            device = torch.device("cpu")
        data = load_data(device, args.train_subset)[:2]
        # The group's own process group: FSDP2's collectives stay inside the group, so a
        # failure in another group never reaches them.
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",  # rank 0 hosts the store
            rank=env.rank,
            world_size=env.world_size,
            timeout=dist_timeout(),  # bounds the rendezvous and FSDP2's collectives
            device_id=device if device.type == "cuda" else None,  # NCCL binds to it at once
        )
    except (LaunchError, MnistDataError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except dist.DistError as exc:  # the group's other ranks never came
        print(f"error: {init_error_message(env, exc)}", file=sys.stderr, flush=True)
        return 2

    from torchft import Manager, Optimizer, ProcessGroupGloo, ProcessGroupNCCL

    torch.manual_seed(args.seed)  # the same initial weights in every group (and rank)
    model = build_model().to(device)
    fully_shard(model)  # over the default process group: this group's ranks
    optimizer, scheduler = build_optimizer(model, args.lr, args.steps)  # AdamW on the shards

    # What a healing rank receives from rank r of a live group: rank r's shards, as plain
    # tensors (torchft's transport sends tensors; the shards are put back into this rank's
    # DTensors, which carry this group's mesh).
    def state_dict():
        optim = optimizer.state_dict()
        return {"model": {n: local(p.detach()) for n, p in model.named_parameters()},
                "optimizer": {"state": {i: {k: local(v) for k, v in s.items()}
                                        for i, s in optim["state"].items()},
                              "param_groups": optim["param_groups"]},
                "scheduler": scheduler.state_dict()}  # fmt: skip

    def load_state_dict(state):
        with torch.no_grad():
            for n, p in model.named_parameters():
                local(p).copy_(state["model"][n])
        shards = [p for group in optimizer.param_groups for p in group["params"]]
        optimizer.load_state_dict({  # a fresh group has no AdamW state yet: rebuilt here
            "state": {i: {k: (DTensor.from_local(v, shards[i].device_mesh, shards[i].placements,
                                                 shape=shards[i].shape, stride=shards[i].stride())
                              if v.dim() else v) for k, v in s.items()}
                      for i, s in state["optimizer"]["state"].items()},
            "param_groups": state["optimizer"]["param_groups"]})  # fmt: skip
        scheduler.load_state_dict(state["scheduler"])

    timeout = dist_timeout()
    # Across the groups: NCCL between GPUs (torchft aborts it after its timeout, so a dead peer
    # is an error, not a hang), gloo on CPUs; rebuilt by torchft on each new quorum.
    pg = (ProcessGroupNCCL(timeout=timedelta(seconds=10)) if device.type == "cuda"
          else ProcessGroupGloo(timeout=timedelta(seconds=10)))  # fmt: skip
    try:
        manager = Manager(
            pg=pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=1,
            use_async_quorum=False,  # heal before the forward pass: a batch is picked by the step
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timedelta(seconds=10),
            rank=env.rank,  # inside the group: rank 0 runs the group's server
            world_size=env.world_size,
            store_addr=env.master_addr,  # the group's store, the one init_process_group made
            store_port=env.master_port,
            lighthouse_addr=lighthouse,
            replica_id=f"group{args.group}",
            hostname=socket.gethostname(),
        )
    except RuntimeError as exc:
        print(f"error: torchft's Manager did not start: {(str(exc) or repr(exc)).splitlines()[0]}"
              f"{ipv6_hint()}", file=sys.stderr, flush=True)  # fmt: skip
        dist.destroy_process_group()
        return 2
    ft_optimizer = Optimizer(manager, optimizer)
    mine = sum(local(p).numel() for p in model.parameters())
    say(f"on {socket.gethostname()} ({device}), {env.world_size} ranks in this group, holding "
        f"{mine} of the model's {sum(p.numel() for p in model.parameters())} parameters; data "
        f"shard {args.group} of {args.groups}, batch {args.batch_size // env.world_size} per rank")
    # Noted only, acted on at the next step's start by every rank together (train()).
    stop: list[str] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signal.Signals(signum).name))
    try:
        # Every rank loads its own shards of the newest checkpoint (DCP reads what it needs).
        if args.ckpt_dir and (resumed := resume(args.ckpt_dir, args, manager, model, optimizer,
                                                scheduler)):  # fmt: skip
            say(f"resumed from {resumed}: step {manager.current_step()} | shard "
                f"{shard_hash(model, optimizer)}")  # fmt: skip
        return train(args, env, data, manager, model, optimizer, scheduler, ft_optimizer, stop)
    except TimeoutError:
        newest = args.ckpt_dir and newest_checkpoint(args.ckpt_dir)
        kept = (f"; the newest checkpoint, {newest}, is where new groups resume" if newest
                else "; no checkpoint kept (--ckpt-dir): new groups start at step 0")
        print(f"error: no quorum within {timeout.total_seconds():.0f} s at step "
              f"{manager.current_step()}: is the lighthouse job still running? "
              f"(a longer wait: COURSE_DIST_TIMEOUT=<seconds>){kept}", file=sys.stderr,
              flush=True)  # fmt: skip
        return 1
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except (dist.DistError, RuntimeError) as exc:  # gloo's or NCCL's: a rank of the group died
        print(f"error: a rank of group {args.group} failed during a step "
              f"({(str(exc) or repr(exc)).splitlines()[0][:160]}): the group ends (srun "
              f"--kill-on-bad-exit); the other groups go on", file=sys.stderr, flush=True)
        return 1
    finally:
        manager.shutdown(wait=False)
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
