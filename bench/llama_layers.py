"""Llama-3-8B-like decoder layers as plain functions of weight dicts, for the benchmarks.

Hidden 4096, 32 query / 8 key-value heads of 128, FFN 14336, bf16. Decode attention reads a KV cache
with two batched matmuls (memory-bound); `df.region` tags mark the phases for partition rules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import dynaflow_fn as df

HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, FFN = 4096, 32, 8, 128, 14336
DTYPE = torch.bfloat16


def make_layer(device: torch.device, tp: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=DTYPE, generator=generator) * 0.02

    return {
        "wqkv": weight(HIDDEN, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM // tp),
        "wo": weight(Q_HEADS * HEAD_DIM // tp, HIDDEN),
        "wgu": weight(HIDDEN, 2 * FFN // tp),
        "wd": weight(FFN // tp, HIDDEN),
        "n1": torch.ones(HIDDEN, device=device, dtype=DTYPE),
        "n2": torch.ones(HIDDEN, device=device, dtype=DTYPE),
    }


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * weight


def decode_attention(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tp: int = 1) -> torch.Tensor:
    """One new token per sequence against its cache: [B, kv, group, D] x [B, kv, L, D]."""
    batch = qkv.shape[0]
    q_heads, kv_heads = Q_HEADS // tp, KV_HEADS // tp
    q = qkv[:, : q_heads * HEAD_DIM].view(batch, kv_heads, q_heads // kv_heads, HEAD_DIM)
    scores = torch.matmul(q, k_cache.transpose(-1, -2)) * HEAD_DIM ** -0.5
    probs = torch.softmax(scores.float(), -1).to(DTYPE)
    return torch.matmul(probs, v_cache).reshape(batch, q_heads * HEAD_DIM)


def decoder_layer(p: dict, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tp: int = 1,
                  all_reduce=None) -> torch.Tensor:
    with df.region("pre"):
        qkv = rms_norm(x, p["n1"]) @ p["wqkv"]
    with df.region("attn"):
        a = decode_attention(qkv, k_cache, v_cache, tp)
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


def decoder_stack(layers: list, x: torch.Tensor, k_caches: list, v_caches: list) -> torch.Tensor:
    for p, k, v in zip(layers, k_caches, v_caches):
        x = decoder_layer(p, x, k, v)
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
