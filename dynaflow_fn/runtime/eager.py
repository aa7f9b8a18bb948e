"""The eager runtime (the interpreter): interpret the Plan on every call, on any device.

On CUDA each plan stream is a real stream, so overlap happens; on the CPU steps run in issue order.
Outputs are allocated fresh on every call, so they alias nothing. Calls take turns (`Turns`): the
arena is shared by every call (and, with a `SharedPool`, by the calls of other plans too).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..plan.plan import Plan
from .interpreter import BoundPlan
from .shared_pool import SharedPool
from .turns import Turns


class EagerExecutable:
    """A Plan interpreted on every call, on whatever tensors the call passes; with `memory`, in the
    arena of a `SharedPool`, taking its turns (see `shared_pool`)."""

    def __init__(self, plan: Plan, device: torch.device, memory: SharedPool | None = None):
        self.bound = BoundPlan(plan, device, memory.buffer("arena", plan.arena_nbytes) if memory is not None else None)
        self.streams = self.events = None
        if device.type == "cuda" and len(plan.streams) > 1:
            self.streams = [None] + [torch.cuda.Stream(device, priority=s.priority) for s in plan.streams[1:]]
            self.events = [torch.cuda.Event() for _ in range(plan.num_events)]
        self.turns = memory.turns if memory is not None else Turns(device)

    @torch.no_grad()
    def __call__(self, inputs: Sequence[torch.Tensor]) -> Sequence[Any]:
        with self.turns:
            env = self.bound.new_env(inputs)
            self.bound.allocate_outputs(env)
            if self.streams is None:
                self.bound.run(env)
            else:
                streams = list(self.streams)
                streams[0] = torch.cuda.current_stream(self.bound.device)
                self.bound.run(env, streams, self.events)
            return self.bound.outputs(env)
