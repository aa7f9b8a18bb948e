"""Outputs: where each returned tensor lives when the plan finishes.

A donated output is copied into its input (unless re-inplacing already left it there). Any other
output needs storage that outlives the call: an arena buffer becomes an output buffer, and an output
that aliases an input or a constant is copied into a fresh one, so the caller never gets its own
input (or the plan's constant) back as a result.
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
    for out_index, in_index in sorted(draft.donate.items()):
        src, dst = output_slots[out_index], draft.input_slots[in_index]
        if src != dst:
            draft.steps.append(new_step(StepKind.COPY, 0, torch.ops.aten.copy_.default, (Ref(dst), Ref(src)), {},
                                        (dst,), node=results[out_index].name, note="donated output"))
        output_slots[out_index] = dst
    for out_index, slot_index in enumerate(output_slots):
        if out_index in draft.donate:
            continue
        slot = draft.slots[slot_index]
        storage = draft.storages[slot.storage]
        if storage.kind is StorageKind.ARENA:
            storage.kind = StorageKind.OUTPUT
        elif storage.kind in (StorageKind.INPUT, StorageKind.CONSTANT):
            output_slots[out_index] = _copy_to_output(draft, slot, results[out_index].name)
    draft.output_slots = output_slots
    return bool(output_slots)


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
