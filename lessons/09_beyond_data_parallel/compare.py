"""Lesson 09: DDP, FSDP2, TP, PP and 2D on the same model, measured side by side.

Every process of the job runs this file (srun starts one per task, see compare.sh). The ranks
train the same TinyLM (same size, same initial weights, the same global batch at every step)
under each form in turn, a few steps each, and print one row per form:

* memory per rank: bytes of parameters + gradients + AdamW state that the rank holds, counted
  from the tensors' local shards (a DTensor counts its local piece); the largest rank's. Not
  counted: activations, communication buffers, FSDP2's briefly gathered blocks.
* bytes sent per step and rank: every collective and send of one step is recorded (a
  CommDebugMode that also reads the tensors' sizes and their process group), and priced as a
  ring algorithm sends it: all-reduce 2(n-1)/n of the buffer, all-gather and reduce-scatter
  (n-1)/n of the full tensor, a send its tensor. "gloo" prices reduce-scatters as the
  all-reduces gloo runs for them; "across nodes" is the part in groups (or to peers) that span
  nodes. The largest rank's.
* step time: the median of the timed steps, the slowest rank's.
* the loss at step 1 (before any update: the same for every form, up to float rounding) and at
  the last step.

Without SLURM, on one machine (CPU, gloo), from the course root with the venv active:
    torchrun --standalone --nproc-per-node 4 lessons/09_beyond_data_parallel/compare.py --steps 3
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pp import build_stage  # noqa: E402
from tinylm import TinyLM, batch, corpus, loss_fn  # noqa: E402
from tp import shard_2d, sum_partial_grads, tp_plan  # noqa: E402

from common.env import LaunchError, resolve_launch_env  # noqa: E402
from common.launch import check_launch, cuda_device_index, dist_timeout  # noqa: E402

FORMS = ("ddp", "fsdp2", "tp", "pp", "2d")
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--forms", type=lambda s: s.split(","), default=list(FORMS),
                   help=f"comma-separated, from {','.join(FORMS)}")  # fmt: skip
    p.add_argument("--steps", type=int, default=10, help="timed steps per form, after 3 untimed")
    p.add_argument("--no-header", action="store_true",
                   help="print the rows only (compare.sh runs each form in a step of its own)")
    p.add_argument("--batch-size", type=int, default=16, help="global: sequences per step")
    p.add_argument("--microbatches", type=int, default=4, help="PP: microbatches per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    return p.parse_args(argv)


def check_args(args, world: int, tasks_per_node: int) -> str:
    """Why these forms cannot run this model on this many ranks, as one line (empty if they
    can). TP splits over all the ranks, 2D over the tasks of one node, DDP and FSDP2 split
    the batch over all the ranks, PP the model's layers."""
    if unknown := [f for f in args.forms if f not in FORMS]:
        return f"--forms {unknown[0]} is not one of {', '.join(FORMS)}: pass e.g. --forms ddp,tp"
    if args.steps < 1:
        return f"--steps {args.steps}: pass 1 or more (timed steps per form)"
    if world < 2:
        return f"{world} rank: the forms split the work between ranks; run 2 or more tasks"
    if {"ddp", "fsdp2"} & set(args.forms) and args.batch_size % world:
        return (f"--batch-size {args.batch_size} is not a multiple of the {world} ranks: DDP "
                f"and FSDP2 give each rank an equal share; pass e.g. --batch-size {4 * world}")
    rows = world // tasks_per_node  # 2D: one dp row per node
    if "2d" in args.forms and (world % tasks_per_node or args.batch_size % rows):
        return (f"--batch-size {args.batch_size} is not a multiple of the {rows} nodes: 2D "
                "gives each node (a dp row) an equal share; pass a multiple")
    tp = {"tp": world, "2d": tasks_per_node}
    for form in ("tp", "2d"):
        if form not in args.forms:
            continue
        for flag in ("heads", "hidden", "dim", "seq_len"):
            if (value := getattr(args, flag)) % tp[form]:
                name = "--" + flag.replace("_", "-")
                return (f"{name} {value} is not a multiple of {tp[form]}: the {form} form splits "
                        f"it over {tp[form]} ranks; pass a multiple of {tp[form]}")  # fmt: skip
    if "pp" in args.forms:
        if args.layers < world:
            return (f"--layers {args.layers} is fewer than the {world} pipeline stages: a stage "
                    f"needs at least one layer; pass --layers {world} or more")  # fmt: skip
        if args.microbatches < world or args.batch_size % args.microbatches:
            return (f"--microbatches {args.microbatches}: the pp form needs at least one per "
                    f"stage ({world}: its Schedule1F1B refuses fewer) and an equal split of "
                    f"--batch-size {args.batch_size}; pass e.g. --microbatches "
                    f"{world}")  # fmt: skip
    return ""


