"""Property tests: random programs under random valid schedules are race-free and exact, and the
verifier catches every planted race."""

import dataclasses
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn.lowering import memory
from dynaflow_fn import transforms as T
from dynaflow_fn.plan.plan import StepKind
from dynaflow_fn.ir.program import Stream

UNARY = {"tanh": torch.tanh, "relu": torch.relu, "neg": torch.neg, "exp_clip": lambda v: v.clamp(-3, 3).exp()}
BINARY = {"add": torch.add, "mul": torch.mul, "sub": torch.sub}


@st.composite
def recipes(draw):
    """A random DAG: each op reads one or two earlier values; a few values are returned."""
    inputs = draw(st.integers(1, 3))
    ops = []
    for i in range(draw(st.integers(2, 12))):
        available = inputs + i
        choice = draw(st.integers(0, 2))
        if choice == 0:
            ops.append((draw(st.sampled_from(sorted(UNARY))), draw(st.integers(0, available - 1)), None))
        elif choice == 1:
            ops.append(("matmul", draw(st.integers(0, available - 1)), None))
        else:
            ops.append((draw(st.sampled_from(sorted(BINARY))), draw(st.integers(0, available - 1)),
                        draw(st.integers(0, available - 1))))
    total = inputs + len(ops)
    outputs = sorted(set(draw(st.lists(st.integers(inputs, total - 1), min_size=1, max_size=3))))
    return inputs, ops, outputs


def build(recipe):
    """fn(w, *xs): the recipe's ops over xs; "matmul" multiplies by the shared weight w."""
    inputs, ops, outputs = recipe

    def program(w, *xs):
        values = list(xs)
        for name, a, b in ops:
            if name == "matmul":
                values.append(values[a] @ w)
            else:
                values.append(UNARY[name](values[a]) if b is None else BINARY[name](values[a], values[b]))
        return tuple(values[i] for i in outputs)

    return inputs, program


@dataclasses.dataclass(frozen=True)
class EachNode(T.Rule):
    """Every node its own stage: the finest schedules."""

    def match(self, node, node_info):
        return node.name


class RandomScheduler(df.Scheduler):
    """Any valid schedule: a random ready stage each time, on a random stream; with `pace`, sometimes
    paced after random earlier stages."""

    def __init__(self, seed, streams, pace=True):
        self.random, self.count, self.pace = random.Random(seed), streams, pace

    def streams(self, graph):
        return [Stream(i, f"s{i}") for i in range(self.count)]

    def pick(self, ready, graph, issued):
        return self.random.choice(ready), self.random.randrange(self.count)

    def schedule(self, graph):
        order = super().schedule(graph)
        if not self.pace:
            return order
        earlier = lambda position: [issue.stage for issue in order[:position]]
        return [T.Issue(issue.stage, issue.stream,
                        tuple(self.random.sample(earlier(i), min(i, self.random.randrange(3)))))
                for i, issue in enumerate(order)]


def _schedule(fn, strategy, micro_batches, inputs):
    step = T.microbatch(fn, num=2, in_axes=(None,) + (0,) * inputs) if micro_batches else fn
    return T.overlap(T.partition(step, rules=[EachNode()]), strategy=strategy)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(), seed=st.integers(0, 2**16), streams=st.integers(1, 3), micro_batches=st.booleans())
def test_random_schedules_are_verified_and_exact(recipe, seed, streams, micro_batches):
    inputs, fn = build(recipe)
    args = [torch.randn(8, 8) for _ in range(inputs + 1)]
    random_step = _schedule(fn, RandomScheduler(seed, streams), micro_batches, inputs)
    sequential_step = _schedule(fn, "sequential", micro_batches, inputs)
    plan = df.lower(df.trace(random_step, *args))
    df.verify(plan)
    got = df.jit(random_step)(*args)
    expected = df.jit(sequential_step)(*args)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    for a, b in zip(got, fn(*args)):
        torch.testing.assert_close(a, b, equal_nan=True)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=recipes(), seed=st.integers(0, 2**16), choice=st.integers(0, 10**6))
def test_removing_any_event_wait_is_caught(recipe, seed, choice):
    inputs, fn = build(recipe)
    args = [torch.randn(8, 8) for _ in range(inputs + 1)]
    plan = df.lower(df.trace(_schedule(fn, RandomScheduler(seed, 3, pace=False), True, inputs), *args))
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
    plan = df.lower(df.trace(step, torch.randn(8, 4)))
    target = next(s for s in plan.steps if s.waits and s.kind is not StepKind.JOIN)
    broken = [dataclasses.replace(s, waits=()) if s.index == target.index else s for s in plan.steps]
    with pytest.raises(df.VerificationError, match=rf"step {target.index} \(s{target.stream}"):
        df.verify(dataclasses.replace(plan, steps=tuple(broken)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20), st.integers(1, 5000)), min_size=1, max_size=25))
def test_arena_never_overlaps_buffers_that_are_live_together(intervals):
    """On one stream, buffer p may share bytes with q only if one's last use precedes the other's first."""
    spans = [(min(a, b), max(a, b), size) for a, b, size in intervals]
    release = np.array([[last + 1] for _, last, _ in spans])
    acquire = np.array([[first] for first, _, _ in spans])
    layout = memory.pack([size for _, _, size in spans], release, acquire)
    for i, (f1, l1, s1) in enumerate(spans):
        assert layout.offsets[i] % memory.ALIGNMENT == 0
        assert layout.offsets[i] + s1 <= layout.nbytes
        for j, (f2, l2, s2) in enumerate(spans[:i]):
            if f1 <= l2 and f2 <= l1:
                a, b = layout.offsets[i], layout.offsets[j]
                assert a + memory.align(s1) <= b or b + memory.align(s2) <= a
