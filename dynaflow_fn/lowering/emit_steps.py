"""Emit steps: one step per node, in issue order, choosing how each runs.

* a view op becomes a VIEW step: no kernel, no memory;
* an op with a faithful `out=` overload becomes a KERNEL step writing into a planned arena buffer;
* an op without one becomes an ALLOC step, and the Plan says why;
* work that depends on no input (masks, position ids, rotary tables) moves to `setup`, computed once;
* the `copy_` that functionalization leaves for a mutated input becomes a COPY step (a write-back),
  unless the updates it copies back ran inplace, leaving the value where it goes already;
* a call that updates input arguments in place (an Inductor run holding a write-back) writes their
  slots and allocates its other results;
* a node that reinplace chose runs as its inplace variant, writing the arguments it mutates.

Which tensors share memory comes from the fake tensors of the trace: two values with the same fake
storage alias.
"""

from __future__ import annotations

import operator
from typing import Any

import optree
import torch
from torch import fx

from ..errors import InternalError, TransformError
from ..ir import ops
from ..ir.analyses import is_write_back, setup_nodes
from ..ir.formatting import op_name
from ..ir.program import info
from ..plan.plan import Layout, Ref, Step, StepKind, StorageKind
from .draft import PlanDraft, flat_values, new_step, storage_key
from .out_kernels import out_call_is_faithful
from .reinplace import mutated_arguments
from .sub_pass import sub_pass


@sub_pass("emit steps", reads=("program", "issue_order", "inplace", "slot_of", "storage_of_key", "slots", "storages"),
          writes=("setup", "steps", "slot_of", "storage_of_key", "slots", "storages"))
def emit_steps(draft: PlanDraft) -> bool:
    setup = setup_nodes(draft.program)
    for node in draft.issue_order:
        if node.target is operator.getitem:
            _forward_getitem(draft, node)
            continue
        if is_write_back(node) and _writes_back_in_place(draft, node):
            continue
        at_setup = node in setup
        step = _step_for(draft, node, at_setup)
        (draft.setup if at_setup else draft.steps).append(step)
    return bool(draft.setup or draft.steps)


def _writes_back_in_place(draft: PlanDraft, node: fx.Node) -> bool:
    """Whether the write-back `node` would copy its input onto itself: the updates it copies back ran
    inplace (reinplace), so the new value is already where it goes. No step then."""
    dst, src = (draft.slot_of.get((arg, 0)) for arg in node.args[:2])
    if dst is None or src != dst:
        return False
    draft.slot_of[(node, 0)] = dst
    return True


def _forward_getitem(draft: PlanDraft, node: fx.Node) -> None:
    """A getitem of a multi-result op is no step: its results are slots of the parent's."""
    parent, index = node.args
    start, count = _leaf_offset(parent.meta["val"], index)
    for k in range(count):
        if (parent, start + k) in draft.slot_of:
            draft.slot_of[(node, k)] = draft.slot_of[(parent, start + k)]


def _leaf_offset(values: Any, index: int) -> tuple[int, int]:
    """Where the `index`-th element of a (nested) result sits among its flat leaves: (start, count)."""
    count = lambda v: len(optree.tree_leaves(v, none_is_leaf=True))
    return sum(count(v) for v in values[:index]), count(values[index])


def _step_for(draft: PlanDraft, node: fx.Node, at_setup: bool) -> Step:
    op = node.target
    stream = info(node).stream or 0
    args, kwargs = draft.ref(tuple(node.args)), draft.ref(dict(node.kwargs))
    if op is torch.ops.aten.copy_.default and draft.storage_kind(node.args[0]) is StorageKind.INPUT:
        dst = draft.slot_of[(node.args[0], 0)]
        draft.slot_of[(node, 0)] = dst
        return new_step(StepKind.COPY, stream, op, (Ref(dst), args[1]), {}, (dst,), node=node.name,
                        note="input mutation write-back")
    if ops.is_mutating(op):
        raise TransformError(f"{node.name} = {op_name(op)}(...) writes {node.args[0]} in place, which is no program "
                             f"input; lowering takes functional programs, whose only writes are the copy_ into an "
                             f"input that tracing leaves for an input mutation. A pass that rewrote the program made "
                             f"this node: have it emit the functional op instead")
    if node in draft.inplace and not at_setup:
        return _inplace_step(draft, node, stream, args, kwargs)
    if ops.is_collective_wait(op):
        return _wait_step(draft, node, stream, args)
    if getattr(op, "updated_arguments", None):
        return _updating_call_step(draft, node, stream, args, kwargs, op.updated_arguments)
    return _computed_step(draft, node, at_setup, stream, args, kwargs)


