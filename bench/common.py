"""Shared benchmark plumbing: timing (CUDA events through the library's `samples_ms`), the results file
format, tables, and the two peers every single-GPU benchmark shows per case:

  compile-reduce-overhead  `compiled(fn, args)`: torch.compile(fn, mode="reduce-overhead") in its
                           recommended form (an nn.Module, or persistent tensors marked by `mark_static`)
  df                       `jitted(fn, args)`: df.jit(fn) with default settings, the same tensors marked

`with_speedup_vs_compile` adds each row's speedup over compile-reduce-overhead.

Every benchmark writes `bench/results/<name>.json` in one format (see DESIGN.md section 5):
{"name", "device", "num_gpus", "torch", "cuda", "date", "rows": [{"case", "variant", "median_ms",
"p10_ms", "p90_ms", "peak_mem_mb", ...}]}, so ratios can be recomputed from the file alone.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import optree
import torch

import dynaflow_fn as df
from dynaflow_fn.compat import clear_cublas_workspaces
from dynaflow_fn.jitting.timing import samples_ms
from dynaflow_fn.runtime.cudagraph import without_automatic_gc

RESULTS = os.path.join(os.path.dirname(__file__), "results")
ONE_RANK_NOTE = ("One rank: every collective is local, so this checks the multi-GPU code path (NCCL communicators, "
                 "collectives captured in CUDA graphs) and its overheads, not communication overlap.")
COMPILE = "compile-reduce-overhead"
DF = "df"


def init_distributed() -> torch.device:
    """Under torchrun: this rank's GPU, with an NCCL process group bound to it."""
    import torch.distributed as dist

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return device


def finish_distributed() -> None:
    """End a torchrun benchmark once its results are written. On 2 H200s, tearing NCCL down (or exiting
    the interpreter) after collectives were captured in CUDA graphs hung every rank until killed, so
    each rank flushes its output and leaves without the teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def quantiles(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {"median_ms": statistics.median(ordered), "p10_ms": pick(0.1), "p90_ms": pick(0.9)}


def cuda_samples(fn: Callable[[], Any], repeats: int = 30, inner: int = 1, warmup: int = 5) -> list[float]:
    """Milliseconds per call of `fn`, one sample per `inner` back-to-back calls timed with CUDA events."""
    return samples_ms(fn, torch.device("cuda"), repeats=repeats, inner=inner, warmup=warmup)


def time_cuda(fn: Callable[[], Any], repeats: int = 30, inner: int = 1, warmup: int = 5) -> dict[str, float]:
    """Median/p10/p90 milliseconds per call of `fn` (see `cuda_samples`)."""
    return quantiles(cuda_samples(fn, repeats, inner, warmup))


def time_variants(calls: dict[str, Callable[[], Any]], rounds: int = 3, repeats: int = 10,
                  inner: int = 1) -> dict[str, dict[str, float]]:
    """`time_cuda` for several variants, interleaved over `rounds` so that drift hits all alike."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples[name] += cuda_samples(call, repeats=repeats, inner=inner, warmup=2)
    return {name: quantiles(values) for name, values in samples.items()}


def time_host(fn: Callable[[], Any], repeats: int = 30, inner: int = 1, warmup: int = 5) -> dict[str, float]:
    """Host milliseconds to issue one call: the clock stops before waiting for the device to finish."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) * 1e3 / inner)
        sync()
    return quantiles(samples)


def capture_graph(fn: Callable[[], Any], warmup: int = 2) -> tuple[Callable[[], None], Any]:
    """Capture fn() into one CUDA graph after warming up on a side stream: (replay, static output).

    The static output holds real values only after the first replay. cuBLAS's workspaces are cleared
    before the capture, as torch.compile and df.jit do around theirs: a GEMM captured on a stream that
    ran GEMMs in the warm-up (the side streams of a hand-written multi-stream graph) would otherwise
    bake in a workspace from the general pool, which the next of their captures frees under this graph.
    Python's cyclic collector is paused over the capture, as df.jit pauses it over its own: a graph of
    an earlier variant that it destroyed there would invalidate this capture.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    clear_cublas_workspaces()
    with without_automatic_gc(), torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def mark_static(*trees: Any) -> None:
    """Mark every tensor in the pytrees with torch._dynamo.mark_static_address: torch.compile's documented
    declaration of a tensor that persists across calls (weights, KV caches passed as arguments), so that
    cudagraph trees read it in place instead of copying it per replay. df.jit reads such tensors in place
    too, so marking once gives both peers the same declaration."""
    for tensor in optree.tree_leaves(trees):
        if isinstance(tensor, torch.Tensor):
            torch._dynamo.mark_static_address(tensor)


