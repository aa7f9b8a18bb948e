"""TorchInductor kernels inside dynaflow_fn plans against torch.compile, Llama-3-8B-like shapes (bf16).

stack   4 decoder layers over whole prompts (prefill: causal GQA attention), 1x2048 and 4x2048 tokens:
          compile-max-autotune-no-cudagraphs  torch.compile(fn, mode="max-autotune-no-cudagraphs"): tuned
                                              Triton kernels launched one by one from Python
          compile-reduce-overhead             torch.compile(fn, mode="reduce-overhead"): Inductor kernels
                                              replayed through cudagraph trees; the baseline of the ratios
          df.jit                              dynaflow_fn with aten kernels, one CUDA graph
          df.inductor                         df.jit(fn, backend="inductor"): each stage compiled by
                                              Inductor, the whole plan one CUDA graph
          df.inductor+rr2                     df.jit(T.overlap(T.microbatch(fn, 2), "roundrobin"),
                                              backend="inductor"): two micro-batches on two streams
                                              (4x2048 only: one prompt cannot be split into two)
pod     prefill attention || decode attention (`pod` of bench/single_gpu.py, at its shapes):
          compile-reduce-overhead             the baseline, as above
          df.inductor                         Inductor kernels, one stream
          df.inductor+branches                T.overlap(T.partition(pod, regions), "branches") with
                                              Inductor kernels: the two attentions on two streams
          df.branches                         the same plan with aten kernels (as in bench/single_gpu.py)

Every variant reads the weights (and, in pod, every input) in place: torch.compile sees them marked
as static addresses, df.jit as persistent arguments; the stack's activations are copied into each
CUDA graph's static input. Each sample times back-to-back calls with CUDA events, interleaved over
the variants. peak_mem_mb is the memory allocated while a variant is built (compilation, warm-up,
capture; with Inductor that includes benchmarking its kernel configs unless its on-disk cache has
them); it is left out for cudagraph trees, whose pool bookkeeping rewrites the allocator's counters.
hf      an unmodified transformers LlamaForCausalLM (4 Llama-3-8B-like layers, vocabulary 32000) at 1x2048
        tokens: eager, torch.compile reduce-overhead (the baseline), and torch.compile with
        df.compile_backend (aten kernels) and df.compile_backend(backend="inductor"), every Dynamo graph
        one df CUDA graph.

rel_err compares one more call, made after timing, with eager PyTorch. Prints medians and ratios
against compile-reduce-overhead; writes bench/results/inductor.json (inductor-<cases>.json for a
subset).   python -m bench.inductor [--cases stack pod hf]
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

import optree
import torch
import torch.nn.functional as F

import dynaflow_fn as df
from bench.common import peak_memory_mb, print_table, time_variants, write_results
from bench.llama_layers import DTYPE, FFN, HEAD_DIM, HIDDEN, KV_HEADS, Q_HEADS, make_layer, rms_norm
from bench.single_gpu import pod, relative_error
from dynaflow_fn import transforms as T

DEVICE = torch.device("cuda")
BASELINE = "compile-reduce-overhead"
LAYERS = 4
PROMPTS = ((1, 2048), (4, 2048))                                  # (batch, tokens) of the stack
POD_SHAPES = ((2048, 128, 2048), (4096, 256, 2048), (1024, 64, 4096))  # (prefill tokens, decode batch, context)
UNCOUNTED_MEMORY = {BASELINE}     # cudagraph trees: the allocated total can end below where it started
COLUMNS = ["case", "variant", "median_ms", "p10_ms", "p90_ms", "speedup_vs_baseline", "peak_mem_mb", "rel_err"]


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


def round_robin(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn(layers, x) in two micro-batches of prompts, taking turns on two streams."""
    return T.overlap(T.microbatch(fn, num=2, in_axes=(None, 0)), strategy="roundrobin")


