"""Refusing a function that reseeds torch's global random generator while it is traced.

A Plan replays the aten ops a trace recorded. `torch.manual_seed(s)` (or `torch.set_rng_state`,
`torch.cuda.manual_seed`) is no aten op: inside the function it runs once, at trace time, and every
later call draws from wherever the generator stands, so a function that seeds itself returns the
same values as eager PyTorch on its first call and different ones after. Tracing draws nothing from
the real generators (random ops run on fake tensors), so a generator whose seed or state changed
while the function was traced was set by the function: the trace is refused and the generator put
back as it was.

A generator of the function's own (`torch.rand(..., generator=g)` with `g` closed over) would reach
the graph as a constant whose state no plan replays, so it is refused too, at the op, before make_fx
records it (`compat.refusing_generator_arguments`).

The state is compared only while no other Python thread runs (tqdm's monitor aside), since another
thread may draw random numbers meanwhile; the seed, which only seeding changes, is compared always.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

from .. import compat
from ..errors import TraceError
from ..ir.tree import OWN_GENERATOR_ADVICE


def _generators() -> list[torch.Generator]:
    """The CPU generator and, where CUDA is initialized already, each device's (never initializes it)."""
    generators = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        generators += list(torch.cuda.default_generators)
    return generators


def _other_threads() -> list[threading.Thread]:
    """Python threads besides this one that may draw random numbers (tqdm's monitor, which the cold
    start's progress bar starts, never does)."""
    current = threading.current_thread()
    return [t for t in threading.enumerate() if t is not current and not type(t).__module__.startswith("tqdm")]


@contextlib.contextmanager
def refusing_reseeds(fn_name: str) -> Iterator[None]:
    """Run a trace; raise a TraceError if the traced function reseeded a global generator."""
    generators = _generators()
    seeds = [g.initial_seed() for g in generators]
    states = [g.get_state() for g in generators]
    alone = not _other_threads()
    yield
    changed = [g for g, seed, state in zip(generators, seeds, states)
               if g.initial_seed() != seed or (alone and not torch.equal(g.get_state(), state))]
    if not changed:
        return
    for g, state in zip(generators, states):
        g.set_state(state)
    raise TraceError(
        f"{fn_name} sets torch's global random generator while being traced (torch.manual_seed, "
        f"torch.set_rng_state, ...) on {', '.join(str(g.device) for g in changed)}. A jitted function "
        f"replays only tensor ops, so the seeding would happen on the first call alone and later calls "
        f"would draw different numbers than eager PyTorch. Seed before calling the jitted function instead.")


def refusing_own_generators(fn_name: str) -> contextlib.AbstractContextManager:
    """Enter inside make_fx's trace: refuse an op that draws from a generator other than the global one."""
    return compat.refusing_generator_arguments(lambda op: TraceError(
        f"{fn_name} draws random numbers from a torch.Generator of its own ({op} with generator=...). "
        f"{OWN_GENERATOR_ADVICE}"))
