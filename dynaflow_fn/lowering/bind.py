"""Bind: a slot and a storage for every tensor input and program constant, which the caller (or the
program) provides when the plan runs."""

from __future__ import annotations

from ..plan.plan import StorageKind
from .draft import PlanDraft
from .sub_pass import sub_pass


@sub_pass("bind", reads=("program",), writes=("storages", "slots", "storage_of_key", "slot_of", "input_slots"))
def bind(draft: PlanDraft) -> bool:
    program = draft.program
    for index, node in enumerate(program.placeholders()):
        draft.input_slots.append(draft.slot_for_value(node, 0, node.meta["val"], True, StorageKind.INPUT,
                                                      input_index=index))
    for node in program.graph.nodes:
        if node.op == "get_attr":
            draft.slot_for_value(node, 0, node.meta["val"], True, StorageKind.CONSTANT, constant=node.target)
    return bool(draft.slots)
