"""Interpreting a Plan: memory binding and step execution shared by every runtime.

`BoundPlan` allocates what a plan needs once (the arena, constants, the results of `setup`) and turns
each step into a small closure over slot indices, so running a plan is a loop of closure calls. On
CUDA every plan stream maps to a `torch.cuda.Stream` and events to `torch.cuda.Event`s; on the CPU the
steps simply run in issue order, which the verifier proves is equivalent.
"""

from __future__ import annotations

from typing import Callable, Sequence

import optree
import torch

from ..compat import sm_carveout, sm_carveout_supported
from ..errors import InternalError, KernelError, KernelIndexError
from ..ir.formatting import type_str
from ..ir.ops import op_info
from ..ir.tree import picker
from ..plan.plan import Plan, Ref, Slot, Step, StepKind, Storage, StorageKind
from .collectives import all_reduce_on_current_stream

Env = list


def byte_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """`nbytes` uninitialized bytes on `device` (at least 16, so that even an empty plan has an address)."""
    return torch.empty(max(nbytes, 16), dtype=torch.uint8, device=device)


def view_of(buffer: torch.Tensor, offset: int, slot: Slot) -> torch.Tensor:
    """The tensor of `slot`, placed `offset` bytes into a raw byte buffer."""
    layout = slot.layout
    start = offset + slot.byte_offset
    if start % layout.itemsize:
        raise InternalError(f"slot {slot.name} is misaligned at byte {start}: memory planning must place every "
                            f"slot at a multiple of its element size")
    typed = buffer.view(layout.dtype)
    return typed.as_strided(layout.shape, layout.stride, start // layout.itemsize + layout.storage_offset)


_RUN_AS = {"_c10d_functional.all_reduce_": all_reduce_on_current_stream}
"""Plan ops (by `OpInfo.packet`) that run through another function with the same effect (see each function)."""


def compile_step(step: Step, carveout: bool = False) -> Callable[[Env], None]:
    """A closure that runs one step against an environment (a list indexed by slot); with `carveout`
    (CUDA), a step marked to leave SMs to a collective runs under cuBLAS's SM carveout. Only cuBLASLt
    honours the carveout (bench/streams.py: through PyTorch's default cuBLAS path a GEMM still took
    every SM), so such a step also prefers cuBLASLt for its GEMMs."""
    runner = _compile_step(step)
    if not (carveout and step.sm_carveout and sm_carveout_supported()):
        return runner
    reserved = step.sm_carveout

    def run_leaving_sms(env: Env) -> None:
        with sm_carveout(reserved):
            runner(env)
    return run_leaving_sms


def _compile_step(step: Step) -> Callable[[Env], None]:
    if step.kind in (StepKind.FORK, StepKind.JOIN):
        return lambda env: None
    if step.kind is StepKind.COPY:
        dst, src = step.args[0].slot, step.args[1].slot
        return lambda env: env[dst].copy_(env[src])

    leaves, spec = optree.tree_flatten((step.args, step.kwargs), is_leaf=lambda x: isinstance(x, Ref),
                                       none_is_leaf=True)
    refs = [(i, leaf.slot) for i, leaf in enumerate(leaves) if isinstance(leaf, Ref)]
    info = op_info(step.op)
    op = _RUN_AS.get(info.packet, step.op) if info is not None else step.op

    def arguments(env: Env) -> tuple[tuple, dict]:
        values = list(leaves)
        for position, slot in refs:
            values[position] = env[slot]
        return optree.tree_unflatten(spec, values)

    if step.kind is StepKind.KERNEL:
        outs = list(zip(step.out_names, step.outputs))

        def run_kernel(env: Env) -> None:
            args, kwargs = arguments(env)
            for name, slot in outs:
                kwargs[name] = env[slot]
            op(*args, **kwargs)
        return run_kernel

    outputs, indices = step.outputs, step.result_indices
    if not indices:
        only = outputs[0]

        def run_single(env: Env) -> None:
            args, kwargs = arguments(env)
            env[only] = op(*args, **kwargs)
        return run_single

    def run_multi(env: Env) -> None:
        args, kwargs = arguments(env)
        results = optree.tree_leaves(op(*args, **kwargs), none_is_leaf=True)
        for slot, index in zip(outputs, indices):
            env[slot] = results[index]
    return run_multi


def _release_schedule(plan: Plan) -> tuple[list[list[int]], list[list[int]]]:
    """When to drop each run-time tensor (after its last use, so the allocator can reuse its memory), and
    which reads cross streams from where a run-time allocation was made (they need `record_stream`)."""
    keep = set(plan.output_slots) | set(plan.input_slots)
    last_use: dict[int, int] = {}
    made_by: dict[int, int] = {}
    for step in plan.steps:
        for slot in step.outputs:
            if plan.slots[slot].bound:
                continue
            last_use.setdefault(slot, step.index)
            if step.kind is StepKind.ALLOC:
                made_by.setdefault(plan.slots[slot].storage, step.stream)
        for slot in step.reads():
            if slot in last_use:
                last_use[slot] = step.index
    release: list[list[int]] = [[] for _ in plan.steps]
    for slot, index in last_use.items():
        if slot not in keep:
            release[index].append(slot)
    foreign: list[list[int]] = [[] for _ in plan.steps]
    for step in plan.steps:
        for slot in step.reads():
            origin = made_by.get(plan.slots[slot].storage)
            if origin is not None and origin != step.stream:
                foreign[step.index].append(slot)
    return release, foreign


def kernel_error(plan: Plan, step: Step, env: Env, error: Exception) -> Exception:
    """What a step's failure raises: a `KernelError` naming the op, its node and its operands, since the
    kernel's own message names none of them (a `KernelIndexError` for an IndexError). Only torch's plain
    kernel checks are translated: an error of a class of its own (dynaflow_fn's, running out of memory,
    a custom op's, NotImplementedError), or the CPU allocator's failure, says what happened and may be
    caught by its class."""
    if type(error) not in (RuntimeError, IndexError) or "can't allocate memory" in str(error):
        return error
    operands = ", ".join(type_str(env[slot]) for slot in step.reads()) or "no tensors"
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__).rstrip(".")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        why = ("It ran before the capture and failed only inside the plan's CUDA graph capture: the op cannot be "
               "captured (it waits for the device, or allocates outside the graph's memory). backend=\"eager\" "
               "runs the plan without a graph.")
    else:
        why = ("Tracing accepted the op: the error depends on the values (an index out of range), or torch's "
               "shape-only (meta) kernel, which tracing runs, checks less than the real one (the dtypes of a "
               f"matrix product). Eager PyTorch raises the same error at the line of {plan.name} that calls the op.")
    kind = KernelIndexError if isinstance(error, IndexError) else KernelError
    return kind(f"df.jit({plan.name}): {step.op} (node {step.node}) failed on {operands}: {first}. {why}")


