"""Timing a call on a device: CUDA events on CUDA (device time, not host time), the host clock elsewhere.

`strategy="auto"` and the benchmarks (bench/common.py) time with this one function."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch


def samples_ms(run: Callable[[], Any], device: torch.device, repeats: int = 10, inner: int = 1,
               warmup: int = 3) -> list[float]:
    """Milliseconds per call of `run`, one sample per `inner` back-to-back calls, after `warmup` calls."""
    for _ in range(warmup):
        run()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / inner)
        else:
            start_s = time.perf_counter()
            for _ in range(inner):
                run()
            samples.append((time.perf_counter() - start_s) * 1e3 / inner)
    return samples


def median_ms(run: Callable[[], Any], device: torch.device, warmup: int = 3, repeats: int = 10) -> float:
    """Median milliseconds per call (see `samples_ms`)."""
    return statistics.median(samples_ms(run, device, repeats=repeats, warmup=warmup))