def compiled_per_shape(fn: Callable[..., Any], shapes: int, mode: str = "reduce-overhead") -> Callable[..., Any]:
    """torch.compile(fn, mode=mode, dynamic=False) for a caller that calls it at `shapes` distinct input
    shapes (batch sizes, buckets): a graph for each. Dynamo compiles at most `recompile_limit` (8) graphs
    of one function and runs it eagerly beyond them, with only a warning in the log: a peer called at
    11 sizes would run 3 of them uncompiled. The limit is raised to cover every shape."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, 2 * shapes)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * shapes)
    return torch.compile(fn, mode=mode, dynamic=False)


def compiled(fn: Callable[..., Any], args: tuple, mode: str | None = "reduce-overhead", static: Sequence[int] = (),
             backend: Any = "inductor") -> Callable[[], Any]:
    """torch.compile(fn, mode or backend) on `args`, warmed up, as a call under no_grad; by default the
    compile-reduce-overhead peer.

    `static`: arguments to `mark_static` first, as bench.substitute asks; the other benchmarks mark their
    persistent tensors before building any variant, so that the df rows see the same marks whatever the
    order. Three calls: the first compiles, the next two let cudagraph trees warm up and record.
    """
    mark_static([args[index] for index in static])
    function = torch.compile(fn, mode=mode, backend=backend, dynamic=False)

    def call() -> Any:
        with torch.no_grad():
            return function(*args)

    for _ in range(3):
        call()
    return call


def jitted(fn: Callable[..., Any], args: tuple, persistent: Sequence[int] = (), **options: Any) -> Callable[[], Any]:
    """df.jit(fn, **options) on `args`, built by its first call, as a call under no_grad (as the peers and
    eager run: inference, where parameters that require grad would otherwise have the call mark its
    outputs as ones without a backward); with no options, the df peer.

    `persistent`: arguments declared persistent (persistent_argnums), as bench.substitute asks; tensors
    marked by `mark_static`, and the parameters and buffers of df.pure's state, are read in place without.
    """
    fast = df.jit(fn, persistent_argnums=tuple(persistent), **options)

    def call() -> Any:
        with torch.no_grad():
            return fast(*args)

    call()
    call.jitted = fast                          # for its cache_info() and, with strategy="auto", its choices
    return call


def chosen_strategies(call: Callable[[], Any]) -> str | None:
    """What `strategy="auto"` kept for a `jitted` call, per input signature ("none", "branches", ...);
    None for any other call."""
    fast = getattr(call, "jitted", None)
    choices = getattr(fast, "choices", None)
    return ", ".join(choice.strategy for choice in choices.values()) if choices else None


def output_of(call: Callable[[], Any], static_output: Any) -> Any:
    """A variant's result, to check: a hand-captured graph's static output (which holds the last replay's
    results), else what one more call returns, read at once (cudagraph trees overwrite their outputs on
    the next call)."""
    return call() if static_output is None else static_output


def with_speedup_vs_compile(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add speedup_vs_compile (the compile-reduce-overhead row's median / the row's) to the rows of every
    case that has that row."""
    peer = {row["case"]: row["median_ms"] for row in rows if row["variant"] == COMPILE}
    for row in rows:
        if row["case"] in peer:
            row["speedup_vs_compile"] = peer[row["case"]] / row["median_ms"]
    return rows


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def release() -> None:
    """Drop the finished case's models, compiled code and cudagraph-tree pools, so the next case compiles
    afresh (no recompile limit, no automatic dynamic shapes) and has the memory to itself."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def peak_memory_mb(fn: Callable[[], Any]) -> float:
    """Peak CUDA memory (MiB) allocated while `fn` runs once, above what was allocated before."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def write_results(name: str, rows: list[dict[str, Any]], **extra: Any) -> str:
    """Write `bench/results/<name>.json`. Only from a machine with CUDA: the files hold one GPU machine's
    measurements, and absolute times from anywhere else would read as its."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"not writing bench/results/{name}.json without a CUDA device: the results there are "
                           "GPU measurements")
    os.makedirs(RESULTS, exist_ok=True)
    record = {
        "name": name,
        "device": device_name(),
        "num_gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
        "rows": rows,
    }
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path


def print_table(rows: list[dict[str, Any]], columns: Sequence[str], title: str = "") -> None:
    if title:
        print(f"\n{title}")
    text = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in text)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in text:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
