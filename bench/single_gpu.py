"""Single-GPU overlap with Llama-3-8B-like shapes (bf16), every variant in one CUDA graph, side by side.

pod     prefill attention (compute-bound flash attention) beside decode attention (memory-bound) of
        other sequences: independent work, POD-Attention style.
          baseline     both in one hand-captured CUDA graph on one stream
          hand-2s      hand-written two-stream version (fork, one attention per stream, join)
          df.jit       dynaflow_fn, no transforms (one stream)
          df.branches  T.overlap(T.partition(fn, regions), "branches")
decode  4 decoder layers at decode batch 64-512 (KV context 2048), micro-batched:
          baseline     whole batch, one stream, hand-captured graph
          df.jit       dynaflow_fn, no transforms
          df.mb2-seq   2 micro-batches, one stream (what splitting alone costs)
          df.rr2/tbo2  2 micro-batches overlapped with roundrobin / two-batch overlap

Each sample times 10 back-to-back calls with CUDA events (steady state, so host work per call overlaps
the GPU as in a serving loop); 30 samples per variant, interleaved. Prints medians and ratios against
the baseline; writes bench/results/single_gpu.json.   python -m bench.single_gpu
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import dynaflow_fn as df
from bench.common import capture_graph, peak_memory_mb, print_table, time_variants, write_results
from bench.llama_layers import DTYPE, HEAD_DIM, HIDDEN, KV_HEADS, Q_HEADS, decoder_stack, make_layer
from dynaflow_fn import transforms as T

DEVICE = torch.device("cuda")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


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
        variants = {
            "baseline": lambda: capture_graph(lambda: pod(*args)),
            "hand-2s": lambda: capture_graph(two_streams),
            "df.jit": lambda: _df(pod, args),
            "df.branches": lambda: _df(T.overlap(T.partition(pod, rules=rules), strategy="branches"), args),
            "prefill-alone": lambda: capture_graph(first),
            "decode-alone": lambda: capture_graph(second),
        }
        measured = _measure(case, variants, reference)
        alone = {r["variant"]: r["median_ms"] for r in measured}
        for row in measured:
            row["ideal_speedup"] = (alone["prefill-alone"] + alone["decode-alone"]) / max(
                alone["prefill-alone"], alone["decode-alone"])
        rows += measured
        torch.cuda.empty_cache()
    return rows


def _df(fn, args, persistent=None):
    fast = df.jit(fn, persistent_argnums=tuple(range(len(args))) if persistent is None else persistent,
                  static_outputs=True)
    out = fast(*args)
    return (lambda: fast(*args)), out


def _measure(case: str, variants: dict, reference) -> list[dict]:
    """Build every variant (recording its peak memory and error), then time them interleaved."""
    rows, calls, outputs = [], {}, {}
    for name, build in variants.items():
        holder = {}
        memory = peak_memory_mb(lambda: holder.setdefault("built", build()))
        calls[name], outputs[name] = holder["built"]
        rows.append({"case": case, "variant": name, "peak_mem_mb": memory})
    timings = time_variants(calls, rounds=3, repeats=10, inner=10)
    torch.cuda.synchronize()
    for row in rows:
        row.update(timings[row["variant"]])
        out = outputs[row["variant"]]      # static outputs: they hold the last replay's results
        if isinstance(out, (tuple, list)) and isinstance(reference, (tuple, list)) and len(out) == len(reference):
            row["rel_err"] = max(relative_error(a, b) for a, b in zip(out, reference))
        elif isinstance(out, torch.Tensor) and isinstance(reference, torch.Tensor):
            row["rel_err"] = relative_error(out, reference)
    base = timings["baseline"]["median_ms"]
    for row in rows:
        row["speedup_vs_baseline"] = base / row["median_ms"]
    return rows


# --- micro-batched decode layers -------------------------------------------------------------------

def decode_rows(layers: int = 4, context: int = 2048) -> list[dict]:
    rows = []
    weights = [make_layer(DEVICE, seed=i) for i in range(layers)]
    for batch in (64, 128, 256, 512):
        case = f"decode {layers} layers, batch {batch}, ctx {context}"
        k_caches = [torch.randn(batch, KV_HEADS, context, HEAD_DIM, device=DEVICE, dtype=DTYPE) for _ in range(layers)]
        v_caches = [torch.randn_like(k) for k in k_caches]
        x = torch.randn(batch, HIDDEN, device=DEVICE, dtype=DTYPE)
        args = (weights, x, k_caches, v_caches)
        reference = decoder_stack(*args)
        static_x = x.clone()

        def baseline():
            replay, out = capture_graph(lambda: decoder_stack(weights, static_x, k_caches, v_caches))
            return (lambda: (static_x.copy_(x), replay())), out

        def split(strategy):
            step = T.microbatch(decoder_stack, num=2, in_axes=(None, 0, 0, 0))
            return T.overlap(T.partition(step, rules=[T.Region("attn")]), strategy=strategy)

        variants = {
            "baseline": baseline,
            "df.jit": lambda: _df(decoder_stack, args, persistent=(0, 2, 3)),
            "df.mb2-seq": lambda: _df(split("sequential"), args, persistent=(0, 2, 3)),
            "df.rr2": lambda: _df(split("roundrobin"), args, persistent=(0, 2, 3)),
            "df.tbo2": lambda: _df(split("tbo"), args, persistent=(0, 2, 3)),
        }
        rows += _measure(case, variants, reference)
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    torch.manual_seed(0)
    rows = pod_rows() + decode_rows()
    columns = ["case", "variant", "median_ms", "p10_ms", "p90_ms", "speedup_vs_baseline", "peak_mem_mb", "rel_err"]
    print_table(rows, columns, f"single GPU overlap ({torch.cuda.get_device_name()})")
    print(f"\nwrote {write_results('single_gpu', rows)}")


if __name__ == "__main__":
    main()
