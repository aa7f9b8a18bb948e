"""The Plan under construction, shared by lowering's sub-passes.

Each sub-pass reads what the earlier ones decided and adds its own part, as it declares
(`sub_pass`): slots and storages (bind, emit steps, outputs), the steps (emit steps, outputs; elide
copies removes some, synchronize adds fork, join and events), the happens-before order of the final
steps (synchronize), and the final storages with their arena offsets (place buffers). Storages stay
drafts until then because copy elision places some inside others. `print(draft)` shows the slots and
steps so far.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import optree
import torch
from torch import fx

from ..compat import StorageWeakRef
from ..ir.program import Program
from ..plan.ordering import Clocks
from ..plan.plan import Layout, Ref, Slot, Step, StepKind, Storage, StorageKind, format_step

UNNUMBERED = -1   # the index of a step until synchronize numbers the final list


def new_step(kind: StepKind, stream: int, op: Any = None, args: tuple = (), kwargs: dict | None = None,
             outputs: tuple[int, ...] = (), **fields: Any) -> Step:
    """A step not yet numbered and without events: synchronize adds both."""
    return Step(UNNUMBERED, kind, stream, op, args, {} if kwargs is None else kwargs, outputs, **fields)


@dataclass
class StorageDraft:
    kind: StorageKind
    nbytes: int
    input_index: int | None = None
    constant: str | None = None
    parent: int | None = None           # set when placed inside another storage (elided cat)
    parent_offset: int = 0


@dataclass
class PlanDraft:
    """Mutable state of one lowering; `slot_of` maps (node, flat result index) to the slot holding it."""

    program: Program
    donate: dict[int, int]
    storages: list[StorageDraft] = field(default_factory=list)
    slots: list[Slot] = field(default_factory=list)
    storage_of_key: dict[StorageWeakRef, int] = field(default_factory=dict)
    slot_of: dict[tuple[fx.Node, int], int] = field(default_factory=dict)
    input_slots: list[int] = field(default_factory=list)
    output_slots: list[int] = field(default_factory=list)
    issue_order: list[fx.Node] = field(default_factory=list)
    inplace: set[fx.Node] = field(default_factory=set)   # nodes that run as their inplace variant (reinplace)
    setup: list[Step] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    num_events: int = 0
    clocks: Clocks | None = None                         # happens-before of the final steps (synchronize)
    placed_storages: tuple[Storage, ...] = ()            # the final storages (place buffers)
    placed_slots: tuple[Slot, ...] = ()                  # the slots, re-pointed into those (place buffers)
    arena_nbytes: int = 0

    def new_storage(self, draft: StorageDraft) -> int:
        self.storages.append(draft)
        return len(self.storages) - 1

    def new_slot(self, name: str, layout: Layout, storage: int, bound: bool) -> int:
        self.slots.append(Slot(len(self.slots), name, layout, storage, 0, bound))
        return len(self.slots) - 1

    def slot_for_value(self, node: fx.Node, index: int, tensor: torch.Tensor, bound: bool,
                       kind: StorageKind | None = None, **storage_fields: Any) -> int:
        """A slot for one tensor value; a new storage unless the value aliases a known one."""
        key = storage_key(tensor)
        storage = self.storage_of_key.get(key)
        if storage is None:
            storage = self.new_storage(StorageDraft(kind, tensor.untyped_storage().nbytes(), **storage_fields))
            self.storage_of_key[key] = storage
        name = node.name if len(flat_values(node)) == 1 else _result_name(node, index)
        slot = self.new_slot(name, Layout.of(tensor), storage, bound)
        self.slot_of[(node, index)] = slot
        return slot

    def storage_kind(self, node: fx.Node) -> StorageKind:
        return self.storages[self.slots[self.slot_of[(node, 0)]].storage].kind

    def ref(self, arg: Any) -> Any:
        """Replace fx Nodes in an argument structure by slot references."""
        return map_nodes(arg, lambda node: Ref(self.slot_of[(node, 0)]))

    def memory_span(self, slot_index: int) -> tuple[int, tuple[int, int]]:
        """(top-level storage, byte range inside it) of a slot, following elided-cat placements."""
        slot = self.slots[slot_index]
        storage, offset = slot.storage, 0
        while self.storages[storage].parent is not None:
            offset += self.storages[storage].parent_offset
            storage = self.storages[storage].parent
        start, end = slot.byte_range()
        return storage, (start + offset, end + offset)

    def place(self, slot_index: int) -> str:
        """Where a slot lives so far: its storage by kind and index (`arena3`), and the storage an
        elided `cat` placed that one in."""
        slot = self.slots[slot_index]
        text = f"{self.storages[slot.storage].kind.value}{slot.storage}"
        top, (start, _) = self.memory_span(slot_index)
        return text if top == slot.storage else f"{text} in {self.storages[top].kind.value}{top}+{start}"

    def __str__(self) -> str:
        """The slots and steps so far: what the sub-passes that ran have decided."""
        steps = len(self.setup) + len(self.steps)
        lines = [f"# draft of {self.program.name}: {len(self.slots)} slots, {len(self.storages)} storages, "
                 f"{steps} steps ({len(self.setup)} at setup)", "slots:"]
        lines += [f"    {slot.name}: {slot.layout}  {self.place(slot.index)}" for slot in self.slots]
        if self.setup:
            lines.append("setup:")
            lines += ["    " + format_step(step, self.slots, self.place) for step in self.setup]
        lines.append("steps:")
        lines += ["    " + format_step(step, self.slots, self.place) for step in self.steps]
        return "\n".join(lines)


def _result_name(node: fx.Node, index: int) -> str:
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == index:
            return user.name
    return f"{node.name}[{index}]"


def flat_values(node: fx.Node) -> list[Any]:
    """A node's results as a flat list (ops such as _fused_adamw return a tuple of lists)."""
    return optree.tree_leaves(node.meta.get("val"), none_is_leaf=True)


def storage_key(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


def map_nodes(arg: Any, fn: Callable[[fx.Node], Any]) -> Any:
    """Apply fn to every fx Node in a nested argument, rebuilding fx's immutable containers as plain
    lists and tuples (aten ops reject the immutable ones)."""
    if isinstance(arg, fx.Node):
        return fn(arg)
    if isinstance(arg, list):
        return [map_nodes(a, fn) for a in arg]
    if isinstance(arg, tuple):
        return tuple(map_nodes(a, fn) for a in arg)
    if isinstance(arg, dict):
        return {k: map_nodes(v, fn) for k, v in arg.items()}
    return arg
