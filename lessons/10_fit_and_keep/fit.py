"""Lesson 10, part 1: will it fit? The peak memory of one training step per rank, estimated on a
login node: no GPU, no allocation, no other process.

The model is built and one training step (two, in fact: the first creates AdamW's state) is run
under torch's FakeTensorMode: every tensor has a shape, a dtype and a device but no storage, so
an 8 G-parameter model costs nothing. torch's MemTracker (one process, no sharding) or
FSDPMemTracker (FSDP2, as rank 0 of N) watches every tensor created and freed, sorts it into
parameters, gradients, optimizer state, activations, temporaries and FSDP's all-gather and
reduce-scatter buffers, and keeps the snapshot at the peak. For N ranks the process group is
torch's "fake" one (a single process that calls itself rank 0 of N; its collectives do
nothing), so `fully_shard` shards as it would on N GPUs.

Fake tensors run the kernels their device picks: on the CPU nn.RMSNorm keeps fp32 copies that
CUDA's fused kernel does not. Without a GPU, FSDP2 cannot run on fake CUDA tensors (fully_shard
asks the driver for streams) and attention there falls to the math path: `--kernels cuda` keeps
the CPU device and stands in CUDA's own operators for RMSNorm and attention. The lesson's rows
stay on the CPU's kernels: they are what step.py measures here.

    python lessons/10_fit_and_keep/fit.py                                  # the lesson's model
    python lessons/10_fit_and_keep/fit.py --model llama3-8b --world 8,16,64 --bf16 \
        --kernels cuda --gpu-mem 81079MiB     # an 80 GB H100: 81079 MiB to torch
    python lessons/10_fit_and_keep/fit.py --model llama3-8b --world 8 --bf16 --kernels cuda --ac

step.py runs the same step for real and prints this estimate beside the measured peak.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

# torch's fake process group: it ships in torch's test utilities, and its own tests and
# torchtitan's memory estimation use it the same way.
from torch.testing._internal.distributed.fake_pg import FakeStore

from common.launch import dist_timeout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import CONFIGS, GPT, Attention, Block, Config, loss_fn, random_batch  # noqa: E402

MIB, GIB = 2**20, 2**30
# (batch, sequence length) per rank when not given: the lesson's run, and Llama-3's context.
DEFAULT_BATCH = {"lesson": (8, 256), "tiny": (32, 64), "llama3-8b": (1, 8192)}
# The tracker's categories (torch/distributed/_tools/{mem_tracker,fsdp2_mem_tracker}.py), in
# the columns printed. "params" is this rank's shard; "gathered" the whole parameters FSDP2
# holds while a block runs (its all-gather's output, in the compute dtype).
COLUMNS = {
    "params": ("Parameter", "Sharded Param"),
    "gathered": ("Unsharded Param",),
    "grads": ("Gradient", "Sharded Grad", "Unsharded Grad"),
    "optimizer": ("Optstate", "OptState"),
    "activations": ("Activation", "Inputs"),
    "temporaries": ("Temp", "Buffer", "Other"),
    "all-gather": ("All Gather",),
    "reduce-scatter": ("Reduce Scatter",),
}


class FusedRMSNorm(torch.autograd.Function):
    """nn.RMSNorm as a GPU runs it, for the estimate. On CUDA, rms_norm is one operator,
    aten::_fused_rms_norm (aten/src/ATen/native/cuda/layer_norm_kernel.cu); its backward
    (tools/autograd/derivatives.yaml) keeps the input, the weight and result1, the fp32 rstd
    (one number per row). On the CPU the same call decomposes into steps that each keep an
    fp32 copy of the rows. Forward and backward here are the CUDA path's two operators; the
    backward has no CPU kernel, only the shape function FakeTensorMode runs: estimates only."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = torch.ops.aten._fused_rms_norm_backward(grad, x, [x.shape[-1]], rstd, weight,
                                                         [True, True])  # fmt: skip
        return dx, dw, None


def gpu_attend(q, k, v):
    """Attention as a GPU runs it, for the estimate. On an H100 torch's dispatcher
    (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) picks cuDNN or flash attention in
    bf16 and the memory-efficient kernel in fp32 (flash and cuDNN need 16-bit floats); all three
    keep q, k and v (k and v at their own, fewer heads), the output and one fp32 log-sum-exp per
    query and head, never the s x s scores. Called by name: on fake CUDA tensors without a GPU
    the dispatcher finds no device and falls to the math path, which keeps the scores."""
    if q.dtype in (torch.bfloat16, torch.float16):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0,
                                                                  True)[0]  # fmt: skip


def use_gpu_kernels(model: GPT) -> None:
    """Every RMSNorm and attention of the model through the stand-ins above."""
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm):
            module.forward = partial(lambda m, x: FusedRMSNorm.apply(x, m.weight, m.eps), module)
        elif isinstance(module, Attention):
            module.attend = gpu_attend


