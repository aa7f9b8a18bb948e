"""The Plan: a flat, printable list of steps over preallocated storage. Data, not code.

A Plan says, for one set of input shapes, exactly what runs: each step's stream, op, argument slots,
output slots and the events it waits for and records. Memory is described by `Storage`s (the caller's
inputs, one arena of scratch memory at fixed offsets, outputs, constants, and results of ops that
still allocate) and `Slot`s (tensor views into a storage). Backends only interpret this data.
`print(plan)` lists it under the header a Program prints too (`ir.formatting`).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import optree
import torch

from ..ir.formatting import dtype_name, format_arg, format_bytes, header, op_name
from ..ir.program import Stream
from ..ir.signature import HasSignature, Signature
from ..ir.tree import TensorSpec


class StorageKind(str, enum.Enum):
    INPUT = "input"          # a caller's tensor
    ARENA = "arena"          # scratch memory at a fixed byte offset of the plan's arena
    OUTPUT = "output"        # memory that outlives the call: returned to the caller
    CONSTANT = "constant"    # computed once when the plan is bound, or a constant of the program
    DYNAMIC = "dynamic"      # allocated at run time by an op that has no out= overload


@dataclass(frozen=True)
class Storage:
    index: int
    kind: StorageKind
    nbytes: int
    offset: int = 0                   # ARENA: byte offset in the arena
    input_index: int | None = None    # INPUT: position among the flat tensor inputs
    constant: str | None = None       # CONSTANT: name of a program constant (None: computed by setup)


@dataclass(frozen=True)
class Layout(TensorSpec):
    """A TensorSpec placed in memory: its element offset inside its storage as well."""

    storage_offset: int = 0

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Layout":
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device, tensor.storage_offset())

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def byte_range(self) -> tuple[int, int]:
        """[first, last) bytes this view touches, relative to its storage start."""
        if any(size == 0 for size in self.shape):
            start = self.storage_offset * self.itemsize
            return start, start
        last = self.storage_offset + sum((size - 1) * stride for size, stride in zip(self.shape, self.stride))
        return self.storage_offset * self.itemsize, (last + 1) * self.itemsize

    def __str__(self) -> str:
        return f"{dtype_name(self.dtype)}{list(self.shape)}"


@dataclass(frozen=True)
class Slot:
    """A tensor value of the plan: a view of `storage` starting `byte_offset` bytes into it."""

    index: int
    name: str
    layout: Layout
    storage: int
    byte_offset: int = 0
    bound: bool = False   # materialized when the plan is bound (inputs, planned roots); else made by a step

    def byte_range(self) -> tuple[int, int]:
        start, end = self.layout.byte_range()
        return self.byte_offset + start, self.byte_offset + end


@dataclass(frozen=True)
class Ref:
    """An argument that is a plan slot (everything else in `Step.args` is a Python constant)."""

    slot: int

    def __repr__(self) -> str:
        return f"%{self.slot}"


class StepKind(str, enum.Enum):
    KERNEL = "kernel"    # an out= overload writing into bound output slots
    ALLOC = "alloc"      # a functional op whose result is allocated at run time
    VIEW = "view"        # a view op: no kernel, no memory
    COPY = "copy"        # outputs[0].copy_(args[0]): write-backs into inputs, outputs that alias inputs
    FORK = "fork"        # the capture stream records an event that side streams wait on
    JOIN = "join"        # the capture stream waits for every side stream


@dataclass(frozen=True)
class Step:
    index: int
    kind: StepKind
    stream: int
    op: Any = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    outputs: tuple[int, ...] = ()
    out_names: tuple[str, ...] = ()
    waits: tuple[int, ...] = ()
    records: tuple[int, ...] = ()
    node: str = ""
    note: str = ""
    result_indices: tuple[int, ...] = ()   # ALLOC/VIEW of a multi-result op: which result feeds each output
    sm_carveout: int | None = None         # SMs the step's GEMMs leave free for a collective running beside it

    def reads(self) -> tuple[int, ...]:
        return self._reads

    @functools.cached_property
    def _reads(self) -> tuple[int, ...]:
        """Computed once: a step never changes, and lowering, the verifier and every binding of the plan
        (a capture, and each capture again) ask for each step's reads."""
        return step_reads(self.kind, self.args, self.kwargs)

    def writes(self) -> tuple[int, ...]:
        return step_writes(self.kind, self.outputs)


def step_reads(kind: StepKind, args: tuple, kwargs: dict) -> tuple[int, ...]:
    """Slots whose data a step reads: its slot arguments (for a VIEW, the base whose data the view
    exposes), except the destination of a COPY, which is only written."""
    if kind is StepKind.COPY:
        args = args[1:]
    refs = optree.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, Ref), none_is_leaf=True)
    return tuple(dict.fromkeys(leaf.slot for leaf in refs if isinstance(leaf, Ref)))


def step_writes(kind: StepKind, outputs: tuple[int, ...]) -> tuple[int, ...]:
    """Slots a step writes data into (views and fork/join write nothing)."""
    return tuple(outputs) if kind in (StepKind.KERNEL, StepKind.ALLOC, StepKind.COPY) else ()


