"""One rank of lesson 09's split == unsplit checks (tests/test_lesson09.py starts 2 of them).

    python tests/workers/lesson09_split.py tp    # TP (with and without SP) vs one process
    python tests/workers/lesson09_split.py pp    # GPipe and 1F1B vs one process

Every rank also builds the unsplit model (same seed) and runs the same batch through it; the
split run's loss, logits and every gradient must match within TOL. Prints one "ok" line per
check; any mismatch raises.
"""

from __future__ import annotations

import gc
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "lessons" / "09_beyond_data_parallel"))
import pp  # noqa: E402
import tp  # noqa: E402
from tinylm import TinyLM, loss_fn  # noqa: E402

# float32, the same arithmetic split in two: sums taken in another order differ by rounding.
TOL = {"rtol": 1e-4, "atol": 1e-5}
SHAPE = {"dim": 32, "n_heads": 4, "hidden": 64, "seq_len": 8}


def reference(layers: int, x, y):
    torch.manual_seed(0)
    model = TinyLM(layers=layers, **SHAPE)
    logits = model(x)
    loss = loss_fn(logits, y)
    loss.backward()
    return model, logits.detach(), loss.detach()


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_tp(rank: int) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(1)  # the same batch on both ranks
    x, y = torch.randint(128, (3, 8)), torch.randint(128, (3, 8))
    ref, ref_logits, ref_loss = reference(1, x, y)
    for sp in (False, True):
        torch.manual_seed(0)
        model = tp.tp_plan(TinyLM(layers=1, **SHAPE), mesh, sp)
        with loss_parallel():
            logits = model(x)
            loss = loss_fn(logits, y)
            loss.backward()
        tp.sum_partial_grads(model)
        torch.testing.assert_close(full(loss), ref_loss, **TOL)
        torch.testing.assert_close(full(logits), ref_logits, **TOL)
        named = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(full(p.grad), named[name].grad, **TOL, msg=name)
        if rank == 0:
            print(f"ok tp sequence_parallel={sp}: loss, logits and "
                  f"{len(named)} gradients equal the unsplit model's", flush=True)  # fmt: skip


def check_pp(rank: int) -> None:
    args = type("Args", (), {"dim": 32, "heads": 4, "hidden": 64, "seq_len": 8, "layers": 4})
    torch.manual_seed(1)  # the same batch on both ranks
    x, y = torch.randint(128, (8, 8)), torch.randint(128, (8, 8))
    ref, _, ref_loss = reference(4, x, y)
    named = dict(ref.named_parameters())
    for name in ("gpipe", "1f1b"):
        module = pp.build_stage(args, rank, 2, torch.device("cpu"))
        stage = pp.PipelineStage(module, rank, 2, torch.device("cpu"))
        schedule = pp.SCHEDULES[name](stage, 4, loss_fn=loss_fn)
        losses: list[torch.Tensor] = []
        schedule.step(*([x] if rank == 0 else []),
                      **({"target": y, "losses": losses} if rank == 1 else {}))  # fmt: skip
        if rank == 1:  # equal microbatches: the mean of their losses is the batch's loss
            torch.testing.assert_close(torch.stack(losses).mean(), ref_loss, **TOL)
        for pname, p in module.named_parameters():
            torch.testing.assert_close(p.grad, named[pname].grad, **TOL, msg=pname)
        held = torch.tensor([len(list(module.parameters()))])
        dist.all_reduce(held)
        assert held.item() == len(named), (held, len(named))
        if rank == 0:
            print(f"ok pp {name}: 4 microbatches on 2 stages, loss and {len(named)} gradients "
                  "equal the unsplit model's", flush=True)  # fmt: skip


def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=30))  # fmt: skip
    torch.set_num_threads(1)
    try:
        {"tp": check_tp, "pp": check_pp}[sys.argv[1]](rank)
    finally:
        dist.destroy_process_group()
        gc.collect()  # free what points at the group now, not at exit (gloo's threads)


if __name__ == "__main__":
    main()