def apply_ac(model: GPT) -> None:
    """Activation checkpointing per block: a block keeps only its input for the backward and
    runs its forward again there: one more forward per block. No more all-gathers: FSDP2 gathers
    a block's parameters again for its backward anyway (reshard_after_forward), and the
    recomputation runs inside that backward. Applied before fully_shard, so that FSDP2 shards
    the wrapped blocks."""
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper,
                                      checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda module: isinstance(module, Block),
    )


def shard(model: GPT, mesh, bf16: bool) -> None:
    """FSDP2 as in lesson 07: each block is one all-gather unit, the root holds the rest (the
    embeddings, the norm, the output layer). With bf16 the units are gathered and run in bf16
    and the gradients reduced in fp32; the shards and AdamW's state stay fp32 (lesson 07,
    "Mixed precision")."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if bf16 else MixedPrecisionPolicy()  # fmt: skip
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def build(c: Config, mesh, ac: bool, bf16: bool, device,
          gpu_kernels: bool = False) -> tuple[GPT, torch.optim.Optimizer]:  # fmt: skip
    """The model (the same weights on every rank: one seed before sharding) and its AdamW."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(c)
    if gpu_kernels:
        use_gpu_kernels(model)
    if ac:
        apply_ac(model)
    if mesh is not None:
        shard(model, mesh, bf16)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def estimate(c: Config, mesh, batch: int, seq_len: int, ac: bool, bf16: bool,
             device="cpu", kernels: str | None = None) -> dict[str, int]:  # fmt: skip
    """Bytes per column at the peak of two training steps of this rank, and "peak", the sum.
    mesh None: one process, no FSDP. Nothing is allocated: every tensor is fake. kernels
    "cuda" on a CPU device: RMSNorm and attention as a GPU runs them (the stand-ins above);
    by default the device's own."""
    gpu_kernels = kernels == "cuda" and torch.device(device).type == "cpu"
    with FakeTensorMode():
        model, optimizer = build(c, mesh, ac, bf16, device, gpu_kernels)
        x, y = random_batch(c, batch, seq_len, 0, device)
        if mesh is None:
            tracker = MemTracker()
            tracker.track_external(model, optimizer, x)
        else:
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs((x,))
        with tracker:
            for i in range(2):  # the first step creates AdamW's state, the second holds it
                logits = model(x)
                logits_bytes = logits.untyped_storage().nbytes()
                loss = loss_fn(logits, y)
                del logits  # as in step.py: gone before the backward
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if i == 0:
                    tracker.reset_mod_stats()  # FSDPMemTracker fails on a second step without
        (snapshot,) = tracker.get_tracker_snapshot("peak").values()  # one device
        # What the forward leaves for the backward: the activations at the end of the model's
        # forward (of the second step), what activation checkpointing cuts, less the forward's
        # output: the logits, which the loss reads and the backward does not keep.
        snapshots = tracker.memory_tracking[model].snapshots
        ends = ("Post-Forward", "After Post-Forward")  # MemTracker's, FSDPMemTracker's name
        (after_forward,) = next(v[-1] for k, v in snapshots.items() if k.value in ends).values()

    def columns(snap) -> dict[str, int]:
        names = {str(getattr(k, "value", k)): v for k, v in snap.items()}
        out = {col: sum(names.get(n, 0) for n in keys) for col, keys in COLUMNS.items()}
        return out | {"peak": names["Total"]}

    return columns(snapshot) | {"saved": columns(after_forward)["activations"] - logits_bytes}


def parse_size(text: str) -> int:
    """80GiB, 80GB, 141G, 24576MiB: bytes. GB is 10**9, GiB and G 2**30."""
    m = re.fullmatch(r"\s*([\d.]+)\s*(GiB|GB|G|MiB|MB|M|TiB|TB|T)\s*", text, re.I)
    if not m:
        raise ValueError(text)
    unit = m[2].lower()
    scale = {"g": GIB, "gib": GIB, "gb": 10**9, "m": MIB, "mib": MIB, "mb": 10**6,
             "t": 2**40, "tib": 2**40, "tb": 10**12}[unit]  # fmt: skip
    return int(float(m[1]) * scale)


def count(flag: str, what: str, default: str):
    """An argparse type for a number of things: 1 or more. 0 is refused, not taken for "the
    default" (as `value or default` would take it)."""

    def parse(text: str) -> int:
        n = int(text) if re.fullmatch(r"\s*[+-]?\d+\s*", text) else 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"{flag} {text}: pass 1 or more {what}, or leave "
                                             f"{flag} out (default: {default})")  # fmt: skip
        return n

    return parse