@dataclass(frozen=True)
class Plan(HasSignature):
    """A static schedule for one input signature of the traced function whose `Signature` it keeps.
    `print(plan)` shows streams, steps and buffers."""

    signature: Signature
    streams: tuple[Stream, ...]
    storages: tuple[Storage, ...]
    slots: tuple[Slot, ...]
    setup: tuple[Step, ...]
    steps: tuple[Step, ...]
    num_events: int
    input_slots: tuple[int, ...]      # the flat tensor inputs: the arguments', then the closed-over ones
    output_slots: tuple[int, ...]
    arena_nbytes: int
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    provenance: tuple[str, ...] = ()

    # --- summaries ------------------------------------------------------------------------------

    def allocating_steps(self) -> list[Step]:
        return [s for s in self.steps if s.kind is StepKind.ALLOC]

    def copy_steps(self) -> list[Step]:
        return [s for s in self.steps if s.kind is StepKind.COPY]

    def kernel_steps(self) -> list[Step]:
        return [s for s in self.steps if s.kind in (StepKind.KERNEL, StepKind.ALLOC, StepKind.COPY)]

    def written_inputs(self) -> list[int]:
        """Positions of the flat tensor inputs that some step writes (write-backs, donated updates)."""
        written = {self.storages[self.slots[slot].storage].input_index for step in self.steps
                   for slot in step.writes() if self.storages[self.slots[slot].storage].kind is StorageKind.INPUT}
        return sorted(written)

    def storage_bytes(self, kind: StorageKind) -> int:
        return sum(s.nbytes for s in self.storages if s.kind is kind)

    def closed_over_slots(self) -> tuple[int, ...]:
        """The input slots bound to the `closed_over` tensors, which come after the arguments'."""
        return self.input_slots[len(self.input_slots) - len(self.closed_over):]

    def __str__(self) -> str:
        return format_plan(self)

    def __repr__(self) -> str:
        return (f"<Plan {self.name}: {len(self.streams)} streams, {len(self.steps)} steps, "
                f"arena {format_bytes(self.arena_nbytes)}>")


# --- printing: the header is the one Programs print (ir.formatting); the steps are the Plan's own ---


def format_step(step: Step, slots: Sequence[Slot], place: Callable[[int], str]) -> str:
    """One step as a line: its stream, the events it waits for, the call with slots by name, where a
    kernel writes (`place` of each output slot), what it is, and the events it records."""
    outs = ", ".join(slots[i].name for i in step.outputs)
    sync = "".join(f" wait(e{e})" for e in step.waits)
    after = "".join(f" record(e{e})" for e in step.records)
    if step.kind in (StepKind.FORK, StepKind.JOIN):
        return f"s{step.stream}  {step.kind.value}{sync}{after}"
    literal = lambda value: slots[value.slot].name if isinstance(value, Ref) else repr(value)
    args = [format_arg(a, literal) for a in step.args]
    args += [f"{k}={format_arg(v, literal)}" for k, v in step.kwargs.items()]
    if step.kind is StepKind.COPY:
        call = f"{outs}.copy_({args[1]})"
    else:
        call = f"{outs} = {op_name(step.op)}({', '.join(args)})"
    where = ""
    if step.kind is StepKind.KERNEL:
        where = "  -> " + ", ".join(place(i) for i in step.outputs)
    tag = {StepKind.ALLOC: "  [allocates]", StepKind.COPY: "  [copy]", StepKind.VIEW: "  [view]"}.get(step.kind, "")
    note = f"  ({step.note})" if step.note else ""
    carveout = f"  [leaves {step.sm_carveout} SMs]" if step.sm_carveout else ""
    return f"s{step.stream} {sync.strip()+' ' if sync else ''}{call}{where}{tag}{carveout}{note}{after}"


def format_plan_step(plan: Plan, step: Step) -> str:
    return format_step(step, plan.slots, lambda slot_index: _slot_place(plan, slot_index))


def _slot_place(plan: Plan, slot_index: int) -> str:
    slot = plan.slots[slot_index]
    storage = plan.storages[slot.storage]
    if storage.kind is StorageKind.ARENA:
        return f"arena@{storage.offset + slot.byte_offset}"
    return f"{storage.kind.value}{storage.index}" + (f"+{slot.byte_offset}" if slot.byte_offset else "")


def format_plan(plan: Plan) -> str:
    arena = [s for s in plan.storages if s.kind is StorageKind.ARENA]
    outputs = [s for s in plan.storages if s.kind is StorageKind.OUTPUT]
    allocs, copies = plan.allocating_steps(), plan.copy_steps()
    lines = header(f"Plan {plan.name} on {plan.device}", plan.provenance, plan.streams, plan.signature,
                   [plan.slots[i].name for i in plan.closed_over_slots()])
    lines += [
        f"# {len(plan.steps)} steps, {len(plan.kernel_steps())} launch kernels, {plan.num_events} events",
        f"# arena: {format_bytes(plan.arena_nbytes)} holding {len(arena)} buffers "
        f"({format_bytes(plan.storage_bytes(StorageKind.ARENA))} unshared); outputs: {len(outputs)} buffers, "
        f"{format_bytes(plan.storage_bytes(StorageKind.OUTPUT))}",
        f"# allocates: {len(allocs)} steps" + (" (" + ", ".join(sorted({op_name(s.op) for s in allocs})) + ")" if allocs else ""),
        f"# copies: {len(copies)} steps" + (" (" + ", ".join(sorted({s.note or 'copy' for s in copies})) + ")" if copies else ""),
    ]
    if plan.setup:
        lines.append(f"# setup (once, when bound): {len(plan.setup)} steps")
        lines += ["    " + format_plan_step(plan, s) for s in plan.setup]
    lines.append("steps:")
    lines += ["    " + format_plan_step(plan, s) for s in plan.steps]
    if arena:
        lines.append("arena buffers:")
        for storage in sorted(arena, key=lambda s: (s.offset, s.index)):
            names = [slot.name for slot in plan.slots if slot.storage == storage.index and slot.bound]
            lines.append(f"    [{storage.offset:>10}, {storage.offset + storage.nbytes:>10})  "
                         f"{format_bytes(storage.nbytes):>10}  {', '.join(names)}")
    return "\n".join(lines)
