"""How the GPU runs concurrent work: two probes behind the design of comm streams and `comm_ctas`.

    python -m bench.streams

issue order   A chain of eleven 8192x8192 bf16 GEMMs on the main stream; a small kernel on a
              high-priority side stream needs only the first GEMM. It is issued either right after
              that GEMM ("early") or after all eleven ("late"), run eagerly and as one CUDA graph.
              probe_wait_us: from the end of the GEMM it needs to its own start (median), and
              probe_waited: in how many runs it waited more than 100 us, i.e. for the next GEMM to end.
carveout      The same chain under cuBLAS's SM carveout (torch._C._set_sm_carveout_experimental(N),
              what `comm_ctas=N` applies beside collectives), the side kernel issued early, with
              PyTorch's default cuBLAS backend and with cuBLASLt (preferred_blas_library).
median_ms is per GEMM; gemm_slowdown compares it with the early-issued chain without a carveout in
the same mode.

Every variant runs 9 times under the profiler, the variants interleaved round by round; medians are
reported. Writes bench/results/streams.json.
"""

from __future__ import annotations

import functools
import statistics
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import print_table, quantiles, write_results
from dynaflow_fn.runtime.cudagraph import without_automatic_gc

SIZE, CHAIN, ROUNDS = 8192, 10, 9
WAITED_US = 100.0            # a side kernel that started this late waited for a GEMM to end


def chain(a: torch.Tensor, w: torch.Tensor, probe: torch.Tensor, side: torch.cuda.Stream, late: bool,
          carveout: int | None, blas: str) -> torch.Tensor:
    """GEMMs on the current stream (through `blas`); `probe` scaled on `side` once the first GEMM is done."""
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    previous = torch._C._get_sm_carveout_experimental()
    previous_blas = torch.backends.cuda.preferred_blas_library()
    torch._C._set_sm_carveout_experimental(carveout)
    torch.backends.cuda.preferred_blas_library(blas)
    try:
        x = a @ w
        ready = torch.cuda.Event()
        ready.record(main)

        def side_kernel() -> None:
            with torch.cuda.stream(side):
                side.wait_event(ready)
                probe.mul_(1.0001)

        if not late:
            side_kernel()
        for _ in range(CHAIN):
            x = x @ w
        if late:
            side_kernel()
    finally:
        torch._C._set_sm_carveout_experimental(previous)
        torch.backends.cuda.preferred_blas_library(previous_blas)
    main.wait_stream(side)
    return x


def as_graph(fn: Callable[[], object]) -> Callable[[], None]:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with without_automatic_gc(), torch.cuda.graph(graph):
        fn()
    return graph.replay


def profile_once(run: Callable[[], object]) -> tuple[float, float]:
    """(median GEMM milliseconds, microseconds from the first GEMM's end to the side kernel's start)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    side = next(e for e in kernels if "mul" in e.name.lower() and "gemm" not in e.name.lower())
    gemms = [e for e in kernels if e is not side and not e.name.lower().startswith(("memcpy", "memset"))]
    per_gemm = statistics.median((e.time_range.end - e.time_range.start) / 1e3 for e in gemms)
    return per_gemm, side.time_range.start - gemms[0].time_range.end


def main() -> None:
    torch.manual_seed(0)
    a = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16) / SIZE ** 0.5
    probe = torch.randn(1 << 22, device="cuda")
    side = torch.cuda.Stream(priority=-1)
    settings = [("issue order", late, None, "cublas") for late in (False, True)]
    settings += [("carveout", False, sms, blas) for blas in ("cublas", "cublaslt") for sms in (None, 8, 16)
                 if (sms, blas) != (None, "cublas")]
    runs = {}
    for case, late, sms, blas in settings:
        for mode in ("eager", "graph"):
            body = functools.partial(chain, a, w, probe, side, late, sms, blas)
            variant = (f"{mode}, {'late' if late else 'early'}" if case == "issue order"
                       else f"{mode}, {blas}, carveout={sms}")
            runs[(case, variant, mode, sms)] = as_graph(body) if mode == "graph" else body
    samples: dict[tuple, list[tuple[float, float]]] = {key: [] for key in runs}
    for _ in range(ROUNDS):                     # interleaved, so that clocks and heat drift hit all alike
        for key, run in runs.items():
            run()
            samples[key].append(profile_once(run))
    rows = []
    for (case, variant, mode, sms), values in samples.items():
        waits = [wait for _, wait in values]
        rows.append({"case": f"{case}: {CHAIN + 1} GEMMs {SIZE}^2 bf16 + a side kernel", "variant": variant,
                     **quantiles([ms for ms, _ in values]), "probe_wait_us": statistics.median(waits),
                     "probe_waited": f"{sum(w > WAITED_US for w in waits)}/{len(waits)}", "mode": mode, "sms": sms})
    for row in rows:
        reference = next(r for r in rows if r["mode"] == row["mode"] and r["variant"].endswith("early"))
        row["gemm_slowdown"] = row["median_ms"] / reference["median_ms"]
    print_table(rows, ["case", "variant", "median_ms", "p10_ms", "p90_ms", "probe_wait_us", "probe_waited",
                       "gemm_slowdown"],
                f"concurrent work on one GPU ({torch.cuda.get_device_name()})")
    print(f"\nwrote {write_results('streams', rows)}")


if __name__ == "__main__":
    main()
