"""Lowering: Program -> Plan.

The pass walks the program's nodes in issue order (the schedule's, or trace order when there is
none) and decides for each one how it runs:

* a view op becomes a VIEW step: no kernel, no memory;
* an op with an `out=` overload becomes a KERNEL step writing into a planned buffer;
* an op without one becomes an ALLOC step, and the Plan says so;
* work that depends on no input (masks, position ids, rotary tables) moves to `setup`, computed once;
* the `copy_` that functionalization leaves for a mutated input becomes a COPY step (a write-back).

Which tensors share memory comes from the fake tensors of the trace: two values with the same fake
storage alias. A `cat` whose inputs are each the whole result of one kernel is removed: each input is
planned straight into its slice of the `cat` output, so micro-batch merges copy nothing.

Then cross-stream dependencies become events (one per producer, only where the stream is not already
ordered after it), side streams fork from and join the first stream, and scratch buffers get arena
offsets from `memory.pack` under the happens-before order of the final steps.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import numpy as np
import optree
import torch
from torch import fx

from ..compat import OpOverload, StorageWeakRef
from ..errors import InputError, ScheduleError
from ..ir import ops
from ..ir.analyses import setup_nodes
from ..ir.program import Program, contiguous_strides, dtype_name, info
from ..plan.ordering import Clocks
from ..plan.plan import Layout, Plan, Ref, Slot, Step, StepKind, Storage, StorageKind, step_reads, step_writes
from . import memory
from .reinplace import inplace_variant, mutated_arguments, plan_inplace


def lower(program: Program, *, donate: Mapping[int, int] | None = None) -> Plan:
    """Build the static Plan of a Program.

    `donate` maps a flat output index to a flat tensor-input index whose storage receives that
    output in place (the caller donated the input); `df.jit(donate_argnums=...)` computes it.
    """
    if not isinstance(program, Program):
        raise InputError(_not_a_program(program))
    return _Lowering(program, _checked_donation(program, donate)).run()


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


def _checked_donation(program: Program, donate: Mapping[int, int] | None) -> dict[int, int]:
    """`donate` as a dict, after checking that every pair names an output and a tensor input of the same
    shape, strides, dtype and device, and that no input receives two outputs."""
    if donate is None:
        return {}
    if not isinstance(donate, Mapping):
        raise InputError(f"donate maps output indices to input indices, e.g. donate={{0: 0}}; got {donate!r}")
    outputs = list(program.output_node().args[0])
    placeholders = program.placeholders()
    output_paths = {spec.tensor_index: spec.path for spec in program.outputs if spec.tensor_index is not None}
    input_paths = {spec.node_name: spec.path for spec in program.inputs if spec.is_tensor}
    output_name = lambda i: f"output {i} ({output_paths.get(i, outputs[i].name)})"
    input_name = lambda i: f"input {i} ({input_paths.get(placeholders[i].name, placeholders[i].name)})"
    receiver: dict[int, int] = {}
    for out_index, in_index in donate.items():
        pair = f"donate={{{out_index!r}: {in_index!r}}}"
        if type(out_index) is not int or type(in_index) is not int:
            raise InputError(f"{pair}: donate maps a flat output index (an int) to a flat tensor-input index (an int)")
        if not 0 <= out_index < len(outputs):
            raise InputError(f"{pair} names output {out_index}, but {program.name} returns {len(outputs)} tensors")
        if not 0 <= in_index < len(placeholders):
            raise InputError(f"{pair} names input {in_index}, but {program.name} takes {len(placeholders)} tensors")
        if in_index in receiver:
            raise InputError(f"donate writes {output_name(receiver[in_index])} and {output_name(out_index)} both into "
                             f"{input_name(in_index)}; an input can receive one output")
        receiver[in_index] = out_index
        value, wanted = outputs[out_index].meta.get("val"), placeholders[in_index].meta["val"]
        if not isinstance(value, torch.Tensor) or _layout(value) != _layout(wanted):
            raise InputError(f"{pair}: {output_name(out_index)} is {_layout_text(value)} but {input_name(in_index)} is "
                             f"{_layout_text(wanted)}; an output is donated only to an input of the same shape, "
                             f"strides, dtype and device")
    return dict(donate)


def _layout(tensor: torch.Tensor) -> tuple:
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device


def _layout_text(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return f"not a tensor: {type(value).__name__}"
    shape, stride, dtype, device = _layout(value)
    return f"{dtype_name(dtype)}{list(shape)} strides {stride} on {device}"


@dataclass
class _StorageDraft:
    kind: StorageKind
    nbytes: int
    input_index: int | None = None
    constant: str | None = None
    parent: int | None = None           # set when placed inside another storage (elided cat)
    parent_offset: int = 0


@dataclass
class _StepDraft:
    """A Step under construction: lowering adds events and drops elided steps before freezing it."""

    kind: StepKind
    stream: int
    op: Any = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    outputs: tuple[int, ...] = ()
    out_names: tuple[str, ...] = ()
    node: str = ""
    note: str = ""
    waits: list[int] = field(default_factory=list)
    records: list[int] = field(default_factory=list)
    removed: bool = False
    result_indices: tuple[int, ...] = ()


def _values(node: fx.Node) -> list[Any]:
    """A node's results as a flat list (ops such as _fused_adamw return a tuple of lists)."""
    return optree.tree_leaves(node.meta.get("val"), none_is_leaf=True)


