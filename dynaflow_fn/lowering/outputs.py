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
from ..plan.plan import Layout, Ref, StepKind, StorageKind
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
            output_slots[out_index] = _fresh_copy(draft, slot_index, StorageKind.OUTPUT, results[out_index].name,
                                                  "out", "output aliases an input or constant")
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
            pending.append((target, _through_buffer(draft, source, name), name))
            continue
        pending.remove(ready)
        target, source, name = ready
        if _overlap(draft, target, source):              # a shifted copy within one storage
            source = _through_buffer(draft, source, name)
        _copy(draft, target, source, name, "donated output")


def _overlap(draft: PlanDraft, one: int, other: int) -> bool:
    """Whether two slots share bytes."""
    (storage, (start, end)), (other_storage, (other_start, other_end)) = draft.memory_span(one), draft.memory_span(other)
    return storage == other_storage and start < other_end and other_start < end


def _through_buffer(draft: PlanDraft, source: int, name: str) -> int:
    """A donated output copied into arena memory of its own, for a copy whose target it overlaps."""
    return _fresh_copy(draft, source, StorageKind.ARENA, name, "moved", "donated output, through a buffer")


def _fresh_copy(draft: PlanDraft, source: int, kind: StorageKind, name: str, suffix: str, note: str) -> int:
    """A copy of slot `source` in a new storage of `kind` (an output buffer, or arena memory a donated
    output passes through), dense as the source is or else contiguous; the copy's slot."""
    layout = draft.slots[source].layout
    strides = layout.stride if _is_dense(layout) else contiguous_strides(layout.shape)
    fresh = Layout(layout.shape, strides, layout.dtype, layout.device, 0)
    storage = draft.new_storage(StorageDraft(kind, fresh.byte_range()[1]))
    copy = draft.new_slot(f"{name}_{suffix}", fresh, storage, True)
    _copy(draft, copy, source, name, note)
    return copy


def _copy(draft: PlanDraft, target: int, source: int, name: str, note: str) -> None:
    draft.steps.append(new_step(StepKind.COPY, 0, torch.ops.aten.copy_.default, (Ref(target), Ref(source)), {},
                                (target,), node=name, note=note))


def _is_dense(layout: Layout) -> bool:
    """Non-overlapping and dense: the elements exactly fill their byte range (any dimension order)."""
    numel = int(np.prod(layout.shape)) if layout.shape else 1
    start, end = layout.byte_range()
    sizes = [n for n in layout.shape if n > 1]
    strides = {s for s, n in zip(layout.stride, layout.shape) if n > 1}
    return numel * layout.itemsize == end - start and len(strides) == len(sizes)
