"""Lesson 12: three ways a node can be sick while the job still runs, each found by the ranks.

Every rank calls these at the same steps, and every decision below is made from numbers all
ranks gathered, so all ranks come to the same verdict at the same step without a vote:

* ``StepTimer``: how long each rank computes in a step, and how long it waits for the others
  (in DDP's buffer broadcast before its forward, and in the gradients' all-reduce after it).
  A slow rank computes longest and waits least; the others wait for it. Per-rank step times
  cannot name it: the collectives end every rank's step at the same moment.
* ``nonfinite_ranks``: which ranks' loss is NaN or inf at this step (one all-gather of a flag),
  so that every rank skips the same step, and the report names where it came from.
* ``fingerprint`` / ``odd_ones_out``: an exact checksum of a rank's weights and optimizer state;
  ranks that should hold the same bits and do not are named (a flipped bit, a bad GPU).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class StepTimer:
    """Compute and wait time of each step, from two hooks on the DDP model.

    A DDP step has two places where a rank waits for the others. Its forward starts with a
    collective: DDP broadcasts rank 0's buffers (BatchNorm's running statistics) to every rank,
    so the step's real work starts when the module's own forward does (a forward pre-hook on
    ``ddp_model.module``). Then in backward DDP calls the communication hook once per gradient
    bucket, when that bucket's gradients are ready on this rank, and the hook starts the
    bucket's all-reduce: the last call marks the end of this rank's own work. From there to the
    end of ``backward()`` the rank waits for the all-reduces, that is for the other ranks.
    compute = module forward start -> last bucket ready; wait = the rest of the step.

    On a GPU the hooks run when the CPU *queues* the work, not when the GPU has done it: there
    the marks are CUDA events recorded on the current stream at the same points, read once per
    window (``torch.cuda.Event.elapsed_time``; written here, not run on a GPU).
    """

    def __init__(self, ddp_model, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list = []
        self._start = self._forward = self._ready = None
        ddp_model.module.register_forward_pre_hook(self._forward_hook)
        ddp_model.register_comm_hook(None, self._comm_hook)

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _forward_hook(self, module, args) -> None:
        self._forward = self._now()  # rank 0's buffers have arrived: this rank's work starts

    def _comm_hook(self, process_group, bucket):
        self._ready = self._now()  # the latest bucket so far: this rank's gradients are ready
        return default_hooks.allreduce_hook(process_group, bucket)  # DDP's own average

    def start(self) -> None:
        self._start = self._now()
        self._forward = self._ready = None

    def stop(self) -> None:
        """After ``backward()``: DDP has waited for every bucket's all-reduce."""
        self._marks.append((self._start, self._forward, self._ready, self._now()))

    def window(self) -> tuple[float, float, int]:
        """Median compute and wait seconds of the steps since the last call (the median: one
        step that the machine's other work held up does not make a window slow), and how many
        steps that was."""
        if self.cuda:
            torch.cuda.synchronize()
            span = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731  (milliseconds)
        else:
            span = lambda a, b: b - a  # noqa: E731
        pairs = [(span(f, r), span(s, f) + span(r, e)) for s, f, r, e in self._marks]
        self._marks = []
        if not pairs:
            return 0.0, 0.0, 0
        return (statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
                len(pairs))


def gather_floats(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's ``values`` (the same length everywhere), as a list indexed by rank."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    every = torch.empty(dist.get_world_size() * len(values), dtype=torch.float64, device=device)
    dist.all_gather_single(every, mine)
    return every.view(dist.get_world_size(), len(values)).tolist()


@dataclass
class StragglerWatch:
    """Names the node whose *fastest* rank computes ``factor`` times longer than the median
    rank of the other nodes, in ``windows`` windows in a row.

    By node, not by rank: a sick node slows every rank it runs, and the node is what a site
    takes out. Its fastest rank against the others' median: one rank that the machine's other
    work held up does not make its node slow, and the yardstick is not itself on the sick node.
    Relative, so a machine that is slow everywhere (CI's load, a smaller GPU) flags nothing;
    sustained, so one unlucky window does not either. A job on one node has nothing to compare
    with, and nowhere to move to: it is never flagged."""

    nodes: list[str]  # the node of each rank
    factor: float = 3.0
    windows: int = 3
    streak: int = 0
    suspect: str | None = None
    highest: float = 0.0  # the highest ratio seen in any window: how near a clean run comes
    history: list = field(default_factory=list)  # per window: [(compute, wait) per rank]

    def ratios(self, times: list[list[float]]) -> dict[str, float]:
        """Per node: its fastest rank's compute time over the others' median."""
        out = {}
        for node in dict.fromkeys(self.nodes):
            mine = [t[0] for t, n in zip(times, self.nodes, strict=True) if n == node]
            others = [t[0] for t, n in zip(times, self.nodes, strict=True) if n != node]
            if others and statistics.median(others) > 0:
                out[node] = min(mine) / statistics.median(others)
        return out

    def update(self, times: list[list[float]]) -> str | None:
        """``times[rank] = [compute, wait]``; returns the straggler's node once it is sure."""
        self.history.append(times)
        ratios = self.ratios(times)
        if not ratios:
            return None
        node = max(ratios, key=ratios.get)
        self.highest = max(self.highest, ratios[node])
        if ratios[node] < self.factor:
            self.streak, self.suspect = 0, None
            return None
        self.streak = self.streak + 1 if node == self.suspect else 1
        self.suspect = node
        return node if self.streak >= self.windows else None


def nonfinite_ranks(loss: torch.Tensor) -> list[int]:
    """The ranks whose loss is not finite at this step: the same list on every rank.

    One flag per rank, all-gathered: a MAX all-reduce would also make every rank skip, but
    would not say which rank's batch (or node) it came from."""
    flag = (~torch.isfinite(loss.detach())).to(torch.int32).reshape(1)
    flags = torch.empty(dist.get_world_size(), dtype=torch.int32, device=loss.device)
    dist.all_gather_single(flags, flag)
    return [rank for rank, bad in enumerate(flags.tolist()) if bad]


@torch.no_grad()
def checksum(tensors) -> torch.Tensor:
    """An exact checksum of TENSORS: their bits, read as integers and summed (wrapping at 64
    bits). Any one flipped bit changes it; it needs no copy to the CPU, so on a GPU it stays
    there. Not a cryptographic hash: it names a rank whose state differs, which is all this
    needs."""
    total = None
    for t in tensors:
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        part = t.detach().contiguous().view(bits).to(torch.int64).sum()
        total = part if total is None else total + part
    return total


def fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The checksum of the weights and the optimizer state: what DDP keeps equal on every rank.
    Not the buffers: BatchNorm's running statistics differ by rank by design (each rank's
    forward updates rank 0's copy with its own batch, lesson 03's train.py)."""
    tensors = list(model.parameters())
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    return checksum(tensors)


def odd_ones_out(prints: list[int]) -> list[int]:
    """Ranks whose fingerprint differs from the one most ranks hold (none if all agree; with a
    tie, the ranks outside the group that holds rank 0's value are named)."""
    counts = {p: prints.count(p) for p in prints}
    best = max(counts.values())
    majority = prints[0] if counts[prints[0]] == best else max(counts, key=counts.get)
    return [rank for rank, p in enumerate(prints) if p != majority]


def gather_fingerprints(model, optimizer) -> list[int]:
    mine = fingerprint(model, optimizer).reshape(1)
    every = torch.empty(dist.get_world_size(), dtype=torch.int64, device=mine.device)
    dist.all_gather_single(every, mine)
    return every.tolist()
