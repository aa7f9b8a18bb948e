"""`strategy="auto"`: measure candidate strategies on the device, keep the fastest, remember the choice.

Whether overlap pays depends on the model, the batch and the machine (on an H200, splitting a
memory-bound decode batch loses; prefill beside decode attention wins), so `df.jit(fn,
strategy="auto", in_axes=...)` decides by measuring. For each new input signature it builds the
candidate plans (no overlap; `branches`; with `in_axes`, 2 and 4 micro-batches under `roundrobin`
and `tbo`), runs each with warm-up and takes medians, and keeps a candidate only if it beats no
overlap by a margin, so the result is never slower than no overlap. The decision is stored on disk,
keyed by device, versions, function and shapes, and reused by later processes. With several ranks,
rank 0 measures and broadcasts, so every rank builds the same plan (collectives stay in step).

A candidate that does not apply (4 micro-batches of a batch of 3: a TransformError, InputError or
TraceError) or does not fit in device memory is skipped; one warning per signature names each
skipped candidate and why, and `fast.choices` records them. A candidate that breaks one of
dynaflow_fn's own invariants (a plan that fails verification, an invalid schedule, an internal
error) is a bug: it is skipped with a warning that says so, and under a test suite (the testing
plugin sets DYNAFLOW_STRICT=1) it raises, so that no test passes by auto quietly choosing no overlap.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist

from .. import transforms as T
from ..errors import (InputError, InternalError, ScheduleError, TraceError, TransformError, VerificationError,
                      strict, warn)
from ..ir import tree
from ..ir.progress import progress_bar
from ..ir.program import Program, dtype_name, info
from ..ir.tree import Flat
from ..tracing.tracer import trace_flat
from .state import is_state
from .timing import median_ms

NO_OVERLAP = "none"
MARGIN = 0.02
COMM_CTAS = (8,)
"""Thread-block budgets of the dedicated communicators tried on several NCCL ranks."""


DOES_NOT_APPLY = (TransformError, InputError, TraceError, torch.OutOfMemoryError)
"""A candidate that cannot run for this signature (its split does not fit the batch, its plan does not
fit in memory): skipped."""
BUGS = (VerificationError, ScheduleError, InternalError)
"""A candidate that breaks one of dynaflow_fn's invariants: skipped for users, raised under tests."""


@dataclass(frozen=True)
class Choice:
    """What `strategy="auto"` decided for one input signature: the candidate kept, the medians it was
    chosen by (empty when a stored decision was reused) and the candidates skipped, with why."""

    strategy: str
    median_ms: dict[str, float]
    skipped: dict[str, str]


@dataclass(frozen=True)
class Candidate:
    name: str
    fn: Callable[..., Any]


class Buildable(Protocol):
    """What tuning needs of a built candidate (a cache entry): a call of it that leaves the arguments as they are."""

    def benchmark(self, leaves: Sequence[Any]) -> Callable[[], Any]: ...


Built = TypeVar("Built", bound=Buildable)


