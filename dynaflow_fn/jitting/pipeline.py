"""What `df.jit` runs to turn a function into a Plan for one call signature, as one list of stages:

    trace -> causal masks -> [inductor] -> lower -> [verify]

`Pipeline.run` is the one driver: it runs each stage that applies, times it as a phase of the cold
start (the progress bar and its split), and keeps every stage's result, each printable
(`print(fast.pipeline.run(params, x))`). Program -> Program stages are `Pass`es, which stamp the
Program's provenance; lowering carries the provenance on into the Plan, and verify adds its line.
`print(fast.pipeline)` lists the stages and when each applies.

The cold start: a first call traces the function, compiles its kernels (seconds with Inductor, less
when Inductor's on-disk caches hold them from an earlier process), lowers the Program to a Plan and
captures the CUDA graph. `ColdStart` times each phase, and a progress bar names the phase running
once the call has taken `SHOW_AFTER_S` (a small function's first call stays silent), ending with the
split:

    df.jit(LlamaLike), trace 2.1s, inductor 6.3s, lower 0.4s, capture 0.9s
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..errors import InternalError
from ..ir.program import Program
from ..ir.progress import progress_bar
from ..ir.tree import Flat
from ..lowering.lower import lower
from ..passes.causal import CausalKernelPass
from ..passes.inductor import InductorPass
from ..plan.plan import Plan
from ..plan.verify import verify
from ..tracing.tracer import trace_flat
from .inputs import TensorInputs, match_donations
from .options import INDUCTOR, JitOptions


SHOW_AFTER_S = 2.0


class ColdStart:
    """Seconds per phase of one first call (`seconds`), with a progress bar of the phases."""

    def __init__(self, name: str, show: bool):
        self.name = name
        self.seconds: dict[str, float] = {}
        self._started = time.perf_counter()
        self._bar = progress_bar(desc=f"df.jit({name})", delay=SHOW_AFTER_S, disable=not show, leave=True,
                                 bar_format="{desc}{postfix}")

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """Time one phase, named on the bar while it runs."""
        self._bar.set_postfix_str(f"{self._split()}{', ' if self.seconds else ''}{label}...", refresh=self._late())
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[label] = time.perf_counter() - start
            self._bar.update(1)

    def finish(self) -> None:
        """Show the split and close the bar."""
        self._bar.set_postfix_str(self._split(), refresh=False)
        self._bar.close()                              # prints the split only if the bar was shown

    def _late(self) -> bool:
        """Whether the call has run long enough to show the bar (tqdm's own delay covers updates only)."""
        return time.perf_counter() - self._started >= SHOW_AFTER_S

    def _split(self) -> str:
        return ", ".join(f"{label} {seconds:.1f}s" for label, seconds in self.seconds.items())


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
