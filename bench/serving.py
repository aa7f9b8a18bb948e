"""Serving clients, side by side on one GPU: transformers' generate() with a static KV cache, a decode
loop whose batch moves over 1..256, and the continuous-batching loop of examples/serve_llama.py.

generate cases (`llama`, `qwen2`). Each case generates greedily from a batch of prompts with
`generation_config.cache_implementation = "static"`, and every variant runs the same generate() call:

  eager          generate(..., disable_compile=True): the model's own PyTorch code
  hf-compile-ro  generate() as transformers runs it by default for a static cache: the forward compiled
                 by torch.compile(mode="reduce-overhead") (CUDA graphs of Inductor kernels)
  df             model.forward = torch.compile(model.forward, backend=df.compile_backend(), dynamic=False),
                 generate(..., disable_compile=True): every Dynamo graph through df.jit, default settings
  df-auto        the same with df.compile_backend(strategy="auto")
  hf-compile-df  generate() compiling the forward itself, as hf-compile-ro does, with the backend its compile
                 config names: generation_config.compile_config = CompileConfig(backend=df.compile_backend())
  ... (one cache)  hf-compile-ro and df passed one transformers StaticCache, reset before each generate(), as
                 `past_key_values=` (the README's advice for df: generate() otherwise builds a new cache per
                 call, and the decode graph, which reads the cache at its own address, captures again)

Reported per variant: tokens/s (new tokens of the whole batch over the median generate() time of
`--repeats` calls after the first), the first generate() in seconds (compilation and capture included)
and, for df, the CUDA-graph captures of all its graphs. Every variant's first-step logits are checked
against eager's (relative error under MAX_REL_ERR, bf16), and its tokens compared. Each variant runs
in a fresh process, one after the other, as a user runs one of them. In one process, what a variant
leaves behind (Dynamo's caches of the model's code, cudagraph trees' pool, a heap grown by compiling)
weighs on the next: on an H200, Qwen2's df variant ran 1288 tokens/s after the eager and hf-compile-ro
variants and 1651 in a process of its own (the same code), and Llama's hf-compile-ro 3395 after eager
and 4045 alone.

`decode-walk`: examples/serve_llama.py's model step (a 4-layer Llama-like model, bf16, decode tokens
only: a one-token dummy chunk) over a static KV cache, at batch sizes drawn by a seeded random walk
over 1..256 for 200 steps (121 distinct sizes). Variants:

  df-buckets     df.jit(step, buckets="serving", ...): a plan per bucket reached, one memory pool
  df-exact       df.jit(step): a plan per batch size
  compile-ro     torch.compile(step, mode="reduce-overhead", dynamic=False): a graph per batch size

A plan per size for 121 sizes costs minutes of compiling per variant, so every variant first plans
`--walk-sample` sizes spread over the walk's range (WALK_SAMPLE) and is timed on the walk's steps at
those sizes; then df-buckets plans every size the walk visits and is timed on the whole walk (left
out with `--walk-sample-only`). Reported: the first pass over the sizes planned (planning,
compiling and capturing included) and per size, steady tokens/s (the median of `--walk-rounds` passes
of at least 200 steps, the variants taking turns, with the slowest and fastest pass), CUDA graph
captures, the memory the graphs hold (df's own count, and torch.cuda.memory_allocated /
memory_reserved after minus before, caches emptied), and the fraction of tokens equal to eager's.
compile-ro's memory over 16 sizes is a lower bound of its memory over all 121.

`decode-sizes`: the decode walk's step at batch sizes just past a bucket (DECODE_SIZES), df-exact,
df-buckets and compile-ro taking turns (CUDA events, medians): df-exact against compile-ro is a plan's
speed against Inductor's graph at one size, df-buckets against df-exact the cost of its padded rows.

`serve-llama`: examples/serve_llama.py's loop (its GPU model, fp32: the tokens are checked against
transformers' generate) with the step under df.jit (decode and prefill attention on two streams, or
one), against the same loop with the step under torch.compile(mode="reduce-overhead", dynamic=False)
and its decode batch padded by hand to the same buckets (PaddedCompiledStep). Reported: tokens/s of a
second run over new requests, after every variant has planned every bucket (the first run plans and
compiles what it meets, and a pass over all buckets the rest), the first run's seconds, and requests
whose tokens differ from generate()'s.

Writes bench/results/serving.json (serving-<cases>.json for a subset).

    python -m bench.serving [--cases llama qwen2 decode-walk decode-sizes serve-llama] [--repeats 5]
                            [--generate-variants df "df (one cache)" ...] [--rounds 1]
                            [--walk-variants df-buckets df-exact compile-ro] [--walk-largest 256]
                            [--walk-sample 16] [--walk-sample-only] [--walk-rounds 5]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

import dynaflow_fn as df
from dynaflow_fn.compat import clear_cublas_workspaces
from dynaflow_fn.jitting.buckets import SERVING_BUCKETS, BucketTable

from .common import compiled_per_shape, mark_static, print_table, relative_error, release, time_variants, write_results

MAX_REL_ERR = 5e-2
"""bf16 logits of a random-weight model through 8-28 layers differ by 1e-2 to 3e-2 between kernel choices
(Inductor's fusions against eager's kernels)."""
BATCH, PROMPT, NEW_TOKENS = 8, 128, 64

CONFIGS = {
    "llama": dict(family="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=8, vocab_size=32000),
    "qwen2": dict(family="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, vocab_size=32000),
}


def build_model(name: str) -> torch.nn.Module:
    import transformers as hf

    config = dict(CONFIGS[name])
    family = config.pop("family")
    classes = {"llama": (hf.LlamaConfig, hf.LlamaForCausalLM), "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM)}
    config_class, model_class = classes[family]
    torch.manual_seed(0)
    model = model_class(config_class(**config, max_position_embeddings=PROMPT + NEW_TOKENS + 64))
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.pad_token_id = 0
    return model


def one_static_cache(model: torch.nn.Module, batch: int) -> Any:
    """One transformers StaticCache for every generate() call, reset before each: what the README tells df
    users to pass so that no graph sees its KV cache move (generate() builds a new cache per call)."""
    from transformers import StaticCache

    config = model.config
    model.generation_config.cache_implementation = None          # generate() refuses both a cache and its kind
    cache = StaticCache(config=config, max_cache_len=PROMPT + NEW_TOKENS)
    cache.early_initialization(batch_size=batch, num_heads=config.num_key_value_heads, dtype=torch.bfloat16,
                               head_dim=config.hidden_size // config.num_attention_heads, device="cuda")
    return cache


def generate(model: torch.nn.Module, ids: torch.Tensor, disable_compile: bool, cache: Any = None) -> Any:
    if cache is not None:
        cache.reset()
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, disable_compile=disable_compile, return_dict_in_generate=True,
                              output_logits=True, **({"past_key_values": cache} if cache is not None else {}))


def measure(model: torch.nn.Module, ids: torch.Tensor, disable_compile: bool, repeats: int,
            cache: Any = None) -> dict[str, Any]:
    """The first generate()'s seconds, then the median of `repeats` more; the last call's output."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate(model, ids, disable_compile, cache)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    seconds = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(model, ids, disable_compile, cache)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    return {"first_generate_s": first, "generate_s": median, "tokens_per_s": ids.shape[0] * NEW_TOKENS / median,
            "out": out}


