"""What `df.jit` runs to turn a function into a Plan for one call signature, as one list of stages:

    trace -> causal masks -> [inductor] -> lower -> [verify]

`Pipeline.run` is the one driver: it runs each stage that applies, times it as a phase of the cold
start (the progress bar and its split), and keeps every stage's result, each printable
(`print(fast.pipeline.run(params, x))`). Program -> Program stages are `Pass`es, which stamp the
Program's provenance; lowering carries the provenance on into the Plan, and verify adds its line.
`print(fast.pipeline)` lists the stages and when each applies.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import InternalError
from ..ir.program import Program
from ..ir.tree import Flat
from ..lowering.lower import lower
from ..passes.causal import CausalKernelPass
from ..passes.inductor import InductorPass
from ..plan.plan import Plan
from ..plan.verify import verify
from ..tracing.tracer import trace_flat
from .cold_start import ColdStart
from .donation import match_donations
from .inputs import TensorInputs
from .options import INDUCTOR, JitOptions


@dataclass(frozen=True)
class Context:
    """What stages read besides the previous stage's result: the call and the options."""

    fn: Callable[..., Any]
    flat: Flat
    inputs: TensorInputs
    options: JitOptions


@dataclass(frozen=True)
class Stage:
    """One step of the pipeline: `run(previous result, context)`, where `applies` says it should."""

    name: str
    does: str
    run: Callable[[Any, Context], Any]
    applies: Callable[[Any, Context], bool] = lambda value, context: True
    when: str = ""


def _trace(_: None, context: Context) -> Program:
    return trace_flat(context.fn, context.flat)


def _causal_masks(program: Program, context: Context) -> Program:
    return CausalKernelPass().apply(program)


def _inductor(program: Program, context: Context) -> Program:
    return InductorPass(context.options.progress).apply(program)


def _lower(program: Program, context: Context) -> Plan:
    return lower(program, donate=match_donations(program, context.inputs))


def _verify(plan: Plan, context: Context) -> Plan:
    verify(plan)
    return dataclasses.replace(plan, provenance=plan.provenance + (f"verify({len(plan.streams)} streams)",))


STAGES = (
    Stage("trace", "the function as an aten Program, traced on fake tensors", _trace),
    Stage("causal masks", "attention under a constant causal mask runs with is_causal=True, as eager does",
          _causal_masks),
    Stage("inductor", "each stage's ops compiled into fused kernels by TorchInductor", _inductor,
          lambda program, context: context.options.kernels(program.device) == INDUCTOR,
          "the kernels are Inductor's (backend='inductor', or 'auto' on a CUDA device Triton serves)"),
    Stage("lower", "the Program as a Plan: steps on streams, events, preallocated buffers", _lower),
    Stage("verify", "a static happens-before proof that the Plan is race-free", _verify,
          lambda plan, context: len(plan.streams) > 1, "the plan runs on several streams"),
)


@dataclass(frozen=True)
class Built:
    """Every stage's result for one call, in order; the last is the Plan."""

    results: tuple[tuple[str, Any], ...]

    @property
    def program(self) -> Program:
        """The Program lowering took."""
        return next(value for _, value in reversed(self.results) if isinstance(value, Program))

    @property
    def plan(self) -> Plan:
        plan = self.results[-1][1]
        if not isinstance(plan, Plan):
            raise InternalError(f"the pipeline ended with {type(plan).__name__}, not a Plan")
        return plan

    def __str__(self) -> str:
        return "\n\n".join(f"=== {name}\n{value}" for name, value in self.results)


class Pipeline:
    """The stages of `df.jit(fn)` (see the module docstring)."""

    def __init__(self, fn: Callable[..., Any], options: JitOptions):
        self.fn = fn
        self.options = options
        self.stages = STAGES

    def run(self, *args: Any, **kwargs: Any) -> Built:
        """Every stage's result for a call with these arguments (nothing is run on the device)."""
        flat = Flat.of(args, kwargs)
        inputs = TensorInputs.of(self.fn, flat, self.options.donate_argnums, self.options.persistent_argnums)
        return self.build(self.fn, flat, inputs)

    def build(self, fn: Callable[..., Any], flat: Flat, inputs: TensorInputs, cold_start: ColdStart | None = None,
              until: str | None = None) -> Built:
        """Run the stages that apply for `fn` (the jitted function, or a candidate strategy of it) on a
        call, each timed as a phase of `cold_start`; stop after stage `until` if given."""
        context = Context(fn, flat, inputs, self.options)
        cold_start = cold_start or ColdStart(getattr(fn, "__name__", "fn"), show=False)
        value: Any = None
        results = []
        for stage in self.stages:
            if stage.applies(value, context):
                with cold_start.phase(stage.name):
                    value = stage.run(value, context)
                results.append((stage.name, value))
            if stage.name == until:
                break
        return Built(tuple(results))

    def __str__(self) -> str:
        shown = " -> ".join(stage.name if not stage.when else f"[{stage.name}]" for stage in self.stages)
        lines = [f"df.jit({getattr(self.fn, '__name__', 'fn')}): {shown}"]
        lines += [f"  {stage.name}: {stage.does}" + (f"; when {stage.when}" if stage.when else "")
                  for stage in self.stages]
        return "\n".join(lines)
