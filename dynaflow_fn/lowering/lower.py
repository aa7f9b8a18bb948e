"""`df.lower`: Program -> Plan, as a sequence of named sub-passes over one PlanDraft.

Each sub-pass has a module of its own (see `SUB_PASSES`) and declares the draft fields it reads and
writes (`sub_pass`); before running them, `lower` checks that every field is written before a
sub-pass reads it. The Plan's provenance ends with the names of the sub-passes that changed
something, in the order they ran.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

import torch

from ..errors import InputError, InternalError
from ..ir.program import Program
from ..plan.plan import Plan
from .bind import bind
from .donate_check import checked_donation
from .draft import PlanDraft
from .elide_copies import elide_copies
from .emit_steps import emit_steps
from .issue_order import issue_order
from .memory import place_buffers
from .outputs import outputs
from .reinplace import reinplace
from .sm_budget import sm_budget
from .sub_pass import SubPass, unwritten_reads
from .synchronize import synchronize

SUB_PASSES: tuple[SubPass, ...] = (
    bind, issue_order, reinplace, emit_steps, outputs, elide_copies, synchronize, sm_budget, place_buffers,
)

PLAN_READS = ("program", "placed_storages", "placed_slots", "setup", "steps", "num_events", "input_slots",
              "output_slots", "arena_nbytes")
"""The draft fields the finished Plan is made of."""


def lower(program: Program, *, donate: Mapping[int, int] | None = None) -> Plan:
    """Build the static Plan of `program` (from `df.trace`, transformed or not).

    `donate` maps a flat output index to a flat tensor-input index whose storage receives that
    output (the caller donated the input); `df.jit(donate_argnums=...)` computes it.
    """
    if not isinstance(program, Program):
        raise InputError(_not_a_program(program))
    check_order(SUB_PASSES)
    draft = PlanDraft(program, checked_donation(program, donate))
    changed = [sub_pass.name for sub_pass in SUB_PASSES if sub_pass(draft)]
    return _finished_plan(draft, changed)


def check_order(sub_passes: Sequence[SubPass]) -> None:
    """Refuse sub-passes in an order where one reads a draft field before any earlier one writes it."""
    missing = unwritten_reads(sub_passes, PLAN_READS)
    if missing:
        reader, name = missing[0]
        raise InternalError(f"lowering sub-pass {reader!r} reads the draft's {name!r}, which no sub-pass before it "
                            f"writes (order: {', '.join(s.name for s in sub_passes)})")


def provenance_line(changed: Sequence[str]) -> str:
    """The provenance line lowering adds to a Plan: the sub-passes that changed it, in order."""
    return "lower: " + " -> ".join(changed)


def _finished_plan(draft: PlanDraft, changed: Sequence[str]) -> Plan:
    program = draft.program
    return Plan(
        signature=program.signature,
        streams=program.streams,
        storages=draft.placed_storages,
        slots=draft.placed_slots,
        setup=tuple(replace(step, index=i) for i, step in enumerate(draft.setup)),
        steps=tuple(draft.steps),
        num_events=draft.num_events,
        input_slots=tuple(draft.input_slots),
        output_slots=tuple(draft.output_slots),
        arena_nbytes=draft.arena_nbytes,
        constants={n.target: getattr(program.graph_module, n.target)
                   for n in program.graph.nodes if n.op == "get_attr"},
        provenance=program.provenance + (provenance_line(changed),),
    )


def _not_a_program(value: Any) -> str:
    what = f"df.lower takes a Program, got {type(value).__qualname__}"
    if isinstance(value, Plan):
        return f"{what}: it is lowered already (df.verify and the runtimes take it as it is)"
    if isinstance(value, torch.nn.Module):
        return (f"{what}; make it a pure function and trace it: fn, params = df.pure(model); "
                f"df.lower(df.trace(fn, params, *args))")
    if callable(value) and callable(getattr(value, "lower", None)):
        return f"{what}; a jitted function builds its own plan for given arguments: fast.lower(*args)"
    if callable(value):
        return f"{what}; trace the function first: df.lower(df.trace(fn, *args))"
    return f"{what}; trace a function to get one: df.lower(df.trace(fn, *args))"
