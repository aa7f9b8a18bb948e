"""Operator substitution: the decode stack's attention replaced by a fused kernel, without editing it.

Four Llama-3-8B-like decoder layers at decode (one new token per sequence against its KV cache,
bf16), from bench/llama_layers.py, whose attention region is written as matmul -> softmax ->
matmul. Side by side, per case:

  compile-reduce-overhead  torch.compile(decoder_stack, mode="reduce-overhead"), weights and caches
                           marked as static addresses (read in place): the peer in its recommended form
  df                       df.jit(decoder_stack) with weights and caches persistent (read in place)
  df.substituted           the same after T.substitute({T.Region("attn"): sdpa_decode}): the region runs
                           F.scaled_dot_product_attention (flash attention) instead
  df.substituted-inductor  the same with backend="inductor": the other stages' elementwise work fused
  df.substituted-splitkv   the region replaced by a split-KV Triton kernel (bench/split_kv_attention.py)

Reports medians (CUDA events) and the speedup over `df`; writes bench/results/substitute.json.

    python -m bench.substitute
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

import dynaflow_fn as df
from bench.common import print_table, write_results
from bench.inductor import compiled, jitted, measure, release
from bench.llama_layers import DTYPE, HEAD_DIM, HIDDEN, KV_HEADS, Q_HEADS, decoder_stack, make_layer
from dynaflow_fn import transforms as T

CASES = ((64, 2048), (64, 4096), (256, 2048), (256, 4096))       # (sequences, cached tokens)
LAYERS = 4
BASELINE = "df"
COLUMNS = ["case", "variant", "median_ms", "p10_ms", "p90_ms", "speedup_vs_df", "peak_mem_mb", "rel_err"]


def sdpa_decode(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """The attention region of llama_layers.decoder_layer as one fused kernel: the query heads of each
    key-value head are the query rows of one attention problem against that head's cache."""
    batch = qkv.shape[0]
    q = qkv[:, : Q_HEADS * HEAD_DIM].view(batch, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)
    return F.scaled_dot_product_attention(q, k_cache, v_cache).reshape(batch, Q_HEADS * HEAD_DIM)


def split_kv_decode_region(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """The attention region as the split-KV Triton kernel of bench/split_kv_attention.py."""
    from bench.split_kv_attention import split_kv_decode

    batch = qkv.shape[0]
    q = qkv[:, : Q_HEADS * HEAD_DIM].view(batch, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM)
    return split_kv_decode(q, k_cache, v_cache)


substituted_stack = T.substitute(decoder_stack, {T.Region("attn"): sdpa_decode})
split_kv_stack = T.substitute(decoder_stack, {T.Region("attn"): split_kv_decode_region})


def rows_for(sequences: int, context: int, device: torch.device) -> list[dict]:
    weights = [make_layer(device, seed=i) for i in range(LAYERS)]
    k_caches = [torch.randn(sequences, KV_HEADS, context, HEAD_DIM, device=device, dtype=DTYPE) for _ in weights]
    v_caches = [torch.randn_like(k) for k in k_caches]
    x = torch.randn(sequences, HIDDEN, device=device, dtype=DTYPE)
    args = (weights, x, k_caches, v_caches)
    with torch.no_grad():
        reference = decoder_stack(*args)
    variants = {
        "compile-reduce-overhead": lambda: compiled(decoder_stack, args, "reduce-overhead", static=(0, 2, 3)),
        BASELINE: lambda: jitted(decoder_stack, args, persistent=(0, 2, 3)),
        "df.substituted": lambda: jitted(substituted_stack, args, persistent=(0, 2, 3)),
        "df.substituted-inductor": lambda: jitted(substituted_stack, args, persistent=(0, 2, 3),
                                                  backend="inductor"),
    }
    if importlib.util.find_spec("triton") is not None:
        variants["df.substituted-splitkv"] = lambda: jitted(split_kv_stack, args, persistent=(0, 2, 3))
    rows = measure(f"decode {LAYERS} layers, {sequences} seqs x {context} tokens", variants, reference, inner=10)
    base = next(r["median_ms"] for r in rows if r["variant"] == BASELINE)
    for row in rows:
        row["speedup_vs_df"] = base / row["median_ms"]
    release()
    return rows


def main() -> None:
    if not torch.cuda.is_available():
        print("bench.substitute measures on a GPU; nothing to do here")
        return
    torch.manual_seed(0)
    device = torch.device("cuda")
    rows = [row for sequences, context in CASES for row in rows_for(sequences, context, device)]
    print_table(rows, COLUMNS, f"substituted decode attention ({torch.cuda.get_device_name()}, df {df.__version__})")
    print(f"\nwrote {write_results('substitute', rows)}")


if __name__ == "__main__":
    main()