def variants() -> dict[str, Callable[[torch.nn.Module], tuple[bool, Any]]]:
    """Per variant: prepare the model, returning (disable_compile, the df backend or None)."""
    def eager(model):
        return True, None

    def hf_compile(model):
        return False, None

    def with_backend(**options):
        def prepare(model):
            backend = df.compile_backend(progress=False, **options)
            model.forward = torch.compile(model.forward, backend=backend, dynamic=False)
            return True, backend
        return prepare

    def hf_compile_with_df(model):
        from transformers.generation import CompileConfig

        backend = df.compile_backend(progress=False)
        model.generation_config.compile_config = CompileConfig(backend=backend)
        return False, backend

    return {"eager": eager, "hf-compile-ro": hf_compile, "df": with_backend(), "df-auto": with_backend(strategy="auto"),
            "hf-compile-df": hf_compile_with_df, f"hf-compile-ro{ONE_CACHE}": hf_compile, f"df{ONE_CACHE}": with_backend()}


ONE_CACHE = " (one cache)"
"""The suffix of the variants that pass one_static_cache() to every generate() call."""


def run_case(name: str, repeats: int, chosen: Sequence[str] = (), rounds: int = 1) -> list[dict[str, Any]]:
    """Rows of every generate variant, or of those `chosen` (eager, the reference, always runs). Each
    variant runs in a process of its own, one after the other: what one leaves behind (Dynamo's caches
    of the model's code, cudagraph trees' pool, a heap grown by compiling) would otherwise weigh on the
    next, as a user runs one of them. With `rounds`, the variants take turns that many times and a
    row reports the lower median process (tokens/s of one process moved by up to 18% from one to the next
    on an H200: the loop is bound by the host's time per step)."""
    names = [variant for variant in variants() if not chosen or variant in chosen or variant == "eager"]
    runs: dict[str, list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]]] = {variant: [] for variant in names}
    for turn in range(rounds):
        for variant in names:
            if variant != "eager" or turn == 0:                  # eager: the reference, once
                runs[variant].append(_in_own_process(name, variant, repeats))
    reference = runs["eager"][0][1:]
    rows = []
    for variant, results in runs.items():
        speeds = [row["tokens_per_s"] for row, _, _ in results]
        row = sorted(results, key=lambda result: result[0]["tokens_per_s"])[(len(results) - 1) // 2][0]   # the lower median
        row.update(rounds=len(results), tokens_per_s_min=min(speeds), tokens_per_s_max=max(speeds),
                   first_logits_rel_err=max(relative_error(result[1], reference[0]) for result in results),
                   tokens_match=min(float((result[2] == reference[1]).float().mean()) for result in results))
        rows.append(row)
    measured = {row["variant"]: row["tokens_per_s"] for row in rows}
    for row in rows:
        peer = measured.get("hf-compile-ro" + (ONE_CACHE if row["variant"].endswith(ONE_CACHE) else ""))
        row["vs_hf_compile_ro"] = row["tokens_per_s"] / peer if peer else None   # the peer that treats the cache alike
        row["logits_ok"] = row["first_logits_rel_err"] <= MAX_REL_ERR
    return rows


def _in_own_process(name: str, variant: str, repeats: int) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "result.pt")
        subprocess.run([sys.executable, "-m", "bench.serving", "--one-generate", name, variant, path,
                        "--repeats", str(repeats)], check=True, cwd=os.path.dirname(os.path.dirname(__file__)) or ".")
        result = torch.load(path)
    return result["row"], result["logits"], result["sequences"]


