"""Lesson 09: tensor parallelism (Megatron-style) and 2D parallelism (TP x FSDP2) on a DeviceMesh.

Every process of the job runs this file (srun starts one per task, see tp.sh and 2d.sh). The
ranks form a 2-D mesh (dp, tp): the `tp` ranks of one row split every layer of the model
between them (each holds a slice of every weight, and they exchange activations inside each
block), the `dp` rows each see their own data and shard the already-split weights once more
with FSDP2. `--tp` = the world size (the default on one node) is plain tensor parallelism.

Without SLURM, on one machine (CPU, gloo), from the course root with the venv active:
    torchrun --standalone --nproc-per-node 2 lessons/09_beyond_data_parallel/tp.py --steps 20
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tinylm import TinyLM, batch, corpus, loss_fn  # noqa: E402

from common.env import LaunchError, resolve_launch_env  # noqa: E402
from common.launch import check_launch, cuda_device_index, dist_timeout  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=0,
                   help="tensor-parallel degree (default: the tasks on one node)")  # fmt: skip
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="shard the norms' activations along the sequence")  # fmt: skip
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16, help="per dp rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--count-comms", action="store_true",
                   help="count the collectives of one step (CommDebugMode)")  # fmt: skip
    return p.parse_args(argv)


def check_shapes(args, world_size: int) -> str:
    """Why this mesh cannot split this model, as one line (empty when it can)."""
    tp = args.tp
    if tp < 1 or world_size % tp:
        return (f"--tp {tp} does not divide the world size {world_size}: the mesh is "
                f"(dp, tp) = (world/tp, tp); pass a divisor of {world_size}, e.g. --tp "
                f"{world_size}")  # fmt: skip
    for flag, value in (("--heads", args.heads), ("--hidden", args.hidden), ("--dim", args.dim)):
        if value % tp:
            return (f"--tp {tp} does not divide {flag} {value}: each tp rank holds "
                    f"{flag[2:]}/tp of every layer; pass a --tp that divides {value} or a "
                    f"{flag} that --tp divides")  # fmt: skip
    if args.sequence_parallel and args.seq_len % tp:
        return (f"--tp {tp} does not divide --seq-len {args.seq_len}: sequence parallelism "
                "splits the sequence over the tp ranks; pass a --seq-len that --tp divides or "
                "--no-sequence-parallel")  # fmt: skip
    return ""


def tp_plan(model: TinyLM, tp_mesh, sequence_parallel: bool) -> TinyLM:
    """Megatron's split: in each pair of linear layers the first is split by columns (each rank
    computes some heads, some hidden units: no exchange), the second by rows (each rank holds a
    partial sum of the output: one all-reduce). With sequence parallelism the all-reduce becomes
    a reduce-scatter along the sequence (the norms and residuals then run on 1/tp of the
    tokens) and an all-gather before the next pair."""
    seq = Shard(1) if sequence_parallel else Replicate()  # what flows between the blocks
    parallelize_module(model, tp_mesh, {
        # Embedding tables split by rows (vocabulary / positions): each rank looks up the rows
        # it has and the partial results are summed (scattered along the sequence under SP).
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
        # Output layer split by columns = by vocabulary: each rank has the logits of 1/tp of
        # the bytes, and loss_parallel computes the cross-entropy without gathering them.
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                  use_local_output=False),  # fmt: skip
    })  # fmt: skip
    for block in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
            # The attention and the MLP need the whole sequence (under SP: all-gather it
            # here). Their input as one DTensor also means that the gradients of wq, wk and
            # wv are summed locally first and exchanged once, not once per layer.
            "attention": PrepareModuleInput(input_layouts=(seq,),
                                            desired_input_layouts=(Replicate(),)),  # fmt: skip
            "feed_forward": PrepareModuleInput(input_layouts=(seq,),
                                               desired_input_layouts=(Replicate(),)),  # fmt: skip
        }
        if sequence_parallel:
            plan |= {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()}
        parallelize_module(block, tp_mesh, plan)
    return model


def sum_partial_grads(model) -> None:
    """Under sequence parallelism each rank ran the norms on its part of the sequence, so the
    norms' weight gradients are partial sums (placement Partial). Sum them over the tp group
    once, here; left Partial, every use by the optimizer would sum them again (AdamW reads a
    gradient three times). FSDP2 does this itself in its backward."""
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)


def tp_groups_within_nodes(mesh, node_rank: int, device) -> str:
    """TP exchanges activations in every block, forward and backward: its ranks must share a
    node's fast links. Each rank says which node it is on; every tp group (a row of the mesh)
    must name one. Returns why not, as one line (empty when they do)."""
    nodes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(nodes, torch.tensor([node_rank], device=device))
    for row in mesh.mesh.tolist():  # the global ranks of each tp group
        on = sorted({int(nodes[r]) for r in row})
        if len(on) > 1:
            return (f"tp group of ranks {row} spans nodes {on}: --tp {len(row)} is more than "
                    "the tasks per node (the ranks are numbered node by node); pass --tp <tasks "
                    "per node> or a divisor of it")  # fmt: skip
    return ""


def print0(*args) -> None:
    if dist.get_rank() == 0:
        print(" ".join(map(str, args)) + "\n", end="", flush=True)


def show_placements(model: TinyLM, mesh) -> None:
    """What a DTensor is: a global shape, a mesh, one placement per mesh dimension, and the
    local piece this rank holds."""
    demo = distribute_tensor(torch.arange(8.0).reshape(2, 4), mesh["tp"], [Shard(1)])
    full = demo.full_tensor().tolist()  # a collective: every rank takes part
    print0(f"distribute_tensor(arange(8).reshape(2, 4), mesh['tp'], [Shard(1)]): "
           f"rank 0 holds {demo.to_local().tolist()}, full {full}")  # fmt: skip
    block = model.layers["0"]
    for name, param in (("layers.0.attention.wq.weight", block.attention.wq.weight),
                        ("layers.0.attention.wo.weight", block.attention.wo.weight),
                        ("layers.0.attention_norm.weight", block.attention_norm.weight),
                        ("output.weight", model.output.weight)):  # fmt: skip
        kind = type(param).__name__
        placements = getattr(param, "placements", "-")
        local = tuple(param.to_local().shape) if kind == "DTensor" else tuple(param.shape)
        print0(f"  {name}: {kind} {tuple(param.shape)} {placements}, rank 0 holds {local}")


def count_comms(model, optimizer, x, y, tp: int) -> None:
    """The collectives of one training step, counted by CommDebugMode: DTensor's (the TP
    plan's) and the c10d ones FSDP2 runs. The step is taken (it is the first of the run)."""
    comm = CommDebugMode()
    with comm, loss_parallel():
        loss_fn(model(x), y).backward()
    step = CommDebugMode()
    with step:
        sum_partial_grads(model)
        optimizer.step()
    optimizer.zero_grad()

    def fmt(counts) -> str:
        return ", ".join(f"{op.__name__} {n}" for op, n in sorted(counts.items(), key=str)) or "-"

    # Keyed "<class>.<name>" ("TinyLM.layers.0", "FSDPTinyLM.layers.0" once sharded).
    per_module = {fqn.partition(".")[2] or fqn: c for fqn, c in comm.comm_module_counts.items()}
    empty = {"forward": {}, "backward": {}}
    for fqn in ("tok_embeddings", "pos_embeddings", "layers.0", "output"):
        c = per_module.get(fqn, empty)
        print0(f"  collectives {fqn:<15} forward: {fmt(c['forward'])} | "
               f"backward: {fmt(c['backward'])}")  # fmt: skip
    # With --tp 1 nothing is exchanged and CommDebugMode records no module at all.
    model_total = next((c for fqn, c in comm.comm_module_counts.items() if "." not in fqn
                        and fqn != "Global"), empty)  # fmt: skip
    # What runs outside the model's modules: loss_parallel's reductions over the tp group.
    outside = {op: n - model_total["forward"].get(op, 0)
               for op, n in per_module.get("Global", empty)["forward"].items()}  # fmt: skip
    print0(f"  collectives {'loss_parallel':<15} forward: "
           f"{fmt({op: n for op, n in outside.items() if n})}")  # fmt: skip
    print0(f"  collectives {'partial grads':<15} {fmt(step.get_comm_counts())}")
    print0(f"  collectives in all (tp={tp}, {len(model.layers)} blocks): "
           f"{fmt(comm.get_comm_counts())}")  # fmt: skip


