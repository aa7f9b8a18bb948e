"""Elide copies: remove a `cat` whose inputs are each the whole result of one kernel.

Each input is planned straight into its slice of the `cat` output (its storage gets the output's as
parent, at a byte offset), so the kernels write the concatenation where it lives and micro-batch
merges copy nothing.
"""

from __future__ import annotations

import torch

from ..ir.tree import contiguous_strides
from ..plan.plan import Layout, Step, StepKind, StorageKind
from .draft import PlanDraft
from .sub_pass import sub_pass


@sub_pass("elide copies", reads=("steps", "slots", "storages"), writes=("steps", "storages"))
def elide_copies(draft: PlanDraft) -> bool:
    elided: set[int] = set()
    for position, step in enumerate(draft.steps):
        if step.kind is StepKind.KERNEL and step.op is torch.ops.aten.cat.out:
            members = _cat_members(draft, step)
            if members is None:
                continue
            target = draft.slots[step.outputs[0]].storage
            for storage_index, offset in members:
                storage = draft.storages[storage_index]
                storage.parent, storage.parent_offset = target, offset
            elided.add(position)
    draft.steps = [step for position, step in enumerate(draft.steps) if position not in elided]
    return bool(elided)


def _cat_members(draft: PlanDraft, step: Step) -> list[tuple[int, int]] | None:
    """(storage, byte offset in the cat output) per input, if every input can live in its slice."""
    inputs = step.args[0]
    dim = step.args[1] if len(step.args) > 1 else step.kwargs.get("dim", 0)
    out = draft.slots[step.outputs[0]].layout
    dim = dim % len(out.shape)
    if not _is_contiguous(out) or out.storage_offset != 0 or any(s != 1 for s in out.shape[:dim]):
        return None
    members, offset, seen = [], 0, set()
    for ref in inputs:
        slot = draft.slots[ref.slot]
        storage = draft.storages[slot.storage]
        nbytes = slot.layout.byte_range()[1]
        if (storage.kind is not StorageKind.ARENA or storage.parent is not None or slot.storage in seen
                or slot.layout.dtype != out.dtype or not _is_contiguous(slot.layout)
                or slot.layout.storage_offset != 0 or nbytes != storage.nbytes):
            return None
        seen.add(slot.storage)
        members.append((slot.storage, offset))
        offset += nbytes
    return members


def _is_contiguous(layout: Layout) -> bool:
    return all(size == 1 or stride == expected
               for size, stride, expected in zip(layout.shape, layout.stride, contiguous_strides(layout.shape)))
