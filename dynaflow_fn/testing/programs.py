"""Random programs and random valid schedules, the raw material of `check_scheduler`.

A *recipe* describes a small random DAG of tensor ops (`strategies.recipes` draws them with
hypothesis); `build` turns it into a function. `EachNode` makes every op its own stage, the finest
partition, so a scheduler sees as many stages and orders as there can be. `RandomScheduler` issues
any valid schedule, the adversary a race checker must survive. None of this needs hypothesis.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Sequence

import torch
from torch import fx

from ..ir.program import NodeInfo, Stream
from ..transforms.partitioning import Rule
from ..transforms.schedule import Issue, Scheduler, Stage, StageGraph

UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh, "relu": torch.relu, "neg": torch.neg, "exp_clip": lambda v: v.clamp(-3, 3).exp()}
BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add, "mul": torch.mul, "sub": torch.sub}

Recipe = tuple[int, Sequence[tuple[str, int, "int | None"]], Sequence[int]]
"""(number of inputs, ops as (name, first operand, second operand or None), indices of the returned values).
Values are numbered inputs first, then one per op; "matmul" multiplies its operand by the shared weight."""


def build(recipe: Recipe) -> tuple[int, Callable[..., tuple[torch.Tensor, ...]]]:
    """(number of batched inputs, fn(w, *xs)): the recipe's ops over xs, "matmul" by the shared weight w."""
    inputs, ops, outputs = recipe

    def program(w: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = list(xs)
        for name, a, b in ops:
            if name == "matmul":
                values.append(values[a] @ w)
            else:
                values.append(UNARY[name](values[a]) if b is None else BINARY[name](values[a], values[b]))
        return tuple(values[i] for i in outputs)

    return inputs, program


@dataclasses.dataclass(frozen=True)
class EachNode(Rule):
    """Every node its own stage: the finest partition, so schedules can differ the most."""

    def match(self, node: fx.Node, node_info: NodeInfo) -> str:
        return node.name


class RandomScheduler(Scheduler):
    """Any valid schedule: a random ready stage each time, on a random one of `streams` streams;
    with `pace`, each stage is also paced after up to two random earlier stages. The same seed gives
    the same schedule."""

    def __init__(self, seed: int, streams: int, pace: bool = True):
        self.seed, self.count, self.pace = seed, streams, pace

    def streams(self, graph: StageGraph) -> list[Stream]:
        return [Stream(i, f"s{i}") for i in range(self.count)]

    def pick(self, ready: list[Stage], graph: StageGraph, issued: list[Issue]) -> tuple[Stage, int]:
        return self.random.choice(ready), self.random.randrange(self.count)

    def schedule(self, graph: StageGraph) -> list[Issue]:
        self.random = random.Random(self.seed)
        order = super().schedule(graph)
        if not self.pace:
            return order
        earlier = lambda position: [issue.stage for issue in order[:position]]
        return [Issue(issue.stage, issue.stream, tuple(self.random.sample(earlier(i), min(i, self.random.randrange(3)))))
                for i, issue in enumerate(order)]

    def describe(self) -> str:
        return f"RandomScheduler(seed={self.seed}, streams={self.count}, pace={self.pace})"


def example_inputs(inputs: int, generator: torch.Generator | None = None, size: int = 8) -> list[torch.Tensor]:
    """The weight and `inputs` batched tensors a built recipe takes: all `size` x `size`."""
    return [torch.randn(size, size, generator=generator) for _ in range(inputs + 1)]
