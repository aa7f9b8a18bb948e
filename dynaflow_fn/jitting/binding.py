"""A Plan bound to the calls it serves: which leaves of a call are its tensor inputs, which of those
are resident, which it writes, and how its outputs go back into the function's return structure.

The plan's tensor inputs are the call's tensor leaves (flat, in order) and then the tensors the
function closes over. A CUDA graph reads a *resident* input at its own address instead of copying it
in: model state (`state.is_state`), donated and persistent arguments, closed-over tensors, and
arguments the function updates in place. An input updated in place is state that outlives the
call (a KV cache, running statistics, an optimizer's moments, passed as a plain tensor): copying it
in and writing it back on every call would cost two copies of it, and eager semantics are that the
update lands in the caller's tensor. One that is a new tensor on every call is copied in after its
second move (see `replayer`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..ir.tree import TensorSpec, picker
from ..plan.plan import Plan
from ..tracing.gradients import GradientFlow
from .inputs import TensorInputs
from .object_watch import ObjectWatch
from .state import is_state


class Binding:
    """A plan, the module modes it was traced in, and its input map (see the module docstring)."""

    def __init__(self, plan: Plan, module_modes: Sequence[tuple[torch.nn.Module, bool]], inputs: TensorInputs,
                 fn_name: str, watch: ObjectWatch | None = None, gradient_flow: GradientFlow | None = None):
        self.plan = plan
        self.fn_name = fn_name
        self.module_modes = tuple(module_modes)
        self.watch = watch or ObjectWatch(())          # the hooks, submodules and attributes it was traced under
        self.positions = inputs.positions
        self.pick_tensors = picker(inputs.positions)
        self.closed_over = [c.tensor for c in plan.closed_over]
        self.closed_over_specs = [TensorSpec.of(t) for t in self.closed_over]
        arguments = len(inputs.positions)
        self.written = plan.written_inputs()
        self.declared_resident = (inputs.donated | inputs.persistent | set(self.written)
                                  | set(range(arguments, arguments + len(self.closed_over))))
        self.names = list(inputs.names) + [c.name for c in plan.closed_over]
        returned_inputs = set(plan.input_slots)
        known = gradient_flow is not None and len(gradient_flow.outputs) == len(plan.output_slots)
        depends = gradient_flow.outputs if known else [tuple(range(len(self.names)))] * len(plan.output_slots)
        self.differentiable = [(i, depends[i]) for i, slot in enumerate(plan.output_slots)
                               if slot not in returned_inputs and depends[i]]   # output, the inputs it comes from
        self.updated_under_grad = gradient_flow.updated if gradient_flow is not None else ()
        self.build_outputs = plan.signature.output_builder()   # the call's return value from the flat outputs

    def stale(self) -> bool:
        """Whether a closed-over tensor has changed layout, or a hook it was traced with is gone: this
        plan can never run again."""
        return (any(TensorSpec.of(t) != spec for t, spec in zip(self.closed_over, self.closed_over_specs))
                or self.watch.dead())

    def resident(self, tensors: Sequence[torch.Tensor], copied_anyway: set[int] = frozenset()) -> list[bool]:
        """Per input, whether a CUDA graph reads it at its own address: declared resident or model state,
        on the plan's device, and not among the inputs that keep moving (`copied_anyway`)."""
        device = self.plan.device
        return [(i in self.declared_resident or is_state(t)) and t.device == device and i not in copied_anyway
                for i, t in enumerate(tensors)]
