"""Single-GPU overlap with Llama-3-8B-like shapes (bf16), every variant in one CUDA graph, side by side.

pod     prefill attention (compute-bound flash attention) beside decode attention (memory-bound) of
        other sequences: independent work, POD-Attention style.
          baseline                 both in one hand-captured CUDA graph on one stream
          hand-2s                  hand-written two-stream version (fork, one attention per stream, join)
          compile-reduce-overhead  torch.compile(pod, mode="reduce-overhead"), cudagraph trees
          df                       df.jit(pod), default settings (Inductor stages, one CUDA graph, one stream)
          df.branches              df.jit(T.overlap(T.partition(pod, regions), "branches"))
          df.auto                  df.jit(pod, strategy="auto"): the fastest of no overlap and branches
decode  4 decoder layers at decode batch 64 and 256 (KV context 2048), micro-batched:
          baseline                 whole batch, one stream, hand-captured graph
          compile-reduce-overhead  torch.compile(decoder_stack, mode="reduce-overhead")
          df                       df.jit(decoder_stack), default settings
          df.mb2-seq               2 micro-batches, one stream (what splitting alone costs)
          df.rr2/tbo2              2 micro-batches overlapped with roundrobin / two-batch overlap
          df.auto                  strategy="auto" with in_axes: the fastest of those candidates, measured
decode module  the same 4 layers as an nn.Module (weights as parameters, KV caches as registered buffers),
        batch 64 and 256: the form torch.compile documents, needing no marks.
          eager                    module(x), the baseline of this group
          compile-reduce-overhead  torch.compile(module, mode="reduce-overhead")
          df                       fn, state = df.pure(module); df.jit(fn)(state, x), default settings
          df.aten                  the same with backend="cudagraph" (aten kernels)
          df.auto                  strategy="auto", micro-batching x and the cache buffers

In pod and decode, the tensors that persist across calls (weights and KV caches; in pod every input)
are marked with torch._dynamo.mark_static_address, which torch.compile and df.jit both read in place;
the df rows are df.jit's default settings around their transform. Each sample times 10 back-to-back
calls with CUDA events (steady state, so host work per call overlaps the GPU as in a serving loop);
30 samples per variant, interleaved. Prints medians, ratios against the baseline and against
compile-reduce-overhead, and what df.auto kept (`choice`); peak_mem_mb is left out for cudagraph
trees, whose pool bookkeeping rewrites the allocator's counters. Writes bench/results/single_gpu.json
(single_gpu-<cases>.json for a subset).
    python -m bench.single_gpu [--cases pod decode module]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import dynaflow_fn as df
from bench.common import (COMPILE, DF, capture_graph, chosen_strategies, compiled, jitted, mark_static, output_of,
                          peak_memory_mb, print_table, relative_error, release, time_variants,
                          with_speedup_vs_compile, write_results)
from bench.llama_layers import DTYPE, HEAD_DIM, HIDDEN, KV_HEADS, Q_HEADS, decoder_layer, decoder_stack, make_layer
from dynaflow_fn import transforms as T

DEVICE = torch.device("cuda")


# --- prefill attention || decode attention ---------------------------------------------------------

def prefill_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def cache_attention(q_decode, k_cache, v_cache):
    scores = torch.matmul(q_decode, k_cache.transpose(-1, -2)) * HEAD_DIM ** -0.5
    return torch.matmul(torch.softmax(scores.float(), -1).to(DTYPE), v_cache)


def pod(q, k, v, q_decode, k_cache, v_cache):
    with df.region("prefill"):
        prefill = prefill_attention(q, k, v)
    with df.region("decode"):
        decode = cache_attention(q_decode, k_cache, v_cache)
    return prefill, decode


def pod_rows() -> list[dict]:
    rows = []
    for prefill_tokens, decode_batch, context in ((2048, 128, 2048), (4096, 256, 2048), (1024, 64, 4096)):
        case = f"prefill {prefill_tokens} || decode {decode_batch}x{context}"
        r = lambda *shape: torch.randn(*shape, device=DEVICE, dtype=DTYPE)
        args = (r(1, Q_HEADS, prefill_tokens, HEAD_DIM), r(1, Q_HEADS, prefill_tokens, HEAD_DIM),
                r(1, Q_HEADS, prefill_tokens, HEAD_DIM), r(decode_batch, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM),
                r(decode_batch, KV_HEADS, context, HEAD_DIM), r(decode_batch, KV_HEADS, context, HEAD_DIM))
        reference = pod(*args)
        first = lambda: prefill_attention(*args[:3])
        second = lambda: cache_attention(*args[3:])
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def two_streams():
            current = torch.cuda.current_stream()
            s1.wait_stream(current)
            s2.wait_stream(current)
            with torch.cuda.stream(s1):
                a = first()
            with torch.cuda.stream(s2):
                b = second()
            current.wait_stream(s1)
            current.wait_stream(s2)
            return a, b

        rules = [T.Region("prefill"), T.Region("decode")]
        mark_static(args)
        variants = {
            "baseline": lambda: capture_graph(lambda: pod(*args)),
            "hand-2s": lambda: capture_graph(two_streams),
            COMPILE: lambda: compiled(pod, args),
            DF: lambda: jitted(pod, args),
            "df.branches": lambda: jitted(T.overlap(T.partition(pod, rules=rules), strategy="branches"), args),
            "df.auto": lambda: jitted(pod, args, strategy="auto", progress=False),
            "prefill-alone": lambda: capture_graph(first),
            "decode-alone": lambda: capture_graph(second),
        }
        measured = _measure(case, variants, reference)
        alone = {r["variant"]: r["median_ms"] for r in measured}
        for row in measured:
            row["ideal_speedup"] = (alone["prefill-alone"] + alone["decode-alone"]) / max(
                alone["prefill-alone"], alone["decode-alone"])
        rows += measured
        release()
    return rows


def _measure(case: str, variants: dict, reference, baseline: str = "baseline") -> list[dict]:
    """Build every variant (recording its peak memory), time them interleaved, then check each against
    `reference`.

    A hand-captured graph builds into (replay, static output); the other variants into a call returning
    fresh outputs, which `output_of` calls once more after timing and reads at once.
    """
    rows, calls, outputs = [], {}, {}
    for name, build in variants.items():
        holder = {}
        memory = peak_memory_mb(lambda: holder.setdefault("built", build()))
        built = holder["built"]
        calls[name], outputs[name] = built if isinstance(built, tuple) else (built, None)
        rows.append({"case": case, "variant": name, "peak_mem_mb": None if name == COMPILE else memory,
                     "choice": chosen_strategies(calls[name])})
    timings = time_variants(calls, rounds=10, repeats=10, inner=10)
    torch.cuda.synchronize()
    base = timings[baseline]["median_ms"]
    for row in rows:
        row.update(timings[row["variant"]])
        row["speedup_vs_baseline"] = base / row["median_ms"]
        out = output_of(calls[row["variant"]], outputs[row["variant"]])
        if isinstance(out, (tuple, list)) and isinstance(reference, (tuple, list)) and len(out) == len(reference):
            row["rel_err"] = max(relative_error(a, b) for a, b in zip(out, reference))
        elif isinstance(out, torch.Tensor) and isinstance(reference, torch.Tensor):
            row["rel_err"] = relative_error(out, reference)
    return with_speedup_vs_compile(rows)


# --- micro-batched decode layers -------------------------------------------------------------------

def decode_rows(layers: int = 4, context: int = 2048) -> list[dict]:
    rows = []
    weights = [make_layer(DEVICE, seed=i) for i in range(layers)]
    for batch in (64, 256):
        case = f"decode {layers} layers, batch {batch}, ctx {context}"
        k_caches = [torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=DEVICE, dtype=DTYPE) for _ in range(layers)]
        v_caches = [torch.randn_like(k) for k in k_caches]
        x = torch.randn(batch, HIDDEN, device=DEVICE, dtype=DTYPE)
        args = (weights, x, k_caches, v_caches)
        reference = decoder_stack(*args)
        static_x = x.clone()
        mark_static(weights, k_caches, v_caches)

        def baseline():
            replay, out = capture_graph(lambda: decoder_stack(weights, static_x, k_caches, v_caches))
            return (lambda: (static_x.copy_(x), replay())), out

        def split(strategy):
            step = T.microbatch(decoder_stack, num=2, in_axes=(None, 0, 0, 0))
            return T.overlap(T.partition(step, rules=[T.Region("attn")]), strategy=strategy)

        variants = {
            "baseline": baseline,
            COMPILE: lambda: compiled(decoder_stack, args),
            DF: lambda: jitted(decoder_stack, args),
            "df.mb2-seq": lambda: jitted(split("sequential"), args),
            "df.rr2": lambda: jitted(split("roundrobin"), args),
            "df.tbo2": lambda: jitted(split("tbo"), args),
            "df.auto": lambda: jitted(decoder_stack, args, strategy="auto", in_axes=(None, 0, 0, 0), progress=False),
        }
        rows += _measure(case, variants, reference)
        release()
    return rows


# --- the same layers as an nn.Module ---------------------------------------------------------------

class DecodeLayer(nn.Module):
    """One decoder layer of llama_layers: its weights as frozen parameters, its KV caches as buffers."""

    def __init__(self, weights: dict, k_cache: torch.Tensor, v_cache: torch.Tensor):
        super().__init__()
        self.names = tuple(weights)
        for name, weight in weights.items():
            self.register_parameter(name, nn.Parameter(weight, requires_grad=False))
        self.register_buffer("k_cache", k_cache)
        self.register_buffer("v_cache", v_cache)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return decoder_layer({name: getattr(self, name) for name in self.names}, x, self.k_cache, self.v_cache)


class DecodeStack(nn.Module):
    """`decoder_stack` over `weights` as a module, with fresh random KV caches of `batch` x `context` tokens."""

    def __init__(self, weights: list, batch: int, context: int):
        super().__init__()
        cache = lambda: torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=DEVICE, dtype=DTYPE)
        self.layers = nn.Sequential(*(DecodeLayer(p, cache(), cache()) for p in weights))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def decode_module_rows(layers: int = 4, context: int = 2048) -> list[dict]:
    """The decode stack in torch.compile's recommended form: whether df.pure's state, read in place by
    default, matches cudagraph trees' static parameters and buffers."""
    rows = []
    weights = [make_layer(DEVICE, seed=i) for i in range(layers)]
    for batch in (64, 256):
        module = DecodeStack(weights, batch, context)
        fn, state = df.pure(module)
        x = torch.randn(batch, HIDDEN, device=DEVICE, dtype=DTYPE)
        cache_axes = {name: 0 if name.endswith("_cache") else None for name in state}   # split the caches by sequence
        with torch.no_grad():
            reference = module(x)
        variants = {
            "eager": lambda: lambda: module(x),
            COMPILE: lambda: compiled(module, (x,)),
            DF: lambda: jitted(fn, (state, x)),
            "df.aten": lambda: jitted(fn, (state, x), backend="cudagraph"),
            "df.auto": lambda: jitted(fn, (state, x), strategy="auto", in_axes=(cache_axes, 0), progress=False),
        }
        rows += _measure(f"decode module {layers} layers, batch {batch}, ctx {context}", variants, reference,
                         baseline="eager")
        release()
    return rows


CASES = {"pod": pod_rows, "decode": decode_rows, "module": decode_module_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", choices=list(CASES), default=list(CASES))
    options = parser.parse_args()
    os.environ.setdefault("DYNAFLOW_CACHE_DIR", tempfile.mkdtemp())   # df.auto measures, not recalls
    torch.manual_seed(0)
    rows = [row for case in options.cases for row in CASES[case]()]
    columns = ["case", "variant", "median_ms", "p10_ms", "p90_ms", "speedup_vs_baseline", "speedup_vs_compile",
               "peak_mem_mb", "choice", "rel_err"]
    print_table(rows, columns, f"single GPU overlap ({torch.cuda.get_device_name()})")
    name = "single_gpu" if options.cases == list(CASES) else f"single_gpu-{'-'.join(options.cases)}"
    print(f"\nwrote {write_results(name, rows)}")


if __name__ == "__main__":
    main()
