"""Substitution: a decode stack's attention replaced by a fused kernel, without editing the model.

The model below writes decode attention (one new token per sequence against its KV cache) as
matmul -> softmax -> matmul inside `with df.region("attn")`, as bench/llama_layers.py does.
`T.substitute` replaces that region by `F.scaled_dot_product_attention` (flash attention on a GPU):
`sdpa_decode` receives the tensors the region reads, in the order it first reads them (the fused
qkv projection, the key cache, the value cache), and returns what the region produced.
`check=True` first runs the region and the replacement on random inputs and refuses a replacement
that disagrees.

On a GPU it uses Llama-3-8B shapes (4 layers, 256 sequences x 4096 cached tokens) and prints the
time per call of both plans; on a CPU, small shapes.

    python examples/substitute_attention.py
"""

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import dynaflow_fn as df
from dynaflow_fn import transforms as T


@dataclass(frozen=True)
class Shape:
    hidden: int = 4096
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336


def rms_norm(x, weight):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * weight


def decode_layer(p, x, k_cache, v_cache, shape):
    batch = x.shape[0]
    qkv = rms_norm(x, p["n1"]) @ p["wqkv"]
    with df.region("attn"):
        q = qkv[:, : shape.q_heads * shape.head_dim].view(batch, shape.kv_heads, -1, shape.head_dim)
        scores = torch.matmul(q, k_cache.transpose(-1, -2)) * shape.head_dim ** -0.5
        probs = torch.softmax(scores.float(), -1).to(x.dtype)
        a = torch.matmul(probs, v_cache).reshape(batch, -1)
    h = x + a @ p["wo"]
    gate, up = (rms_norm(h, p["n2"]) @ p["wgu"]).chunk(2, -1)
    return h + (F.silu(gate) * up) @ p["wd"]


def decode_stack(layers, x, k_caches, v_caches, shape):
    for p, k, v in zip(layers, k_caches, v_caches):
        x = decode_layer(p, x, k, v, shape)
    return x


def sdpa_decode(qkv, k_cache, v_cache):
    """The region as one fused kernel: each key-value head's group of query heads is the query rows of
    one attention problem against that head's cache."""
    batch, kv_heads, _, head_dim = k_cache.shape
    q = qkv[:, : qkv.shape[1] - 2 * kv_heads * head_dim].view(batch, kv_heads, -1, head_dim)
    return F.scaled_dot_product_attention(q, k_cache, v_cache).reshape(batch, -1)


def make_inputs(shape, layers, sequences, context, device):
    w = lambda *size: torch.randn(*size, device=device, dtype=torch.bfloat16) * 0.02
    weights = [{"n1": torch.ones(shape.hidden, device=device, dtype=torch.bfloat16),
                "n2": torch.ones(shape.hidden, device=device, dtype=torch.bfloat16),
                "wqkv": w(shape.hidden, (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim),
                "wo": w(shape.q_heads * shape.head_dim, shape.hidden),
                "wgu": w(shape.hidden, 2 * shape.ffn), "wd": w(shape.ffn, shape.hidden)} for _ in range(layers)]
    cache = lambda: [w(sequences, shape.kv_heads, context, shape.head_dim) * 50 for _ in range(layers)]
    return weights, w(sequences, shape.hidden) * 50, cache(), cache(), shape


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ms_per_call(call, args, repeats=20):
    call(*args)
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        call(*args)
    synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    if torch.cuda.is_available():
        args = make_inputs(Shape(), layers=4, sequences=256, context=4096, device="cuda")
    else:
        args = make_inputs(Shape(256, 8, 2, 32, 512), layers=2, sequences=8, context=256, device="cpu")
    substituted = T.substitute(decode_stack, {T.Region("attn"): sdpa_decode}, check=True)
    plain = df.jit(decode_stack, persistent_argnums=(0, 2, 3))
    fast = df.jit(substituted, persistent_argnums=(0, 2, 3))
    with torch.no_grad():
        expected = decode_stack(*args).float()
        error = ((fast(*args).float() - expected).abs().max() / expected.abs().max()).item()
    print(f"largest difference from eager, relative to the largest output: {error:.2g} (bf16)")
    times = {"df": ms_per_call(plain, args), "df.substituted": ms_per_call(fast, args)}
    for name, ms in times.items():
        print(f"{name:16s} {ms:8.3f} ms per call ({times['df'] / ms:.2f}x)")


if __name__ == "__main__":
    main()
