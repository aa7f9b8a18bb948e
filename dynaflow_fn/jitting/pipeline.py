"""What `df.jit` runs to turn a function into a Plan for one input signature:

    trace -> causal masks -> [Inductor's stages, where the kernels are Inductor's] -> lower -> verify

Every step between trace and lower is a `Pass`, so the Program's provenance, which the Plan carries
on, names each step that ran and what it did. Which kernels a plan runs is `kernels`: by default
Inductor's on a CUDA device Triton supports (fused, and what torch.compile runs), aten's elsewhere.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable

import torch

from ..ir.program import Program
from ..lowering.lower import lower
from ..passes.causal import CausalKernelPass
from ..passes.inductor import InductorPass
from ..plan.plan import Plan
from ..plan.verify import verify
from ..tracing.tracer import trace

INDUCTOR, ATEN = "inductor", "aten"


def kernels(backend: str, device: torch.device) -> str:
    """The kernels a plan on `device` runs under `backend`: "inductor" or "aten".

    backend="auto" takes Inductor's where Inductor generates Triton kernels (a CUDA device of compute
    capability 7.0 or later, with Triton installed): they fuse the elementwise work between matmuls
    that aten runs as one kernel per op, and are what torch.compile runs. On the CPU Inductor would
    compile C++ for minutes where aten kernels are already fast, so "auto" keeps aten there."""
    if backend == "inductor":
        return INDUCTOR
    if backend == "auto" and triton_available(device):
        return INDUCTOR
    return ATEN


def triton_available(device: torch.device) -> bool:
    """Whether Inductor can generate Triton kernels for this device."""
    return (device.type == "cuda" and importlib.util.find_spec("triton") is not None
            and torch.cuda.get_device_capability(device)[0] >= 7)


def traced(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Program:
    """`fn` traced for these arguments, with the rewrites that choose its kernels (causal masks); what
    `Jitted.trace` shows."""
    return CausalKernelPass().apply(trace(fn, *args, **kwargs))


def compiled(program: Program, kernels_of_plan: str, progress: bool = True) -> Program:
    """The Program with Inductor's kernels for its stages when `kernels_of_plan` is "inductor"."""
    if kernels_of_plan == INDUCTOR:
        return InductorPass(progress).apply(program)
    return program


def lowered(program: Program, donate: dict[int, int]) -> Plan:
    """The Plan of a Program, proved race-free when it runs on several streams."""
    plan = lower(program, donate=donate)
    if len(plan.streams) > 1:
        verify(plan)
    return plan