def shard_2d(model: TinyLM, mesh, sequence_parallel: bool) -> TinyLM:
    """TP over mesh["tp"], then, with more than one dp row, FSDP2 over mesh["dp"] (compare.py
    builds its 2D form with this too)."""
    tp_plan(model, mesh["tp"], sequence_parallel)
    if mesh["dp"].size() > 1:
        # FSDP2 across the dp dimension only: its all-gathers and reduce-scatters cross the
        # nodes; the TP collectives, many per block, stay inside a node. (The whole 2-D mesh,
        # fully_shard(..., mesh=mesh), fails on these TP-split blocks: show_whole_mesh_trap.)
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        # FSDP2 warns that the root returns a view (the logits): nothing changes it in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    return model


def show_whole_mesh_trap(args, mesh, device) -> None:
    """fully_shard(block, mesh=mesh) with the whole (dp, tp) mesh, on throwaway models. On a
    TP-split block FSDP2 joins its mesh to the parameters' tp mesh, and the two overlap: it
    raises. On a block with no TP the 2-D mesh means HSDP: whole copies across dim 0 (dp), shards
    across dim 1 (tp)."""
    torch.manual_seed(0)
    split = TinyLM(args.dim, args.heads, args.hidden, 1, args.seq_len).to(device)
    tp_plan(split, mesh["tp"], args.sequence_parallel)
    try:
        fully_shard(split.layers["0"], mesh=mesh)
        outcome = "no error"
    except RuntimeError as exc:  # the error this shows: anything else is a failure
        outcome = f"RuntimeError: {str(exc).splitlines()[0]}"
    print0(f"fully_shard(block, mesh=<(dp, tp) mesh>) on a TP-split block: {outcome}")
    whole = TinyLM(args.dim, args.heads, args.hidden, 1, args.seq_len).to(device)
    fully_shard(whole.layers["0"], mesh=mesh)
    wq = whole.layers["0"].attention.wq.weight
    print0(f"fully_shard(block, mesh=<(dp, tp) mesh>) on a block with no TP: HSDP, wq.weight "
           f"{wq.placements}, rank 0 holds {tuple(wq.to_local().shape)} of {tuple(wq.shape)}")


