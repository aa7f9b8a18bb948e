"""`check_scheduler`: a user Scheduler, run over random programs, makes valid, race-free, exact,
deterministic plans."""

from __future__ import annotations

from typing import Any, Callable, Union

import torch

from ..errors import EquivalenceError, ScheduleError
from ..ir.program import Program, info
from ..jitting.jitted import jit
from ..lowering.lower import lower
from ..plan.verify import verify
from ..tracing.tracer import trace
from ..transforms.microbatching import microbatch
from ..transforms.overlapping import overlap
from ..transforms.partitioning import partition
from ..transforms.schedule import Scheduler
from .compare import first_difference
from .equivalence import aten_kernels_for
from .programs import EachNode, Recipe, build, example_inputs
from .requirements import require_hypothesis

SchedulerSource = Union[Scheduler, Callable[[], Scheduler]]


def check_scheduler(scheduler: SchedulerSource, max_examples: int = 25, micro_batches: tuple[int, ...] = (1, 2, 3),
                    seed: int | None = 0, shrink: bool = False, device: "torch.device | str" = "cpu") -> None:
    """Run `scheduler` over random programs (hypothesis `strategies.recipes`, every op its own stage,
    split into each count of `micro_batches`) and check, for every program:

      - the schedule is valid (each stage once, after what it reads, on a declared stream: else the
        ScheduleError that `T.overlap` raises, with the program);
      - the plan passes `df.verify` (every cross-stream access ordered by events);
      - `df.jit` of it equals the sequential schedule bit for bit;
      - planning is deterministic: planning the program again (with a new scheduler from
        `scheduler` when it is a class or factory, else with the same one) gives the same stream,
        position and pacing for every node, as every rank of a distributed job must build.

    A failure is an AssertionError (or the scheduler's own error) that shows the failing program as
    code. `seed` fixes hypothesis's draws (None: new draws each run). With `shrink`, hypothesis first
    reduces a failing program to a minimal one, which plans it hundreds of times more (minutes).
    `device` is where the programs run: on a CUDA device each plan is one CUDA graph of eager
    PyTorch's kernels, its streams real CUDA streams. Needs hypothesis.
    """
    hypothesis = require_hypothesis()
    from .strategies import recipes

    make = scheduler if not isinstance(scheduler, Scheduler) else (lambda: scheduler)
    st = hypothesis.strategies

    phases = [phase for phase in hypothesis.Phase if shrink or phase is not hypothesis.Phase.shrink]

    @hypothesis.settings(max_examples=max_examples, deadline=None, database=None, phases=phases,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(recipe=recipes(), num=st.sampled_from(micro_batches), values=st.integers(0, 2**16))
    def run(recipe: Recipe, num: int, values: int) -> None:
        _check_one(make, recipe, num, values, torch.device(device))

    if seed is not None:
        run = hypothesis.seed(seed)(run)
    run()


def _check_one(make: Callable[[], Scheduler], recipe: Recipe, num: int, values: int, device: torch.device) -> None:
    inputs, fn = build(recipe)
    args = [a.to(device) for a in example_inputs(inputs, torch.Generator().manual_seed(values), size=max(8, num))]
    try:
        program = trace(_scheduled(fn, make(), num, inputs), *args)
    except ScheduleError as error:
        unscheduled = trace(_scheduled(fn, None, num, inputs), *args)
        raise ScheduleError(f"{error}\nthe program, micro-batched {num} ways:\n{unscheduled}") from error
    context = f"\nthe program, micro-batched {num} ways (inputs seeded {values}):\n{program}"
    verify(lower(program))
    again = trace(_scheduled(fn, make(), num, inputs), *args)
    difference = _first_placement_difference(program, again)
    if difference is not None:
        raise EquivalenceError(f"{program.provenance[-1]} is not deterministic: planning the same program twice "
                               f"placed {difference}. Every rank of a job must build the same plan: derive every "
                               f"choice from the StageGraph (seed any randomness, iterate sorted){context}")
    kernels = aten_kernels_for(tuple(args), {})
    got = jit(_scheduled(fn, make(), num, inputs), backend=kernels)(*args)
    expected = jit(_scheduled(fn, "sequential", num, inputs), backend=kernels)(*args)
    problem = first_difference(got, expected, exact=True)
    if problem is not None:
        raise EquivalenceError(f"the scheduled plan differs from the sequential one: {problem}{context}")


def _scheduled(fn: Callable[..., Any], strategy: "Scheduler | str | None", num: int, inputs: int) -> Any:
    """fn split `num` ways, every node its own stage, ordered by `strategy` (None: left unscheduled)."""
    step = microbatch(fn, num=num, in_axes=(None,) + (0,) * inputs) if num > 1 else fn
    step = partition(step, rules=[EachNode()])
    return overlap(step, strategy=strategy) if strategy is not None else step


def _first_placement_difference(first: Program, second: Program) -> str | None:
    """Where two schedules of one program first differ: the node and its (stream, position, pacing) in each."""
    if first.streams != second.streams:
        return f"declared streams {list(first.streams)} the first time and {list(second.streams)} the second"
    for a, b in zip(first.ops(), second.ops()):
        placed = lambda node: (info(node).stream, info(node).order, info(node).after)
        if placed(a) != placed(b):
            return (f"node {a.name} at (stream, position, after) {placed(a)} the first time and "
                    f"{placed(b)} the second")
    return None
