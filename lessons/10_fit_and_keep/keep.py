"""Lesson 10, part 3: keep it. A sharded DCP checkpoint of an FSDP2 model, converted to one
safetensors file that a plain `load_state_dict` reads in one process, and read back into FSDP2.

    srun --ntasks 4 python lessons/10_fit_and_keep/keep.py --dir checkpoints/keep   # in a job
    python lessons/10_fit_and_keep/keep.py --check checkpoints/keep                  # 1 process

With the ranks of a job (keep.sh: 2 nodes x 2 tasks):
1. train two steps with FSDP2 and save the training checkpoint with DCP: every rank writes its
   own shards (model and AdamW state) to DIR/dcp, nothing is gathered;
2. a fresh FSDP2 model loads it (a resume), and saves its model again through
   HuggingFaceStorageWriter: every rank writes its shards to DIR/hf/sharded, then the
   coordinator (rank 0) reads them all and writes DIR/hf/model-00001-of-00001.safetensors and
   model.safetensors.index.json, the layout Hugging Face's loaders read;
3. HuggingFaceStorageReader reads that file back into a third FSDP2 model: every rank's shards
   equal the trained ones, bit for bit.
With --check, one process and no process group: `safetensors.torch.load_file` and
`model.load_state_dict(..., strict=True)`, compared with the DCP checkpoint read into a plain
model (DCP reads without a process group too).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from common.env import LaunchError, resolve_launch_env
from common.launch import (
    check_cuda_usable,
    check_launch,
    cpu_threads,
    cuda_device_index,
    dist_timeout,
    init_error_message,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fit import DEFAULT_BATCH, build  # noqa: E402
from model import CONFIGS, GPT, loss_fn, random_batch  # noqa: E402

SAFETENSORS = "model-00001-of-00001.safetensors"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", help="where to write dcp/ and hf/: a folder every rank sees")
    p.add_argument("--check", metavar="DIR", help="one process: read DIR/hf with safetensors")
    p.add_argument("--model", default="lesson", help=f"one of {', '.join(CONFIGS)}")
    return p.parse_args(argv)


def check_args(args) -> str:
    """Why the arguments cannot be run, in one line; empty when they can."""
    # Without the package DCP's writer fails late, with a CheckpointException, and leaves a
    # 0-byte file behind: say so before anything is written.
    if importlib.util.find_spec("safetensors") is None:
        return ("the safetensors package is not installed: pip install -r requirements.txt "
                "(HuggingFaceStorageWriter/Reader write and read through it)")  # fmt: skip
    if args.model not in CONFIGS or args.model == "llama3-8b":
        return f"--model {args.model} is not one of lesson, tiny: pass e.g. --model tiny"
    if bool(args.dir) == bool(args.check):
        return "pass --dir DIR (with the ranks of a job) or --check DIR (one process), not both"
    if args.check and not (Path(args.check) / "hf" / SAFETENSORS).is_file():
        return (f"--check {args.check}: no {Path(args.check) / 'hf' / SAFETENSORS}; run "
                "keep.py --dir with the ranks of a job first (keep.sh)")  # fmt: skip
    return ""


def shards(model) -> dict[str, torch.Tensor]:
    """This rank's pieces of the model's tensors (a DTensor's local shard)."""
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
            for k, v in model.state_dict().items()}  # fmt: skip


def all_ranks_see(path: Path, rank: int, device) -> bool:
    """DCP's consolidation runs on rank 0 and reads every rank's shard files, and every rank
    reads the checkpoint back: DIR must be one folder for all of them (a shared filesystem),
    not a node-local /tmp. Rank 0 leaves a mark there; every rank looks for it."""
    token = torch.tensor([os.getpid()], device=device)
    dist.broadcast(token, src=0)  # rank 0's name for the mark, on every rank
    mark = path / f".seen-by-all-{token.item()}"
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        mark.touch()
    dist.barrier()
    seen = torch.tensor([int(mark.exists())], device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MIN)
    dist.barrier()
    if rank == 0:
        mark.unlink()
    return bool(seen.item())


