"""What `df.jit` runs to turn a function into a Plan for one input signature:

    trace -> causal masks -> [Inductor's stages, with backend="inductor"] -> lower -> verify

Every step between trace and lower is a `Pass`, so the Program's provenance, which the Plan carries
on, names each step that ran and what it did.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ..ir.program import Program
from ..lowering.lower import lower
from ..passes.causal import CausalKernelPass
from ..passes.inductor import InductorPass
from ..plan.plan import Plan
from ..plan.verify import verify
from ..tracing.tracer import trace
from ..transforms.base import Pass


def rewrites() -> list[Pass]:
    """The passes that choose the kernels a Program runs; `Jitted.trace` shows the Program after them."""
    return [CausalKernelPass()]


def passes(backend: str, progress: bool = True) -> list[Pass]:
    """The passes between trace and lower, in the order they run; new ones for every plan, since
    each pass describes what it did to its Program."""
    if backend == "inductor":
        return rewrites() + [InductorPass(progress)]
    return rewrites()


def transformed(fn: Callable[..., Any], args: tuple, kwargs: dict, steps: Sequence[Pass]) -> Program:
    """`fn` traced for these arguments, then rewritten by each pass in turn."""
    program = trace(fn, *args, **kwargs)
    for step in steps:
        program = step.apply(program)
    return program


def lowered(program: Program, donate: dict[int, int]) -> Plan:
    """The Plan of a Program, proved race-free when it runs on several streams."""
    plan = lower(program, donate=donate)
    if len(plan.streams) > 1:
        verify(plan)
    return plan
