"""`df.verify`: a static happens-before check of a Plan. No GPU needed.

The issue order of a Plan is a valid sequential program. Running it on several streams gives the same
result exactly when every pair of *conflicting* accesses (the same bytes, at least one a write) is
ordered by events and stream order in the same direction as the issue order. That single rule covers
reading a value before it is written, overwriting a buffer another stream may still be reading
(an arena reuse race), and two writers racing. On top of it the verifier checks the event protocol
(each event recorded once, before anyone waits on it) and fork/join: every side stream starts after
the capture stream's fork and ends before its join, as CUDA-graph capture requires.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from ..errors import InputError, VerificationError
from ..ir.program import Program
from .ordering import Clocks
from .plan import Plan, StepKind, StorageKind, format_plan_step


def verify(plan: Plan) -> Plan:
    """Check that `plan` is race-free: every two accesses of the same bytes, one a write, are ordered
    by stream order and events as in the issue order. Returns the plan if so; otherwise raises a
    VerificationError listing every unordered pair."""
    if not isinstance(plan, Plan):
        raise InputError(_not_a_plan(plan))
    problems = _check_events(plan) or []
    if not problems:
        clocks = Clocks(plan.steps, len(plan.streams))
        problems = _check_fork_join(plan, clocks) + _check_defined_before_use(plan) + _check_races(plan, clocks)
    if problems:
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise VerificationError(f"plan {plan.name} is not safe to run on {len(plan.streams)} streams:\n  {shown}{more}")
    return plan


def _not_a_plan(value: Any) -> str:
    what = f"df.verify takes a Plan, got {type(value).__qualname__}"
    if isinstance(value, Program):
        return f"{what}; lower it first: df.verify(df.lower(program))"
    if callable(value) and callable(getattr(value, "lower", None)):
        return f"{what}; check the plan it runs for given arguments: df.verify(fast.lower(*args))"
    if callable(value):
        return f"{what}; trace and lower the function first: df.verify(df.lower(df.trace(fn, *args)))"
    return f"{what}, as df.lower(program) or fast.lower(*args) build"


def _describe(plan: Plan, index: int) -> str:
    return f"step {index} ({format_plan_step(plan, plan.steps[index]).strip()})"


def _check_events(plan: Plan) -> list[str]:
    problems = []
    recorded: dict[int, int] = {}
    for step in plan.steps:
        if not 0 <= step.stream < len(plan.streams):
            problems.append(f"{_describe(plan, step.index)} runs on undeclared stream s{step.stream}")
        for event in step.waits:
            if event not in recorded:
                problems.append(f"{_describe(plan, step.index)} waits on event e{event} before anything records it")
        for event in step.records:
            if event in recorded:
                problems.append(f"event e{event} is recorded twice (steps {recorded[event]} and {step.index})")
            recorded[event] = step.index
    return problems


def _check_fork_join(plan: Plan, clocks: Clocks) -> list[str]:
    used = {step.stream for step in plan.steps}
    if used <= {0}:
        return []
    first, last = plan.steps[0], plan.steps[-1]
    if first.kind is not StepKind.FORK or first.stream != 0 or last.kind is not StepKind.JOIN or last.stream != 0:
        return ["a multi-stream plan must begin with a fork and end with a join on stream s0"]
    problems = []
    for step in plan.steps[1:-1]:
        if not clocks.before(first.index, step.index):
            problems.append(f"{_describe(plan, step.index)} is not ordered after the fork")
        if not clocks.before(step.index, last.index):
            problems.append(f"{_describe(plan, step.index)} is not joined back into stream s0 before the end")
    return problems


def _check_defined_before_use(plan: Plan) -> list[str]:
    """In issue order, every slot a step uses is bound or produced by an earlier step."""
    defined = {slot.index for slot in plan.slots if slot.bound}
    for step in plan.setup:
        defined.update(step.outputs)
    problems = []
    for step in plan.steps:
        for slot in step.reads():
            if slot not in defined:
                problems.append(f"{_describe(plan, step.index)} reads {plan.slots[slot].name} before any step makes it")
        defined.update(step.outputs)
    return problems


def _domain_of(plan: Plan, slot_index: int) -> tuple[tuple[str, int], int]:
    """(memory domain, byte offset of the slot's storage inside it): the arena is one shared domain."""
    slot = plan.slots[slot_index]
    storage = plan.storages[slot.storage]
    if storage.kind is StorageKind.ARENA:
        return ("arena", 0), storage.offset
    return (storage.kind.value, storage.index), 0


def _check_races(plan: Plan, clocks: Clocks) -> list[str]:
    accesses: dict[tuple[str, int], list[tuple[int, bool, int, int, int]]] = defaultdict(list)
    for step in plan.steps:
        if step.kind is StepKind.VIEW:
            continue
        for is_write, slots in ((False, step.reads()), (True, step.writes())):
            for slot_index in slots:
                domain, base = _domain_of(plan, slot_index)
                lo, hi = plan.slots[slot_index].byte_range()
                if hi > lo:
                    accesses[domain].append((step.index, is_write, base + lo, base + hi, slot_index))
    problems = []
    for domain, items in accesses.items():
        steps = np.array([a[0] for a in items])
        writes = np.array([a[1] for a in items])
        lo = np.array([a[2] for a in items])
        hi = np.array([a[3] for a in items])
        slots = np.array([a[4] for a in items])
        for k in np.nonzero(writes)[0]:
            conflict = (lo < hi[k]) & (lo[k] < hi) & (np.arange(len(items)) != k)
            same_step = conflict & (steps == steps[k]) & (slots != slots[k])
            for j in np.nonzero(same_step & ~writes)[0]:
                problems.append(f"{_describe(plan, int(steps[k]))} reads and writes overlapping bytes of "
                                f"{plan.slots[items[j][4]].name}")
            earlier = np.nonzero(conflict & (steps < steps[k]))[0]
            if len(earlier):
                ok = clocks.after_all(int(steps[k]), steps[earlier])
                for j in earlier[~ok]:
                    problems.append(_race(plan, items[j], items[k], domain))
            later = np.nonzero(conflict & (steps > steps[k]) & ~writes)[0]
            if len(later):
                ok = clocks.before_all(int(steps[k]), steps[later])
                for j in later[~ok]:
                    problems.append(_race(plan, items[k], items[j], domain))
    return problems


def _race(plan: Plan, first: tuple, second: tuple, domain: tuple[str, int]) -> str:
    verb = {True: "writes", False: "reads"}
    where = f"{domain[0]}[{max(first[2], second[2])}:{min(first[3], second[3])})"
    return (f"{_describe(plan, first[0])} {verb[first[1]]} {plan.slots[first[4]].name} and "
            f"{_describe(plan, second[0])} {verb[second[1]]} {plan.slots[second[4]].name} at {where}, "
            f"but no event orders them")
