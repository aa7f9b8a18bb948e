"""Llama-3-like decoder layers as plain functions of weight dicts, for the benchmarks.

Two shapes: Llama-3-8B (hidden 4096, 32 query / 8 key-value heads of 128, FFN 14336) and Llama-3-70B
(hidden 8192, 64 / 8 heads, FFN 28672), bf16. Decode attention reads a KV cache with two batched
matmuls (memory-bound); `df.region` tags mark the phases for partition rules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

import dynaflow_fn as df


@dataclass(frozen=True)
class Shape:
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    ffn: int


LLAMA3_8B = Shape(hidden=4096, q_heads=32, kv_heads=8, head_dim=128, ffn=14336)
LLAMA3_70B = Shape(hidden=8192, q_heads=64, kv_heads=8, head_dim=128, ffn=28672)
SHAPES = {"8b": LLAMA3_8B, "70b": LLAMA3_70B}
HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, FFN = (LLAMA3_8B.hidden, LLAMA3_8B.q_heads, LLAMA3_8B.kv_heads,
                                            LLAMA3_8B.head_dim, LLAMA3_8B.ffn)
DTYPE = torch.bfloat16


def make_layer(device: torch.device, tp: int = 1, seed: int = 0, shape: Shape = LLAMA3_8B) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(seed)

    def weight(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=device, dtype=DTYPE, generator=generator) * 0.02

    return {
        "wqkv": weight(shape.hidden, (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim // tp),
        "wo": weight(shape.q_heads * shape.head_dim // tp, shape.hidden),
        "wgu": weight(shape.hidden, 2 * shape.ffn // tp),
        "wd": weight(shape.ffn // tp, shape.hidden),
        "n1": torch.ones(shape.hidden, device=device, dtype=DTYPE),
        "n2": torch.ones(shape.hidden, device=device, dtype=DTYPE),
    }


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * weight


def decode_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tp: int = 1,
                     shape: Shape = LLAMA3_8B) -> torch.Tensor:
    """One new token per sequence against its cache: [B, kv, group, D] x [B, kv, L, D]."""
    batch = qkv.shape[0]
    q_heads, kv_heads = shape.q_heads // tp, shape.kv_heads // tp
    q = qkv[:, : q_heads * shape.head_dim].view(batch, kv_heads, q_heads // kv_heads, shape.head_dim)
    scores = torch.matmul(q, k_cache.transpose(-1, -2)) * shape.head_dim ** -0.5
    probs = torch.softmax(scores.float(), -1).to(DTYPE)
    return torch.matmul(probs, v_cache).reshape(batch, q_heads * shape.head_dim)


def decoder_layer(p: dict, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tp: int = 1,
                  all_reduce=None, shape: Shape = LLAMA3_8B) -> torch.Tensor:
    with df.region("pre"):
        qkv = rms_norm(x, p["n1"]) @ p["wqkv"]
    with df.region("attn"):
        a = decode_attention(qkv, k_cache, v_cache, tp, shape)
    with df.region("post"):
        o = a @ p["wo"]
        if all_reduce is not None:
            o = all_reduce(o)
        h = x + o
        gate, up = (rms_norm(h, p["n2"]) @ p["wgu"]).chunk(2, -1)
        d = (F.silu(gate) * up) @ p["wd"]
        if all_reduce is not None:
            d = all_reduce(d)
        return h + d


def decoder_stack(layers: list, x: torch.Tensor, k_caches: list, v_caches: list,
                  shape: Shape = LLAMA3_8B) -> torch.Tensor:
    for p, k, v in zip(layers, k_caches, v_caches):
        x = decoder_layer(p, x, k, v, shape=shape)
    return x


class LlamaLike(torch.nn.Module):
    """A trainable Llama-style decoder (RMSNorm, GQA attention with `is_causal`, SwiGLU), plain PyTorch."""

    def __init__(self, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(_Block(hidden, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(hidden, eps=1e-5)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class _Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(hidden, eps=1e-5), torch.nn.RMSNorm(hidden, eps=1e-5)
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = torch.nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.gate_up = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, -1, self.head_dim).split(
            [self.heads, self.kv_heads, self.kv_heads], dim=2)
        with df.region("attn"):
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, enable_gqa=True)
        x = x + self.out(a.transpose(1, 2).reshape(batch, length, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)
