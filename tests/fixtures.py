"""Builders shared by the tests that mirror the package: random programs, fine partitions, random
schedules, and the flat tensor inputs a Plan's executable takes."""

from __future__ import annotations

import dataclasses
import random

import optree
import torch
from hypothesis import strategies as st

import dynaflow_fn as df
from dynaflow_fn import transforms as T
from dynaflow_fn.ir.program import Stream
from dynaflow_fn.plan.plan import Step, StepKind

UNARY = {"tanh": torch.tanh, "relu": torch.relu, "neg": torch.neg, "exp_clip": lambda v: v.clamp(-3, 3).exp()}
BINARY = {"add": torch.add, "mul": torch.mul, "sub": torch.sub}


@st.composite
def recipes(draw, max_ops: int = 12):
    """A random DAG: (number of inputs, ops, returned value indices). Each op reads one or two
    earlier values; "matmul" multiplies by a shared weight."""
    inputs = draw(st.integers(1, 3))
    ops = []
    for i in range(draw(st.integers(2, max_ops))):
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
    """(number of x inputs, fn(w, *xs)) computing the recipe's ops."""
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


def recipe_args(inputs: int, size: int = 8) -> list[torch.Tensor]:
    """Fresh random arguments (w, *xs) for a recipe's function."""
    return [torch.randn(size, size) for _ in range(inputs + 1)]


@dataclasses.dataclass(frozen=True)
class EachNode(T.Rule):
    """Every node its own stage: the finest schedules."""

    def match(self, node, node_info):
        return node.name


class RandomScheduler(df.Scheduler):
    """Any valid schedule: a random ready stage each time, on a random stream."""

    def __init__(self, seed: int, streams: int):
        self.random, self.count = random.Random(seed), streams

    def streams(self, graph):
        return [Stream(i, f"s{i}") for i in range(self.count)]

    def pick(self, ready, graph, issued):
        return self.random.choice(ready), self.random.randrange(self.count)


def scheduled(fn, strategy, inputs: int, micro_batches: bool = True):
    """fn split into two micro-batches (optionally), one stage per node, ordered by `strategy`."""
    step = T.microbatch(fn, num=2, in_axes=(None,) + (0,) * inputs) if micro_batches else fn
    return T.overlap(T.partition(step, rules=[EachNode()]), strategy=strategy)


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
