"""Shared benchmark plumbing: timing (CUDA events through the library's `samples_ms`), the results file
format, tables.

Every benchmark writes `bench/results/<name>.json` in one format (see DESIGN.md section 5):
{"name", "device", "num_gpus", "torch", "cuda", "date", "rows": [{"case", "variant", "median_ms",
"p10_ms", "p90_ms", "peak_mem_mb", ...}]}, so ratios can be recomputed from the file alone.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import torch

from dynaflow_fn.jitting.timing import samples_ms

RESULTS = os.path.join(os.path.dirname(__file__), "results")
ONE_RANK_NOTE = ("One rank: every collective is local, so this checks the multi-GPU code path (NCCL communicators, "
                 "collectives captured in CUDA graphs) and its overheads, not communication overlap.")


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

    The static output holds real values only after the first replay.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


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