def generate_variant(name: str, variant: str, repeats: int, path: str) -> None:
    """One generate variant's row, and its first-step logits and tokens, saved to `path` (run_case's
    child process)."""
    case = f"generate {name} ({CONFIGS[name]['num_hidden_layers']} layers), batch {BATCH}, prompt {PROMPT}, " \
           f"{NEW_TOKENS} new tokens"
    ids = torch.randint(1, CONFIGS[name]["vocab_size"], (BATCH, PROMPT), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    model = build_model(name)
    disable_compile, backend = variants()[variant](model)
    cache = one_static_cache(model, BATCH) if variant.endswith(ONE_CACHE) else None
    result = measure(model, ids, disable_compile, repeats, cache)
    out = result.pop("out")
    captures = sum(g.cache_info().captures for g in backend.graphs) if backend is not None else None
    row = {"case": case, "variant": variant, "tokens_per_s": result["tokens_per_s"],
           "median_ms": result["generate_s"] * 1e3, "first_generate_s": result["first_generate_s"],
           "captures": captures, "graphs": len(backend.graphs) if backend is not None else None}
    torch.save({"row": row, "logits": out.logits[0].float().cpu(), "sequences": out.sequences.cpu()}, path)


# --- decode-walk: a decode loop whose batch moves over 1..256 ---------------------------------------

DECODE_WALK, DECODE_STEP, SERVE_LLAMA = "decode-walk", "decode-sizes", "serve-llama"
WALK_MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=8)
WALK_STEPS, WALK_LARGEST, WALK_POSITION = 200, 256, 512
"""The walk's steps and largest batch, and the position every row decodes at (its cache holds that many tokens)."""


