"""Decode attention as a split-KV Triton kernel (flash-decoding), registered as a custom op.

One new token per sequence attends to its KV cache: for each (sequence, key-value head), the G query
heads that share the head are G query rows against L cached keys. The kernel gives each (sequence,
head, chunk of the cache) its own program, which streams its chunk once with an online softmax and
writes a partial result; a short combine step weighs the chunks by their softmax mass. Chunks are
only made when there are too few (sequence, head) pairs to fill the GPU.

`torch.library.custom_op` with a fake implementation makes it traceable, so `T.substitute` can put
it where a model's attention region was (bench/substitute.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64          # cached tokens per inner step
QUERY_ROWS = 16       # tl.dot needs 16 rows: the G query heads of a group, padded


@triton.jit
def _partial_attention(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, o_ptr, heads, context, chunk, scale,
                       sq_b, sq_h, sq_g, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, splits,
                       GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr):
    pair, split = tl.program_id(0), tl.program_id(1)
    b, h = pair // heads, pair % heads
    rows, dims = tl.arange(0, ROWS), tl.arange(0, DIM)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_g + dims[None, :], mask=rows[:, None] < GROUP,
                other=0.0)
    start = split * chunk
    end = tl.minimum(start + chunk, context)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DIM], tl.float32)
    for n in range(start, end, BLOCK):
        cols = n + tl.arange(0, BLOCK)
        inside = cols < end
        k = tl.load(k_ptr + b * sk_b + h * sk_h + cols[None, :] * sk_n + dims[:, None], mask=inside[None, :], other=0.0)
        s = tl.dot(q, k) * scale
        s = tl.where(inside[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + b * sv_b + h * sv_h + cols[:, None] * sv_n + dims[None, :], mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    slot = pair * splits + split
    tl.store(m_ptr + slot * ROWS + rows, m_i)
    tl.store(l_ptr + slot * ROWS + rows, l_i)
    tl.store(o_ptr + (slot * ROWS + rows[:, None]) * DIM + dims[None, :], acc)


def _splits(pairs: int, context: int, device: torch.device) -> int:
    """Chunks per (sequence, head): enough programs for four per SM, each at least 256 tokens."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(4 * sms, pairs), context // 256))


@torch.library.custom_op("bench::split_kv_decode", mutates_args=())
def split_kv_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v for q [B, H, G, D] against caches [B, H, L, D]; returns [B, H*G*D]."""
    batch, heads, group, dim = q.shape
    context = k_cache.shape[2]
    pairs = batch * heads
    splits = _splits(pairs, context, q.device)
    chunk = triton.cdiv(triton.cdiv(context, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(context, chunk)                  # no empty chunk
    m = torch.empty(pairs, splits, QUERY_ROWS, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    o = torch.empty(pairs, splits, QUERY_ROWS, dim, device=q.device, dtype=torch.float32)
    _partial_attention[(pairs, splits)](
        q, k_cache, v_cache, m, l, o, heads, context, chunk, dim ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), splits,
        GROUP=group, ROWS=QUERY_ROWS, DIM=dim, BLOCK=BLOCK_N)
    m, l, o = m[:, :, :group], l[:, :, :group], o[:, :, :group]
    weight = torch.exp(m - m.amax(1, keepdim=True))
    out = (o * weight[..., None]).sum(1) / (l * weight).sum(1)[..., None]
    return out.to(q.dtype).reshape(batch, heads * group * dim)


@split_kv_decode.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2] * q.shape[3])
