"""Lesson 05: lesson 03's training, made to survive the faults of a long job on a shared cluster.

The model, the data and the evaluation are lesson 03's. What this file adds:

* a stop request: SIGUSR1 (the time-limit warning, see requeue.sh) and SIGTERM (preemption)
  only set a flag; every few steps the ranks decide together, and at that safe point rank 0
  saves a checkpoint in the middle of the epoch and every rank exits with 75 ("requeue me");
* a checkpoint that resumes exactly: RNG states, the step within the epoch, the loss so far,
  and DDP's gradient-bucket order, so a resumed run repeats an uninterrupted one bit for bit
  (on CPU/gloo; on GPUs see make_deterministic);
* ``--epochs-per-run N`` for chains of jobs (chain.sh): each link trains N epochs and ends;
* ``@record`` for torchrun (crash.sh): a crashing rank's traceback goes to TORCHELASTIC_ERROR_FILE,
  and torchrun's report names rank and host; ``--crash-rank``/``--faulty-node`` cause those crashes.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
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
from common.mnist import (  # lesson 03's model, data and evaluation
    MnistDataError,
    build_model,
    build_optimizer,
    evaluate,
    load_data,
)

# "Stopped on request, checkpoint written, run me again": EX_TEMPFAIL from sysexits.h.
REQUEUE_EXIT_CODE = 75
CKPT_KEYS = ("model", "optimizer", "scheduler", "epoch", "step", "epoch_loss", "rng")


class StopRequest:
    """Remembers that a stop was asked for (SIGUSR1: time is running out; SIGTERM: preempted).

    CPython runs a handler in the main thread, between two bytecodes: a blocking call (an
    all_reduce, a checkpoint being written) delays it until the call returns, and a hung
    collective prevents it. So it only sets a flag; the training loop acts on it at safe points.
    """

    def __init__(self, signums=(signal.SIGUSR1, signal.SIGTERM)):
        self.signum = None
        for signum in signums:
            signal.signal(signum, self._handler)

    def _handler(self, signum, frame) -> None:
        self.signum = self.signum or signum

    def agreed(self, device: torch.device) -> bool:
        """True on every rank as soon as any rank got a signal.

        The signal reaches the ranks at different moments; a rank that stopped alone would
        leave the others waiting for its gradients. So they decide together: a MAX over flags.
        """
        flag = torch.tensor([0.0 if self.signum is None else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def make_deterministic() -> None:
    """Ask for the same bits from the same inputs, run after run.

    On the CPU (gloo) PyTorch's kernels already are. On GPUs, cuDNN may pick a different
    convolution algorithm in every run (benchmark mode) and some kernels add with atomics in
    any order; cuBLAS needs a fixed workspace (set before its first use). warn_only: an
    operation with no deterministic version warns instead of stopping the job. What can still
    differ on GPUs: NCCL's sums are reproducible only with the same number of ranks, topology
    and NCCL version, and a resumed run is exact only on the same kind of GPU and software.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


