"""TorchInductor kernels inside dynaflow_fn plans against torch.compile, Llama-3-8B-like shapes (bf16).

df.jit's default compiles each stage with Inductor inside its one CUDA graph; df.aten rows are
backend="cudagraph", the aten kernels.

stack   4 decoder layers over whole prompts (prefill: causal GQA attention), 1x2048 and 4x2048 tokens:
          compile-reduce-overhead             torch.compile(fn, mode="reduce-overhead"): Inductor kernels
                                              replayed through cudagraph trees; the baseline of the ratios
          df                                  df.jit(fn), default settings
          df.aten                             df.jit(fn, backend="cudagraph")
          df.rr2                              df.jit(T.overlap(T.microbatch(fn, 2), "roundrobin")): two
                                              micro-batches on two streams (4x2048 only: one prompt cannot
                                              be split into two)
          df.auto                             df.jit(fn, strategy="auto", in_axes=(None, 0)): the fastest
                                              candidate, measured (4x2048 only)
hf      an unmodified transformers LlamaForCausalLM (4 Llama-3-8B-like layers, vocabulary 32000) at 1x2048
        and 4x2048 tokens:
          eager                               model(ids, use_cache=False).logits under no_grad
          compile-reduce-overhead             torch.compile of that, the baseline
          df                                  df.jit over fn, params = df.pure(model), default settings
          df.compile_backend                  torch.compile(backend=df.compile_backend()): every Dynamo
                                              graph one df CUDA graph (with df's default Inductor stages)
          df.rr2, df.tbo2                     df.jit of two micro-batches of prompts, strategy "roundrobin"
                                              or "tbo" (4x2048 only)
          df.auto                             df.jit(..., strategy="auto", in_axes=(None, 0)) (4x2048 only)

Prefill attention beside decode attention, with Inductor's kernels, is bench/single_gpu.py's pod group.

Every variant reads the weights in place: they are marked with
torch._dynamo.mark_static_address (bench.common.mark_static), which torch.compile and df.jit both
honour, and the HF model's are module parameters and buffers; the stack's activations are copied into
each CUDA graph's static input. Each sample times back-to-back calls with CUDA events, interleaved over
the variants. peak_mem_mb is the memory allocated while a variant is built (compilation, warm-up,
capture; with Inductor that includes benchmarking its kernel configs unless its on-disk cache has
them); it is left out for cudagraph trees, whose pool bookkeeping rewrites the allocator's counters.

rel_err compares one more call, made after timing, with eager PyTorch. Prints medians and ratios
against compile-reduce-overhead (speedup_vs_baseline and speedup_vs_compile are the same ratio here);
writes bench/results/inductor.json (inductor-<cases>.json for a subset).
    python -m bench.inductor [--cases stack hf]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any, Callable

import optree
import torch
import torch.nn.functional as F

import dynaflow_fn as df
from bench.common import (COMPILE, DF, compiled, jitted, mark_static, peak_memory_mb, print_table, relative_error, release,
                          time_variants, with_speedup_vs_compile, write_results)
from bench.llama_layers import DTYPE, FFN, HEAD_DIM, HIDDEN, KV_HEADS, Q_HEADS, make_layer, rms_norm
from dynaflow_fn import transforms as T

DEVICE = torch.device("cuda")
BASELINE = COMPILE
LAYERS = 4
PROMPTS = ((1, 2048), (4, 2048))                                  # (batch, tokens) of the stack
UNCOUNTED_MEMORY = {BASELINE}     # cudagraph trees: the allocated total can end below where it started
COLUMNS = ["case", "variant", "median_ms", "p10_ms", "p90_ms", "speedup_vs_compile", "peak_mem_mb", "rel_err"]


# --- the functions ---------------------------------------------------------------------------------

def prefill_layer(p: dict, x: torch.Tensor) -> torch.Tensor:
    """One decoder layer over whole prompts [B, T, hidden]: the prefill twin of llama_layers.decoder_layer."""
    batch, tokens, _ = x.shape
    qkv = (rms_norm(x, p["n1"]) @ p["wqkv"]).view(batch, tokens, Q_HEADS + 2 * KV_HEADS, HEAD_DIM).transpose(1, 2)
    q, k, v = qkv.split([Q_HEADS, KV_HEADS, KV_HEADS], dim=1)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    h = x + a.transpose(1, 2).reshape(batch, tokens, Q_HEADS * HEAD_DIM) @ p["wo"]
    gate, up = (rms_norm(h, p["n2"]) @ p["wgu"]).chunk(2, -1)
    return h + (F.silu(gate) * up) @ p["wd"]


def prefill_stack(layers: list, x: torch.Tensor) -> torch.Tensor:
    """The layers one after the other: every variant compiles this one function."""
    for p in layers:
        x = prefill_layer(p, x)
    return x


def two_microbatches(fn: Callable[..., Any], strategy: str = "roundrobin") -> Callable[..., Any]:
    """fn(weights, x) in two micro-batches of prompts on two streams, scheduled by `strategy`."""
    return T.overlap(T.microbatch(fn, num=2, in_axes=(None, 0)), strategy=strategy)


# --- the variants ----------------------------------------------------------------------------------

def measure(case: str, variants: dict[str, Callable[[], Callable[[], Any]]], reference: Any,
            inner: int) -> list[dict]:
    """Build every variant (recording its peak memory), time them interleaved, then check each against eager.

    The check calls each variant once more and reads the result at once: outputs of cudagraph trees
    (and static outputs of df.jit) stay valid only until the next call.
    """
    rows, calls = [], {}
    for name, build in variants.items():
        memory = peak_memory_mb(lambda: calls.update({name: build()}))
        rows.append({"case": case, "variant": name, "peak_mem_mb": None if name in UNCOUNTED_MEMORY else memory})
    timings = time_variants(calls, rounds=3, repeats=10, inner=inner)
    base = timings[BASELINE]["median_ms"]
    for row in rows:
        row.update(timings[row["variant"]])
        row["speedup_vs_baseline"] = base / row["median_ms"]
        outputs = optree.tree_leaves(calls[row["variant"]]())
        row["rel_err"] = max(relative_error(a, b) for a, b in zip(outputs, optree.tree_leaves(reference)))
    return with_speedup_vs_compile(rows)


# --- the cases -------------------------------------------------------------------------------------

def stack_rows() -> list[dict]:
    """Compute-bound prefill: how Inductor's fusions inside one df CUDA graph compare with torch.compile's."""
    weights = [make_layer(DEVICE, seed=i) for i in range(LAYERS)]
    mark_static(weights)
    rows = []
    for batch, tokens in PROMPTS:
        args = (weights, torch.randn(batch, tokens, HIDDEN, device=DEVICE, dtype=DTYPE))
        with torch.no_grad():
            reference = prefill_stack(*args)
        variants = {
            BASELINE: lambda: compiled(prefill_stack, args),
            DF: lambda: jitted(prefill_stack, args),
            "df.aten": lambda: jitted(prefill_stack, args, backend="cudagraph"),
        }
        if batch > 1:
            variants["df.rr2"] = lambda: jitted(two_microbatches(prefill_stack), args)
            variants["df.auto"] = lambda: jitted(prefill_stack, args, strategy="auto", in_axes=(None, 0),
                                                 progress=False)
        rows += measure(f"prefill {LAYERS} layers, {batch}x{tokens} tokens", variants, reference, inner=3)
        release()
    return rows


def hf_rows() -> list[dict]:
    """An unmodified transformers Llama (Llama-3-8B-like layers, random weights): through torch.compile
    with Inductor's cudagraph trees or with dynaflow_fn behind Dynamo, and through df.jit of df.pure."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to(DEVICE, DTYPE).eval().requires_grad_(False)     # for inference
    logits = lambda ids: model(ids, use_cache=False).logits
    fn, params = df.pure(model)
    pure_logits = lambda params, ids: fn(params, ids, use_cache=False).logits
    rows = []
    for batch, tokens in PROMPTS:
        args = (torch.randint(0, config.vocab_size, (batch, tokens), device=DEVICE),)
        with torch.no_grad():
            reference = logits(*args)
        variants = {
            "eager": lambda: lambda: _no_grad(logits, args),
            BASELINE: lambda: compiled(logits, args),
            DF: lambda: jitted(pure_logits, (params, *args)),
            "df.compile_backend": lambda: compiled(logits, args, None, backend=df.compile_backend(progress=False)),
        }
        if batch > 1:
            variants["df.rr2"] = lambda: jitted(two_microbatches(pure_logits), (params, *args))
            variants["df.tbo2"] = lambda: jitted(two_microbatches(pure_logits, "tbo"), (params, *args))
            variants["df.auto"] = lambda: jitted(pure_logits, (params, *args), strategy="auto", in_axes=(None, 0),
                                                 progress=False)
        rows += measure(f"transformers Llama, {LAYERS} layers, {batch}x{tokens} tokens", variants, reference, inner=3)
        release()
    return rows


def _no_grad(fn: Callable[..., Any], args: tuple) -> Any:
    with torch.no_grad():
        return fn(*args)


CASES = {"stack": stack_rows, "hf": hf_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", choices=sorted(CASES), default=list(CASES))
    options = parser.parse_args()
    os.environ.setdefault("DYNAFLOW_CACHE_DIR", tempfile.mkdtemp())   # df.auto measures, not recalls
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    rows = []
    for case in options.cases:
        found = CASES[case]()
        print_table(found, COLUMNS, f"{case}: speedup vs {BASELINE} ({device})")
        rows += found
    name = "inductor" if options.cases == list(CASES) else f"inductor-{'-'.join(options.cases)}"
    print(f"\nwrote {write_results(name, rows, baseline=BASELINE)}")


if __name__ == "__main__":
    main()