def nbytes(x) -> int:
    """Bytes of a tensor or of the tensors in (nested) lists of them."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(nbytes(t) for t in x)
    return 0


class CommBytes(TorchDispatchMode):
    """Records every collective and send this rank issues (the c10d ones DDP, FSDP2 and the
    pipeline schedules call, the functional ones DTensor's TP plans turn into), and prices each:
    the bytes this rank sends in it. Like tp.py's CommDebugMode, without its module tracker
    (whose backward hooks the pipeline schedules' autograd.grad calls do not support)."""

    def __init__(self, node_of: list[int]):
        super().__init__()
        self.node_of = node_of  # global rank -> node index
        self.sent = Counter()  # "ring", "gloo", "across"
        self.ops = Counter()  # by name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            # A mode sees an op before the tensor subclass does: let DTensor turn it into
            # local ops and collectives first, which then come back through here.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if "c10d" in getattr(func, "namespace", ""):
            self.price(func._overloadpacket.__name__, args)
        return out

    def price(self, name: str, args) -> None:
        # The group: a ProcessGroup (c10d ops) or its name (functional collectives).
        group = next((a for a in args if isinstance(a, torch.ScriptObject)), None)
        functional = group is None
        if not functional:
            group = dist.ProcessGroup.unbox(group)
        else:
            named = [a for a in args if isinstance(a, str)]
            if not named:
                return  # not a collective (wait_tensor)
            # (the group's name is its last string argument; the reduce op, if any, comes first)
            group = dist.distributed_c10d._resolve_process_group(named[-1])
        self.ops[name] += 1
        ranks = dist.get_process_group_ranks(group)
        n = len(ranks)
        # The full tensor: c10d ops take (output, input) and functional ones (input, ...); an
        # all-gather's output and a reduce-scatter's input are the full one, the larger.
        full = max(nbytes(args[0]), nbytes(args[1]))
        if "gather" in name and functional:
            full = nbytes(args[0]) * n  # a functional all-gather's input: this rank's piece
        if name in ("send", "recv_"):
            peer = dist.get_global_rank(group, args[2])
            sent = full if name == "send" else 0
            ring = gloo = sent
            across = self.node_of[peer] != self.node_of[dist.get_rank()]
        elif "reduce_scatter" in name:
            ring, gloo = full * (n - 1) / n, full * 2 * (n - 1) / n  # gloo: an all-reduce
        elif "gather" in name or "broadcast" in name:
            ring = gloo = full * (n - 1) / n
        elif "reduce" in name:  # all-reduce: a reduce-scatter, then an all-gather
            ring = gloo = full * 2 * (n - 1) / n
        else:
            raise RuntimeError(f"no price for the collective {name}")
        if name not in ("send", "recv_"):
            across = len({self.node_of[r] for r in ranks}) > 1
        self.sent["ring"] += ring
        self.sent["gloo"] += gloo
        self.sent["across"] += ring if across else 0


def held_bytes(params, optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state on this rank (local shards only)."""
    params = list(params)
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    grads = [g.to_local() if isinstance(g, DTensor) else g for p in params
             if (g := p.grad) is not None]  # fmt: skip
    state = [t.to_local() if isinstance(t, DTensor) else t for s in optimizer.state.values()
             for t in s.values() if torch.is_tensor(t)]  # fmt: skip
    return nbytes(local) + nbytes(grads) + nbytes(state)


def build(form: str, args, env, device):
    """(parameters, a function that trains one step on the global batch (x, y) and returns
    this rank's share of the global loss: the shares over all ranks add up to it)."""
    world, rank, tasks = env.world_size, env.rank, env.local_world_size

    def model():
        torch.manual_seed(0)  # the same initial weights in every form, before any split
        return TinyLM(args.dim, args.heads, args.hidden, args.layers, args.seq_len).to(device)

    def rows(x, parts: int, index: int):
        share = len(x) // parts
        return x[index * share : (index + 1) * share]

    if form in ("ddp", "fsdp2"):
        if form == "ddp":
            # gradient_as_bucket_view: the gradients live in DDP's communication buckets, not
            # in a second copy (the memory column counts the gradients once).
            net = DDP(model(), device_ids=[device.index] if device.type == "cuda" else None,
                      gradient_as_bucket_view=True)  # fmt: skip
        else:
            net = model()
            mesh = init_device_mesh(device.type, (world,))
            for block in net.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(net, mesh=mesh)

        def step(x, y):  # each rank its slice of the batch; DDP/FSDP2 average the gradients
            loss = loss_fn(net(rows(x, world, rank)), rows(y, world, rank))
            loss.backward()
            return loss.detach() / world

        return net.parameters(), step

    if form in ("tp", "2d"):
        # TP: one tp group of all the ranks (here across both nodes: what 2D avoids). 2D: the
        # tasks of a node form a tp group, FSDP2 shards across the nodes (tp.py's layout).
        tp = world if form == "tp" else tasks
        mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        net = model()
        if form == "tp":
            tp_plan(net, mesh["tp"], sequence_parallel=True)
        else:
            shard_2d(net, mesh, sequence_parallel=True)
        dp, row = world // tp, mesh.get_local_rank("dp")

        def step(x, y):  # each tp group (a dp row) its slice of the batch
            with loss_parallel():
                loss = loss_fn(net(rows(x, dp, row)), rows(y, dp, row))
                loss.backward()
            sum_partial_grads(net)
            loss = loss.detach()
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            return loss / world  # the tp ranks of a row agree: each adds 1/world of it

        return net.parameters(), step

    # PP: one stage per rank, 1F1B.
    shape = SimpleNamespace(dim=args.dim, heads=args.heads, hidden=args.hidden,
                            layers=args.layers, seq_len=args.seq_len)  # fmt: skip
    stage = build_stage(shape, rank, world, device)
    schedule = Schedule1F1B(PipelineStage(stage, rank, world, device), args.microbatches,
                            loss_fn=loss_fn)  # fmt: skip

    def step(x, y):  # the batch goes in at stage 0, the targets at the last stage
        losses: list[torch.Tensor] = []
        schedule.step(*([x] if rank == 0 else []),
                      **({"target": y, "losses": losses} if rank == world - 1 else {}))  # fmt: skip
        return torch.stack(losses).mean().detach() if losses else torch.zeros((), device=device)

    return stage.parameters(), step


def measure(form: str, args, env, device, node_of: list[int]) -> dict:
    params, step = build(form, args, env, device)
    params = list(params)
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    data = corpus()
    gen = torch.Generator().manual_seed(1000)  # every rank, every form: the same batches

    def train_step():
        x, y = (t.to(device) for t in batch(data, args.batch_size, args.seq_len, gen))
        loss = step(x, y)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradients' storage: it is counted
        return loss

    # Steps 1 and 2 warm up: lazy initialisation (FSDP2's, the pipeline's shape exchange) and,
    # in step 2, DDP's one-off broadcast of its rebuilt gradient buckets. Step 3 is recorded,
    # collective by collective (not timed: the recording is slow); then the timed steps.
    losses, times = [train_step(), train_step()], []
    comm = CommBytes(node_of)
    with comm:
        losses.append(train_step())
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()  # every rank starts the step together: a fair clock
        t0 = time.perf_counter()
        losses.append(train_step())
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    loss = torch.stack([losses[0], losses[-1]]).float()
    dist.all_reduce(loss)  # each rank's share of the global loss: the sum is the loss
    mine = torch.tensor([held_bytes(params, optimizer), comm.sent["ring"], comm.sent["gloo"],
                         comm.sent["across"], statistics.median(times)],
                        dtype=torch.float64, device=device)  # fmt: skip
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the rank that holds, sends, takes the most
    held, ring, gloo, across, step_s = mine.tolist()
    counts = ", ".join(f"{op} {n}" for op, n in sorted(comm.ops.items()))
    return dict(held=held, ring=ring, gloo=gloo, across=across, step=step_s,
                loss1=loss[0].item(), lossn=loss[1].item(), counts=counts)  # fmt: skip


LAYOUT = {
    "ddp": "whole model on each rank, batch / {w}",
    "fsdp2": "every tensor sharded / {w}, batch / {w}",
    "tp": "every layer split / {w}, whole batch",
    "pp": "{layers} layers / {w} stages, 1F1B, {m} microbatches",
    "2d": "TP / {t} in a node x FSDP2 / {n} nodes",
}


def run(args, env, device) -> int:
    world = env.world_size
    # Which node each rank is on: "across nodes" needs it for every group and peer.
    nodes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(nodes, torch.tensor([env.node_rank], device=device))
    node_of = [int(n) for n in nodes]
    params = sum(p.numel() for p in TinyLM(args.dim, args.heads, args.hidden, args.layers,
                                           args.seq_len).parameters())  # fmt: skip
    if env.rank == 0 and not args.no_header:
        print(f"{world} ranks on {env.num_nodes} node(s), backend {dist.get_backend()}; TinyLM "
              f"{params / 1e6:.2f} M parameters ({params * 4 / MIB:.2f} MiB fp32); global batch "
              f"{args.batch_size} x {args.seq_len} bytes; AdamW; {args.steps} timed steps after "
              "3 untimed", flush=True)  # fmt: skip
        print("memory: parameters + gradients + AdamW state held by a rank (local shards); sent:"
              " bytes a rank sends per step, ring algorithm (gloo: reduce-scatter as the "
              "all-reduce it runs); largest rank's; step: median, slowest rank", flush=True)
        print(f"{'form':<6} {'layout':<44} {'memory MiB':>10} {'sent MiB':>9} {'gloo MiB':>9} "
              f"{'across':>7} {'step s':>7} {'loss 1':>7} {'loss ' + str(args.steps + 3):>7}",
              flush=True)  # fmt: skip
    for form in args.forms:
        m = measure(form, args, env, device, node_of)
        gc.collect()  # the form's model, optimizer and groups' tensors go before the next
        layout = LAYOUT[form].format(w=world, layers=args.layers, m=args.microbatches,
                                     t=env.local_world_size, n=world // env.local_world_size)
        if env.rank == 0:
            print(f"{form:<6} {layout:<44} {m['held'] / MIB:10.2f} {m['ring'] / MIB:9.2f} "
                  f"{m['gloo'] / MIB:9.2f} {m['across'] / MIB:7.2f} {m['step']:7.3f} "
                  f"{m['loss1']:7.4f} {m['lossn']:7.4f}", flush=True)  # fmt: skip
            print(f"{'':<6} collectives of one step on rank 0: {m['counts']}", flush=True)
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
    # Bad shapes are refused before the process group, by every rank, in one line.
    if why := check_args(args, env.world_size, env.local_world_size):
        if env.rank == 0:
            print(f"error: {why}", file=sys.stderr, flush=True)
        return 2
    try:
        if torch.cuda.is_available():
            device = torch.device("cuda", cuda_device_index(env, torch.cuda.device_count()))
            torch.cuda.set_device(device)  # before the group: NCCL, DTensor and the sends use it
        else:
            device = torch.device("cpu")
    except LaunchError as exc:  # two ranks on one GPU, say
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(1)
    # FSDP2 warns that the root returns a view (the logits): nothing changes it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=dist_timeout(),  # bounds the rendezvous and every collective: no silent hang
        device_id=device if device.type == "cuda" else None,
    )
    try:
        return run(args, env, device)
    finally:
        dist.destroy_process_group()  # frees the group's resources (it is not a barrier)
        # What still points at the destroyed groups (meshes, DTensors in reference cycles)
        # goes now: left to interpreter exit, gloo's threads can abort the process (exit -6).
        gc.collect()


if __name__ == "__main__":
    sys.exit(main())