def tune(fn: Callable[..., Any], in_axes: Any, flat: Flat, signature: str,
         build: Callable[[Callable[..., Any]], Built], progress: bool = True,
         rows: int | None = None) -> tuple[Choice, Built]:
    """Choose the strategy of `fn` for one input signature: the `Choice`, and the candidate built.

    `build(candidate_fn)` traces and lowers one candidate; `rows`, if known (a batch bucket), is the
    batch size, which leaves out micro-batch counts larger than it. The candidates are timed side by side with
    no overlap (`measure`); a winner other than no overlap is timed again, alone with no overlap, and
    kept only if it still wins, since the fastest of many noisy timings is biased to look fast."""
    device, world = _placement(flat)
    program = check_in_axes(fn, in_axes, flat) if in_axes is not None else trace_flat(fn, flat)
    nccl = world > 1 and dist.get_backend() == "nccl"
    options = {c.name: c.fn for c in candidates(fn, in_axes, COMM_CTAS if nccl else (), region_names(program), rows)}
    decision = decision_key(fn, signature, device, world, list(options))
    stored = load_decision(decision)
    if stored in options:
        return Choice(stored, {}, {}), build(options[stored])
    trials = _Trials(options, build, flat.leaves, device)
    skipped: dict[str, str] = {}
    timings = measure(list(options), trials.timer, progress, skipped=skipped)
    choice = agree(choose(timings))
    if choice != NO_OVERLAP:
        trials.keep(choice)
        rematch = measure([NO_OVERLAP, choice], trials.timer, progress, skipped=skipped)
        choice = agree(choose(rematch))
        timings = {**timings, **{f"{name} (rematch)": ms for name, ms in rematch.items()}}
    if skipped:
        warn(f"strategy='auto' skipped {len(skipped)} of {len(options)} candidates for {_call_text(fn, flat)}: "
             + "; ".join(f"{name}: {why}" for name, why in skipped.items()))
    if world == 1 or dist.get_rank() == 0:
        store_decision(decision, choice, timings)
    return Choice(choice, timings, skipped), trials.built(choice)


class _Trials:
    """The candidates built for timing. No overlap, which every round compares with, stays built, and
    so does a first-round winner once it is rematched, to be returned; every other candidate is
    dropped when `measure` lets go of its timer."""

    def __init__(self, options: dict[str, Callable[..., Any]], build: Callable[[Callable[..., Any]], Buildable],
                 leaves: Sequence[Any], device: torch.device):
        self.options, self.build, self.leaves, self.device = options, build, leaves, device
        self.kept: dict[str, Buildable] = {}
        self.keeping = {NO_OVERLAP}

    def keep(self, name: str) -> None:
        self.keeping.add(name)

    def built(self, name: str) -> Buildable:
        return self.kept.get(name) or self.build(self.options[name])

    def timer(self, name: str) -> Callable[[], float]:
        """Build the candidate (unless kept) and return a function that times one round of it."""
        entry = self.built(name)
        if name in self.keeping:
            self.kept[name] = entry
        call = entry.benchmark(self.leaves)
        return lambda: median_ms(call, self.device)


def candidates(fn: Callable[..., Any], in_axes: Any = None, comm_ctas: Sequence[int] = (),
               regions: Sequence[str] = (), rows: int | None = None) -> list[Candidate]:
    """No overlap first, then the strategies worth trying for this function. `branches` puts
    independent stages on streams of their own: the `df.region` blocks named in `regions` where the
    function has any (prefill beside decode attention), else its compute and communication.
    `comm_ctas` adds 2 micro-batches with collectives on a communicator of that many thread blocks
    (multi-GPU only). With a batch of `rows` rows, only micro-batch counts up to it are tried (a
    bucket of 1 row keeps no overlap or branches)."""
    stages = T.partition(fn, rules=[T.Region(name) for name in regions]) if regions else fn
    found = [Candidate(NO_OVERLAP, fn), Candidate("branches", T.overlap(stages, strategy="branches"))]
    if in_axes is not None:
        for num in (2, 4) if rows is None else [n for n in (2, 4) if n <= rows]:
            split = T.microbatch(fn, num=num, in_axes=in_axes)
            for strategy in ("roundrobin", "tbo"):
                found.append(Candidate(f"microbatch{num}-{strategy}", T.overlap(split, strategy=strategy)))
                found += [Candidate(f"microbatch{num}-{strategy}-ctas{ctas}", T.overlap(split, strategy, comm_ctas=ctas))
                          for ctas in comm_ctas if num == 2]
    return found


def region_names(program: Program) -> list[str]:
    """The names of the `df.region` blocks a traced function ran, in the order they first appear."""
    return list(dict.fromkeys(scope.name for node in program.ops() for scope in info(node).scopes
                              if scope.kind == "region"))