def train(args, env, device) -> int:
    world = env.world_size
    dp = world // args.tp
    # The mesh is (dp, tp) over ranks numbered node by node, so each row (one tp group) is
    # consecutive ranks: on one node when --tp divides the tasks per node.
    mesh = init_device_mesh(device.type, (dp, args.tp), mesh_dim_names=("dp", "tp"))
    if why := tp_groups_within_nodes(mesh, env.node_rank, device):
        if env.rank == 0:  # every rank knows it (the all-gather); one says it
            print(f"error: {why}", file=sys.stderr, flush=True)
        return 2
    print0(f"mesh (dp, tp) = ({dp}, {args.tp}) over {world} ranks on {env.num_nodes} node(s): "
           f"tp groups {mesh.mesh.tolist()}, each within one node")  # fmt: skip

    if dp > 1:
        show_whole_mesh_trap(args, mesh, device)
    torch.manual_seed(0)  # the same initial weights on every rank, before they are split
    model = TinyLM(args.dim, args.heads, args.hidden, args.layers, args.seq_len).to(device)
    shard_2d(model, mesh, args.sequence_parallel)
    show_placements(model, mesh)
    params = sum(p.numel() for p in model.parameters())
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    print0(f"{params / 1e6:.2f} M parameters, rank 0 holds {held / 1e6:.3f} M "
           f"({held / params:.0%}); sequence parallel: {args.sequence_parallel}")  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    data = corpus()
    # The ranks of one tp group must see the same batch (they compute one model together);
    # the dp rows see different ones.
    gen = torch.Generator().manual_seed(1000 + mesh.get_local_rank("dp"))
    if args.count_comms:
        x, y = (t.to(device) for t in batch(data, args.batch_size, args.seq_len, gen))
        count_comms(model, optimizer, x, y, args.tp)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in batch(data, args.batch_size, args.seq_len, gen))
        # The logits are a DTensor split by vocabulary; loss_parallel's cross-entropy works on
        # the split (a max and a sum over the tp group), never gathering (batch, seq, 128).
        with loss_parallel():
            loss = loss_fn(model(x), y)
            loss.backward()
        sum_partial_grads(model)
        optimizer.step()
        optimizer.zero_grad()
        if step % args.log_every == 0 or step == args.steps:
            # Each dp row has its own loss: average them for the line (tp ranks agree).
            value = loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss
            value = value.detach().clone()
            dist.all_reduce(value)
            tokens = step * dp * args.batch_size * args.seq_len
            print0(f"step {step:4d} | loss {value.item() / world:.3f} | "
                   f"{tokens / (time.perf_counter() - t0):.0f} tokens/s")  # fmt: skip
    print0(f"done: {args.steps} steps in {time.perf_counter() - t0:.1f} s")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        # Who am I: rank, world size, node (by node from SLURM_NODEID, SLURM_LOCALID under
        # srun; RANK, WORLD_SIZE under torchrun), checked by common/env.py.
        env = resolve_launch_env()
        check_launch(env)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    args.tp = args.tp or env.local_world_size
    # Bad shapes are refused before the process group, by every rank, in one line.
    if why := check_shapes(args, env.world_size):
        if env.rank == 0:
            print(f"error: {why}", file=sys.stderr, flush=True)
        return 2
    try:
        if torch.cuda.is_available():
            device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))
            torch.cuda.set_device(device)  # before the group: NCCL and DTensor use this GPU
        else:
            device = torch.device("cpu")
    except LaunchError as exc:  # two ranks on one GPU, say
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(1)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=dist_timeout(),  # bounds the rendezvous and every collective: no silent hang
        device_id=device if device.type == "cuda" else None,
    )
    try:
        return train(args, env, device)
    finally:
        dist.destroy_process_group()  # frees the group's resources (it is not a barrier)
        # What still points at the destroyed groups (the mesh, DTensors in reference cycles)
        # goes now: left to interpreter exit, gloo's threads can abort the process (exit -6).
        gc.collect()


if __name__ == "__main__":
    sys.exit(main())