def rng_states() -> dict:
    """The random number generators of this process (CPU, Python, and this process's GPU)."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()  # the current device: this rank's GPU
    return states


def set_rng_states(states: dict) -> None:
    """Restore :func:`rng_states`.

    The CUDA state, when saved, goes to this process's current GPU only, so a job resumed with
    fewer visible GPUs than the one that saved (or on CPU) still starts. A checkpoint holding one
    state per visible GPU (a list) gives this GPU its own entry if it has one, else nothing.
    """
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    cuda = states.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    if isinstance(cuda, (list, tuple)):
        index = torch.cuda.current_device()
        if index >= len(cuda):
            return
        cuda = cuda[index]
    torch.cuda.set_rng_state(cuda)


def settle_gradient_buckets(ddp_model: DDP, sample: torch.Tensor) -> None:
    """One throwaway backward pass (zero gradients, no step, no statistics updated).

    After its first backward pass DDP reorders its gradient buckets to the order in which
    gradients became ready; with more than two ranks that order decides in which order the
    ranks' values are added up, hence the last bit of the sum. Settling the layout before the
    first real step, in every run, lets a resumed run repeat an uninterrupted one bit for bit.
    """
    ddp_model.eval()  # BatchNorm uses (and keeps) its running statistics
    ddp_model(sample).sum().mul(0.0).backward()
    ddp_model.train()
    for p in ddp_model.parameters():
        p.grad = None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128, help="global batch, split over ranks")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", type=Path, help="resumed if it exists; saved every epoch")
    p.add_argument("--stop-check-every", type=int, default=10, help="steps between checks")
    p.add_argument("--epochs-per-run", type=int, default=0, help="end after N epochs (chains)")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--train-subset", type=int, default=0)
    p.add_argument("--test-subset", type=int, default=0)
    p.add_argument("--log-order", type=Path, help="DIR/rank<N>.txt: each epoch's image indices")
    p.add_argument("--crash-rank", type=int, help="this rank crashes, unless resumed")
    p.add_argument("--faulty-node", help="every rank on this host crashes, in every attempt")
    p.add_argument("--crash-at-step", type=int, default=10, help="...at this step of an epoch")
    p.add_argument("--crash-in-epoch", type=int, default=2, help="...of this epoch")
    args = p.parse_args(argv)
    if min(args.epochs, args.batch_size, args.stop_check_every) < 1 or args.epochs_per_run < 0:
        p.error("--epochs, --batch-size and --stop-check-every must be at least 1")
    return args


def maybe_crash(args, rank: int, epoch: int, step: int, resumed: bool) -> None:
    """The faults crash.sh shows: a rank that fails once (in a run that did not resume from a
    checkpoint), or a node on which every rank fails, every time."""
    if epoch + 1 != args.crash_in_epoch or step != args.crash_at_step:
        return
    host = socket.gethostname().split(".")[0]
    if (args.crash_rank == rank and not resumed) or args.faulty_node == host:
        raise RuntimeError(f"deliberate crash of rank {rank} on {host} at epoch {epoch + 1}, "
                           f"step {step}")  # fmt: skip


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only, in one write (lesson 03's train.py says why)."""
    if dist.get_rank() == 0:
        print(" ".join(map(str, args)) + "\n", end="", flush=True, **kwargs)