def _leaf_offset(values: Any, index: int) -> tuple[int, int]:
    """Where the `index`-th element of a (nested) result sits among its flat leaves: (start, count)."""
    count = lambda v: len(optree.tree_leaves(v, none_is_leaf=True))
    return sum(count(v) for v in values[:index]), count(values[index])


def _storage_key(tensor: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())


def _extent_bytes(tensor: torch.Tensor) -> int:
    return Layout.of(tensor).byte_range()[1]


def _is_whole_storage(tensor: torch.Tensor) -> bool:
    return tensor.storage_offset() == 0 and _extent_bytes(tensor) == tensor.untyped_storage().nbytes()


class _Lowering:
    def __init__(self, program: Program, donate: dict[int, int]):
        self.program = program
        self.donate = donate
        self.storages: list[_StorageDraft] = []
        self.slots: list[Slot] = []
        self.storage_of_key: dict[StorageWeakRef, int] = {}
        self.slot_of: dict[tuple[fx.Node, int], int] = {}
        self.setup: list[_StepDraft] = []
        self.steps: list[_StepDraft] = []
        self.hoisted = setup_nodes(program)
        self.inplace: set[fx.Node] = set()
        self.input_slots: list[int] = []
        self.num_events = 0

    # --- driver ----------------------------------------------------------------------------------

    def run(self) -> Plan:
        self._bind_placeholders_and_constants()
        order = self._issue_order()
        placeholders = self.program.placeholders()
        self.inplace = plan_inplace(order, list(self.program.output_node().args[0]),
                                    {placeholders[i] for i in self.donate.values()}, _allocates)
        for node in order:
            self._lower_node(node)
        output_slots = self._lower_outputs()
        self._elide_concatenations()
        steps = [s for s in self.steps if not s.removed]
        if any(s.stream != 0 for s in steps):
            steps = self._add_fork_and_join(steps)
        self._add_events(steps)
        final_steps = tuple(self._finish_step(i, s) for i, s in enumerate(steps))
        clocks = Clocks(final_steps, len(self.program.streams))
        final_steps = _leave_sms_to_collectives(final_steps, clocks, self.program.collective_sms)
        storages, slots, arena_nbytes = self._place(final_steps, clocks)
        device = next((v.device for n in self.program.placeholders() for v in _values(n)
                       if isinstance(v, torch.Tensor)), torch.device("cpu"))
        return Plan(
            name=self.program.name,
            device=device,
            streams=self.program.streams,
            storages=storages,
            slots=slots,
            setup=tuple(self._finish_step(i, s) for i, s in enumerate(self.setup)),
            steps=final_steps,
            num_events=self.num_events,
            input_slots=tuple(self.input_slots),
            output_slots=tuple(output_slots),
            arena_nbytes=arena_nbytes,
            inputs=self.program.inputs,
            in_tree=self.program.in_tree,
            outputs=self.program.outputs,
            out_tree=self.program.out_tree,
            constants={n.target: getattr(self.program.graph_module, n.target)
                       for n in self.program.graph.nodes if n.op == "get_attr"},
            provenance=self.program.provenance + ("lower",),
            captured=self.program.captured,
        )

    def _issue_order(self) -> list[fx.Node]:
        nodes = self.program.ops()
        if not self.program.is_scheduled():
            return nodes
        missing = [n.name for n in nodes if info(n).order is None]
        if missing:
            raise ScheduleError(f"the schedule gives no issue position to nodes {missing[:5]}")
        streams = len(self.program.streams)
        stray = [n.name for n in nodes if not 0 <= (info(n).stream or 0) < streams]
        if stray:
            raise ScheduleError(f"nodes {stray[:5]} are placed on streams the program does not declare "
                                f"(it has {streams})")
        ordered = self.program.issue_order()
        position = {n: i for i, n in enumerate(ordered)}
        for node in ordered:
            for dep in node.all_input_nodes:
                if dep in position and position[dep] > position[node]:
                    raise ScheduleError(f"the schedule issues {node.name} before its input {dep.name}")
        return ordered

    # --- slots and storages ----------------------------------------------------------------------

    def _new_storage(self, draft: _StorageDraft) -> int:
        self.storages.append(draft)
        return len(self.storages) - 1

    def _new_slot(self, name: str, tensor: torch.Tensor, storage: int, bound: bool) -> int:
        self.slots.append(Slot(len(self.slots), name, Layout.of(tensor), storage, 0, bound))
        return len(self.slots) - 1

    def _slot_for_value(self, node: fx.Node, index: int, tensor: torch.Tensor, bound: bool,
                        kind: StorageKind | None = None, **storage_fields: Any) -> int:
        """A slot for one tensor value; a new storage unless the value aliases a known one."""
        key = _storage_key(tensor)
        storage = self.storage_of_key.get(key)
        if storage is None:
            storage = self._new_storage(_StorageDraft(kind, tensor.untyped_storage().nbytes(), **storage_fields))
            self.storage_of_key[key] = storage
        name = node.name if len(_values(node)) == 1 else self._output_name(node, index)
        slot = self._new_slot(name, tensor, storage, bound)
        self.slot_of[(node, index)] = slot
        return slot

    @staticmethod
    def _output_name(node: fx.Node, index: int) -> str:
        for user in node.users:
            if user.target is operator.getitem and user.args[1] == index:
                return user.name
        return f"{node.name}[{index}]"

    def _bind_placeholders_and_constants(self) -> None:
        for index, node in enumerate(self.program.placeholders()):
            self.input_slots.append(self._slot_for_value(node, 0, node.meta["val"], True, StorageKind.INPUT,
                                                         input_index=index))
        for node in self.program.graph.nodes:
            if node.op == "get_attr":
                self._slot_for_value(node, 0, node.meta["val"], True, StorageKind.CONSTANT, constant=node.target)

    def _ref(self, arg: Any) -> Any:
        """Replace fx Nodes in an argument structure by slot references."""
        return _map_nodes(arg, lambda node: Ref(self.slot_of[(node, 0)]))

    # --- nodes -----------------------------------------------------------------------------------

    def _lower_node(self, node: fx.Node) -> None:
        if node.target is operator.getitem:
            parent, index = node.args
            start, count = _leaf_offset(parent.meta["val"], index)
            for k in range(count):
                if (parent, start + k) in self.slot_of:
                    self.slot_of[(node, k)] = self.slot_of[(parent, start + k)]
            return
        op = node.target
        values = _values(node)
        hoist = node in self.hoisted
        destination = self.setup if hoist else self.steps
        stream = info(node).stream or 0
        args, kwargs = self._ref(tuple(node.args)), self._ref(dict(node.kwargs))

        if op is torch.ops.aten.copy_.default and self._is_input_slot(node.args[0]):
            dst = self.slot_of[(node.args[0], 0)]
            self.slot_of[(node, 0)] = dst
            destination.append(_StepDraft(StepKind.COPY, stream, op, (Ref(dst), args[1]), {}, (dst,),
                                          node=node.name, note="input mutation write-back"))
            return
        if ops.is_mutating(op):
            raise NotImplementedError(f"in-place op {op} on a non-input in the functional graph ({node.name})")
        if node in self.inplace and not hoist:
            self._lower_inplace(node, stream, args, kwargs)
            return
        if ops.is_collective_wait(op):
            self._lower_wait(node, stream, args)
            return

        tensors = [(i, v) for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        fresh = [(i, v) for i, v in tensors if _storage_key(v) not in self.storage_of_key]
        if fresh and ops.is_view(op):
            self._alias_to_base(node, fresh)
            fresh = []
        result_indices = tuple(i for i, _ in tensors) if isinstance(node.meta.get("val"), (list, tuple)) else ()
        if not fresh:
            outputs = tuple(self._slot_for_value(node, i, v, False) for i, v in tensors)
            destination.append(_StepDraft(StepKind.VIEW, stream, op, args, kwargs, outputs, node=node.name,
                                          result_indices=result_indices))
            return
        variant = None if hoist else ops.out_variant(op) if isinstance(op, OpOverload) else None
        if (variant is not None and variant.direct and len(fresh) == len(values)
                and all(_is_whole_storage(v) for _, v in fresh) and _out_call_is_faithful(node, variant)):
            outputs = tuple(self._slot_for_value(node, i, v, True, StorageKind.ARENA) for i, v in tensors)
            pos, kw = variant.call_arguments(ops.bind_arguments(op, args, kwargs))
            destination.append(_StepDraft(StepKind.KERNEL, stream, variant.op, tuple(pos), kw, outputs,
                                          variant.out_names, node=node.name))
            return
        kind = StorageKind.CONSTANT if hoist else StorageKind.DYNAMIC
        outputs = tuple(self._slot_for_value(node, i, v, False, kind) for i, v in tensors)
        note = "" if hoist else (getattr(op, "note", "no out= overload") if variant is None else
                                 "its out= kernel is not known to write only its result" if not variant.direct else
                                 "out= overload does not fit")
        destination.append(_StepDraft(StepKind.ALLOC, stream, op, args, kwargs, outputs, node=node.name, note=note,
                                      result_indices=result_indices))

    def _lower_inplace(self, node: fx.Node, stream: int, args: tuple, kwargs: dict) -> None:
        """Run `node` as its in-place variant: its results are the slots of the arguments it mutates."""
        slots = tuple(self.slot_of[(s, 0)] for s in mutated_arguments(node))
        for index, (slot, value) in enumerate(zip(slots, _values(node))):
            self.storage_of_key[_storage_key(value)] = self.slots[slot].storage
            self.slot_of[(node, index)] = slot
        self.steps.append(_StepDraft(StepKind.KERNEL, stream, inplace_variant(node.target), args, kwargs, slots,
                                     node=node.name, note="in place"))

    def _lower_wait(self, node: fx.Node, stream: int, args: tuple) -> None:
        """`wait_tensor` returns its input, but only its completion makes the collective's result
        readable on the device: it runs as a step that *writes* the tensor, so every reader is ordered
        after it (by stream order or an event), not merely after the collective's launch."""
        slot = self.slot_of[(node.args[0], 0)]
        self.storage_of_key[_storage_key(node.meta["val"])] = self.slots[slot].storage
        self.slot_of[(node, 0)] = slot
        self.steps.append(_StepDraft(StepKind.KERNEL, stream, node.target, args, {}, (slot,), node=node.name,
                                     note="collective finished"))

    def _alias_to_base(self, node: fx.Node, values: list[tuple[int, torch.Tensor]]) -> None:
        """A view whose fake result got a storage of its own (make_fx gives a program constant's node and
        its uses different fake tensors) still aliases its base: record that."""
        base = next(a for a in node.args if isinstance(a, fx.Node))
        storage = self.slots[self.slot_of[(base, 0)]].storage
        for _, value in values:
            self.storage_of_key[_storage_key(value)] = storage

    def _is_input_slot(self, node: fx.Node) -> bool:
        return self.storages[self.slots[self.slot_of[(node, 0)]].storage].kind is StorageKind.INPUT

    # --- outputs ---------------------------------------------------------------------------------

    def _lower_outputs(self) -> list[int]:
        """Donated outputs go back into their inputs; other outputs get storage that outlives the call."""
        results = list(self.program.output_node().args[0])
        output_slots = [self.slot_of[(node, 0)] for node in results]
        for out_index, in_index in sorted(self.donate.items()):
            src, dst = output_slots[out_index], self.input_slots[in_index]
            if src != dst:
                self.steps.append(_StepDraft(StepKind.COPY, 0, torch.ops.aten.copy_.default, (Ref(dst), Ref(src)),
                                             {}, (dst,), node=results[out_index].name, note="donated output"))
            output_slots[out_index] = dst
        for out_index, slot_index in enumerate(output_slots):
            if out_index in self.donate:
                continue
            slot = self.slots[slot_index]
            storage = self.storages[slot.storage]
            if storage.kind is StorageKind.ARENA:
                storage.kind = StorageKind.OUTPUT
            elif storage.kind in (StorageKind.INPUT, StorageKind.CONSTANT):
                output_slots[out_index] = self._copy_to_output(slot, results[out_index].name)
        return output_slots

    def _copy_to_output(self, slot: Slot, name: str) -> int:
        layout = slot.layout
        strides = layout.stride if _is_dense(layout) else contiguous_strides(layout.shape)
        fresh = Layout(layout.shape, strides, layout.dtype, 0)
        storage = self._new_storage(_StorageDraft(StorageKind.OUTPUT, fresh.byte_range()[1]))
        self.slots.append(Slot(len(self.slots), f"{name}_out", fresh, storage, 0, True))
        out = len(self.slots) - 1
        self.steps.append(_StepDraft(StepKind.COPY, 0, torch.ops.aten.copy_.default, (Ref(out), Ref(slot.index)),
                                     {}, (out,), node=name, note="output aliases an input or constant"))
        return out

    # --- concatenation elision -------------------------------------------------------------------

    def _elide_concatenations(self) -> None:
        for step in self.steps:
            if step.kind is StepKind.KERNEL and step.op is torch.ops.aten.cat.out:
                members = self._cat_members(step)
                if members is None:
                    continue
                target = self.slots[step.outputs[0]].storage
                for storage_index, offset in members:
                    draft = self.storages[storage_index]
                    draft.parent, draft.parent_offset = target, offset
                step.removed = True

    def _cat_members(self, step: _StepDraft) -> list[tuple[int, int]] | None:
        """(storage, byte offset in the cat output) per input, if every input can live in its slice."""
        inputs = step.args[0]
        dim = step.args[1] if len(step.args) > 1 else step.kwargs.get("dim", 0)
        out = self.slots[step.outputs[0]].layout
        dim = dim % len(out.shape)
        if not _is_contiguous(out) or out.storage_offset != 0 or any(s != 1 for s in out.shape[:dim]):
            return None
        members, offset, seen = [], 0, set()
        for ref in inputs:
            slot = self.slots[ref.slot]
            storage = self.storages[slot.storage]
            nbytes = slot.layout.byte_range()[1]
            if (storage.kind is not StorageKind.ARENA or storage.parent is not None or slot.storage in seen
                    or slot.layout.dtype != out.dtype or not _is_contiguous(slot.layout)
                    or slot.layout.storage_offset != 0 or nbytes != storage.nbytes):
                return None
            seen.add(slot.storage)
            members.append((slot.storage, offset))
            offset += nbytes
        return members

    # --- streams and events ----------------------------------------------------------------------

    def _add_fork_and_join(self, steps: list[_StepDraft]) -> list[_StepDraft]:
        """Bracket a multi-stream plan: side streams start after a fork and end before a join on s0."""
        return [_StepDraft(StepKind.FORK, 0), *steps, _StepDraft(StepKind.JOIN, 0)]

    def _new_event(self) -> int:
        self.num_events += 1
        return self.num_events - 1

    def _add_events(self, steps: list[_StepDraft]) -> None:
        """Make cross-stream dependencies event waits: per step, only those not already implied by its
        stream's order or by another wait of the same step (a transitive reduction)."""
        num_streams = len(self.program.streams)
        stream_clock = np.zeros((num_streams, num_streams), dtype=np.int64)
        position = np.zeros(len(steps), dtype=np.int64)
        clock_after: list[np.ndarray] = []
        event_of_step: dict[int, int] = {}
        deps = self._dependencies(steps)
        for i, step in enumerate(steps):
            clock = stream_clock[step.stream].copy()
            pending = [d for d in deps[i]
                       if steps[d].stream != step.stream and clock[steps[d].stream] < position[d]]
            needed = [a for a in pending
                      if not any(b != a and clock_after[b][steps[a].stream] >= position[a] for b in pending)]
            for dep in sorted(needed):
                if dep not in event_of_step:
                    event_of_step[dep] = self._new_event()
                    steps[dep].records.append(event_of_step[dep])
                step.waits.append(event_of_step[dep])
                np.maximum(clock, clock_after[dep], out=clock)
            clock[step.stream] += 1
            stream_clock[step.stream] = clock
            position[i] = clock[step.stream]
            clock_after.append(clock.copy())

    def _dependencies(self, steps: list[_StepDraft]) -> list[set[int]]:
        """For each step, the earlier steps it must run after: writers of what it reads (through views),
        readers and writers of what it overwrites; and the fork before each side stream's first step,
        every side-stream step before the join."""
        writers: dict[int, list[tuple[int, tuple[int, int]]]] = defaultdict(list)
        readers: dict[int, list[tuple[int, tuple[int, int]]]] = defaultdict(list)
        deps: list[set[int]] = []
        for i, step in enumerate(steps):
            mine: set[int] = set()
            if step.kind is not StepKind.VIEW:
                for slot_index in _reads(step):
                    storage, span = self._memory_span(slot_index)
                    mine.update(j for j, other in writers[storage] if _overlap(span, other))
                    readers[storage].append((i, span))
                for slot_index in _writes(step):
                    storage, span = self._memory_span(slot_index)
                    mine.update(j for j, other in writers[storage] + readers[storage] if _overlap(span, other) and j != i)
                    writers[storage].append((i, span))
            deps.append(mine)
        self._add_pacing(steps, deps)
        if steps and steps[0].kind is StepKind.FORK:
            first_on: dict[int, int] = {}
            for i, step in enumerate(steps):
                first_on.setdefault(step.stream, i)
                if step.stream != 0:
                    deps[-1].add(i)
            for stream, i in first_on.items():
                if stream != 0:
                    deps[i].add(0)
        return deps

    def _add_pacing(self, steps: list[_StepDraft], deps: list[set[int]]) -> None:
        """The schedule's pacing edges: a node's steps run after the last step of each stage in its `after`."""
        node_info = {n.name: info(n) for n in self.program.ops()}
        if not any(i.after for i in node_info.values()):
            return
        last_of_stage: dict[int, int] = {}
        for i, step in enumerate(steps):
            if step.node not in node_info:
                continue
            deps[i].update(last_of_stage[s] for s in node_info[step.node].after if s in last_of_stage)
            last_of_stage[node_info[step.node].stage] = i

    def _memory_span(self, slot_index: int) -> tuple[int, tuple[int, int]]:
        """(top-level storage, byte range inside it) of a slot, following elided-cat placements."""
        slot = self.slots[slot_index]
        storage, offset = slot.storage, 0
        while self.storages[storage].parent is not None:
            offset += self.storages[storage].parent_offset
            storage = self.storages[storage].parent
        start, end = slot.byte_range()
        return storage, (start + offset, end + offset)

    # --- final assembly --------------------------------------------------------------------------

    def _finish_step(self, index: int, step: _StepDraft) -> Step:
        return Step(index, step.kind, step.stream, step.op, step.args, step.kwargs, step.outputs, step.out_names,
                    tuple(step.waits), tuple(step.records), step.node, step.note, step.result_indices)

    def _place(self, steps: tuple[Step, ...], clocks: Clocks) -> tuple[tuple[Storage, ...], tuple[Slot, ...], int]:
        """Renumber the storages that remain, give arena buffers their offsets, and re-point slots."""
        top = [i for i, s in enumerate(self.storages) if s.parent is None]
        accesses: dict[int, set[int]] = defaultdict(set)
        for step in steps:
            for slot_index in (*_reads(step), *_writes(step)):
                accesses[self._memory_span(slot_index)[0]].add(step.index)
        arena = [i for i in top if self.storages[i].kind is StorageKind.ARENA]
        used = [i for i in arena if accesses[i]]
        release = np.array([clocks.release(accesses[i]) for i in used]).reshape(len(used), clocks.num_streams)
        acquire = np.array([clocks.acquire(accesses[i]) for i in used]).reshape(len(used), clocks.num_streams)
        layout = memory.pack([self.storages[i].nbytes for i in used], release, acquire)
        offsets = dict(zip(used, layout.offsets))
        new_index = {old: new for new, old in enumerate(top)}
        storages = tuple(
            Storage(new_index[old], self.storages[old].kind, memory.align(self.storages[old].nbytes, 16),
                    offsets.get(old, 0), self.storages[old].input_index, self.storages[old].constant)
            for old in top)
        slots = []
        for slot in self.slots:
            storage, span = self._memory_span(slot.index)
            start = slot.byte_range()[0]
            slots.append(replace(slot, storage=new_index[storage], byte_offset=span[0] - start))
        return storages, tuple(slots), layout.nbytes


def _leave_sms_to_collectives(steps: tuple[Step, ...], clocks: Clocks, sms: int | None) -> tuple[Step, ...]:
    """Mark the kernels that may run while a collective does (neither ordered before nor after it) to
    leave `sms` SMs free: a persistent GEMM takes every SM, and the collective's thread blocks would
    wait for it to finish instead of running beside it."""
    collectives = np.array([s.index for s in steps if ops.launches_collective(s.op)], dtype=np.int64)
    if sms is None or not len(collectives):
        return steps
    everything = np.arange(len(steps))
    beside = np.zeros(len(steps), dtype=bool)
    for c in collectives:
        beside |= ~clocks.before_all(c, everything) & ~clocks.after_all(c, everything)
    beside[collectives] = False
    return tuple(replace(s, sm_carveout=sms) if beside[s.index] and s.kind in (StepKind.KERNEL, StepKind.ALLOC)
                 else s for s in steps)


def _allocates(node: fx.Node) -> bool:
    """Whether lowering would allocate the node's result (no direct out= kernel)."""
    variant = ops.out_variant(node.target) if isinstance(node.target, OpOverload) else None
    return variant is None or not variant.direct


def _map_nodes(arg: Any, fn: Callable[[fx.Node], Any]) -> Any:
    """Apply fn to every fx Node in a nested argument, rebuilding fx's immutable containers as plain
    lists and tuples (aten ops reject the immutable ones)."""
    if isinstance(arg, fx.Node):
        return fn(arg)
    if isinstance(arg, list):
        return [_map_nodes(a, fn) for a in arg]
    if isinstance(arg, tuple):
        return tuple(_map_nodes(a, fn) for a in arg)
    if isinstance(arg, dict):
        return {k: _map_nodes(v, fn) for k, v in arg.items()}
    return arg


def _reads(step: Any) -> tuple[int, ...]:
    return step_reads(step.kind, step.args, step.kwargs)


def _writes(step: Any) -> tuple[int, ...]:
    return step_writes(step.kind, step.outputs)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _is_contiguous(layout: Layout) -> bool:
    return all(size == 1 or stride == expected
               for size, stride, expected in zip(layout.shape, layout.stride, contiguous_strides(layout.shape)))


def _is_dense(layout: Layout) -> bool:
    """Non-overlapping and dense: the elements exactly fill their byte range (any dimension order)."""
    numel = int(np.prod(layout.shape)) if layout.shape else 1
    return numel * layout.itemsize == layout.byte_range()[1] - layout.byte_range()[0] and \
        len(set(s for s, n in zip(layout.stride, layout.shape) if n > 1)) == sum(1 for n in layout.shape if n > 1)


def _out_call_is_faithful(node: fx.Node, variant: ops.OutVariant) -> bool:
    """Run the out= overload on fake tensors: it must write the functional result's exact layout in place.

    Repeated layers call the same ops on the same shapes, so the answer is cached per signature.
    """
    values = _values(node)
    fake_mode = getattr(values[0], "fake_mode", None)
    if fake_mode is None:
        return False
    args = _map_nodes(tuple(node.args), lambda n: n.meta["val"])
    kwargs = _map_nodes(dict(node.kwargs), lambda n: n.meta["val"])
    try:
        key = (variant.op, _meta_signature((args, kwargs)), _meta_signature(values))
        hash(key)
    except TypeError:
        return _run_out_call(fake_mode, variant, node.target, args, kwargs, values)
    if key not in _FAITHFUL:
        _FAITHFUL[key] = _run_out_call(fake_mode, variant, node.target, args, kwargs, values)
    return _FAITHFUL[key]


_FAITHFUL: dict[Any, bool] = {}


def _meta_signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return tuple(_meta_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _meta_signature(v)) for k, v in value.items())
    return value


def _run_out_call(fake_mode: Any, variant: ops.OutVariant, op: Any, args: tuple, kwargs: dict,
                  values: list[Any]) -> bool:
    pos, kw = variant.call_arguments(ops.bind_arguments(op, args, kwargs))
    try:
        with fake_mode:
            outs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in values]
            storages = [(_storage_key(o), o.untyped_storage().nbytes()) for o in outs]
            result = variant.op(*pos, **kw, **dict(zip(variant.out_names, outs)))
    except Exception:
        return False
    results = list(result) if isinstance(result, (list, tuple)) else [result]
    # An out= kernel may resize `out` on the way (mse_loss.out computes the unreduced loss in it first).
    # In the arena that would write past the buffer, so the storage must keep its identity and size.
    return len(results) == len(outs) and all(
        r.shape == v.shape and r.stride() == v.stride() and (_storage_key(r), r.untyped_storage().nbytes()) == before
        for r, v, before in zip(results, values, storages))
