"""Launch overhead: a launch-bound model (16 small layers, batch 1) run seven ways, side by side.

  eager                    plain PyTorch, one Python call per op
  compile-reduce-overhead  torch.compile(model, mode="reduce-overhead") (CUDA graphs through cudagraph trees)
  hand-graph               a torch.cuda.graph captured by hand: copy input, replay, clone output
  df                       df.jit(fn) on df.pure(model) with default settings (Inductor stages in one CUDA
                           graph), called as fast(params, x)
  df.jit-closure           the same with the parameters closed over, called as fast(x): no pytree of
                           parameters to flatten and check on each call
  df.aten                  df.jit(fn, backend="cudagraph"): aten kernels in one CUDA graph
  df.auto                  df.jit(fn, strategy="auto"): the fastest candidate (batch 1: nothing to split)

Reports the median time per call over back-to-back calls (CUDA events), the host time per call two
ways, ratios against eager, the hand-captured graph and compile-reduce-overhead, and for the compiled rows
build_s: wall seconds until the first steady-state call (df: its first call traces, lowers, compiles
and captures; torch.compile: the first call compiles, the next two warm up and record). Also reports
how long dynaflow_fn takes to trace and lower a 32-layer Llama-like model with parameters on the meta
device (CPU work only).

The two host times: `host_us_per_call` issues 100 calls back to back, so each call is launched while
the device still runs the ones before it; `host_us_idle_device` times one call at a time with the
device idle before it (synchronized between calls), as in a decoding loop, which waits for every token
before it issues the next step.

With `--against DIR` it also times the host time of the df rows with another copy of the dynaflow_fn
package (DIR holds its `dynaflow_fn/` folder, an older checkout say), side by side with this one: each
tree in fresh processes, taking turns, the same model and calls. Written to overhead-against.json.

    python -m bench.overhead            # on a GPU: everything
    python -m bench.overhead --trace    # trace + lower timing only (any machine; written only on a GPU one)
    python -m bench.overhead --against ../old-checkout
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

import dynaflow_fn as df
from bench.common import (COMPILE, DF, capture_graph, compiled, jitted, print_table, time_host, time_variants,
                          with_speedup_vs_compile, write_results)

WIDTH, LAYERS = 512, 16


class SmallLayer(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.fc(self.norm(x)))


class LaunchBound(nn.Module):
    def __init__(self, width: int = WIDTH, layers: int = LAYERS):
        super().__init__()
        self.layers = nn.Sequential(*(SmallLayer(width) for _ in range(layers)))

    def forward(self, x):
        return self.layers(x)


def hand_graph(model: nn.Module, example: torch.Tensor):
    """A torch.cuda.graph of the model, captured by hand (`bench.common.capture_graph`): a call copies the
    input in, replays and clones the output."""
    static_x = example.clone()
    with torch.no_grad():
        replay, static_y = capture_graph(lambda: model(static_x), warmup=3)

    def call(x):
        static_x.copy_(x)
        replay()
        return static_y.clone()
    return call


def trace_and_lower_seconds() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).eval()
    fn, params = df.pure(model)

    def logits(params, ids):
        return fn(params, ids, use_cache=False).logits

    ids = torch.empty(1, 512, dtype=torch.long, device="meta")
    start = time.perf_counter()
    program = df.trace(logits, params, ids)
    traced = time.perf_counter()
    plan = df.lower(program)
    lowered = time.perf_counter()
    return {"case": "llama3-8b-like 32 layers, 512 tokens (meta params)", "variant": "df.trace+lower",
            "trace_s": traced - start, "lower_s": lowered - traced, "total_s": lowered - start,
            "ops": len(program.ops()), "steps": len(plan.steps)}


def launch_bound_rows() -> list[dict]:
    torch.manual_seed(0)
    model = LaunchBound().cuda().eval()
    fn, params = df.pure(model)
    x = torch.randn(1, WIDTH, device="cuda")
    with torch.no_grad():
        reference = model(x)
    graph_call = hand_graph(model, x)
    builds = {
        COMPILE: lambda: compiled(model, (x,)),
        DF: lambda: jitted(fn, (params, x)),
        "df.jit-closure": lambda: jitted(lambda x: fn(params, x), (x,)),
        "df.aten": lambda: jitted(fn, (params, x), backend="cudagraph"),
        "df.auto": lambda: jitted(fn, (params, x), strategy="auto", progress=False),
    }
    built, build_s = {}, {}
    for name, build in builds.items():
        start = time.perf_counter()
        built[name] = build()
        torch.cuda.synchronize()
        build_s[name] = time.perf_counter() - start
    variants = {"eager": no_grad(lambda: model(x)), COMPILE: built[COMPILE], "hand-graph": lambda: graph_call(x),
                **{name: call for name, call in built.items() if name != COMPILE}}
    for name, call in variants.items():
        # Inductor's fused layer norms add in another order than eager's
        torch.testing.assert_close(call(), reference, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
    timings = time_variants(variants, rounds=3, repeats=10, inner=100)
    rows = []
    for name, call in variants.items():
        back_to_back = time_host(call, repeats=10, inner=100)
        one_by_one = time_host(call, repeats=300, inner=1)
        rows.append({"case": f"{LAYERS} layers x {WIDTH}, batch 1", "variant": name, **timings[name],
                     "host_us_per_call": back_to_back["median_ms"] * 1e3,
                     "host_us_idle_device": one_by_one["median_ms"] * 1e3,
                     **({"build_s": build_s[name]} if name in build_s else {})})
    by = {r["variant"]: r for r in rows}
    for row in rows:
        row["speedup_vs_eager"] = by["eager"]["median_ms"] / row["median_ms"]
        row["ratio_vs_hand_graph"] = row["median_ms"] / by["hand-graph"]["median_ms"]
    return with_speedup_vs_compile(rows)


HOST_VARIANTS = {DF: {}, "df.jit-closure": {}, "df.aten": {"backend": "cudagraph"}}
"""The rows --against compares: the options of each, through the public API every version of it has."""


def host_rows() -> dict[str, float]:
    """Host microseconds per call of each df variant in HOST_VARIANTS, in this process's dynaflow_fn."""
    torch.manual_seed(0)
    model = LaunchBound().cuda().eval()
    fn, params = df.pure(model)
    x = torch.randn(1, WIDTH, device="cuda")
    calls = {name: jitted(lambda x: fn(params, x), (x,), **options) if name == "df.jit-closure"
             else jitted(fn, (params, x), **options) for name, options in HOST_VARIANTS.items()}
    return {name: time_host(call, repeats=10, inner=100)["median_ms"] * 1e3 for name, call in calls.items()}