def train(args: argparse.Namespace, env, device: torch.device, stop: StopRequest) -> int:
    """Train or resume until ``args.epochs``; return 0, or REQUEUE_EXIT_CODE when stopped."""
    train_x, train_y, test_x, test_y = load_data(device, args.train_subset, args.test_subset)
    per_rank_batch = max(1, args.batch_size // env.world_size)
    sampler = DistributedSampler(range(len(train_x)), env.world_size, env.rank, seed=args.seed)
    steps_per_epoch = -(-len(sampler) // per_rank_batch)

    torch.manual_seed(args.seed)
    model = build_model().to(device)
    optimizer, scheduler = build_optimizer(model, args.lr, args.epochs * steps_per_epoch)

    start_epoch, start_step = 0, 0
    carried = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, samples so far
    shape = {"world_size": env.world_size, "steps_per_epoch": steps_per_epoch,
             "epochs": args.epochs}  # fmt: skip
    # Rank 0 decides whether to resume and tells the others (lesson 03's train.py says why).
    resume = torch.tensor(int(bool(args.checkpoint and args.checkpoint.exists())), device=device)
    dist.broadcast(resume, src=0)
    if resume.item():
        # Same data order and schedule only with the same shape: refuse another one.
        ckpt = load_checkpoint(args.checkpoint, CKPT_KEYS, expect=shape)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        set_rng_states(ckpt["rng"][env.rank])  # each rank's own generators, as they were
        start_epoch, start_step = ckpt["epoch"], ckpt["step"]
        if env.rank == 0:  # the partial epoch's loss, summed over all ranks when saved
            carried = ckpt["epoch_loss"].to(device)
        print0(f"resumed from {args.checkpoint} at epoch {start_epoch + 1}, step {start_step}")

    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    settle_gradient_buckets(ddp_model, train_x[:2])

    def checkpoint(epoch: int, step: int, epoch_loss: torch.Tensor) -> None:
        if not args.checkpoint:
            return
        # Every rank's random generators, not only rank 0's: anything random that differs by
        # rank (dropout, augmentation) then resumes exactly too.
        rng = [None] * env.world_size
        dist.all_gather_object(rng, rng_states())
        if env.rank == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch, "step": step,
                     "epoch_loss": epoch_loss.cpu(), "rng": rng, **shape}  # fmt: skip
            save_checkpoint(args.checkpoint, state)
        dist.barrier()  # nobody goes on, exits or reads the file before it is complete

    print0(f"training {args.epochs} epochs on {len(train_x)} images, world size "
           f"{env.world_size}, {steps_per_epoch} steps per epoch, device {device}")  # fmt: skip
    last_epoch = min(args.epochs, start_epoch + (args.epochs_per_run or args.epochs))
    for epoch in range(start_epoch, last_epoch):
        sampler.set_epoch(epoch)
        batches = torch.tensor(list(sampler), device=device).split(per_rank_batch)
        if args.log_order:  # the epoch, then this rank's image indices in the order it sees them
            args.log_order.mkdir(parents=True, exist_ok=True)
            with open(args.log_order / f"rank{env.rank}.txt", "a") as f:
                print(epoch + 1, *torch.cat(batches).tolist(), file=f)
        first = start_step if epoch == start_epoch else 0  # skip what a stopped run did
        epoch_loss = carried if epoch == start_epoch else torch.zeros_like(carried)
        t0 = time.perf_counter()
        for step in range(first, steps_per_epoch):
            maybe_crash(args, env.rank, epoch, step, resumed=bool(start_epoch or start_step))
            idx = batches[step]
            loss = F.cross_entropy(ddp_model(train_x[idx]), train_y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            epoch_loss[0] += loss.detach().double() * len(idx)
            epoch_loss[1] += len(idx)
            if (step + 1) % args.log_every == 0:
                print0(f"step  epoch {epoch + 1}/{args.epochs} | batch {step + 1}/"
                       f"{steps_per_epoch} | loss {loss.item():.4f}")  # fmt: skip
            if (step + 1) % args.stop_check_every == 0 and stop.agreed(device):
                # Every rank agreed at this same step: save exactly here, loss so far included.
                dist.all_reduce(epoch_loss)
                checkpoint(epoch, step + 1, epoch_loss)
                print0(f"stop requested (signal {stop.signum or 'on another rank'}): "
                       f"checkpoint saved at epoch {epoch + 1}, step {step + 1}; "
                       f"exiting with {REQUEUE_EXIT_CODE} to be requeued")  # fmt: skip
                return REQUEUE_EXIT_CODE
        train_time = time.perf_counter() - t0
        dist.all_reduce(epoch_loss)
        for buffer in model.buffers():  # evaluate and save rank 0's BatchNorm statistics
            dist.broadcast(buffer, src=0)  # (lesson 03's train.py says why)
        test_loss, test_acc = evaluate(model, test_x, test_y)
        train_loss = (epoch_loss[0] / epoch_loss[1]).item()
        print0(f"epoch {epoch + 1}/{args.epochs} | train_loss {train_loss:.4f} "
               f"| test_loss {test_loss:.4f} | test_acc {test_acc:.2f}% "
               f"| {epoch_loss[1].item() / train_time:.0f} samples/s "
               f"| epoch_time {time.perf_counter() - t0:.1f}s")  # fmt: skip
        checkpoint(epoch + 1, 0, torch.zeros_like(epoch_loss))

    if last_epoch < args.epochs:
        print0(f"this run's {args.epochs_per_run} epoch(s) done: {last_epoch}/{args.epochs}, "
               f"the next run continues from {args.checkpoint}")  # fmt: skip
    elif start_epoch >= args.epochs:
        print0(f"nothing to do: {args.checkpoint} has finished all {args.epochs} epochs")
    else:
        print0(f"done: test_acc {test_acc:.2f}% after {args.epochs} epochs")
    return 0


@record  # under torchrun: this rank's traceback goes to TORCHELASTIC_ERROR_FILE
def main(argv=None) -> int:
    args = parse_args(argv)
    # Listen before anything else: the default action of both signals ends the process,
    # even while it still waits for the other ranks to start.
    stop = StopRequest()
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
    except LaunchError as exc:  # no process group, so no rank 0 to leave it to: each says it
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except dist.DistError as exc:
        print(f"error: {init_error_message(env, exc)}", file=sys.stderr, flush=True)
        return 2
    try:
        if device.type == "cuda":
            # On the CPU the kernels used here already give the same bits every run; asking
            # anyway would cost every process seconds (torch loads its compiler package).
            make_deterministic()
        return train(args, env, device, stop)
    except (LaunchError, MnistDataError, CheckpointError) as exc:
        # Every rank meets the same problem; rank 0 says it, and the others wait until it has
        # (torchrun stops every rank as soon as one of them exits).
        print0(f"error: {exc}", file=sys.stderr)
        dist.barrier()
        return 2
    finally:
        dist.destroy_process_group()  # frees the group's resources (it is not a barrier)
        # What still points at the destroyed group (DDP's reducer, in reference cycles) is
        # freed now: left to interpreter exit, gloo's threads can abort the process (exit -6).
        gc.collect()


if __name__ == "__main__":
    sys.exit(main())