def batch_walk(steps: int, largest: int, seed: int = 0) -> list[int]:
    """Batch sizes of a seeded random walk over 1..largest, starting in the middle, moving up to 16 a step."""
    walk, size, sizes = random.Random(seed), largest // 2, []
    for _ in range(steps):
        size = min(largest, max(1, size + walk.randint(-16, 16)))
        sizes.append(size)
    return sizes


def serve_example() -> Any:
    """examples/serve_llama.py as a module (the model step, KV cache and loop both cases run)."""
    from examples import serve_llama

    return serve_llama


WALK_VARIANTS = ("df-buckets", "df-exact", "compile-ro")
WALK_SAMPLE = 16
"""The walk's sizes the exact-size variants plan. The walk visits 121 sizes, and on an H200 df.jit took
8 to 9 s to plan each bucket (most of it Inductor compiling that size's kernels): planning every size
would take a variant over 15 minutes. So they plan this many sizes spread over the walk's range, and
every variant is timed on the walk's steps at those sizes."""


WALK_ROUNDS = 5
"""Timed passes of each variant over the walk, taking turns: one pass of 200 steps lasts about half a
second, and on an H200 two plans of identical kernels differed by 3-4% between single passes."""


def spread(sizes: Sequence[int], count: int) -> list[int]:
    """`count` of the sorted `sizes`, evenly spaced, the smallest and the largest included."""
    if count >= len(sizes):
        return list(sizes)
    return [sizes[round(k * (len(sizes) - 1) / (count - 1))] for k in range(count)]


def walk_variant(name: str, serve: Any, model: torch.nn.Module, cache: Any, sizes: int) -> Callable[..., Any]:
    """The decode step under `name`, to be called at `sizes` batch sizes."""
    def step(keys, values, decode, chunk):
        return serve.model_step(model, keys, values, decode, chunk)

    if name == "df-buckets":
        padded = {"tokens": 0, "positions": 0, "slots": cache.dummy}
        return df.jit(step, buckets="serving", in_axes=(None, None, 0, None), out_axes=(0, None),
                      pad_value=(None, None, padded, None))
    if name == "df-exact":
        return df.jit(step)
    return compiled_per_shape(step, sizes)


def held_memory_mb() -> tuple[float, float]:
    """CUDA memory allocated and reserved (MiB), after emptying the caching allocator's free blocks and
    cuBLAS's workspaces (which a CUDA graph's capture frees: a count across one would go down by them)."""
    clear_cublas_workspaces()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 2**20, torch.cuda.memory_reserved() / 2**20


def decode_setup(largest: int) -> tuple[Any, torch.nn.Module, Any, dict, dict[int, dict[str, torch.Tensor]]]:
    """The decode step's pieces for batches up to `largest`: examples/serve_llama.py, the model, its KV
    cache (marked static for torch.compile), a one-token dummy chunk (decode only), and each batch
    size's decode inputs (every row at WALK_POSITION, in a slot of its own)."""
    serve = serve_example()
    max_len = WALK_POSITION + 8
    model = serve.build_model(WALK_MODEL, max_len, "cuda", torch.bfloat16)
    cache = serve.KVCache(model.config, largest, max_len, "cuda", torch.bfloat16)
    mark_static(cache.keys, cache.values)
    chunk = serve.chunk_inputs(None, 1, cache.dummy, "cuda")
    generator = torch.Generator("cuda").manual_seed(0)
    inputs = {rows: {"tokens": torch.randint(1, WALK_MODEL["vocab_size"], (rows,), device="cuda", generator=generator),
                     "positions": torch.full((rows,), WALK_POSITION, device="cuda"),
                     "slots": torch.arange(rows, device="cuda")} for rows in range(1, largest + 1)}
    return serve, model, cache, chunk, inputs


DECODE_SIZES = (61, 130, 201)
"""Batch sizes just past a bucket of "serving" (padded to 64, 136, 208: 3 to 7 padded rows)."""