def cache_path() -> str:
    root = os.environ.get("DYNAFLOW_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "dynaflow_fn"))
    return os.path.join(root, "autotune.json")


def check_in_axes(fn: Callable[..., Any], in_axes: Any, flat: Flat) -> Program:
    """Raise the micro-batching error now if `in_axes` cannot split these arguments at all; else the
    Program of `fn` in one micro-batch, which is `fn`'s own (tuning reads its regions from it).

    A candidate that fails to build is skipped, which is right for 4 micro-batches of a batch of 3,
    but an `in_axes` that does not fit the arguments is a mistake the caller must hear about, not a
    silent "no overlap". One micro-batch checks everything but the batch size."""
    return trace_flat(T.microbatch(fn, num=1, in_axes=in_axes), flat)


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


def choose(timings: dict[str, float]) -> str:
    """The fastest candidate, unless it does not beat no overlap by MARGIN: then no overlap."""
    best = min(timings, key=timings.get)
    baseline = timings.get(NO_OVERLAP)
    if baseline is None or timings[best] < baseline * (1 - MARGIN):
        return best
    return NO_OVERLAP


def measure(names: Sequence[str], build: Callable[[str], Callable[[], float]], progress: bool = True,
            rounds: int = 3, skipped: dict[str, str] | None = None) -> dict[str, float]:
    """Time every candidate side by side with the first (no overlap), holding at most two built.

    `build(name)` returns a function that times one round of that candidate. The first candidate stays
    built; every other one is built, timed in `rounds` rounds that alternate with the first, and
    dropped before the next one is built, so choosing needs the device memory of two plans rather
    than of all of them. Alternating puts a candidate and its reference under the same clocks and
    temperature, and each candidate's median is rescaled by how far the reference drifted in its
    window from the reference's median over the whole measurement, so candidates timed a minute
    apart still compare fairly. A candidate that does not apply (`DOES_NOT_APPLY`) or breaks an
    invariant (`BUGS`, outside strict mode) is skipped, and `skipped` records why.
    """
    reference_name, *others = names
    skipped = {} if skipped is None else skipped
    bar = progress_bar(total=len(names) + rounds * max(len(others), 1), desc="df.jit strategy=auto",
                       disable=not progress, leave=False)

    def attempt(name: str, action: Callable[[], Any]) -> Any:
        bar.set_postfix_str(name)
        try:
            return skipping(name, action, skipped)
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


def skipping(name: str, action: Callable[[], Any], skipped: dict[str, str]) -> Any:
    """action(), or None with the reason in `skipped` if the candidate `name` is to be skipped."""
    try:
        return action()
    except BUGS as error:
        if strict():
            raise
        skipped[name] = f"{_first_line(error)} (a bug in dynaflow_fn: please report it)"
    except DOES_NOT_APPLY as error:
        skipped[name] = _first_line(error)
    return None


def _call_text(fn: Callable[..., Any], flat: Flat) -> str:
    """`name(x: f32[3, 32])`: the function and the layouts of its tensor arguments that are not model
    state (parameters are many and do not change between signatures)."""
    names = tree.argument_names(fn, len(flat.args))
    shown = [f"{tree.path_to_str(path, names)}: {dtype_name(leaf.dtype)}{list(leaf.shape)}"
             for path, leaf in zip(flat.paths, flat.leaves) if isinstance(leaf, torch.Tensor) and not is_state(leaf)]
    return f"{getattr(fn, '__name__', 'fn')}({', '.join(shown)})"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _placement(flat: Flat) -> tuple[torch.device, int]:
    """The device of the first tensor argument (the CPU if none) and the number of ranks."""
    device = next((leaf.device for leaf in flat.leaves if isinstance(leaf, torch.Tensor)), torch.device("cpu"))
    return device, dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agree(choice: str) -> str:
    """On several ranks, rank 0's choice wins (every rank must build the same plan)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return choice
    message = [choice]
    dist.broadcast_object_list(message, src=0)
    return message[0]