def against_rows(other: pathlib.Path, rounds: int = 3) -> list[dict]:
    """host_rows() of this tree and of the dynaflow_fn under `other`, each in `rounds` fresh processes,
    taking turns (so that clocks and the GPU's state drift alike for both); the median per variant."""
    if not (other / "dynaflow_fn" / "__init__.py").is_file():
        raise SystemExit(f"--against {other}: no dynaflow_fn/ package there")
    here = pathlib.Path(__file__).resolve().parents[1]
    trees = {"this tree": here, other.resolve().name: other.resolve()}
    samples = {tree: [] for tree in trees}
    for _ in range(rounds):
        for tree, root in trees.items():
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(here), os.environ.get("PYTHONPATH", "")])}
            out = subprocess.run([sys.executable, "-m", "bench.overhead", "--host-rows"], env=env, cwd=here,
                                 check=True, capture_output=True, text=True).stdout
            samples[tree].append(json.loads(out.splitlines()[-1]))
    rows = []
    for tree, runs in samples.items():
        for name in HOST_VARIANTS:
            rows.append({"case": f"{LAYERS} layers x {WIDTH}, batch 1", "tree": tree, "variant": name,
                         "host_us_per_call": statistics.median(run[name] for run in runs)})
    this = {r["variant"]: r["host_us_per_call"] for r in rows if r["tree"] == "this tree"}
    for row in rows:
        row["ratio_vs_this_tree"] = row["host_us_per_call"] / this[row["variant"]]
    return rows


def no_grad(call):
    """`call` under torch.no_grad, so that eager PyTorch records no autograd graph (the graphs record none)."""
    def run():
        with torch.no_grad():
            return call()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="store_true", help="only time trace + lower (no GPU needed)")
    parser.add_argument("--against", type=pathlib.Path, metavar="DIR",
                        help="only compare the df rows' host time with the dynaflow_fn package under DIR")
    parser.add_argument("--host-rows", action="store_true", help=argparse.SUPPRESS)   # one process of --against
    options = parser.parse_args()
    os.environ.setdefault("DYNAFLOW_CACHE_DIR", tempfile.mkdtemp())   # df.auto measures, not recalls
    if options.host_rows:
        print(json.dumps(host_rows()))
        return
    if options.against:
        rows = against_rows(options.against)
        print_table(rows, ["case", "tree", "variant", "host_us_per_call", "ratio_vs_this_tree"],
                    "host time per call, this tree against another")
        print(f"\nwrote {write_results('overhead-against', rows)}")
        return
    trace_row = trace_and_lower_seconds()
    print_table([trace_row], ["case", "variant", "trace_s", "lower_s", "total_s", "ops", "steps"],
                "trace + lower time")
    if options.trace:
        if torch.cuda.is_available():
            write_results("trace_time", [trace_row])
        else:
            print("\nnot written to bench/results/: it holds the GPU machine's measurements")
        return
    rows = launch_bound_rows()
    print_table(rows, ["case", "variant", "median_ms", "p10_ms", "p90_ms", "host_us_per_call", "host_us_idle_device",
                       "speedup_vs_eager", "ratio_vs_hand_graph", "speedup_vs_compile", "build_s"],
                "launch-bound model, time per call")
    path = write_results("overhead", rows + [trace_row])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
