"""Lesson 10, part 4: reshard. A checkpoint saved from lesson 09's 2-D mesh (TP inside a node,
FSDP2 across nodes) resumed as plain FSDP2 on 2 ranks, and loaded into one process with no
process group: the parameters and AdamW's state equal, bit for bit, every time.

    srun --ntasks 4 python lessons/10_fit_and_keep/reshard.py save DIR     # (dp, tp) = (2, 2)
    srun --ntasks 2 python lessons/10_fit_and_keep/reshard.py resume DIR   # FSDP2 over 2
    python lessons/10_fit_and_keep/reshard.py plain DIR                    # one process

DCP stores each tensor by its name (its FQN) and its global shape, with the pieces each rank
wrote and where they sit in the whole; `get_state_dict` names the optimizer state by the same
FQNs. A reader asks for the pieces its own layout needs, whatever layout wrote them: 2-D to
1-D to none is a load, not a conversion. `save` also writes reference.pt, the whole state
gathered on rank 0 (full_state_dict), which the other two compare with.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import loss_parallel

from common.env import LaunchError, resolve_launch_env
from common.launch import (
    check_cuda_usable,
    check_launch,
    cpu_threads,
    cuda_device_index,
    dist_timeout,
    init_error_message,
)

# Lesson 09's model and its 2-D layout (tp.py's shard_2d), as lesson 09 trains them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "09_beyond_data_parallel"))
from tinylm import TinyLM, batch, corpus, loss_fn  # noqa: E402
from tp import shard_2d, sum_partial_grads  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))
from fit import count, parse_or_why  # noqa: E402  (the lesson's one-line refusal of --tp 0)

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], exit_on_error=False)
    p.add_argument("stage", help="save (the 2-D run), resume (FSDP2) or plain (one process)")
    p.add_argument("dir", help="the checkpoint folder: a folder every rank sees")
    p.add_argument("--tp", type=count("--tp", "ranks per tp group", "tasks per node"),
                   help="save: ranks per tp group (default: tasks per node)")  # fmt: skip
    return parse_or_why(p, argv)  # a refused value: args.why (main says it)


def check_args(args, world: int | None) -> str:
    """Why the arguments cannot be run, in one line; empty when they can."""
    if args.why:
        return args.why
    if args.stage not in ("save", "resume", "plain"):
        return f"{args.stage} is not a stage: pass save, resume or plain (then the folder)"
    if args.stage != "save" and not (Path(args.dir) / "dcp" / ".metadata").is_file():
        return (f"no checkpoint in {args.dir} (no dcp/.metadata): run `reshard.py save "
                f"{args.dir}` with the ranks of a job first (reshard.sh)")  # fmt: skip
    if args.stage == "save" and world is not None:
        tp = args.tp
        if world % tp or world // tp < 2:
            return (f"--tp {tp} on {world} ranks: save runs on a (dp, tp) mesh, dp = world / tp "
                    f"of 2 or more; pass a --tp that divides {world}, at most {world // 2}")
    return ""


def flat(model_sd: dict, optim_sd: dict) -> dict[str, object]:
    """Every tensor and number of the state, by one name: model.<fqn>, optim.<fqn>.<key>,
    optim.param_groups. (Empty on ranks other than 0 under FULL: rank 0 gathers.)"""
    out = {f"model.{k}": v for k, v in model_sd.items()}
    for fqn, state in optim_sd.get("state", {}).items():
        out |= {f"optim.{fqn}.{k}": v for k, v in state.items()}
    if "param_groups" in optim_sd:
        out["optim.param_groups"] = optim_sd["param_groups"]
    return out


def compare(state: dict, reference: dict) -> str:
    """'N of N model tensors, M of M optimizer entries equal' (bitwise), and what differs."""
    def same(a, b) -> bool:
        if torch.is_tensor(a) and torch.is_tensor(b):
            return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return a == b

    missing = sorted(set(reference) ^ set(state))
    equal = [k for k in reference if k in state and same(state[k], reference[k])]
    model = sum(k.startswith("model.") for k in reference)
    line = (f"{sum(k.startswith('model.') for k in equal)} of {model} model tensors, "
            f"{sum(k.startswith('optim.') for k in equal)} of {len(reference) - model} AdamW "
            "entries (exp_avg, exp_avg_sq, step per parameter; the param groups) equal, bit for "
            "bit")
    differ = [k for k in reference if k not in equal]
    return line + (f"; differ: {', '.join(differ[:5])}; missing: {missing[:5]}" if differ else "")


def new_model() -> TinyLM:
    torch.manual_seed(1)  # not the saved weights: equality below means the load worked
    return TinyLM()  # lesson 09's defaults: dim 128, 4 heads, hidden 512, 4 layers


def save(args, env, device) -> bool:
    dp = env.world_size // args.tp
    # Lesson 09's 2-D layout: the rows of the mesh are the tp groups, within a node.
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = shard_2d(TinyLM().to(device), mesh, sequence_parallel=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data, gen = corpus(), torch.Generator().manual_seed(1000 + mesh.get_local_rank("dp"))
    for _ in range(3):
        x, y = (t.to(device) for t in batch(data, 16, 64, gen))
        with loss_parallel():
            loss_fn(model(x), y).backward()
        sum_partial_grads(model)
        optimizer.step()
        optimizer.zero_grad()
    wq = model.layers["0"].attention.wq.weight
    model_sd, optim_sd = get_state_dict(model, optimizer)  # DTensors: each rank its pieces
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=Path(args.dir) / "dcp")
    # Gathering a weight split over both dims of the mesh takes two all-gathers; torch's warning
    # says so on every call. Quiet here: it is what this reference costs, once.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    full = flat(*get_state_dict(model, optimizer, options=FULL))  # gathered: a collective
    if env.rank == 0:
        torch.save(full, Path(args.dir) / "reference.pt")
        print(f"saved from the (dp, tp) = ({dp}, {args.tp}) mesh of {env.world_size} ranks on "
              f"{env.num_nodes} node(s): layers.0.attention.wq.weight {wq.placements}, rank 0 "
              f"holds {tuple(wq.to_local().shape)} of {tuple(wq.shape)}; "
              f"{len(full)} entries in reference.pt", flush=True)  # fmt: skip
    return True


def resume(args, env, device) -> bool:
    mesh = init_device_mesh(device.type, (env.world_size,))
    model = new_model().to(device)
    for block in model.layers.values():  # plain FSDP2, as lesson 07 shards
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # get_state_dict creates AdamW's state (it has none before a step) so that there is
    # something to load into; set_state_dict puts the loaded pieces in place.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=Path(args.dir) / "dcp")
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])  # fmt: skip
    wq = model.layers["0"].attention.wq.weight
    full = flat(*get_state_dict(model, optimizer, options=FULL))
    if env.rank != 0:
        return True
    reference = torch.load(Path(args.dir) / "reference.pt", weights_only=True)
    line = compare(full, reference)
    print(f"resumed as FSDP2 over {env.world_size} ranks: layers.0.attention.wq.weight "
          f"{wq.placements}, rank 0 holds {tuple(wq.to_local().shape)}; {line}", flush=True)
    return "differ" not in line


def plain(args) -> bool:
    model = new_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=Path(args.dir) / "dcp")
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])  # fmt: skip
        full = flat(*get_state_dict(model, optimizer))
    reference = torch.load(Path(args.dir) / "reference.pt", weights_only=True)
    line = compare(full, reference)
    print(f"loaded into one process, no process group: {line}", flush=True)
    return "differ" not in line


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.why or args.stage != "save":  # resume needs a checkpoint; plain: one process
        if why := check_args(args, None):
            print(f"error: {why}", file=sys.stderr, flush=True)
            return 2
        if args.stage == "plain":
            return 0 if plain(args) else 1
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
        args.tp = args.tp or env.local_world_size
        # Refused before the process group, by every rank; rank 0 says it.
        if why := check_args(args, env.world_size):
            if env.rank == 0:
                print(f"error: {why}", file=sys.stderr, flush=True)
            return 2
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
        ok = (save if args.stage == "save" else resume)(args, env, device)
        flag = torch.tensor([int(ok)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # rank 0 compared: every rank exits so
        return 0 if flag.item() else 1
    finally:
        dist.destroy_process_group()
        gc.collect()  # the mesh and the DTensors go now, not at exit (lesson 09's tp.py)


if __name__ == "__main__":
    sys.exit(main())