def branches(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The df.branches variant of bench/single_gpu.py: each attention region on its own stream."""
    return T.overlap(T.partition(fn, rules=[T.Region("prefill"), T.Region("decode")]), strategy="branches")


def pod_args(prefill_tokens: int, decode_batch: int, context: int) -> tuple[torch.Tensor, ...]:
    """q, k, v of one prompt, then one query per decoding sequence and its KV cache (bench/single_gpu.py)."""
    r = lambda *shape: torch.randn(*shape, device=DEVICE, dtype=DTYPE)
    prompt = (1, Q_HEADS, prefill_tokens, HEAD_DIM)
    return (r(*prompt), r(*prompt), r(*prompt), r(decode_batch, KV_HEADS, Q_HEADS // KV_HEADS, HEAD_DIM),
            r(decode_batch, KV_HEADS, context, HEAD_DIM), r(decode_batch, KV_HEADS, context, HEAD_DIM))


# --- the variants ----------------------------------------------------------------------------------

def compiled(fn: Callable[..., Any], args: tuple, mode: str | None, static: Sequence[int],
             backend: Any = "inductor") -> Callable[[], Any]:
    """torch.compile(fn, mode or backend) on `args`, warmed up, as a call under no_grad.

    The tensors of the `static` arguments are marked as static addresses, so that cudagraph trees read
    them in place as df.jit reads persistent arguments (otherwise it copies every weight per replay).
    Three calls: the first compiles, the next two let cudagraph trees warm up and record.
    """
    for index in static:
        for tensor in optree.tree_leaves(args[index]):
            torch._dynamo.mark_static_address(tensor)
    function = torch.compile(fn, mode=mode, backend=backend, dynamic=False)

    def call() -> Any:
        with torch.no_grad():
            return function(*args)

    for _ in range(3):
        call()
    return call


def jitted(fn: Callable[..., Any], args: tuple, persistent: Sequence[int], backend: str = "auto"
           ) -> Callable[[], Any]:
    """df.jit(fn) with `persistent` arguments read in place and static outputs, built by its first call."""
    fast = df.jit(fn, backend=backend, persistent_argnums=tuple(persistent), static_outputs=True)
    fast(*args)
    return lambda: fast(*args)


def measure(case: str, variants: dict[str, Callable[[], Callable[[], Any]]], reference: Any,
            inner: int) -> list[dict]:
    """Build every variant (recording its peak memory), time them interleaved, then check each against eager.

    The check calls each variant once more and reads the result at once: outputs of cudagraph trees
    and static outputs of df.jit stay valid only until the next call.
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
    return rows


def release() -> None:
    """Drop the finished case's compiled code and cudagraph-tree pools, so the next case compiles afresh
    (no recompile limit, no automatic dynamic shapes) and has the memory to itself."""
    torch._dynamo.reset()
    torch.cuda.empty_cache()


# --- the cases -------------------------------------------------------------------------------------

def stack_rows() -> list[dict]:
    """Compute-bound prefill: how Inductor's fusions inside one df CUDA graph compare with torch.compile's."""
    weights = [make_layer(DEVICE, seed=i) for i in range(LAYERS)]
    rows = []
    for batch, tokens in PROMPTS:
        args = (weights, torch.randn(batch, tokens, HIDDEN, device=DEVICE, dtype=DTYPE))
        with torch.no_grad():
            reference = prefill_stack(*args)
        variants = {
            "compile-max-autotune-no-cudagraphs": lambda: compiled(prefill_stack, args, "max-autotune-no-cudagraphs",
                                                                   static=(0,)),
            BASELINE: lambda: compiled(prefill_stack, args, "reduce-overhead", static=(0,)),
            "df.jit": lambda: jitted(prefill_stack, args, persistent=(0,)),
            "df.inductor": lambda: jitted(prefill_stack, args, persistent=(0,), backend="inductor"),
        }
        if batch > 1:
            variants["df.inductor+rr2"] = lambda: jitted(round_robin(prefill_stack), args, persistent=(0,),
                                                         backend="inductor")
        rows += measure(f"prefill {LAYERS} layers, {batch}x{tokens} tokens", variants, reference, inner=3)
        release()
    return rows


def pod_rows() -> list[dict]:
    """Independent attentions: whether side streams still pay off once Inductor compiles each branch."""
    rows = []
    for prefill_tokens, decode_batch, context in POD_SHAPES:
        args = pod_args(prefill_tokens, decode_batch, context)
        every = range(len(args))
        variants = {
            BASELINE: lambda: compiled(pod, args, "reduce-overhead", static=every),
            "df.inductor": lambda: jitted(pod, args, every, backend="inductor"),
            "df.inductor+branches": lambda: jitted(branches(pod), args, every, backend="inductor"),
            "df.branches": lambda: jitted(branches(pod), args, every),
        }
        rows += measure(f"prefill {prefill_tokens} || decode {decode_batch}x{context}", variants, pod(*args),
                        inner=10)
        release()
    return rows


def hf_rows() -> list[dict]:
    """An unmodified transformers Llama (Llama-3-8B-like layers, random weights) through torch.compile,
    with Inductor's cudagraph trees or dynaflow_fn behind Dynamo."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to(DEVICE, DTYPE).eval()
    logits = lambda ids: model(ids, use_cache=False).logits
    rows = []
    for batch, tokens in PROMPTS[:1]:
        args = (torch.randint(0, config.vocab_size, (batch, tokens), device=DEVICE),)
        with torch.no_grad():
            reference = logits(*args)
        variants = {
            "eager": lambda: lambda: _no_grad(logits, args),
            BASELINE: lambda: compiled(logits, args, "reduce-overhead", static=()),
            "df.compile_backend": lambda: compiled(logits, args, None, (), df.compile_backend(progress=False)),
            "df.compile_backend-inductor": lambda: compiled(logits, args, None, (),
                                                            df.compile_backend(backend="inductor", progress=False)),
        }
        rows += measure(f"transformers Llama, {LAYERS} layers, {batch}x{tokens} tokens", variants, reference, inner=3)
        release()
    return rows


def _no_grad(fn: Callable[..., Any], args: tuple) -> Any:
    with torch.no_grad():
        return fn(*args)


CASES = {"stack": stack_rows, "pod": pod_rows, "hf": hf_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", choices=sorted(CASES), default=list(CASES))
    options = parser.parse_args()
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
