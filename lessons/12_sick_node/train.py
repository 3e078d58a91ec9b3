"""Lesson 12: lesson 03's training, watched for a sick node while it runs, and moved off it.

The model, the data and the set-up are lesson 03's; the checkpoint that resumes bit for bit is
lesson 05's. What this file adds (the checks themselves are in health.py):

* every ``--check-every`` steps the ranks gather each rank's compute and wait time: a node
  whose ranks all compute ``--slow-factor`` times longer than the other nodes' ranks,
  ``--slow-windows`` windows in a row, is the straggler;
* at every step one all-gather of a "my loss is not finite" flag: every rank skips the same
  step; ``--max-skips`` skips within ``--skip-window`` steps and the job stops;
* at the same windows a checksum of every rank's weights and optimizer state: a rank whose
  bits differ from the others' is named.

When one of them names a node, a healthy rank saves a checkpoint, writes the node's name to
``--report``, and every rank exits with 3; job.sh then submits the job again without that node
and the new job resumes from the checkpoint. ``--fault`` makes a fault on purpose (a NaN in the
batches of one rank or node, a flipped bit in one rank's weights); slow_node.sh makes a
straggler from outside, as a sick node does.
Without SLURM, on one machine: torchrun --standalone --nproc-per-node 4
    lessons/12_sick_node/train.py --steps 200 --train-subset 4096
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from health import (
    StepTimer,
    StragglerWatch,
    checksum,
    gather_fingerprints,
    gather_floats,
    nonfinite_ranks,
    odd_ones_out,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from common.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from common.env import LaunchError, resolve_launch_env
from common.launch import (
    check_cuda_usable,
    check_launch,
    cpu_threads,
    cuda_device_index,
    dist_timeout,
    init_error_message,
)
from common.mnist import MnistDataError, build_model, build_optimizer, evaluate, load_data

SICK_NODE_EXIT = 3  # "a node of this job is sick; checkpoint saved; run me elsewhere"
CKPT_KEYS = ("model", "optimizer", "scheduler", "step")


class Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line: the usage of 20 flags would bury it."""

    def error(self, message):
        self.exit(2, f"error: {message} (python {self.prog} --help lists the flags)\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600, help="training steps in all")
    p.add_argument("--batch-size", type=int, default=128, help="global batch, split over ranks")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", type=Path, help="resumed if it exists")
    p.add_argument("--save-every", type=int, default=100, help="a checkpoint every N steps")
    p.add_argument("--report", type=Path, help="where the sick node's name is written")
    p.add_argument("--check-every", type=int, default=20, help="steps per timing window")
    p.add_argument("--slow-factor", type=float, default=3.0, help="x the other nodes' time")
    p.add_argument("--slow-windows", type=int, default=3, help="windows in a row to be sure")
    p.add_argument("--max-skips", type=int, default=3, help="non-finite steps before stopping")
    p.add_argument("--skip-window", type=int, default=100, help="...within this many steps")
    p.add_argument("--skip-step", type=int, action="append", default=[],
                   help="skip this step on purpose (the run a NaN's skip is compared with)")
    p.add_argument("--fault", choices=("nan", "bitflip"), help="make this fault on purpose")
    p.add_argument("--fault-rank", type=int, help="...on this rank")
    p.add_argument("--fault-node", help="...on every rank on this host (bitflip: the first)")
    p.add_argument("--fault-step", type=int, default=50, help="...from this step on")
    p.add_argument("--fault-steps", type=int, default=0, help="nan: for N steps (0: to the end)")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--train-subset", type=int, default=0)
    p.add_argument("--test-subset", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "save_every", "check_every", "slow_windows",
                 "max_skips", "skip_window"):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.slow_factor > 1:
        p.error(f"--slow-factor must be more than 1 (a ratio to the other nodes), "
                f"got {args.slow_factor}")  # fmt: skip
    if args.max_skips > args.skip_window:
        p.error(f"--max-skips {args.max_skips} can never happen within --skip-window "
                f"{args.skip_window} steps: make the window longer")  # fmt: skip
    if args.fault and (args.fault_rank is None) == (args.fault_node is None):
        p.error(f"--fault {args.fault} needs where: --fault-rank R or --fault-node NODE (one)")
    return args


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only, in one write (lesson 03's train.py says why)."""
    if dist.get_rank() == 0:
        print(" ".join(map(str, args)) + "\n", end="", flush=True, **kwargs)


def settle_gradient_buckets(ddp_model: DDP, sample: torch.Tensor) -> None:
    """Lesson 05's: one throwaway backward pass, so that DDP's bucket order (and so the last
    bit of every sum) is the same in a resumed run as in an uninterrupted one."""
    ddp_model.eval()
    ddp_model(sample).sum().mul(0.0).backward()
    ddp_model.train()
    for p in ddp_model.parameters():
        p.grad = None


def faulty(args, env) -> bool:
    return args.fault_rank == env.rank or (args.fault_node == env.hostname
                                           and (args.fault != "bitflip" or env.local_rank == 0))


@torch.no_grad()
def flip_one_bit(model: torch.nn.Module) -> None:
    """What a bad memory cell or GPU does: one bit of one weight, flipped (a mantissa bit, so
    the value stays finite and nothing crashes: the rank trains on, silently different)."""
    first = next(model.parameters())
    first.view(-1).view(torch.int32)[0] ^= 1 << 20


def train(args: argparse.Namespace, env, device: torch.device) -> int:
    train_x, train_y, test_x, test_y = load_data(device, args.train_subset, args.test_subset)
    per_rank_batch = max(1, args.batch_size // env.world_size)
    sampler = DistributedSampler(range(len(train_x)), env.world_size, env.rank, seed=args.seed)
    steps_per_epoch = -(-len(sampler) // per_rank_batch)

    torch.manual_seed(args.seed)  # the model has no dropout: no other random state to save
    model = build_model().to(device)
    optimizer, scheduler = build_optimizer(model, args.lr, args.steps)
    # Which node each rank runs on, once: a verdict names ranks, a site removes nodes.
    nodes = [None] * env.world_size
    dist.all_gather_object(nodes, env.hostname)

    shape = {"world_size": env.world_size, "steps": args.steps, "seed": args.seed}
    start = 0
    resume = torch.tensor(int(bool(args.checkpoint and args.checkpoint.exists())), device=device)
    dist.broadcast(resume, src=0)  # rank 0 decides for all (lesson 03's train.py says why)
    if resume.item():
        ckpt = load_checkpoint(args.checkpoint, CKPT_KEYS, expect=shape)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        start = ckpt["step"]
        print0(f"resumed from {args.checkpoint} at step {start}, on {','.join(sorted(set(nodes)))}")

    def checkpoint(step: int, saver: int = 0) -> None:
        """SAVER writes (the replicas are the same, unless one drifted: then a healthy one)."""
        if args.checkpoint and env.rank == saver:
            save_checkpoint(args.checkpoint, {"model": model.state_dict(), "step": step,
                                              "optimizer": optimizer.state_dict(),
                                              "scheduler": scheduler.state_dict(), **shape})
        dist.barrier()  # nobody exits, or reads the file, before it is complete

    def sick(ranks: list[int], why: str, step: int, saver: int = 0) -> int:
        """Save, name the nodes of RANKS, and leave: every rank calls this at the same step."""
        sick_nodes = sorted({nodes[r] for r in ranks})
        checkpoint(step, saver)
        if env.rank == saver:
            if args.report:
                args.report.parent.mkdir(parents=True, exist_ok=True)
                args.report.write_text(",".join(sick_nodes) + "\n")
            print(f"sick node: {','.join(sick_nodes)} (rank {','.join(map(str, ranks))}): {why}; "
                  f"checkpoint saved at step {step}; exiting with {SICK_NODE_EXIT} to move off it",
                  flush=True)  # fmt: skip
        return SICK_NODE_EXIT

    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    settle_gradient_buckets(ddp_model, train_x[:2])
    timer = StepTimer(ddp_model, device)
    watch = StragglerWatch(nodes, args.slow_factor, args.slow_windows)
    skipped: list[int] = []
    check_cost = []
    print0(f"training steps {start}..{args.steps} on {len(train_x)} images, world size "
           f"{env.world_size} on {','.join(sorted(set(nodes)))}, device {device}; a window "
           f"every {args.check_every} steps: a node slow at {args.slow_factor}x the others "
           f"in {args.slow_windows} windows, weights compared; {args.max_skips} non-finite "
           f"steps in {args.skip_window} stop the job")  # fmt: skip

    t0 = time.perf_counter()
    batches, epoch = None, -1
    for step in range(start, args.steps):
        if step // steps_per_epoch != epoch:
            epoch = step // steps_per_epoch
            sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
            batches = torch.tensor(list(sampler), device=device).split(per_rank_batch)
        idx = batches[step % steps_per_epoch]
        x, y = train_x[idx], train_y[idx]
        if args.fault == "nan" and faulty(args, env) and step >= args.fault_step and (
                not args.fault_steps or step < args.fault_step + args.fault_steps):
            x = x.clone()
            x[0, 0, 0, 0] = float("nan")  # a corrupt batch: the loss and BatchNorm go NaN
        if args.fault == "bitflip" and faulty(args, env) and step == args.fault_step:
            flip_one_bit(model)

        buffers = [b.clone() for b in model.buffers()]  # BatchNorm's statistics, before
        timer.start()
        loss = F.cross_entropy(ddp_model(x), y)
        loss.backward()  # DDP all-reduces the gradients here; the timer's hooks mark the work
        timer.stop()
        # Asked after backward, so that this collective is not counted as the step's compute;
        # a NaN loss has by now made every rank's averaged gradients NaN, which is harmless:
        # they are thrown away.
        bad = nonfinite_ranks(loss)  # the same list on every rank
        if bad or step in args.skip_step:
            # Every rank skips this step: no optimizer step, and the forward's update of
            # BatchNorm's running statistics undone. The schedule moves on, as the clock does.
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                for b, before in zip(model.buffers(), buffers, strict=True):
                    b.copy_(before)
            scheduler.step()
            if bad:
                skipped.append(step)
                recent = [s for s in skipped if s > step - args.skip_window]
                where = ", ".join(f"rank {r} on {nodes[r]}" for r in bad)
                print0(f"step {step}: non-finite loss on {where}: step skipped on every rank "
                       f"({len(recent)} in the last {args.skip_window} steps)")  # fmt: skip
                if len(recent) >= args.max_skips:
                    return sick(bad, f"{len(recent)} non-finite losses in {args.skip_window} "
                                f"steps", step + 1)  # fmt: skip
        else:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
        if (step + 1) % args.log_every == 0:
            print0(f"step {step + 1}/{args.steps} | loss {loss.item():.4f}")

        if (step + 1) % args.check_every == 0:
            compute, wait, counted = timer.window()
            times = gather_floats([compute, wait, counted], device)
            print0(f"times step {step + 1} | compute ms "
                   + " ".join(f"{t[0] * 1e3:.1f}" for t in times) + " | wait ms "
                   + " ".join(f"{t[1] * 1e3:.1f}" for t in times))  # fmt: skip
            c0 = time.perf_counter()
            prints = gather_fingerprints(model, optimizer)
            check_cost.append(time.perf_counter() - c0)
            odd = odd_ones_out(prints)
            if odd:
                # The copy most ranks hold is saved, by one of them. It is not the copy a run
                # without the fault would hold: since the flip, every step averaged in the
                # sick rank's gradients. The window is what bounds that.
                healthy = min(set(range(env.world_size)) - set(odd))
                held = ", ".join(f"rank {r} {prints[r] & (2**64 - 1):016x}" for r in odd)
                return sick(odd, f"weights and optimizer state differ from the other ranks' "
                            f"at step {step + 1} ({held}; the others "
                            f"{prints[healthy] & (2**64 - 1):016x})", step + 1,
                            saver=healthy)  # fmt: skip
            # Only whole windows are judged: the first after a resume is short, and its first
            # step slow on every rank (allocations, DDP's first buckets).
            full = all(t[2] == args.check_every for t in times)
            slow = watch.update([t[:2] for t in times]) if full else None
            if slow is not None:
                ranks = [r for r in range(env.world_size) if nodes[r] == slow]
                seen = " ".join(f"{watch.ratios(w)[slow]:.1f}x"
                                for w in watch.history[-args.slow_windows:])  # fmt: skip
                return sick(ranks, f"its fastest rank computes {seen} as long as the median "
                            f"rank elsewhere in the last {args.slow_windows} windows, while the "
                            f"others wait for it", step + 1)  # fmt: skip
        if (step + 1) % args.save_every == 0:
            checkpoint(step + 1)

    for buffer in model.buffers():  # evaluate rank 0's BatchNorm statistics (lesson 03)
        dist.broadcast(buffer, src=0)
    test_loss, test_acc = evaluate(model, test_x, test_y)
    state = gather_fingerprints(model, optimizer)
    stats = checksum(model.buffers()).item()  # rank 0's BatchNorm statistics, now everywhere
    cost = 1e3 * sum(check_cost) / max(1, len(check_cost))
    print0(f"clean: highest compute ratio {watch.highest:.2f} (flag at {args.slow_factor}), "
           f"{len(skipped)} step(s) skipped, weights equal on all {env.world_size} ranks "
           f"(compared {len(check_cost)} times, {cost:.2f} ms each)" if len(set(state)) == 1
           else f"weights differ at the end: {state}")  # fmt: skip
    print0(f"done: test_acc {test_acc:.2f}% after {args.steps} steps in "
           f"{time.perf_counter() - t0:.1f}s | state {state[0] & (2**64 - 1):016x} "
           f"| bn {stats & (2**64 - 1):016x}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    env = None
    try:  # the set-up of lesson 03's train.py: who am I, which device, join the group
        env = resolve_launch_env()
        check_launch(env)
        torch.set_num_threads(cpu_threads(env))
        if torch.cuda.is_available():
            device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))
            torch.cuda.set_device(device)
        else:
            check_cuda_usable()
            device = torch.device("cpu")
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=dist_timeout(),
            device_id=device if device.type == "cuda" else None,
        )
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except dist.DistError as exc:
        print(f"error: {init_error_message(env, exc)}", file=sys.stderr, flush=True)
        return 2
    try:
        return train(args, env, device)
    except (LaunchError, MnistDataError, CheckpointError) as exc:
        print0(f"error: {exc}", file=sys.stderr)
        dist.barrier()
        return 2
    finally:
        dist.destroy_process_group()
        gc.collect()  # lesson 03's train.py says why


if __name__ == "__main__":
    sys.exit(main())
