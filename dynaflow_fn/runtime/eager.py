"""The eager runtime (the interpreter): interpret the Plan on every call, on any device.

On CUDA each plan stream is a real stream, so overlap happens; on the CPU steps run in issue order.
Outputs are allocated fresh on every call, so they alias nothing. Calls take turns (`Turns`): the
arena is shared by every call.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..plan.plan import Plan
from .interpreter import BoundPlan
from .turns import Turns


class EagerExecutable:
    """A Plan interpreted on every call, on whatever tensors the call passes."""

    def __init__(self, plan: Plan, device: torch.device):
        self.bound = BoundPlan(plan, device)
        self.streams = self.events = None
        if device.type == "cuda" and len(plan.streams) > 1:
            self.streams = [None] + [torch.cuda.Stream(device, priority=s.priority) for s in plan.streams[1:]]
            self.events = [torch.cuda.Event() for _ in range(plan.num_events)]
        self.turns = Turns(device)

    @torch.no_grad()
    def __call__(self, inputs: Sequence[torch.Tensor]) -> list[Any]:
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
