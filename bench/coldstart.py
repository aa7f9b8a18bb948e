"""Cold start: the first inference call of a 32-layer Llama-3-8B-like model, in a fresh process.

The model is bench/llama_layers.LlamaLike at Llama-3-8B's sizes (hidden 4096, 32 layers, 32 query /
8 key-value heads of 128, FFN 14336, vocabulary 128256; 8.0B parameters, random weights), bf16, eval
mode, under torch.no_grad, on input ids of 1 x 128 tokens:

  compile-reduce-overhead  torch.compile(model, mode="reduce-overhead"): Dynamo and Inductor compile on
                           the first call; cudagraph trees warm up on it and record the CUDA graph on the
                           second, which the third replays
  df                       fn, params = df.pure(model); df.jit(fn): df's default backend traces, compiles
                           each stage with Inductor and captures the whole plan as one CUDA graph, all
                           on the first call

Each measurement runs in a fresh process with TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and
DYNAFLOW_CACHE_DIR inside one new temporary directory per variant: "cold" is the first process, over
the empty directory; "warm" a second one over what the first left there (Inductor's FX graph and
kernel caches, Triton's compiled kernels). first_call_s is the wall time from wrapping the model to
the end of the first call, when torch.cuda.synchronize returns; ready_s runs on to the end of the
third call, so it includes the recording of cudagraph trees. Both include what any process pays on
its first compiled call (importing Inductor and Triton, loading CUDA modules, setting up cuBLAS).
median_ms, timed with CUDA events after those calls, is one call in the steady state, for the
start-up cost to read against. rel_err compares one more call with eager PyTorch, run only then
(bf16 logits after 32 layers differ by about 1e-2 between kernel choices; above MAX_REL_ERR the
child fails). Prints the table; writes bench/results/coldstart.json.
    python -m bench.coldstart
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch

import dynaflow_fn as df
from bench.common import print_table, relative_error, time_cuda, write_results
from bench.llama_layers import LlamaLike

DEVICE = torch.device("cuda")
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 128256, 4096, 32, 32, 8, 14336
TOKENS = (1, 128)                       # (batch, tokens) of the input ids
CASE = f"LlamaLike {LAYERS} layers x {HIDDEN} (Llama-3-8B-like), bf16 inference, ids {TOKENS[0]}x{TOKENS[1]}"
MAX_REL_ERR = 5e-2
CHILD_TIMEOUT_S = 600
COLUMNS = ["case", "variant", "caches", "first_call_s", "ready_s", "median_ms", "p10_ms", "p90_ms", "rel_err"]


# --- in the child process: one variant, one measurement --------------------------------------------

def make_model() -> torch.nn.Module:
    """The model built on the GPU in bf16 (made on the CPU in fp32, 8B parameters would take tens of seconds)."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with DEVICE:
            return LlamaLike(VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN).eval()
    finally:
        torch.set_default_dtype(default)


def compile_reduce_overhead(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return torch.compile(model, mode="reduce-overhead", dynamic=False)


def df_jit(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    fn, params = df.pure(model)
    fast = df.jit(fn)
    return lambda ids: fast(params, ids)


VARIANTS = {"compile-reduce-overhead": compile_reduce_overhead, "df": df_jit}


def measure(variant: str) -> dict[str, Any]:
    """Wrap the model, time its first call and its first three, then its steady state and its error."""
    model = make_model()
    ids = torch.randint(0, VOCAB, TOKENS, device=DEVICE)
    torch.cuda.synchronize()
    start = time.perf_counter()
    forward = VARIANTS[variant](model)

    def call() -> torch.Tensor:
        with torch.no_grad():
            return forward(ids)

    ends = []
    for _ in range(3):
        call()
        torch.cuda.synchronize()
        ends.append(time.perf_counter() - start)
    timing = time_cuda(call, repeats=20, warmup=3)
    out = call().clone()          # cudagraph trees overwrite their outputs on the next call
    with torch.no_grad():
        reference = model(ids)
    rel_err = relative_error(out, reference)
    if not rel_err < MAX_REL_ERR:
        raise AssertionError(f"{variant}: logits differ from eager PyTorch by {rel_err:.3g} (relative), "
                             f"above {MAX_REL_ERR}")
    return {"first_call_s": ends[0], "ready_s": ends[-1], **timing, "rel_err": rel_err}


# --- in the parent process: fresh processes over fresh caches --------------------------------------

def run_child(variant: str, cache_dir: str) -> dict[str, Any]:
    """One measurement in a new interpreter whose compilation caches all live under `cache_dir`."""
    env = {**os.environ,
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_dir, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(cache_dir, "triton"),
           "DYNAFLOW_CACHE_DIR": os.path.join(cache_dir, "dynaflow_fn")}
    done = subprocess.run([sys.executable, "-m", "bench.coldstart", "--child", variant], env=env, check=True,
                          stdout=subprocess.PIPE, text=True, timeout=CHILD_TIMEOUT_S)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=sorted(VARIANTS), help="measure this variant here and print it as JSON")
    options = parser.parse_args()
    if options.child:
        print(json.dumps(measure(options.child)), flush=True)
        return
    rows = []
    for variant in VARIANTS:
        with tempfile.TemporaryDirectory(prefix=f"coldstart-{variant}-") as cache_dir:
            for caches in ("cold", "warm"):
                rows.append({"case": CASE, "variant": variant, "caches": caches, **run_child(variant, cache_dir)})
                print(f"{variant}, {caches} caches: first call {rows[-1]['first_call_s']:.1f} s, ready after "
                      f"{rows[-1]['ready_s']:.1f} s", flush=True)
    print_table(rows, COLUMNS, f"cold start ({torch.cuda.get_device_name()})")
    print(f"\nwrote {write_results('coldstart', rows)}")


if __name__ == "__main__":
    main()
