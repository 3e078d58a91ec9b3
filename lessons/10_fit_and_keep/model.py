"""Lesson 10's model: a small Llama-shaped transformer, and its named sizes.

Not the lesson's point, so fit.py, step.py and keep.py import it. The shape is Llama's
(pre-norm blocks of grouped-query attention and a SwiGLU MLP, RMSNorm, untied output layer) so
that one class describes both the model the lesson trains on the local cluster and a Llama-3-8B
that no machine here could hold: fit.py estimates the second without allocating it. Positions
are learned embeddings (Llama rotates q and k instead; the memory is the same to a rounding).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    dim: int
    layers: int
    heads: int
    kv_heads: int  # fewer than heads: grouped-query attention (k and v shared by a group)
    ffn: int  # the MLP's hidden width
    vocab: int
    seq_len: int  # the longest sequence (the position table's size)


CONFIGS = {
    # What the lesson trains on the local cluster: 7.4 M parameters, a step in a few seconds.
    "lesson": Config(dim=256, layers=8, heads=8, kv_heads=4, ffn=768, vocab=2048, seq_len=256),
    # What the tests run: small enough for 4 ranks on 2 cores in seconds.
    "tiny": Config(dim=128, layers=2, heads=4, kv_heads=2, ffn=384, vocab=256, seq_len=64),
    # Llama-3-8B's shape (its config.json): 8.0 G parameters.
    "llama3-8b": Config(dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256,
                        seq_len=8192),  # fmt: skip
}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention, k and v with fewer heads than q (grouped-query). torch picks the kernel
    by device and dtype; fit.py swaps in the one a GPU would run, to count what it keeps."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Attention(nn.Module):
    attend = staticmethod(attend)

    def __init__(self, c: Config):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        out = self.attend(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)): the unit that FSDP2 shards and that
    activation checkpointing recomputes."""

    def __init__(self, c: Config):
        super().__init__()
        self.attention_norm = nn.RMSNorm(c.dim)
        self.attention = Attention(c)
        self.ffn_norm = nn.RMSNorm(c.dim)
        self.feed_forward = FeedForward(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.pos_embeddings = nn.Embedding(c.seq_len, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.tok_embeddings(x) + self.pos_embeddings(pos)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def random_batch(c: Config, batch: int, seq_len: int, seed: int, device) -> tuple:
    """Random tokens: memory does not depend on what the tokens say."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(c.vocab, (batch, seq_len + 1), generator=gen)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def describe(c: Config) -> str:
    return ", ".join(f"{k} {v}" for k, v in asdict(c).items())
