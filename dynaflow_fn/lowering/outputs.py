"""Outputs: where each returned tensor lives when the plan finishes.

A donated output is copied into its input (unless re-inplacing already left it there). Any other
output needs storage that outlives the call: an arena buffer becomes an output buffer, and an output
that aliases an input or a constant is copied into a fresh one, so the caller never gets its own
input (or the plan's constant) back as a result.

Those copies read inputs that the donated copies write, so their order matters. Re-inplacing may
leave any value in a donated input's memory (`a * 3` in `a`, while `a * 2` is the output donated to
`a`), and donated outputs may swap places (`return b + 0, a + 0` with both donated, each result
computed in the other's memory). So the outputs that stay are copied out first, and the donated
copies then run as a parallel assignment: each one before any copy that overwrites what it reads,
and where the copies form a cycle, one source goes through a buffer of its own first.
"""

from __future__ import annotations

import numpy as np
import torch

from ..ir.tree import contiguous_strides
from ..plan.plan import Layout, Ref, Slot, StepKind, StorageKind
from .draft import PlanDraft, StorageDraft, new_step
from .sub_pass import sub_pass


@sub_pass("outputs", reads=("program", "donate", "slot_of", "input_slots", "slots", "storages", "steps"),
          writes=("steps", "storages", "slots", "output_slots"))
def outputs(draft: PlanDraft) -> bool:
    results = list(draft.program.output_node().args[0])
    output_slots = [draft.slot_of[(node, 0)] for node in results]
    for out_index, slot_index in enumerate(output_slots):
        if out_index in draft.donate:
            continue
        slot = draft.slots[slot_index]
        storage = draft.storages[slot.storage]
        if storage.kind is StorageKind.ARENA:
            storage.kind = StorageKind.OUTPUT
        elif storage.kind in (StorageKind.INPUT, StorageKind.CONSTANT):
            output_slots[out_index] = _copy_to_output(draft, slot, results[out_index].name)
    moves = []
    for out_index, in_index in sorted(draft.donate.items()):
        source, target = output_slots[out_index], draft.input_slots[in_index]
        if source != target:
            moves.append((target, source, results[out_index].name))
        output_slots[out_index] = target
    _write_donated(draft, moves)
    draft.output_slots = output_slots
    return bool(output_slots)


def _write_donated(draft: PlanDraft, moves: list[tuple[int, int, str]]) -> None:
    """Copy each donated output (target input slot, source slot, node name) into its input, in an order
    in which no copy overwrites memory a later copy reads; a cycle goes through a buffer of its own."""
    pending = list(moves)
    while pending:
        ready = next((move for move in pending if not any(
            _overlap(draft, move[0], other[1]) for other in pending if other is not move)), None)
        if ready is None:                                # every target is read by another copy: a cycle
            target, source, name = pending.pop(0)
            pending.append((target, _copy_to_buffer(draft, draft.slots[source], name), name))
            continue
        pending.remove(ready)
        target, source, name = ready
        if _overlap(draft, target, source):              # a shifted copy within one storage
            source = _copy_to_buffer(draft, draft.slots[source], name)
        draft.steps.append(new_step(StepKind.COPY, 0, torch.ops.aten.copy_.default, (Ref(target), Ref(source)), {},
                                    (target,), node=name, note="donated output"))


def _overlap(draft: PlanDraft, one: int, other: int) -> bool:
    """Whether two slots share bytes."""
    (storage, (start, end)), (other_storage, (other_start, other_end)) = draft.memory_span(one), draft.memory_span(other)
    return storage == other_storage and start < other_end and other_start < end


def _copy_to_buffer(draft: PlanDraft, slot: Slot, name: str) -> int:
    """A copy of a donated output in arena memory of its own, for a copy whose target it overlaps."""
    layout = slot.layout
    fresh = Layout(layout.shape, contiguous_strides(layout.shape), layout.dtype, layout.device, 0)
    storage = draft.new_storage(StorageDraft(StorageKind.ARENA, fresh.byte_range()[1]))
    buffer = draft.new_slot(f"{name}_moved", fresh, storage, True)
    draft.steps.append(new_step(StepKind.COPY, 0, torch.ops.aten.copy_.default, (Ref(buffer), Ref(slot.index)), {},
                                (buffer,), node=name, note="donated output, through a buffer"))
    return buffer


def _copy_to_output(draft: PlanDraft, slot: Slot, name: str) -> int:
    layout = slot.layout
    strides = layout.stride if _is_dense(layout) else contiguous_strides(layout.shape)
    fresh = Layout(layout.shape, strides, layout.dtype, layout.device, 0)
    storage = draft.new_storage(StorageDraft(StorageKind.OUTPUT, fresh.byte_range()[1]))
    out = draft.new_slot(f"{name}_out", fresh, storage, True)
    draft.steps.append(new_step(StepKind.COPY, 0, torch.ops.aten.copy_.default, (Ref(out), Ref(slot.index)), {},
                                (out,), node=name, note="output aliases an input or constant"))
    return out


def _is_dense(layout: Layout) -> bool:
    """Non-overlapping and dense: the elements exactly fill their byte range (any dimension order)."""
    numel = int(np.prod(layout.shape)) if layout.shape else 1
    start, end = layout.byte_range()
    sizes = [n for n in layout.shape if n > 1]
    strides = {s for s, n in zip(layout.stride, layout.shape) if n > 1}
    return numel * layout.itemsize == end - start and len(strides) == len(sizes)
