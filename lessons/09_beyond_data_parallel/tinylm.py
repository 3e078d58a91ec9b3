"""Lesson 09's model and data: a byte-level transformer and a text corpus made on the spot.

Not the lesson's point, so the three scripts (tp.py, pp.py, compare.py) import it: the model
is written the way the parallel plans expect it (named linear layers, heads counted from the
width of the local q/k/v, so a rank that holds half the heads runs the same code), and the
corpus is made from a fixed seed, so no run downloads anything and every rank has the same.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 128  # bytes of ASCII text

# Sentences from a small grammar: enough structure that the loss falls visibly within a minute
# (from 5.06 at the first step to below 1 after 100; README, first section), nothing to download.
_SUBJECTS = ["the cluster", "a rank", "the scheduler", "every node", "the job", "a student",
             "the pipeline", "one stage", "the mesh", "a shard"]  # fmt: skip
_VERBS = ["sends", "gathers", "waits for", "reduces", "splits", "holds", "reads", "frees"]
_OBJECTS = ["the gradients", "a tensor", "its weights", "the activations", "one microbatch",
            "the loss", "half the heads", "every column"]  # fmt: skip
_ENDS = [" before the step.", " after the backward.", ".", " on every rank.", " in order."]


def corpus(n_chars: int = 200_000, seed: int = 0) -> torch.Tensor:
    """About n_chars bytes of sentences, as a 1-D uint8 tensor; the same for the same seed."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_chars:
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        s += rng.choice(_ENDS) + ("\n" if rng.random() < 0.2 else " ")
        parts.append(s)
        size += len(s)
    return torch.frombuffer(bytearray("".join(parts)[:n_chars].encode()), dtype=torch.uint8)


def batch(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator):
    """batch_size random windows of seq_len bytes and the same windows shifted by one."""
    start = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=gen)
    x = torch.stack([data[s : s + seq_len] for s in start]).long()
    y = torch.stack([data[s + 1 : s + seq_len + 1] for s in start]).long()
    return x, y


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1, not n_heads: under tensor parallelism wq/wk/wv give this rank its heads only.
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLM(nn.Module):
    """Token and position embeddings, `layers` blocks, a norm and an output layer. Any part
    may be None (a pipeline stage keeps only its own); layers is a ModuleDict so that a layer
    keeps its name ("layers.3...") on the stage that holds it."""

    def __init__(self, dim: int = 128, n_heads: int = 4, hidden: int = 512, layers: int = 4,
                 seq_len: int = 64):  # fmt: skip
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.pos_embeddings = nn.Embedding(seq_len, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, n_heads, hidden) for i in range(layers)})
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:  # first stage: bytes in
            pos = torch.arange(x.shape[1], device=x.device).expand(x.shape)
            x = self.tok_embeddings(x) + self.pos_embeddings(pos)
        for layer in self.layers.values():
            x = layer(x)
        if self.output is not None:  # last stage: logits out
            x = self.output(self.norm(x))
        return x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
