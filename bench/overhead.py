"""Launch overhead: a launch-bound model (16 small layers, batch 1) run four ways, side by side.

  eager            plain PyTorch, one Python call per op
  compile-ro       torch.compile(mode="reduce-overhead") (CUDA graphs through cudagraph trees)
  hand-graph       a torch.cuda.graph captured by hand: copy input, replay, clone output
  df.jit           dynaflow_fn.jit with the default cudagraph backend, called as fast(params, x)
  df.jit-closure   the same with the parameters closed over, called as fast(x): no pytree of
                   parameters to flatten and check on each call

Reports the median time per call over back-to-back calls (CUDA events), the host time per call, and
ratios against eager and the hand-captured graph. Also reports how long dynaflow_fn takes to trace and
lower a 32-layer Llama-like model with parameters on the meta device (CPU work only).

    python -m bench.overhead            # on a GPU: everything
    python -m bench.overhead --trace    # trace + lower timing only (any machine; written only on a GPU one)
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import dynaflow_fn as df
from bench.common import print_table, time_host, time_variants, write_results

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
    static_x = example.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        static_y = model(static_x)

    def call(x):
        static_x.copy_(x)
        graph.replay()
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

    start = time.perf_counter()
    fast = df.jit(fn)
    torch.testing.assert_close(fast(params, x), reference)
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - start

    compiled = torch.compile(model, mode="reduce-overhead")
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), reference)
    graph_call = hand_graph(model, x)
    torch.testing.assert_close(graph_call(x), reference)

    def no_grad(call):
        def run():
            with torch.no_grad():
                return call()
        return run

    closed = df.jit(lambda x: fn(params, x))
    torch.testing.assert_close(closed(x), reference)
    variants = {
        "eager": no_grad(lambda: model(x)),
        "compile-ro": no_grad(lambda: compiled(x)),
        "hand-graph": lambda: graph_call(x),
        "df.jit": lambda: fast(params, x),
        "df.jit-closure": lambda: closed(x),
    }
    timings = time_variants(variants, rounds=3, repeats=10, inner=100)
    rows = []
    for name, call in variants.items():
        host = time_host(call, repeats=10, inner=100)
        rows.append({"case": f"{LAYERS} layers x {WIDTH}, batch 1", "variant": name, **timings[name],
                     "host_us_per_call": host["median_ms"] * 1e3})
    by = {r["variant"]: r for r in rows}
    for row in rows:
        row["speedup_vs_eager"] = by["eager"]["median_ms"] / row["median_ms"]
        row["ratio_vs_hand_graph"] = row["median_ms"] / by["hand-graph"]["median_ms"]
    by["df.jit"]["first_call_s"] = first_call_s
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="store_true", help="only time trace + lower (no GPU needed)")
    options = parser.parse_args()
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
    print_table(rows, ["case", "variant", "median_ms", "p10_ms", "p90_ms", "host_us_per_call",
                       "speedup_vs_eager", "ratio_vs_hand_graph"], "launch-bound model, time per call")
    path = write_results("overhead", rows + [trace_row])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
