"""`df.lower`: Program -> Plan, as a sequence of named sub-passes over one PlanDraft.

Each sub-pass has a module of its own (see `SUB_PASSES`); the Plan's provenance ends with their names
in the order they ran.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping

import torch

from ..errors import InputError
from ..ir.program import Program
from ..plan.plan import Plan
from .bind import bind
from .donation import checked_donation
from .draft import PlanDraft
from .elide_copies import elide_copies
from .issue_order import issue_order
from .kernels import kernels
from .memory import place_buffers
from .outputs import outputs
from .reinplace import reinplace
from .sm_budget import sm_budget
from .synchronize import synchronize

SUB_PASSES: tuple[tuple[str, Callable[[PlanDraft], None]], ...] = (
    ("bind", bind),
    ("issue order", issue_order),
    ("reinplace", reinplace),
    ("kernels", kernels),
    ("outputs", outputs),
    ("elide copies", elide_copies),
    ("synchronize", synchronize),
    ("sm budget", sm_budget),
    ("place buffers", place_buffers),
)


def lower(program: Program, *, donate: Mapping[int, int] | None = None) -> Plan:
    """Build the static Plan of `program` (from `df.trace`, transformed or not).

    `donate` maps a flat output index to a flat tensor-input index whose storage receives that
    output in place (the caller donated the input); `df.jit(donate_argnums=...)` computes it.
    """
    if not isinstance(program, Program):
        raise InputError(_not_a_program(program))
    draft = PlanDraft(program, checked_donation(program, donate))
    for _, sub_pass in SUB_PASSES:
        sub_pass(draft)
    return _finished_plan(draft)


def provenance_line() -> str:
    """The provenance line lowering adds to a Plan: its sub-passes in order."""
    return "lower: " + " -> ".join(name for name, _ in SUB_PASSES)


def _finished_plan(draft: PlanDraft) -> Plan:
    program = draft.program
    return Plan(
        name=program.name,
        device=program.device,
        streams=program.streams,
        storages=draft.placed_storages,
        slots=tuple(draft.slots),
        setup=tuple(replace(step, index=i) for i, step in enumerate(draft.setup)),
        steps=tuple(draft.steps),
        num_events=draft.num_events,
        input_slots=tuple(draft.input_slots),
        output_slots=tuple(draft.output_slots),
        arena_nbytes=draft.arena_nbytes,
        inputs=program.inputs,
        in_tree=program.in_tree,
        outputs=program.outputs,
        out_tree=program.out_tree,
        constants={n.target: getattr(program.graph_module, n.target)
                   for n in program.graph.nodes if n.op == "get_attr"},
        provenance=program.provenance + (provenance_line(),),
        captured=program.captured,
    )


def _not_a_program(value: Any) -> str:
    what = f"df.lower takes a Program, got {type(value).__qualname__}"
    if isinstance(value, Plan):
        return f"{what}: it is lowered already (df.verify and the backends take it as it is)"
    if isinstance(value, torch.nn.Module):
        return (f"{what}; make it a pure function and trace it: fn, params = df.pure(model); "
                f"df.lower(df.trace(fn, params, *args))")
    if callable(value) and callable(getattr(value, "lower", None)):
        return f"{what}; a jitted function builds its own plan for given arguments: fast.lower(*args)"
    if callable(value):
        return f"{what}; trace the function first: df.lower(df.trace(fn, *args))"
    return f"{what}; trace a function to get one: df.lower(df.trace(fn, *args))"
