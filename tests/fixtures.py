"""Builders shared by the tests of several folders: random programs, fine partitions and random
schedules (dynaflow_fn.testing's, which users get too), the verified plan of a function, the flat
tensor inputs a Plan's executable takes, threads released at once, a training step, and the C++
checks built before any test runs."""

from __future__ import annotations

import threading
import warnings
from typing import Any, Callable

import optree
import torch
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn import native
from dynaflow_fn import transforms as T
from dynaflow_fn.plan.plan import Plan, Step, StepKind
from dynaflow_fn.testing.programs import EachNode, RandomScheduler, build, example_inputs
from dynaflow_fn.testing.strategies import recipes

__all__ = ["EachNode", "RandomScheduler", "build", "example_inputs", "flat_tensors", "native_checks_ready", "plan_of",
           "recipes", "run_together", "scheduled", "step_lists", "training_step"]


def scheduled(fn, strategy, inputs: int, micro_batches: bool = True):
    """fn split into two micro-batches (optionally), one stage per node, ordered by `strategy`."""
    step = T.microbatch(fn, num=2, in_axes=(None,) + (0,) * inputs) if micro_batches else fn
    return T.overlap(T.partition(step, rules=[EachNode()]), strategy=strategy)


def plan_of(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Plan:
    """fn traced on the arguments and lowered, without df.jit's passes: `df.lower(df.trace(fn, ...))`,
    checked by df.verify, so every plan a test reads is race-free."""
    return df.verify(df.lower(df.trace(fn, *args, **kwargs)))


def run_together(work: Callable[[int], None], threads: int) -> None:
    """work(0), ..., work(threads - 1), each on a thread of its own, released at once by a barrier so
    that their calls race; the first exception any of them raised is raised again in the caller."""
    start = threading.Barrier(threads)
    errors = []

    def body(index):
        start.wait()
        try:
            work(index)
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)

    running = [threading.Thread(target=body, args=(index,)) for index in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    if errors:
        raise errors[0]


def training_step(loss_fn: Callable[..., torch.Tensor], optimizer: Any) -> Callable[..., tuple]:
    """The training step users write: the loss of loss_fn(params, x, y) and its gradients, then
    `optimizer`'s update; `train_step(params, state, x, y) -> (params, state, loss)`."""
    def train_step(params, state, x, y):
        loss, grads = df.value_and_grad(loss_fn)(params, x, y)
        params, state = optimizer.update(grads, state, params)
        return params, state, loss
    return train_step


def flat_tensors(*args, **kwargs) -> list[torch.Tensor]:
    """The tensor leaves of (args, kwargs) in flatten order: what a Plan's executable takes."""
    return [leaf for leaf in optree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]


@st.composite
def step_lists(draw, max_steps: int = 14):
    """(steps, number of streams): random kernel steps on a few streams; each may record a fresh
    event and wait on events recorded before it."""
    num_streams = draw(st.integers(1, 4))
    steps, recorded = [], []
    for index in range(draw(st.integers(1, max_steps))):
        waits = tuple(sorted(set(draw(st.lists(st.sampled_from(recorded), max_size=2))))) if recorded else ()
        records = (len(recorded),) if draw(st.booleans()) else ()
        recorded += list(records)
        steps.append(Step(index, StepKind.KERNEL, draw(st.integers(0, num_streams - 1)), waits=waits, records=records))
    return steps, num_streams


def native_checks_ready() -> None:
    """Build or load df.jit's C++ checks now, outside any test: where they cannot be built, the warning
    that says so is given here, not inside the first test to make a guard (where a test that turns
    warnings into errors would fail on it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        native.module()