def parse_or_why(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The parser's arguments, with `why`: the one line a value its type refused gets (the
    parser is made with exit_on_error=False), empty when none was."""
    try:
        args = parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        return argparse.Namespace(why=exc.message)
    args.why = ""
    return args


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], exit_on_error=False)
    p.add_argument("--model", default="lesson", help=f"one of {', '.join(CONFIGS)}")
    p.add_argument("--world", default="1,2,4", help="ranks, comma-separated (1: no FSDP)")
    p.add_argument("--batch", type=count("--batch", "sequences per rank", "the model's"),
                   help="sequences per rank (default: the model's)")  # fmt: skip
    p.add_argument("--seq-len", type=count("--seq-len", "tokens per sequence", "the model's"),
                   help="tokens per sequence (default: the model's)")  # fmt: skip
    p.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    p.add_argument("--bf16", action="store_true", help="FSDP2 mixed precision: bf16 compute")
    p.add_argument("--kernels", default="cpu", help="whose kernels' saved tensors to count: "
                   "cpu (this machine's, default) or cuda (a GPU's, stood in on the CPU)")
    p.add_argument("--gpu-mem", help="the GPU's memory as torch sees it (torch.cuda."
                   "get_device_properties(0).total_memory), e.g. 81079MiB: say if it fits")
    args = parse_or_why(p, argv)
    args.why = args.why or check_args(args)
    return args


def check_args(args) -> str:
    """Why the arguments cannot be run, in one line; empty when they can."""
    if args.model not in CONFIGS:
        return f"--model {args.model} is not one of {', '.join(CONFIGS)}: pass e.g. --model lesson"
    try:
        args.worlds = [int(w) for w in args.world.split(",")]
    except ValueError:
        args.worlds = []
    if not args.worlds or min(args.worlds) < 1:
        return f"--world {args.world} is not a list of rank counts: pass e.g. --world 1,2,4"
    if args.kernels not in ("cpu", "cuda"):
        return f"--kernels {args.kernels} is not cpu or cuda: pass e.g. --kernels cuda"
    c = CONFIGS[args.model]
    batch, seq_len = DEFAULT_BATCH[args.model]
    args.batch = batch if args.batch is None else args.batch
    args.seq_len = seq_len if args.seq_len is None else args.seq_len
    if args.seq_len > c.seq_len:
        return (f"--seq-len {args.seq_len} is outside 1..{c.seq_len}, the positions --model "
                f"{args.model} has: pass --seq-len {c.seq_len} or less")  # fmt: skip
    if args.bf16 and 1 in args.worlds:
        return ("--bf16 is FSDP2's mixed precision (lesson 07), and --world 1 runs no FSDP2: "
                "pass --world 2 or more with --bf16")  # fmt: skip
    args.gpu_bytes = None
    if args.gpu_mem is not None:
        try:
            args.gpu_bytes = parse_size(args.gpu_mem)
        except ValueError:
            return f"--gpu-mem {args.gpu_mem} is not a size: pass e.g. --gpu-mem 81079MiB"
    return ""


def fmt_bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.why:
        print(f"error: {args.why}", file=sys.stderr, flush=True)
        return 2
    c = CONFIGS[args.model]
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(c).parameters())
    print(f"model {args.model}: {n / 1e6:,.1f} M parameters; batch {args.batch} x {args.seq_len} "
          f"tokens per rank; AdamW; {'bf16 compute, fp32 shards' if args.bf16 else 'fp32'}; "
          f"activation checkpointing {'on' if args.ac else 'off'}", flush=True)  # fmt: skip
    print("kernels: " + ("a GPU's for RMSNorm (fused) and attention (flash, memory-efficient in "
                         "fp32), stood in on the CPU" if args.kernels == "cuda" else
                         "this CPU's"), flush=True)  # fmt: skip
    unit = GIB if n > 1e9 else MIB
    cols = list(COLUMNS) + ["peak"]
    fits = f" fits {args.gpu_mem}" if args.gpu_bytes else ""
    print(f"per rank, {'GiB' if unit == GIB else 'MiB'}, at the peak of a step (saved: the "
          "activations the forward leaves for the backward, the logits not counted):",
          flush=True)  # fmt: skip
    header = " ".join(f"{c:>{max(len(c), 8)}}" for c in cols + ["saved"])
    print(f"{'ranks':>5} {header}{fits}", flush=True)
    for world in args.worlds:
        t0 = time.perf_counter()
        mesh = None
        if world > 1:
            # The fake group: this process is rank 0 of `world`, nothing is sent. The mesh is
            # made here, outside FakeTensorMode (init_device_mesh fails inside it).
            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world,
                                    timeout=dist_timeout())  # fmt: skip
            mesh = init_device_mesh("cpu", (world,))
        try:
            est = estimate(c, mesh, args.batch, args.seq_len, args.ac, args.bf16,
                           kernels=args.kernels)  # fmt: skip
        finally:
            if world > 1:
                dist.destroy_process_group()
        fits = ""
        if args.gpu_bytes:
            fits = f" {'yes' if est['peak'] <= args.gpu_bytes else 'no':>{len(args.gpu_mem) + 5}}"
        row = " ".join(f"{est[c] / unit:>{max(len(c), 8)}.1f}" for c in cols + ["saved"])
        print(f"{world:>5} {row}{fits}   ({time.perf_counter() - t0:.0f} s)", flush=True)
    print("counted: tensors the step creates (the allocator's view); not counted: the CUDA "
          "context, NCCL's buffers, the caching allocator's reserve and fragmentation "
          "(README, 'What is counted')", flush=True)  # fmt: skip
    return 0

if __name__ == "__main__":
    sys.exit(main())
