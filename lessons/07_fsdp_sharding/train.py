"""Lesson 07: lesson 03's training loop with the model sharded by FSDP2 and checkpoints by DCP.

Every process of the job runs this file (srun starts one per GPU, see job.sh). Under DDP every
rank holds the whole model, its gradients and AdamW's two moments; here `fully_shard` splits
each of them across the ranks (each rank keeps 1/world_size of every parameter as a DTensor
shard), gathers a block's parameters just before the block runs, and reduce-scatters its
gradients right after its backward. Checkpoints are written by torch.distributed.checkpoint
(DCP): every rank writes its own shard, nobody gathers the model, and a checkpoint written by
4 ranks loads into 2 (or 1, or 3): the job can come back at another size.

`--wrap ddp` runs the same loop under DistributedDataParallel, to compare. Without SLURM, on
one machine (CPU, gloo), from the course root with the venv active:
    torchrun --standalone --nproc-per-node 2 lessons/07_fsdp_sharding/train.py --epochs 1 \
        --train-subset 4096 --checkpoint-dir checkpoints/fsdp-demo
    python lessons/07_fsdp_sharding/train.py --epochs 1 --checkpoint-dir checkpoints/fsdp-demo
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

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
from common.mnist import MnistDataError, build_optimizer, load_data

# "Stopped on request, checkpoint written, run me again" (EX_TEMPFAIL, as in lesson 05).
REQUEUE_EXIT_CODE = 75
# What a checkpoint continued must match: the model's shape and the recipe (not the world size).
RECIPE = ("width", "depth", "epochs", "batch_size", "lr", "seed", "train_subset")


class Block(nn.Module):
    """A residual MLP block: the unit that FSDP2 gathers, runs and frees as one."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    """MNIST as 784 numbers: a stem, `depth` blocks of `width`, a head. width 256, depth 4:
    1.3 M parameters; memory.py builds the same class at width 1024, depth 8 (34 M)."""

    def __init__(self, width: int = 256, depth: int = 4):
        super().__init__()
        self.stem = nn.Linear(28 * 28, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x.flatten(1))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shard_model(model: Net, precision: str) -> Net:
    """FSDP2: each block is one unit (gathered for its forward and backward, freed after), the
    root takes what is left (stem, head). Sharding only the root would gather the whole model
    at once, which is the memory that sharding was meant to save."""
    if precision == "bf16":
        # Parameters gathered and computed in bf16 (half the all-gather traffic and memory);
        # gradients reduced in fp32, since a sum over many ranks in bf16 (8 bits of mantissa)
        # loses small contributions; the optimizer updates the sharded fp32 "master weights".
        block_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root_mp = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
        )
    else:
        block_mp = root_mp = MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=block_mp)
    fully_shard(model, mp_policy=root_mp)
    return model


class StopRequest:
    """SIGUSR1 (time-limit warning) or SIGTERM (preemption) only sets a flag; the ranks act on it
    together at a safe point (lesson 05 explains why)."""

    def __init__(self):
        self.signum = None
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(signum, self._handler)

    def _handler(self, signum, frame) -> None:
        self.signum = self.signum or signum

    def agreed(self, device: torch.device) -> bool:
        # A rank that stopped alone would leave the others waiting in the next all-gather.
        flag = torch.tensor([0.0 if self.signum is None else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def print0(*args, **kwargs) -> None:
    """print() on rank 0, text and newline in one write: no other process's line lands between."""
    if dist.get_rank() == 0:
        print(" ".join(map(str, args)) + "\n", end="", flush=True, **kwargs)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=128, help="global batch, split over ranks")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of the one-cycle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--wrap", choices=("fsdp", "ddp"), default="fsdp")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                   help="auto: bf16 parameters on GPUs that have it, fp32 on the CPU")  # fmt: skip
    p.add_argument("--checkpoint-dir", type=Path,
                   help="DCP checkpoints: one folder per save, the newest is resumed")  # fmt: skip
    p.add_argument("--max-steps", type=int, default=0, help="stop after N steps in all (tests)")
    p.add_argument("--stop-check-every", type=int, default=5, help="steps between stop checks")
    p.add_argument("--log-every", type=int, default=50, help="a progress line every N steps")
    p.add_argument("--train-subset", type=int, default=0, help="use only the first N images")
    p.add_argument("--test-subset", type=int, default=0, help="evaluate on the first N images")
    args = p.parse_args(argv)
    if min(args.epochs, args.batch_size, args.width, args.depth, args.stop_check_every) < 1:
        p.error("--epochs, --batch-size, --width, --depth, --stop-check-every must be >= 1")
    return args


