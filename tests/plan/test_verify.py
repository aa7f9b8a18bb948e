"""Property tests: random programs under random valid schedules are race-free and exact, and the
verifier catches every planted race."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn import testing as dft
from dynaflow_fn import transforms as T
from dynaflow_fn.plan.plan import StepKind
from fixtures import EachNode, RandomScheduler, build, plan_of, recipes, scheduled


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(), seed=st.integers(0, 2**16), streams=st.integers(1, 3), micro_batches=st.booleans())
def test_random_schedules_are_verified_and_exact(recipe, seed, streams, micro_batches):
    inputs, fn = build(recipe)
    args = [torch.randn(8, 8) for _ in range(inputs + 1)]
    random_step = scheduled(fn, RandomScheduler(seed, streams), inputs, micro_batches)
    plan_of(random_step, *args)
    dft.assert_equivalent(fn, random_step, *args, draws=1)    # bit for bit as the micro-batches one after another


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(), seed=st.integers(0, 2**16), choice=st.integers(0, 10**6))
def test_removing_any_event_wait_is_caught(recipe, seed, choice):
    inputs, fn = build(recipe)
    args = [torch.randn(8, 8) for _ in range(inputs + 1)]
    plan = plan_of(scheduled(fn, RandomScheduler(seed, 3, pace=False), inputs), *args)
    waits = [(step.index, event) for step in plan.steps for event in step.waits]
    if not waits:
        return
    index, event = waits[choice % len(waits)]
    broken = list(plan.steps)
    broken[index] = dataclasses.replace(broken[index], waits=tuple(e for e in broken[index].waits if e != event))
    with pytest.raises(df.VerificationError):
        df.verify(dataclasses.replace(plan, steps=tuple(broken)))


def test_verifier_names_the_unordered_steps():
    def two(x):
        return x.sin(), x.cos() + x.sin()

    step = T.overlap(T.partition(T.microbatch(two, num=2), rules=[EachNode()]), strategy="roundrobin")
    plan = plan_of(step, torch.randn(8, 4))
    target = next(s for s in plan.steps if s.waits and s.kind is not StepKind.JOIN)
    broken = [dataclasses.replace(s, waits=()) if s.index == target.index else s for s in plan.steps]
    with pytest.raises(df.VerificationError, match=rf"step {target.index} \(s{target.stream}"):
        df.verify(dataclasses.replace(plan, steps=tuple(broken)))

