"""`strategy="auto"`: measure candidate strategies on the device, keep the fastest, remember the choice.

Whether overlap pays depends on the model, the batch and the machine (on an H200, splitting a
memory-bound decode batch loses; prefill beside decode attention wins), so `df.jit(fn,
strategy="auto", in_axes=...)` decides by measuring. For each new input signature it builds the
candidate plans (no overlap; `branches`; with `in_axes`, 2 and 4 micro-batches under `roundrobin`
and `tbo`), runs each with warm-up and takes medians, and keeps a candidate only if it beats no
overlap by a margin, so the result is never slower than no overlap. The decision is stored on disk,
keyed by device, versions, function and shapes, and reused by later processes. With several ranks,
rank 0 measures and broadcasts, so every rank builds the same plan (collectives stay in step).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from .. import transforms as T
from ..tracing.tracer import trace

NO_OVERLAP = "none"
MARGIN = 0.02
COMM_CTAS = (8,)
"""Thread-block budgets of the dedicated communicators tried on several NCCL ranks."""


@dataclass(frozen=True)
class Candidate:
    name: str
    fn: Callable[..., Any]


def candidates(fn: Callable[..., Any], in_axes: Any = None, comm_ctas: Sequence[int] = ()) -> list[Candidate]:
    """No overlap first, then the strategies worth trying for this function. `comm_ctas` adds 2
    micro-batches with collectives on a communicator of that many thread blocks (multi-GPU only)."""
    found = [Candidate(NO_OVERLAP, fn), Candidate("branches", T.overlap(fn, strategy="branches"))]
    if in_axes is not None:
        for num in (2, 4):
            split = T.microbatch(fn, num=num, in_axes=in_axes)
            for strategy in ("roundrobin", "tbo"):
                found.append(Candidate(f"microbatch{num}-{strategy}", T.overlap(split, strategy=strategy)))
                found += [Candidate(f"microbatch{num}-{strategy}-ctas{ctas}", T.overlap(split, strategy, comm_ctas=ctas))
                          for ctas in comm_ctas if num == 2]
    return found


def cache_path() -> str:
    root = os.environ.get("DYNAFLOW_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "dynaflow_fn"))
    return os.path.join(root, "autotune.json")


def check_in_axes(fn: Callable[..., Any], in_axes: Any, args: tuple, kwargs: dict) -> None:
    """Raise the micro-batching error now if `in_axes` cannot split these arguments at all.

    A candidate that fails to build is skipped, which is right for 4 micro-batches of a batch of 3,
    but an `in_axes` that does not fit the arguments is a mistake the caller must hear about, not a
    silent "no overlap". One micro-batch checks everything but the batch size."""
    trace(T.microbatch(fn, num=1, in_axes=in_axes), *args, **kwargs)


def decision_key(fn: Callable[..., Any], signature: str, device: torch.device, world: int,
                 options: Sequence[str] = ()) -> str:
    """A digest of what the measurement depends on: device, versions, the function's code, shapes, ranks,
    and the candidates it chose among (a decision made without micro-batching says nothing about it)."""
    try:
        code = inspect.getsource(fn)
    except (OSError, TypeError):
        code = getattr(fn, "__qualname__", repr(fn))
    parts = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "torch": torch.__version__, "cuda": torch.version.cuda, "world": world,
        "function": f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}",
        "code": hashlib.sha256(code.encode()).hexdigest(), "signature": signature, "candidates": sorted(options),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def load_decision(key: str) -> str | None:
    try:
        with open(cache_path()) as f:
            return json.load(f).get(key, {}).get("choice")
    except (OSError, ValueError):
        return None


def store_decision(key: str, choice: str, timings: dict[str, float]) -> None:
    path = cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path) as f:
            decisions = json.load(f)
    except (OSError, ValueError):
        decisions = {}
    decisions[key] = {"choice": choice, "median_ms": timings, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    temporary = f"{path}.{os.getpid()}"
    with open(temporary, "w") as f:
        json.dump(decisions, f, indent=1)
    os.replace(temporary, path)


def median_ms(run: Callable[[], Any], device: torch.device, warmup: int = 3, repeats: int = 10) -> float:
    """Median milliseconds per call, with CUDA events on CUDA and the host clock elsewhere."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            start_s = time.perf_counter()
            run()
            samples.append((time.perf_counter() - start_s) * 1e3)
    return statistics.median(samples)


def choose(timings: dict[str, float]) -> str:
    """The fastest candidate, unless it does not beat no overlap by MARGIN: then no overlap."""
    best = min(timings, key=timings.get)
    baseline = timings.get(NO_OVERLAP)
    if baseline is None or timings[best] < baseline * (1 - MARGIN):
        return best
    return NO_OVERLAP


def measure(names: Sequence[str], build: Callable[[str], Callable[[], float]], progress: bool = True,
            rounds: int = 3) -> dict[str, float]:
    """Time every candidate side by side with the first (no overlap), holding at most two built.

    `build(name)` returns a function that times one round of that candidate. The first candidate stays
    built; every other one is built, timed in `rounds` rounds that alternate with the first, and
    dropped before the next one is built, so choosing needs the device memory of two plans rather
    than of all of them. Alternating puts a candidate and its reference under the same clocks and
    temperature, and each candidate's median is rescaled by how far the reference drifted in its
    window from the reference's median over the whole measurement, so candidates timed a minute
    apart still compare fairly. Candidates that fail to build or run are skipped, with a message.
    """
    reference_name, *others = names
    bar = tqdm(total=len(names) + rounds * max(len(others), 1), desc="df.jit strategy=auto",
               disable=not progress, leave=False)

    def attempt(name: str, action: Callable[[], Any]) -> Any:
        """action(), or None with a message if it fails."""
        bar.set_postfix_str(name)
        try:
            return action()
        except Exception as error:
            bar.write(f"strategy=auto: candidate {name} skipped ({type(error).__name__}: {error})")
            return None
        finally:
            bar.update()

    bar.set_postfix_str(reference_name)
    reference = build(reference_name)
    bar.update()
    everything: list[float] = []
    windows: dict[str, tuple[list[float], list[float]]] = {}
    for name in others:
        timer = attempt(name, lambda: build(name))
        mine: list[float] = []
        theirs: list[float] = []
        attempts = 0
        while timer is not None and attempts < rounds:
            attempts += 1
            sample = attempt(name, timer)
            if sample is None:
                break
            mine.append(sample)
            theirs.append(reference())
        bar.update(rounds - attempts)
        if len(mine) == rounds:
            windows[name] = (mine, theirs)
        everything += theirs
        timer = None                       # drop this candidate's plan before building the next
    if not others:
        everything = [reference() for _ in range(rounds)]
        bar.update(rounds)
    bar.close()
    overall = statistics.median(everything)
    return {reference_name: overall, **{name: statistics.median(mine) * overall / statistics.median(theirs)
                                        for name, (mine, theirs) in windows.items()}}


def agree(choice: str) -> str:
    """On several ranks, rank 0's choice wins (every rank must build the same plan)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return choice
    message = [choice]
    dist.broadcast_object_list(message, src=0)
    return message[0]