# --------------------------------------------------------------------------- DCP checkpoints

STEP_DIR = re.compile(r"step-(\d{8})")


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint folder under ``root`` (DCP writes .metadata last)."""
    found = [(int(m.group(1)), p) for p in root.glob("step-*")
             if (m := STEP_DIR.fullmatch(p.name)) and (p / ".metadata").is_file()]  # fmt: skip
    return max(found)[1] if found else None


def save(root: Path, step: int, model, optimizer, scheduler, progress: dict) -> float:
    """Every rank writes its own shard (no gather); returns the seconds it took."""
    t0 = time.perf_counter()
    final, tmp = root / f"step-{step:08d}", root / f".step-{step:08d}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed half-way
    dist.barrier()
    # get_state_dict: the model's and the optimizer's state keyed by parameter name (not by
    # the optimizer's parameter numbers), as DTensors: each rank hands DCP its own shards.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(),
             "progress": progress}  # fmt: skip
    dcp.save(state, checkpoint_id=tmp)  # returns on every rank once .metadata is written
    if dist.get_rank() == 0:
        os.replace(tmp, final)  # a folder rename is atomic: the next run sees all or nothing
        for old in sorted(root.glob("step-*"))[:-2]:  # keep the last two
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # nobody goes on (or exits, or is requeued) before the rename
    return time.perf_counter() - t0


def resume(root: Path, args, model, optimizer, scheduler, device) -> dict | None:
    """Load the newest checkpoint under ``root`` into this run, whatever world size wrote it."""
    # Rank 0 alone looks, and tells the others which one: on a shared filesystem another node
    # may not see a new folder yet (NFS caches lookups), and ranks must load the same step.
    path = latest_checkpoint(root) if dist.get_rank() == 0 else None
    step = torch.tensor(int(STEP_DIR.fullmatch(path.name).group(1)) if path else -1, device=device)
    dist.broadcast(step, src=0)
    if step.item() < 0:
        return None
    path = root / f"step-{step.item():08d}"
    fix = f"pass another --checkpoint-dir (CHECKPOINT_DIR) or delete {root} to start afresh"
    # The small part first: a checkpoint of another model or recipe is refused in one line
    # before DCP reports a shape mismatch for every tensor.
    progress = {"step": 0, "epoch": 0, "global_step": 0, "loss_sum": 0.0, "count": 0,
                "world_size": 0, "recipe": dict.fromkeys(RECIPE)}  # fmt: skip
    try:
        dcp.load({"progress": progress}, checkpoint_id=path)
    except (Exception, dcp.CheckpointException) as exc:  # the latter is a BaseException
        reason = dcp_failure(exc)
        raise CheckpointError(f"cannot read checkpoint {path} ({reason}); {fix}") from None
    want = {k: getattr(args, k) for k in RECIPE}
    if progress["recipe"] != want:
        diff = ", ".join(f"{k}={progress['recipe'].get(k)} (this run: {want[k]})"
                         for k in RECIPE if progress["recipe"].get(k) != want[k])  # fmt: skip
        raise CheckpointError(f"checkpoint {path} is from another run: {diff}; {fix}")
    t0 = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optimizer)  # this run's shards, to be filled
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict()}
    # Each rank reads the pieces of the saved shards that overlap the shards it now owns:
    # 4 ranks' quarters are read back as 2 ranks' halves, without a gather.
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])  # fmt: skip
    scheduler.load_state_dict(state["scheduler"])
    progress["path"], progress["load_s"] = path, time.perf_counter() - t0
    return progress


def dcp_failure(exc: BaseException) -> str:
    """The first line of what DCP met: a CheckpointException wraps each rank's error."""
    cause = next(iter(exc.failures.values()))[0] if hasattr(exc, "failures") else exc
    text = str(cause).strip()
    return (text.splitlines()[0] if text else type(cause).__name__)[:160]


