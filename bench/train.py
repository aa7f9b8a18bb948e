"""Training step of a Llama-like model (8 layers, hidden 2048, bf16): eager, torch.compile, df.jit.

The model is plain PyTorch (bench/llama_layers.LlamaLike); one more case runs transformers' Llama,
whose masking code cannot skip the causal mask while traced (it cannot read position ids to rule out
packed sequences), so its traced attention carries an explicit mask that eager PyTorch avoids.

  eager                    model(ids) -> cross-entropy -> backward -> torch.optim.AdamW(fused=True).step();
                           the baseline of speedup_vs_baseline
  compile                  the same with torch.compile(model) (default mode): Inductor kernels for the
                           forward and the backward AOTAutograd derives from it, the fused AdamW eager
                           (PyTorch's documented training recipe)
  compile-reduce-overhead  torch.compile(model, mode="reduce-overhead"): those kernels replayed through
                           cudagraph trees, torch.compiler.cudagraph_mark_step_begin() before each step
  compile-df-backend       torch.compile(model, backend=df.compile_backend()) and the fused AdamW eager: the
                           compile row's recipe with df planning each graph AOTAutograd derives (forward and
                           backward, each one CUDA graph of Inductor's kernels); what an unmodified
                           torch.compile training loop gets from dynaflow_fn
  compile-step             the whole step (forward, loss, backward, AdamW step, zero_grad) in one
                           torch.compile'd function, compiled autograd capturing the backward and Dynamo
                           the optimizer step (PyTorch's compiled optimizer: Inductor fuses AdamW's foreach
                           updates). Dynamo still breaks the graph at backward() and around the optimizer
                           step (on purpose: torch/optim/optimizer.py), so it runs as three graphs, with
                           zero_grad eager between steps. Left out, with its error, where it fails to build
  df                       one traced program: df.value_and_grad + df.optim.adamw, params and optimizer
                           state donated, under df.jit's default backend (each stage compiled by
                           Inductor, the whole plan one CUDA graph)
  df.aten                  the same under backend="cudagraph" (aten kernels in one CUDA graph): what the
                           Inductor stages add

Cases: a launch-bound batch (1x128 tokens) and a large one (8x2048 tokens; hf-8x2048 with
transformers' Llama). Every variant has its own model, seeded alike, so the variants start from the
same weights and take the same steps: loss_after_warmup, the loss of the third step, should agree
across a case up to rounding. first_call_s is the wall time of a variant's first step (Dynamo and
Inductor compilation, df's trace and capture) until the GPU is done; ready_s that of its first three
steps, which also covers the recording of cudagraph trees (second step) and any recompilation once
the optimizer has state. The compile variants' first_call_s depends on what Inductor's on-disk caches
hold already (bench/coldstart.py separates cold from warm). peak_mem_mb is the memory allocated
while a variant is built and takes those steps (weights, gradients, optimizer state, activations,
graph pools); it is left out for cudagraph trees, whose pool bookkeeping rewrites the allocator's
counters. speedup_vs_best_compile is the fastest compile variant's median over the row's. Prints
medians and ratios; writes bench/results/train.json (train-<cases>.json for a subset: the three
cases compile nine times, which takes minutes; train-<cases>-<variants>.json for fewer variants).
    python -m bench.train [--cases 1x128 8x2048 hf-8x2048] [--variants compile compile-df-backend ...]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F

import dynaflow_fn as df
from bench.common import peak_memory_mb, print_table, release, time_variants, write_results

VOCAB = 32000
WARMUP_STEPS = 3          # the steps up to ready_s; the third step's loss is loss_after_warmup
COMPILED = ("compile", "compile-reduce-overhead", "compile-step")
OPTIONAL = {"compile-step", "compile-df-backend"}  # a build error leaves the variant out instead of ending the run
UNCOUNTED_MEMORY = {"compile-reduce-overhead"}  # cudagraph trees: the allocator's counters are rewritten
CASES = {"1x128": (1, 128, "plain"), "8x2048": (8, 2048, "plain"), "hf-8x2048": (8, 2048, "hf")}  # batch, tokens, model
COLUMNS = ["case", "variant", "median_ms", "p10_ms", "p90_ms", "speedup_vs_baseline", "speedup_vs_best_compile",
           "tokens_per_s", "peak_mem_mb", "first_call_s", "ready_s", "loss_after_warmup", "error"]


def make_model(device: torch.device, kind: str = "plain"):
    """8 layers, hidden 2048, 16/8 heads, FFN 5632, bf16: our plain module or transformers' Llama."""
    torch.manual_seed(0)
    if kind == "plain":
        from bench.llama_layers import LlamaLike

        return LlamaLike(VOCAB, 2048, 8, 16, 8, 5632).to(device=device, dtype=torch.bfloat16)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def cross_entropy(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


def _call(kind: str):
    return {} if kind == "plain" else {"use_cache": False}


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits


# --- the variants: each returns step(), which takes one training step and returns its loss ----------

def autograd_training(ids: torch.Tensor, kind: str = "plain", mode: str | None = None):
    """The model stepped by eager autograd and torch.optim.AdamW(fused=True): eager PyTorch, or with
    `mode`, the model under torch.compile(model, mode=mode) and the rest as before."""
    model = make_model(ids.device, kind)
    forward = model if mode is None else torch.compile(model, mode=mode, dynamic=False)
    return autograd_steps(model, forward, ids, kind, mode)


def df_backend_training(ids: torch.Tensor, kind: str = "plain"):
    """The compile row's recipe with df.compile_backend behind torch.compile, as a user writes it."""
    model = make_model(ids.device, kind)
    return autograd_steps(model, torch.compile(model, backend=df.compile_backend()), ids, kind)


def autograd_steps(model: torch.nn.Module, forward: Callable, ids: torch.Tensor, kind: str, mode: str | None = None):
    """step() of `forward` (the model, compiled or not, compiled with `mode`) on `ids`, stepped by
    eager autograd and fused AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    new_step = torch.compiler.cudagraph_mark_step_begin if mode == "reduce-overhead" else (lambda: None)

    def step():
        new_step()    # cudagraph trees: the last step's outputs are dead, their memory may be overwritten
        loss = cross_entropy(_logits(forward(ids, **_call(kind))), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


def compiled_step_training(ids: torch.Tensor, kind: str = "plain"):
    """The whole step under one torch.compile: compiled autograd traces the backward when it runs
    (switched on for this function only: torch.compile reads the flag when it wraps the function),
    and Dynamo traces AdamW's step, whose foreach updates Inductor fuses (so no fused=True)."""
    model = make_model(ids.device, kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss = cross_entropy(_logits(model(ids, **_call(kind))), ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    with torch._dynamo.config.patch(compiled_autograd=True):
        return torch.compile(step, dynamic=False)


def df_training(ids: torch.Tensor, kind: str = "plain", backend: str = "auto"):
    """The same step as one traced program under df.jit, parameters and state donated."""
    model = make_model(ids.device, kind)
    forward, state_dict = df.pure(model)
    names = dict(model.named_parameters())
    params = {k: v.detach() for k, v in state_dict.items() if k in names}
    buffers = {k: v for k, v in state_dict.items() if k not in names}
    optimizer = df.optim.adamw(lr=1e-4)
    state = optimizer.init(params)

    def loss_fn(params, ids):
        return cross_entropy(_logits(forward({**params, **buffers}, ids, **_call(kind))), ids)

    def train_step(params, state, ids):
        loss, grads = df.value_and_grad(loss_fn)(params, ids)
        params, state = optimizer.update(grads, state, params)
        return params, state, loss

    fast = df.jit(train_step, donate_argnums=(0, 1), backend=backend)
    return lambda: fast(params, state, ids)[2]


VARIANTS: dict[str, Callable[[torch.Tensor, str], Callable[[], torch.Tensor]]] = {
    "eager": autograd_training,
    "compile": lambda ids, kind: autograd_training(ids, kind, mode="default"),
    "compile-reduce-overhead": lambda ids, kind: autograd_training(ids, kind, mode="reduce-overhead"),
    "compile-df-backend": df_backend_training,
    "compile-step": compiled_step_training,
    "df": df_training,
    "df.aten": lambda ids, kind: df_training(ids, kind, backend="cudagraph"),
}


# --- measuring --------------------------------------------------------------------------------------

def warm_up(make: Callable[[torch.Tensor, str], Callable[[], torch.Tensor]], ids: torch.Tensor, kind: str) -> dict:
    """Build a variant and take its first WARMUP_STEPS steps, timing them from the first call (what
    compiling, tracing and capturing cost) to when the GPU is done. Each loss is read before the next
    step, as cudagraph trees may overwrite it then."""
    step = make(ids, kind)
    start, ends, loss = time.perf_counter(), [], None
    for _ in range(WARMUP_STEPS):
        loss = float(step().detach())
        torch.cuda.synchronize()
        ends.append(time.perf_counter() - start)
    return {"step": step, "first_call_s": ends[0], "ready_s": ends[-1], "loss_after_warmup": loss}


def rows_for(batch: int, tokens: int, device: torch.device, kind: str = "plain",
             variants: list[str] = list(VARIANTS)) -> list[dict]:
    """Build each of `variants` in turn (they coexist: the timing below interleaves them), then time them."""
    case = f"{'transformers ' if kind != 'plain' else ''}8 layers x 2048, batch {batch} x {tokens} tokens"
    ids = torch.randint(0, VOCAB, (batch, tokens), device=device)
    rows, calls = [], {}
    for name in variants:
        make = VARIANTS[name]
        built: dict = {}
        try:
            memory = peak_memory_mb(lambda: built.update(warm_up(make, ids, kind)))
        except Exception as error:
            if name not in OPTIONAL:
                raise
            print(f"{case}: leaving {name} out, it failed to build: {type(error).__name__}: {error}", flush=True)
            rows.append({"case": case, "variant": name, "error": f"{type(error).__name__}: {error}".splitlines()[0]})
            continue
        calls[name] = built.pop("step")
        rows.append({"case": case, "variant": name, **built,
                     "peak_mem_mb": None if name in UNCOUNTED_MEMORY else memory})
    inner = 5 if tokens * batch <= 512 else 1
    timings = time_variants(calls, rounds=3, repeats=10, inner=inner)
    base = timings["eager"]["median_ms"]
    best_compiled = min((timings[name]["median_ms"] for name in COMPILED if name in timings), default=None)
    for row in rows:
        if row["variant"] in timings:
            row.update(timings[row["variant"]])
            row["speedup_vs_baseline"] = base / row["median_ms"]
            row["speedup_vs_best_compile"] = best_compiled / row["median_ms"] if best_compiled else None
            row["tokens_per_s"] = batch * tokens / row["median_ms"] * 1e3
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", choices=list(CASES), default=list(CASES))
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS),
                        help="the variants to build and time (eager, the baseline, always runs)")
    options = parser.parse_args()
    device = torch.device("cuda")
    variants = ["eager"] + [name for name in options.variants if name != "eager"]
    subset = [] if options.cases == list(CASES) else list(options.cases)
    subset += [] if set(variants) == set(VARIANTS) else variants[1:]
    name = "-".join(["train", *subset])
    rows = []
    for case in options.cases:
        batch, tokens, kind = CASES[case]
        found = rows_for(batch, tokens, device, kind, variants)
        release()
        print_table(found, COLUMNS, f"{case}: training step ({torch.cuda.get_device_name()})")
        rows += found
        path = write_results(name, rows)      # after each case: a run stopped in a later case keeps this one
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