OUTPUT_ALIGNMENT = 256
"""Byte alignment of each output storage packed into one buffer (`BoundPlan.allocate_outputs`), as the
caching allocator aligns its own blocks, so kernels see the alignment they would see otherwise."""


class BoundPlan:
    """A plan with its arena, constants and setup results allocated and computed, ready to run many times.

    `arena`, when given, is memory of at least `plan.arena_nbytes` bytes the plan runs in instead of an
    arena of its own (one shared by plans that never run at once: `shared_pool`)."""

    def __init__(self, plan: Plan, device: torch.device, arena: torch.Tensor | None = None):
        self.plan = plan
        self.device = device
        self.outputs = picker(plan.output_slots)          # an env's output tensors, in one C call
        self.arena = arena if arena is not None else byte_buffer(plan.arena_nbytes, device)
        self.template: Env = [None] * len(plan.slots)
        for slot in plan.slots:
            storage = plan.storages[slot.storage]
            if slot.bound and storage.kind is StorageKind.ARENA:
                self.template[slot.index] = view_of(self.arena, storage.offset, slot)
            elif slot.bound and storage.kind is StorageKind.CONSTANT:
                constant = plan.constants[storage.constant]
                self.template[slot.index] = constant.to(device) if constant.device != device else constant
        for step in plan.setup:
            compile_step(step)(self.template)
        self.output_slots = [(slot, plan.storages[slot.storage]) for slot in plan.slots
                             if slot.bound and plan.storages[slot.storage].kind is StorageKind.OUTPUT]
        self.runners = [compile_step(step, carveout=device.type == "cuda") for step in plan.steps]
        self.release_after, self.cross_stream_reads = _release_schedule(plan)

    def new_env(self, inputs: Sequence[torch.Tensor]) -> Env:
        env = list(self.template)
        for slot, tensor in zip(self.plan.input_slots, inputs):
            env[slot] = tensor
        return env

    def allocate_outputs(self, env: Env, buffer: torch.Tensor | None = None) -> None:
        """Bind the output slots: each output storage in a buffer of its own, or all of them packed
        into `buffer` (at least `packed_outputs()[1]` bytes)."""
        if buffer is not None:
            offsets, _ = self.packed_outputs()
            for slot, storage in self.output_slots:
                env[slot.index] = view_of(buffer, offsets[storage.index], slot)
            return
        buffers: dict[int, torch.Tensor] = {}
        for slot, storage in self.output_slots:
            own = buffers.get(storage.index)
            if own is None:
                own = buffers[storage.index] = byte_buffer(storage.nbytes, self.device)
            env[slot.index] = view_of(own, 0, slot)

    def packed_outputs(self, extra: Sequence[Storage] = ()) -> tuple[dict[int, int], int]:
        """Byte offsets of the output storages (and `extra` ones) packed into one buffer, by storage
        index, and the buffer's size: a multiple of the alignment, so that views of any dtype fit."""
        aligned = lambda nbytes: -(-nbytes // OUTPUT_ALIGNMENT) * OUTPUT_ALIGNMENT   # noqa: E731
        offsets: dict[int, int] = {}
        end = 0
        for storage in [s for _, s in self.output_slots] + list(extra):
            if storage.index not in offsets:
                offsets[storage.index] = aligned(end)
                end = offsets[storage.index] + storage.nbytes
        return offsets, aligned(end)

    def run(self, env: Env, streams: Sequence[torch.cuda.Stream] | None = None,
            events: Sequence[torch.cuda.Event] | None = None) -> None:
        """Run every step; with streams, each on its own stream with its event waits and records."""
        release = self.release_after
        if streams is None:
            for step, runner, dead in zip(self.plan.steps, self.runners, release):
                try:
                    runner(env)
                except (RuntimeError, IndexError) as error:
                    raise kernel_error(self.plan, step, env, error) from error
                for slot in dead:
                    env[slot] = None
            return
        entry, on = torch.cuda.current_stream(self.device), None
        with torch.cuda.device(self.device):        # set_stream makes the stream's device current too
            try:
                for step, runner, dead, foreign in zip(self.plan.steps, self.runners, release,
                                                       self.cross_stream_reads):
                    stream = streams[step.stream]
                    for event in step.waits:
                        stream.wait_event(events[event])
                    for slot in foreign:
                        env[slot].record_stream(stream)
                    if step.stream != on:           # a switch only where the plan changes streams
                        torch.cuda.set_stream(stream)
                        on = step.stream
                    try:
                        runner(env)
                    except (RuntimeError, IndexError) as error:
                        raise kernel_error(self.plan, step, env, error) from error
                    for event in step.records:
                        events[event].record(stream)
                    for slot in dead:
                        env[slot] = None
            finally:
                torch.cuda.set_stream(entry)