# --------------------------------------------------------------------------- training


def evaluate(model, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000):
    """(loss, accuracy %) on the whole test set, each rank scoring a slice.  Every forward
    all-gathers each block from all ranks, so every rank runs the same number of batches (the
    slices differ by one image at most, a last batch may be empty): one more would wait for ever."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor_split(torch.arange(len(x), device=x.device), world_size)[rank]
    batches = -(-(len(x) // world_size + 1) // batch_size)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=x.device)  # loss sum, correct, count
    with torch.no_grad():
        for i in range(batches):
            idx = mine[i * batch_size : (i + 1) * batch_size]
            logits = model(x[idx]).float()
            totals[0] += F.cross_entropy(logits, y[idx], reduction="sum").double()
            totals[1] += (logits.argmax(dim=1) == y[idx]).sum()
            totals[2] += len(idx)
    model.train()
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, 100.0 * correct / count


def local_bytes(tensors) -> int:
    """Bytes of the tensors as this rank holds them (a DTensor: its local shard only)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def train(args: argparse.Namespace, env, device: torch.device, stop: StopRequest) -> int:
    """Train or resume until ``args.epochs``; return 0, or REQUEUE_EXIT_CODE when stopped."""
    if args.batch_size % env.world_size:
        # The global batch is the same set of images at any world size only when every rank
        # takes an equal share: then a run resumed on fewer ranks continues the same recipe.
        raise LaunchError(f"--batch-size {args.batch_size} is not a multiple of the world size "
                          f"{env.world_size}: pick one that is (96 and 192 suit 1, 2, 3 and 4 "
                          f"ranks)")  # fmt: skip
    precision = args.precision
    if precision == "auto":
        # including_emulation=False: by default torch counts a GPU that only emulates bf16
        # (V100, T4: no bf16 units, so slower than fp32) as supporting it.
        native = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        precision = "bf16" if native else "fp32"
    if precision == "bf16" and args.wrap == "ddp":
        raise LaunchError("--precision bf16 is FSDP2's MixedPrecisionPolicy: use it with "
                          "--wrap fsdp (DDP would need torch.autocast)")  # fmt: skip
    train_x, train_y, test_x, test_y = load_data(device, args.train_subset, args.test_subset)

    per_rank_batch = args.batch_size // env.world_size
    sampler = DistributedSampler(range(len(train_x)), env.world_size, env.rank, seed=args.seed)
    steps_per_epoch = -(-len(sampler) // per_rank_batch)

    # Every rank builds the same full model from the same seed and keeps its own slice: FSDP2
    # has no sync_module_states (FSDP1's broadcast from rank 0), the seed is the agreement.
    # (For a model that does not fit one rank, build it on the meta device: memory.py.)
    torch.manual_seed(args.seed)
    model = Net(args.width, args.depth).to(device)
    if args.wrap == "fsdp":
        model = shard_model(model, precision)
    else:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # After fully_shard: the optimizer sees the DTensor shards, so AdamW's moments are
    # created (and stay) sharded too.
    optimizer, scheduler = build_optimizer(model, args.lr, args.epochs * steps_per_epoch)

    start_epoch, start_step, done, loss_carry = 0, 0, 0, (0.0, 0)
    if args.checkpoint_dir:
        progress = resume(args.checkpoint_dir, args, model, optimizer, scheduler, device)
        if progress:
            start_epoch, start_step, done = (progress["epoch"], progress["step"],
                                             progress["global_step"])  # fmt: skip
            loss_carry = (progress["loss_sum"], progress["count"])
            print0(f"resumed from {progress['path']} at epoch {start_epoch + 1}, step "
                   f"{start_step}: saved by {progress['world_size']} ranks, loaded by "
                   f"{env.world_size} in {progress['load_s']:.2f} s")  # fmt: skip

    params = list(model.parameters())
    print0(
        f"training {args.epochs} epochs on {len(train_x)} images, world size "
        f"{env.world_size} ({env.num_nodes} node(s) x {env.local_world_size}), global batch "
        f"{args.batch_size} = {env.world_size} x {per_rank_batch}, {steps_per_epoch} steps per "
        f"epoch, {args.wrap} {precision}, {sum(p.numel() for p in params) / 1e6:.2f} M "
        f"parameters, rank 0 holds {local_bytes(params) / 2**20:.1f} MiB of them, device "
        f"{device}, backend {dist.get_backend()}"
    )
    if args.wrap == "fsdp":
        w = model.blocks[0].fc1.weight
        print0(f"blocks.0.fc1.weight: {type(w).__name__} {tuple(w.shape)} {w.placements}, "
               f"rank 0's shard {tuple(w.to_local().shape)}")  # fmt: skip

    test_acc = None
    if args.max_steps and done >= args.max_steps:
        print0(f"nothing to do: {done} steps done, --max-steps {args.max_steps}")
        return 0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        batches = torch.tensor(list(sampler), device=device).split(per_rank_batch)
        first = start_step if epoch == start_epoch else 0  # skip what the stopped run did
        loss_sum = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, samples
        if epoch == start_epoch and env.rank == 0:
            loss_sum += torch.tensor(loss_carry, dtype=torch.float64, device=device)
        t0, steps_run = time.perf_counter(), 0
        for step in range(first, steps_per_epoch):
            idx = batches[step]
            # FSDP2 all-gathers each block's parameters as the forward reaches it and frees
            # them after; backward gathers them again and reduce-scatters the gradients, so
            # each rank ends the step with the gradient of its own shard only.
            loss = F.cross_entropy(model(train_x[idx]).float(), train_y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()  # each rank updates its own shard (its part of AdamW's moments)
            scheduler.step()
            loss_sum[0] += loss.detach().double() * len(idx)
            loss_sum[1] += len(idx)
            done, steps_run = done + 1, steps_run + 1
            if (step + 1) % args.log_every == 0:
                print0(f"step  epoch {epoch + 1}/{args.epochs} | batch {step + 1}/"
                       f"{steps_per_epoch} | loss {loss.item():.4f} | lr "
                       f"{scheduler.get_last_lr()[0]:.2e}")  # fmt: skip
            at_limit = args.max_steps and done >= args.max_steps
            check = (step + 1) % args.stop_check_every == 0 and step + 1 < steps_per_epoch
            if at_limit or (check and stop.agreed(device)):
                dist.all_reduce(loss_sum)  # the epoch's loss so far, over all ranks
                progress = _progress(args, epoch, step + 1, done, loss_sum, env)
                why = f"--max-steps {args.max_steps}" if at_limit else (
                    f"signal {stop.signum or 'on another rank'}")  # fmt: skip
                if args.checkpoint_dir:
                    secs = save(args.checkpoint_dir, done, model, optimizer, scheduler, progress)
                    print0(f"stop ({why}): checkpoint step-{done:08d} saved at epoch "
                           f"{epoch + 1}, step {step + 1} by {env.world_size} ranks in "
                           f"{secs:.2f} s" + ("" if at_limit else "; exiting with 75"))  # fmt: skip
                else:
                    print0(f"stop ({why}) at epoch {epoch + 1}, step {step + 1}, no checkpoint")
                return 0 if at_limit else REQUEUE_EXIT_CODE
        train_time = time.perf_counter() - t0

        dist.all_reduce(loss_sum)  # each rank saw its own share: sum over all ranks
        test_loss, test_acc = evaluate(model, test_x, test_y)
        train_loss = (loss_sum[0] / loss_sum[1]).item()
        rate = steps_run * args.batch_size / train_time
        print0(f"epoch {epoch + 1}/{args.epochs} | train_loss {train_loss:.4f} | test_loss "
               f"{test_loss:.4f} | test_acc {test_acc:.2f}% | {rate:.0f} samples/s | epoch_time "
               f"{time.perf_counter() - t0:.1f}s")  # fmt: skip
        if args.checkpoint_dir:
            progress = _progress(args, epoch + 1, 0, done, torch.zeros(2), env)
            secs = save(args.checkpoint_dir, done, model, optimizer, scheduler, progress)
            print0(f"checkpoint step-{done:08d} saved by {env.world_size} ranks in {secs:.2f} s")
    if test_acc is not None:
        print0(f"done: test_acc {test_acc:.2f}% after {args.epochs} epochs")
    else:
        print0(f"nothing to do: {args.checkpoint_dir} has finished all {args.epochs} epochs")
    return 0


def _progress(args, epoch, step, done, loss_sum, env) -> dict:
    recipe = {k: getattr(args, k) for k in RECIPE}
    return {"epoch": epoch, "step": step, "global_step": done, "loss_sum": float(loss_sum[0]),
            "count": int(loss_sum[1]), "world_size": env.world_size, "recipe": recipe}


def not_a_folder(path: Path) -> str:
    """Why ``path`` cannot be (or become) a folder: it, or a folder above it, is a file."""
    for place in (path, *path.parents):
        if place.is_dir():
            return ""
        if place.exists():
            return "is a file, not a folder" if place == path else f"is under {place}, a file"
    return ""


def main(argv=None) -> int:
    args = parse_args(argv)
    stop = StopRequest()  # before anything slow: the default action of SIGUSR1 ends the process
    # A file where the folder should be: said now, by every rank and before the process group,
    # not as DCP's NotADirectoryError at the first save, after the training.
    if args.checkpoint_dir and (problem := not_a_folder(args.checkpoint_dir)):
        print(f"error: --checkpoint-dir {args.checkpoint_dir} {problem}: give a folder (it is "
              "created if missing), e.g. --checkpoint-dir checkpoints/fsdp-demo",
              file=sys.stderr, flush=True)  # fmt: skip
        return 2
    env = None
    try:
        # Who am I? Rank, local rank, world size, rank 0's host and port: from srun's SLURM_*
        # variables or torchrun's RANK/WORLD_SIZE/MASTER_*, checked (common/env.py).
        env = resolve_launch_env()
        check_launch(env)
        torch.set_num_threads(cpu_threads(env))  # this process's share of its task's CPUs
        if torch.cuda.is_available():
            device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))
            torch.cuda.set_device(device)  # before the group: NCCL, CUDA and FSDP use this GPU
        else:
            check_cuda_usable()  # GPUs that torch cannot see are an error, not a CPU run
            device = torch.device("cpu")
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{env.master_addr}:{env.master_port}",  # rank 0 hosts the store
            rank=env.rank,
            world_size=env.world_size,
            timeout=dist_timeout(),  # bounds the rendezvous and every collective: no silent hang
            device_id=device if device.type == "cuda" else None,  # NCCL binds to it at once
        )
    except LaunchError as exc:  # no process group, so no rank 0 to leave it to: each says it
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except dist.DistError as exc:  # the others never came, or rank 0's address did not answer
        print(f"error: {init_error_message(env, exc)}", file=sys.stderr, flush=True)
        return 2
    try:
        return train(args, env, device, stop)
    except (LaunchError, MnistDataError, CheckpointError) as exc:
        # Every rank meets the same problem; rank 0 alone says it (all ranks exit with 2). The
        # others wait until it has: torchrun stops every rank as soon as one of them exits.
        print0(f"error: {exc}", file=sys.stderr)
        dist.barrier()
        return 2
    finally:
        dist.destroy_process_group()  # frees the group's resources (it is not a barrier)
        # What still points at the destroyed group (the sharded model, DTensors in cycles) goes
        # now: left to interpreter exit, gloo's threads can abort the process (exit -6).
        gc.collect()


if __name__ == "__main__":
    sys.exit(main())