def run_sizes(sizes: Sequence[int] = DECODE_SIZES, rounds: int = WALK_ROUNDS) -> list[dict[str, Any]]:
    """The decode walk's step at a few batch sizes, the three walk variants taking turns (CUDA events,
    medians). Splits df-buckets' gap to compile-ro into its two parts: df-exact against compile-ro is
    the speed of a plan against Inductor's graph at one size; df-buckets against df-exact is the cost
    of the padded rows (`padded_share`: padded rows over real ones)."""
    serve, model, cache, chunk, inputs = decode_setup(max(sizes))
    steps = {variant: walk_variant(variant, serve, model, cache, len(sizes)) for variant in WALK_VARIANTS}
    table = BucketTable(SERVING_BUCKETS)
    rows_out = []
    def one_step(step, rows):
        return step(cache.keys, cache.values, inputs[rows], chunk)[0].clone()   # cudagraph trees overwrite it

    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*has been traced for")   # df-exact: a plan per size, as asked
        for rows in sizes:
            calls = {variant: functools.partial(one_step, step, rows) for variant, step in steps.items()}
            for call in calls.values():
                for _ in range(3):           # plan or compile, then let cudagraph trees record
                    call()
            timed = time_variants(calls, rounds=rounds, repeats=10, inner=10)
            bucket = table.bucket(rows)
            rows_out += [{"case": f"decode step at batch {rows} (bucket {bucket})", "variant": variant,
                          "median_ms": timed[variant]["median_ms"], "p10_ms": timed[variant]["p10_ms"],
                          "p90_ms": timed[variant]["p90_ms"], "padded_share": (bucket - rows) / rows}
                         for variant in steps]
    for row in rows_out:
        peers = {r["variant"]: r["median_ms"] for r in rows_out if r["case"] == row["case"]}
        row["vs_compile_ro"] = peers["compile-ro"] / row["median_ms"]
        row["vs_df_exact"] = peers["df-exact"] / row["median_ms"]
    del steps
    release()
    return rows_out


def run_walk(variants: Sequence[str] = WALK_VARIANTS, largest: int = WALK_LARGEST, sample: int = WALK_SAMPLE,
             whole: bool = True, rounds: int = WALK_ROUNDS) -> list[dict[str, Any]]:
    """The decode walk over batch sizes 1..largest. Every variant plans `sample` of the sizes the walk
    visits, and the variants take turns `rounds` times over the walk's steps at them, in the walk's
    order (see WALK_SAMPLE); then, if `whole`, df-buckets plans every size the walk visits and is timed
    on the whole walk."""
    serve, model, cache, chunk, inputs = decode_setup(largest)
    case = (f"decode walk: {WALK_MODEL['num_hidden_layers']} Llama-like layers bf16, batch 1..{largest} "
            f"over {WALK_STEPS} steps, {WALK_POSITION} cached tokens")
    walk = batch_walk(WALK_STEPS, largest)
    visited = sorted(set(walk))
    picked = spread(visited, sample)
    at_picked = set(picked)
    stages = [(f"the walk's steps at {len(picked)} of its {len(visited)} sizes", picked,
               [rows for rows in walk if rows in at_picked])]
    if whole:
        stages.append((f"whole walk ({len(visited)} sizes)", visited, walk))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*has been traced for")   # df-exact: a plan per size, as asked
        expected = {rows: serve.model_step(model, cache.keys, cache.values, inputs[rows], chunk)[0] for rows in visited}

        def call(step, rows):
            return step(cache.keys, cache.values, inputs[rows], chunk)[0].clone()   # cudagraph trees overwrite it

        def plan(step, sizes):
            """Call `step` at every size, timed (planning, compiling, capturing), then twice more at each:
            cudagraph trees record a size's graph on its third call."""
            begin = time.perf_counter()
            for rows in sizes:
                call(step, rows)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - begin
            for rows in sizes * 2:
                call(step, rows)
            return seconds

        def row(variant, step, label, planned, first_pass, held, timed):
            info = step.cache_info() if isinstance(step, df.Jitted) else None
            print(f"{variant}, {label}: {info if info else ''}", flush=True)
            return {"case": f"{case}: {label}", "variant": variant, **timed, "sizes_planned": planned,
                    "first_pass_s": first_pass, "first_pass_per_size_s": first_pass / planned,
                    "captures": info.captures if info else None,
                    "graph_mb": info.graph_memory_bytes / 2**20 if info else None,
                    "allocated_mb": held[0], "reserved_mb": held[1],
                    "padding_waste": info.padding_waste if info else None}

        (label, sizes, steps), built = stages[0], {}
        for variant in variants:           # planned one after the other, each one's memory counted alone
            step = walk_variant(variant, serve, model, cache, len(visited))
            before = held_memory_mb()
            first_pass = plan(step, sizes)
            after = held_memory_mb()
            built[variant] = (step, first_pass, (after[0] - before[0], after[1] - before[1]))
        timed = timed_rounds({variant: functools.partial(call, step) for variant, (step, _, _) in built.items()},
                             steps, expected, rounds)
        rows_out = [row(variant, step, label, len(sizes), first_pass, held, timed[variant])
                    for variant, (step, first_pass, held) in built.items()]
        if len(stages) > 1 and "df-buckets" in built:
            (label, sizes, steps), (step, first_pass, held) = stages[1], built["df-buckets"]
            before = held_memory_mb()
            first_pass += plan(step, [rows for rows in sizes if rows not in set(stages[0][1])])
            after = held_memory_mb()
            held = (held[0] + after[0] - before[0], held[1] + after[1] - before[1])
            timed = timed_rounds({"df-buckets": functools.partial(call, step)}, steps, expected, rounds)
            rows_out.append(row("df-buckets", step, label, len(sizes), first_pass, held, timed["df-buckets"]))
        del built, step
        release()
    return with_ratio(rows_out, "compile-ro", "vs_compile_ro")