def _computed_step(draft: PlanDraft, node: fx.Node, at_setup: bool, stream: int, args: tuple, kwargs: dict) -> Step:
    """A VIEW when every result aliases known memory, else a KERNEL into the arena if its out= overload
    fits, else an ALLOC (a CONSTANT computed once, when it is setup work)."""
    op, values = node.target, flat_values(node)
    tensors = [(i, v) for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    fresh = [(i, v) for i, v in tensors if storage_key(v) not in draft.storage_of_key]
    if fresh and ops.is_view(op):
        _alias_to_base(draft, node, fresh)
        fresh = []
    if fresh and len(fresh) < len(tensors):
        raise InternalError(_aliased_result(draft, node, tensors, fresh))
    result_indices = tuple(i for i, _ in tensors) if isinstance(node.meta.get("val"), (list, tuple)) else ()
    if not fresh:
        outputs = tuple(draft.slot_for_value(node, i, v, False) for i, v in tensors)
        return new_step(StepKind.VIEW, stream, op, args, kwargs, outputs, node=node.name,
                        result_indices=result_indices)
    variant = None if at_setup else ops.out_variant(op)
    if (variant is not None and variant.direct and len(fresh) == len(values)
            and all(_is_whole_storage(v) for _, v in fresh) and out_call_is_faithful(node, variant)):
        outputs = tuple(draft.slot_for_value(node, i, v, True, StorageKind.ARENA) for i, v in tensors)
        pos, kw = variant.call_arguments(ops.bind_arguments(op, args, kwargs))
        return new_step(StepKind.KERNEL, stream, variant.op, tuple(pos), kw, outputs, out_names=variant.out_names,
                        node=node.name)
    kind = StorageKind.CONSTANT if at_setup else StorageKind.DYNAMIC
    outputs = tuple(draft.slot_for_value(node, i, v, False, kind) for i, v in tensors)
    note = "" if at_setup else (getattr(op, "note", "no out= overload") if variant is None else
                             "its out= kernel is not known to write only its result" if not variant.direct else
                             "out= overload does not fit")
    return new_step(StepKind.ALLOC, stream, op, args, kwargs, outputs, node=node.name, note=note,
                    result_indices=result_indices)


def _aliased_result(draft: PlanDraft, node: fx.Node, tensors: list, fresh: list) -> str:
    """An op that computes new results and also returns memory another value owns would be a step that
    writes that memory, though other streams may be reading it: a pass built such a node by mistake."""
    fresh_indices = {i for i, _ in fresh}
    aliased = [i for i, _ in tensors if i not in fresh_indices]
    return (f"{node.name} = {op_name(node.target)}(...) computes new tensors but its result {aliased[0]} aliases "
            f"the memory of an existing value; an allocating step must own every result it returns")


def _inplace_step(draft: PlanDraft, node: fx.Node, stream: int, args: tuple, kwargs: dict) -> Step:
    """Run `node` as its inplace variant: its results are the slots of the arguments it mutates."""
    slots = tuple(draft.slot_of[(s, 0)] for s in mutated_arguments(node))
    for index, (slot, value) in enumerate(zip(slots, flat_values(node))):
        draft.storage_of_key[storage_key(value)] = draft.slots[slot].storage
        draft.slot_of[(node, index)] = slot
    return new_step(StepKind.KERNEL, stream, ops.inplace_variant(node.target), args, kwargs, slots,
                    node=node.name, note="reinplaced")


def _updating_call_step(draft: PlanDraft, node: fx.Node, stream: int, args: tuple, kwargs: dict,
                        updated: dict[int, int]) -> Step:
    """A call that updates some of its input arguments in place and allocates its other results (an
    Inductor run that writes a KV cache: `passes.inductor.CompiledRun.updated_arguments`, {result:
    argument}). Each updated result takes its argument's slot, which the step writes."""
    outputs = []
    for index, value in enumerate(flat_values(node)):
        if index in updated:
            argument = node.args[updated[index]]
            if draft.storage_kind(argument) is not StorageKind.INPUT:
                raise InternalError(f"{node.name} updates {argument.name} in place, which is no program input")
            slot = draft.slot_of[(argument, 0)]
            draft.slot_of[(node, index)] = slot
        else:
            slot = draft.slot_for_value(node, index, value, False, StorageKind.DYNAMIC)
        outputs.append(slot)
    return new_step(StepKind.ALLOC, stream, node.target, args, kwargs, tuple(outputs), node=node.name,
                    note=f"{node.target.note}, updating inputs in place", result_indices=tuple(range(len(outputs))))


def _wait_step(draft: PlanDraft, node: fx.Node, stream: int, args: tuple) -> Step:
    """`wait_tensor` returns its input, but only its completion makes the collective's result
    readable on the device: it runs as a step that *writes* the tensor, so every reader is ordered
    after it (by stream order or an event), not merely after the collective's launch."""
    slot = draft.slot_of[(node.args[0], 0)]
    draft.storage_of_key[storage_key(node.meta["val"])] = draft.slots[slot].storage
    draft.slot_of[(node, 0)] = slot
    return new_step(StepKind.KERNEL, stream, node.target, args, {}, (slot,), node=node.name,
                    note="collective finished")


def _alias_to_base(draft: PlanDraft, node: fx.Node, values: list[tuple[int, torch.Tensor]]) -> None:
    """A view whose fake result got a storage of its own (make_fx gives a program constant's node and
    its uses different fake tensors) still aliases its base: record that."""
    base = next(a for a in node.args if isinstance(a, fx.Node))
    storage = draft.slots[draft.slot_of[(base, 0)]].storage
    for _, value in values:
        draft.storage_of_key[storage_key(value)] = storage


def _is_whole_storage(tensor: torch.Tensor) -> bool:
    extent = Layout.of(tensor).byte_range()[1]
    return tensor.storage_offset() == 0 and extent == tensor.untyped_storage().nbytes()