def say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def run(args, env, device) -> int:
    c = CONFIGS[args.model]
    path = Path(args.dir).resolve()
    if not all_ranks_see(path, env.rank, device):
        if env.rank == 0:
            print(f"error: --dir {args.dir} is not the same folder on every node: DCP's "
                  "consolidation reads every rank's shards on rank 0; pass a folder on a shared "
                  "filesystem (the course root is one on the local cluster)", file=sys.stderr,
                  flush=True)  # fmt: skip
        return 2
    mesh = init_device_mesh(device.type, (env.world_size,))
    batch, seq_len = DEFAULT_BATCH[args.model]

    # 1. Train, and save the training checkpoint: each rank its shards, in parallel.
    model, optimizer = build(c, mesh, ac=False, bf16=False, device=device)
    x, y = random_batch(c, batch, seq_len, 1000 + env.rank, device)
    for _ in range(2):
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    trained = shards(model)
    model_sd, optim_sd = get_state_dict(model, optimizer)  # sharded: DTensors, no gathering
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path / "dcp")
    files = sorted(p.name for p in (path / "dcp").iterdir())
    say(env.rank, f"1. saved {path.name}/dcp with DCP from {env.world_size} ranks on "
                  f"{env.num_nodes} node(s): {', '.join(files)}")  # fmt: skip
    del model, optimizer

    # 2. Resume into a fresh FSDP2 model (any seed: every value is overwritten), then write the
    # model through HuggingFaceStorageWriter. save_distributed: each rank writes its shards;
    # enable_consolidation: rank 0 then joins them into one file of whole tensors.
    model, optimizer = build(c, mesh, ac=False, bf16=False, device=device)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path / "dcp")
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])  # fmt: skip
    resumed = all(torch.equal(v, trained[k]) for k, v in shards(model).items())
    writer = HuggingFaceStorageWriter(str(path / "hf"), save_distributed=True,
                                      enable_consolidation=True)  # fmt: skip
    dcp.save(model.state_dict(), storage_writer=writer)
    hf = sorted(p.name + ("/" if p.is_dir() else "") for p in (path / "hf").iterdir())
    say(env.rank, f"2. resumed from dcp (shards equal: {resumed}); wrote {path.name}/hf: "
                  f"{', '.join(hf)}")  # fmt: skip
    del model, optimizer

    # 3. The safetensors file read back into FSDP2: each rank reads the slices it holds.
    torch.manual_seed(1)  # other initial values, so that equality means the read worked
    model, _ = build(c, mesh, ac=False, bf16=False, device=device)
    state = model.state_dict()
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path / "hf")))
    model.load_state_dict(state)
    equal = torch.tensor([int(all(torch.equal(v, trained[k])
                                  for k, v in shards(model).items()))], device=device)  # fmt: skip
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    say(env.rank, f"3. read {path.name}/hf/{SAFETENSORS} back into FSDP2 with "
                  f"HuggingFaceStorageReader: every rank's shards equal the trained ones: "
                  f"{bool(equal.item())}")  # fmt: skip
    return 0 if resumed and equal.item() else 1


def check(args) -> int:
    """One process, no process group: what a user of the exported model does."""
    from safetensors.torch import load_file

    c = CONFIGS[args.model]
    path = Path(args.check)
    model = GPT(c)
    tensors = load_file(path / "hf" / SAFETENSORS)
    model.load_state_dict(tensors, strict=True)  # every key, every shape: or it raises
    # The training checkpoint, read by DCP into a plain model (no process group needed).
    reference = GPT(c).state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": reference}, checkpoint_id=path / "dcp")
    same = [k for k, v in model.state_dict().items() if torch.equal(v, reference[k])]
    size = (path / "hf" / SAFETENSORS).stat().st_size
    print(f"{SAFETENSORS}: {len(tensors)} tensors, {size / 2**20:.1f} MiB; load_state_dict(strict="
          f"True) took them all; equal to the DCP checkpoint, bit for bit: {len(same)} of "
          f"{len(reference)}", flush=True)  # fmt: skip
    return 0 if len(same) == len(reference) else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if why := check_args(args):  # refused before the process group, in one line
        print(f"error: {why}", file=sys.stderr, flush=True)
        return 2
    if args.check:  # one process: no process group, no set-up to do
        return check(args)
    env = None
    try:
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
        return run(args, env, device)
    finally:
        dist.destroy_process_group()
        gc.collect()


if __name__ == "__main__":
    sys.exit(main())