def timed_rounds(calls: dict[str, Callable[[int], torch.Tensor]], steps: Sequence[int],
                 expected: dict[int, torch.Tensor], rounds: int, least_steps: int = 200) -> dict[str, dict[str, float]]:
    """Per variant: the median tokens/s of `rounds` timed passes over `steps` (each repeated to at least
    `least_steps`), the variants taking turns so that drift hits all alike; its slowest and fastest
    pass; and the fraction of its tokens equal to `expected` (eager's) in the first pass."""
    speeds: dict[str, list[float]] = {name: [] for name in calls}
    matches: dict[str, float] = {}
    for turn in range(rounds):
        for name, call in calls.items():
            tokens_per_s, match = timed_walk(call, steps, expected, least_steps)
            speeds[name].append(tokens_per_s)
            matches.setdefault(name, match)
    return {name: {"tokens_per_s": statistics.median(values), "tokens_per_s_min": min(values),
                   "tokens_per_s_max": max(values), "rounds": rounds, "tokens_match": matches[name]}
            for name, values in speeds.items()}


def timed_walk(call: Callable[[int], torch.Tensor], steps: Sequence[int], expected: dict[int, torch.Tensor],
               least_steps: int = 200) -> tuple[float, float]:
    """Tokens/s over `steps` (repeated to at least `least_steps`), and the fraction of tokens equal to
    `expected` (eager's)."""
    repeats = -(-least_steps // len(steps))
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = [call(rows) for _ in range(repeats) for rows in steps]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    match = statistics.mean(float((got == expected[rows]).float().mean()) for got, rows in zip(outputs, steps))
    return repeats * sum(steps) / seconds, match


def with_ratio(rows: list[dict[str, Any]], peer: str, column: str) -> list[dict[str, Any]]:
    """Each row with its tokens/s over the `peer` variant's row of the same case (None without one)."""
    measured = {row["case"]: row["tokens_per_s"] for row in rows if row["variant"] == peer}
    for row in rows:
        row[column] = row["tokens_per_s"] / measured[row["case"]] if row["case"] in measured else None
    return rows


# --- serve-llama: examples/serve_llama.py's continuous-batching loop ---------------------------------


class PaddedCompiledStep:
    """The loop's step under torch.compile(mode="reduce-overhead", dynamic=False), its decode batch padded
    by hand to the buckets df.jit uses, with the same pad values: one graph per bucket. As torch's CUDA
    graph docs ask of a loop, each step begins with `torch.compiler.cudagraph_mark_step_begin()` and its
    outputs are cloned: the loop keeps a step's tokens while it runs the next, and cudagraph trees would
    otherwise record a new graph for each pair of buckets that follow one another."""

    def __init__(self, serve: Any, model: torch.nn.Module, cache: Any, slots: int):
        def step(keys, values, decode, chunk):
            return serve.model_step(model, keys, values, decode, chunk)

        self.table = BucketTable(serve.decode_buckets(slots))
        self.dummy = cache.dummy
        self.compiled = compiled_per_shape(step, len(self.table.sizes))
        mark_static(cache.keys, cache.values)

    def __call__(self, keys: list, values: list, decode: dict, chunk: dict) -> Any:
        rows = decode["tokens"].shape[0]
        extra = self.table.bucket(rows) - rows
        padded = {name: F.pad(tensor, (0, extra), value=self.dummy if name == "slots" else 0)
                  for name, tensor in decode.items()}
        torch.compiler.cudagraph_mark_step_begin()
        tokens, chunk_token = self.compiled(keys, values, padded, chunk)
        return tokens[:rows].clone(), chunk_token.clone()


def plan_every_bucket(serve: Any, step: Callable[..., Any], cache: Any, slots: int, chunk: int) -> None:
    """Call `step` three times at every decode bucket (rows that write only the dummy slot), so that no
    variant plans, compiles or records a graph while it is timed (cudagraph trees record on the third
    call of a size)."""
    dummy_chunk = serve.chunk_inputs(None, chunk, cache.dummy, "cuda")
    for rows in serve.decode_buckets(slots) * 3:
        decode = {"tokens": torch.zeros(rows, dtype=torch.long, device="cuda"),
                  "positions": torch.zeros(rows, dtype=torch.long, device="cuda"),
                  "slots": torch.full((rows,), cache.dummy, dtype=torch.long, device="cuda")}
        step(cache.keys, cache.values, decode, dummy_chunk)
    torch.cuda.synchronize()


def run_serve() -> list[dict[str, Any]]:
    serve = serve_example()
    setup = serve.CONFIGS["cuda"]
    case = (f"serve_llama loop: {setup['model']['num_hidden_layers']} layers fp32, {setup['requests']} requests, "
            f"{setup['slots']} slots, chunks of {setup['chunk']}")
    max_len = setup["prompt"][1] + setup["new_tokens"][1] + setup["chunk"]
    variants = {"df": lambda m, c, s: serve.jitted_step(m, c, s, "branches"),
                "df-no-overlap": lambda m, c, s: serve.jitted_step(m, c, s, "none"),
                "compile-ro": lambda m, c, s: PaddedCompiledStep(serve, m, c, s)}
    rows = []
    for variant, make in variants.items():
        model = serve.build_model(setup["model"], max_len, "cuda", torch.float32)
        cache = serve.KVCache(model.config, setup["slots"], max_len, "cuda", torch.float32)
        step = make(model, cache, setup["slots"])
        runs = []
        for seed in (0, 1):                        # the first run plans and compiles; the second is timed
            requests = serve.make_requests(setup["requests"], setup["prompt"], setup["new_tokens"],
                                           setup["model"]["vocab_size"], seed)
            with torch.no_grad():
                if seed:
                    plan_every_bucket(serve, step, cache, setup["slots"], setup["chunk"])
                runs.append(serve.serve(requests, step, cache, setup["slots"], setup["chunk"], "cuda", progress=False))
        info = step.cache_info() if isinstance(step, df.Jitted) else None
        rows.append({"case": case, "variant": variant, "tokens_per_s": runs[1]["tokens_per_s"],
                     "first_run_s": runs[0]["seconds"], "steps": runs[1]["steps"],
                     "captures": info.captures if info else None,
                     "graph_mb": info.graph_memory_bytes / 2**20 if info else None,
                     "padding_waste": info.padding_waste if info else None,
                     "mismatched": len(serve.check_against_generate(model, requests, 3))})
        del model, cache, step
        release()
    return with_ratio(rows, "compile-ro", "vs_compile_ro")


CASES = (*CONFIGS, DECODE_WALK, DECODE_STEP, SERVE_LLAMA)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", choices=CASES, default=list(CASES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1,
                        help="generate cases: every variant runs in this many processes, taking turns; the lower median is reported")
    parser.add_argument("--generate-variants", nargs="*", choices=list(variants()), default=[],
                        help="only these generate variants (and eager, the reference); all by default")
    parser.add_argument("--walk-variants", nargs="*", choices=WALK_VARIANTS, default=list(WALK_VARIANTS),
                        help="decode-walk's variants (each exact-size one compiles a graph per size: minutes)")
    parser.add_argument("--walk-largest", type=int, default=WALK_LARGEST, help="decode-walk's largest batch")
    parser.add_argument("--walk-sample", type=int, default=WALK_SAMPLE,
                        help="how many of the walk's sizes the exact-size variants plan (WALK_SAMPLE)")
    parser.add_argument("--walk-rounds", type=int, default=WALK_ROUNDS,
                        help="timed passes per decode-walk variant, the variants taking turns (WALK_ROUNDS)")
    parser.add_argument("--walk-sample-only", action="store_true",
                        help="df-buckets too plans only those sizes (no whole-walk row)")
    parser.add_argument("--one-generate", nargs=3, metavar=("CASE", "VARIANT", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_generate:
        generate_variant(*args.one_generate[:2], args.repeats, args.one_generate[2])
        return
    if not torch.cuda.is_available():
        print(f"bench.serving needs a CUDA device; skipped {', '.join(args.cases)}")
        return
    generate_rows = [row for name in args.cases if name in CONFIGS
                     for row in run_case(name, args.repeats, args.generate_variants, args.rounds)]
    walk_rows = (run_walk(args.walk_variants, args.walk_largest, args.walk_sample, not args.walk_sample_only,
                          args.walk_rounds) if DECODE_WALK in args.cases else [])
    size_rows = run_sizes(rounds=args.walk_rounds) if DECODE_STEP in args.cases else []
    serve_rows = run_serve() if SERVE_LLAMA in args.cases else []
    if generate_rows:
        print_table(generate_rows, ["case", "variant", "tokens_per_s", "vs_hf_compile_ro", "tokens_per_s_min",
                                    "tokens_per_s_max", "rounds", "first_generate_s",
                                    "captures", "graphs", "first_logits_rel_err", "tokens_match"],
                    title="transformers generate(), static cache")
    if walk_rows:
        print_table(walk_rows, ["case", "variant", "tokens_per_s", "vs_compile_ro", "tokens_per_s_min",
                                "tokens_per_s_max", "rounds", "sizes_planned", "first_pass_s",
                                "first_pass_per_size_s", "captures", "graph_mb", "allocated_mb", "reserved_mb",
                                "padding_waste", "tokens_match"], title="decode walk")
    if size_rows:
        print_table(size_rows, ["case", "variant", "median_ms", "p10_ms", "p90_ms", "vs_compile_ro", "vs_df_exact",
                                "padded_share"], title="decode step per batch size (ms)")
    if serve_rows:
        print_table(serve_rows, ["variant", "tokens_per_s", "vs_compile_ro", "first_run_s", "steps", "captures",
                                 "graph_mb", "padding_waste", "mismatched"], title=serve_rows[0]["case"])
    subset = ["some-variants"] if args.generate_variants else []
    subset += [f"rounds{args.rounds}"] if args.rounds > 1 else []
    subset += [] if args.walk_variants == list(WALK_VARIANTS) else args.walk_variants
    subset += [] if args.walk_largest == WALK_LARGEST else [f"upto{args.walk_largest}"]
    subset += [] if args.walk_sample == WALK_SAMPLE else [f"sample{args.walk_sample}"]
    subset += ["sample-only"] if args.walk_sample_only else []
    whole = args.cases == list(CASES) and not subset
    name = "serving" if whole else f"serving-{'-'.join(args.cases + subset)}"
    path = write_results(name, generate_rows + walk_rows + size_rows + serve_rows, batch=BATCH, prompt=PROMPT,
                         new_tokens=NEW_TOKENS, max_rel_err=MAX_REL_ERR, walk_steps=WALK_STEPS,
                         walk_largest=args.walk_largest, walk_sample=args.walk_sample)
    print(f"wrote {path}")
    wrong = [f"{row['case']} {row['variant']}: {row['first_logits_rel_err']:.3g}"
             for row in generate_rows if not row["logits_ok"]]
    if wrong:
        raise SystemExit(f"first-step logits differ from eager's by more than {MAX_REL_ERR} (relative): {wrong}")


if __name__ == "__main__":
    main()
