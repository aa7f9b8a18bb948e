"""plan/ordering.py: Clocks says step a is before step b exactly when a path of stream order and
event edges leads from a to b, checked against brute-force reachability."""

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynaflow_fn.plan.ordering import Clocks
from dynaflow_fn.plan.plan import Step, StepKind
from fixtures import RandomScheduler, build, example_inputs, plan_of, recipes, scheduled, step_lists


def _reachability(steps):
    """reach[a, b]: a path of edges (a stream's next step; an event's recorder to its waiters) leads a to b."""
    count = len(steps)
    reach = np.zeros((count, count), dtype=bool)
    recorder = {event: step.index for step in steps for event in step.records}
    for b, step in enumerate(steps):
        earlier_on_stream = [a for a in range(b) if steps[a].stream == step.stream]
        if earlier_on_stream:
            reach[earlier_on_stream[-1], b] = True
        for event in step.waits:
            reach[recorder[event], b] = True
    for k in range(count):
        reach |= reach[:, [k]] & reach[[k], :]
    return reach


def _assert_clocks_match(steps, num_streams):
    clocks = Clocks(steps, num_streams)
    reach = _reachability(steps)
    everything = np.arange(len(steps))
    for a in range(len(steps)):
        for b in range(len(steps)):
            assert clocks.before(a, b) == reach[a, b], (a, b)
        assert (clocks.before_all(a, everything) == reach[a]).all()
        assert (clocks.after_all(a, everything) == reach[:, a]).all()
    return clocks, reach


@settings(max_examples=150, deadline=None)
@given(plan=step_lists())
def test_before_is_exactly_reachability(plan):
    _assert_clocks_match(*plan)


@settings(max_examples=100, deadline=None)
@given(plan=step_lists(), data=st.data())
def test_release_and_acquire_decide_whether_one_set_precedes_another(plan, data):
    steps, num_streams = plan
    clocks, reach = _assert_clocks_match(steps, num_streams)
    indices = list(range(len(steps)))
    first = data.draw(st.lists(st.sampled_from(indices), min_size=1, max_size=4, unique=True))
    rest = [i for i in indices if i not in first]
    if not rest:
        return
    second = data.draw(st.lists(st.sampled_from(rest), min_size=1, max_size=4, unique=True))
    entirely_before = all(reach[p, q] for p in first for q in second)
    assert bool(np.all(clocks.release(first) <= clocks.acquire(second))) == entirely_before


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(max_ops=8), seed=st.integers(0, 2**16), streams=st.integers(2, 3))
def test_clocks_of_lowered_plans_match_their_events(recipe, seed, streams):
    inputs, fn = build(recipe)
    plan = plan_of(scheduled(fn, RandomScheduler(seed, streams), inputs), *example_inputs(inputs))
    _assert_clocks_match(list(plan.steps), len(plan.streams))


def test_one_stream_is_issue_order():
    steps = [Step(i, StepKind.KERNEL, 0) for i in range(5)]
    clocks = Clocks(steps, 1)
    for a in range(5):
        for b in range(5):
            assert clocks.before(a, b) == (a < b)


def test_two_streams_without_events_are_unordered():
    steps = [Step(i, StepKind.KERNEL, i % 2) for i in range(6)]
    clocks = Clocks(steps, 2)
    assert not clocks.before(0, 1) and not clocks.before(1, 2) and clocks.before(0, 2)
    assert torch.equal(torch.as_tensor(clocks.position), torch.tensor([1, 1, 2, 2, 3, 3]))
