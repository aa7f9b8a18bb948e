"""The cudagraph runtime: capture the whole multi-stream Plan once into one CUDA graph; replay it.

At bind time every tensor the plan touches gets a fixed address: the arena, the output buffers, and a
static buffer per input. Some inputs are *resident*: `nn.Parameter`s, donated and persistent
arguments and the tensors the function closes over; the graph reads (and, for donated ones, writes)
the caller's own tensor at its own address, so they are never copied. The others are *copied in*:
copied into their static buffers before each replay. If a resident tensor later arrives at a
different address, the executable reports it and `jit` captures again. The graph reads resident
inputs by address and keeps no reference to them: memory the caller lets go of (the KV cache of an
earlier transformers generate() call) is freed at once, not when the graph is next captured.

A call is: copy the copied-in inputs, replay, then clone the outputs (or hand out the static
outputs themselves when the caller asked for them; the next call overwrites those). Calls take turns
(`Turns`): the static buffers are shared. Capture restricts only its own thread's CUDA calls
("thread_local" mode), so other threads keep running CUDA work while a plan is captured.

Memory the graph replays into. Everything a captured kernel touches must stay allocated, and to
this graph, for as long as the graph lives: the arena, outputs and static inputs are held by the
executable, and allocations made during capture come from the graph's private pool. One thing
escapes that: cuBLAS keeps a workspace per (handle, stream) that it allocates on first use and
reuses, so a GEMM captured on a stream that already ran a GEMM (the warm-up does) bakes in a
workspace from the general pool. Whoever clears cuBLAS's workspaces then (torch.compile's CUDA
graphs do, around each of their captures) frees it while this graph still writes into it, and the
next replay corrupts whatever took that memory ("unspecified launch failure"). So capture starts
from cleared workspaces, making cuBLAS allocate fresh ones inside this graph's private pool, which
only this graph uses and which lives as long as it does; and clears them again afterwards, so that
eager work never reuses memory the graph writes into during its replays.

Python's cyclic collector and captures. A dropped jitted function is cyclic garbage, and destroying
its graph while a stream captures invalidates that capture. So the collector is paused over each of
our captures (`without_automatic_gc`), and a graph whose executable the collector frees inside
someone else's capture (torch.compile's, a hand-written one) is destroyed after it (`_release_graph`).

What an executable holds, `held_bytes`, is counted in two parts, neither of which sees cuBLAS's
workspaces or the allocator's cache come and go: the buffers bound before the warm-up
(`torch.cuda.memory_allocated` grows by them), and the segments the capture added to the caching
allocator (`pool_bytes`: the growth of `torch.cuda.memory_reserved` over the capture, read once
`torch.cuda.graph` has emptied the allocator's cache of free blocks, which it does on entering). The
second counts what the graph's temporaries and workspaces occupy in its pool, though they are free
blocks once the capture ends; and a capture into a shared pool that reuses blocks an earlier capture
freed adds nothing. Counting `memory_allocated` across the whole capture went wrong both ways: the
first clearing frees workspaces allocated before (by the warm-up, by the caller's own GEMMs), down to
a negative count, and the temporaries were not counted at all.

A resident input that moved is captured again into a new executable made from the one it replaces
(`previous`): the bound plan, the static input and output buffers and the streams are the same, and
the warm-up run is left out when the previous executable was captured on this thread, since the
libraries and kernels it initializes (cuBLAS handles, Triton modules) are initialized by then. A
transformers generate() call that builds a new KV cache pays for one capture run, not two runs and a
bind.

Executables given a `SharedPool` (the plans of one function's batch buckets) run in its buffers and
capture into its one graph pool instead, taking its turns, captures included: the warm-up run writes
the shared buffers too. What a graph allocates while it runs and returns (an op without an out=
kernel computing an output) is copied into the shared output buffer at the end of the graph, so that
the pool memory each capture allocated is free again for the next capture.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from typing import Any, Iterator, Sequence

import torch

from .. import compat
from ..errors import ResidentInputMoved
from ..plan.plan import Plan, StorageKind
from .interpreter import BoundPlan, view_of
from .shared_pool import SharedPool
from .turns import Turns


_gc_paused = 0                  # captures under way that keep Python's cyclic collector from running
_gc_was_enabled = False
_gc_lock = threading.Lock()


@contextlib.contextmanager
def without_automatic_gc() -> Iterator[None]:
    """Keep Python's cyclic garbage collector from running inside: a capture must not free a CUDA graph.

    The collector runs whenever enough objects were allocated, in whichever thread allocates, and a
    capture allocates Python objects as it runs the plan's steps. Garbage it finds may hold a CUDA graph
    (a jitted function dropped in a reference cycle, an old torch.compile graph): destroying that graph
    then is an operation CUDA forbids while this thread captures, which invalidates the capture ("operation
    failed due to a previous error during capture", seen first as a failed cuBLAS launch) and leaves the
    process's CUDA generator unable to capture again. torch.cuda.graph no longer collects before a capture
    (torch.compiler.config.force_cudagraph_gc is off by default), so the collector is paused instead, for
    as long as any thread captures, and whatever it would have collected is collected after."""
    global _gc_paused, _gc_was_enabled
    with _gc_lock:
        if _gc_paused == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_paused += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_paused -= 1
            if _gc_paused == 0 and _gc_was_enabled:
                gc.enable()


_kept_from_a_capture: list[torch.cuda.CUDAGraph] = []
"""Graphs of executables that died while their thread's stream was capturing (see `_release_graph`)."""


def _release_graph(graph: torch.cuda.CUDAGraph) -> None:
    """Let go of a dead executable's graph: destroyed, unless this thread's stream is capturing now.

    An executable dies when the cyclic collector frees it (a dropped jitted function is always cyclic
    garbage), and the collector also runs inside captures that are not ours: torch.compile's, a
    hand-written torch.cuda.graph. Destroying a graph there invalidates that capture, so the graph is
    kept instead, until the next graph let go of outside a capture or the next capture of ours."""
    if torch.cuda.is_current_stream_capturing():
        _kept_from_a_capture.append(graph)
    else:
        _kept_from_a_capture.clear()


class CudaGraphExecutable:
    """A Plan captured into one CUDA graph for inputs of fixed layouts (see the module docstring).

    `resident` says per input whether the graph reads it at its own address (else it is copied in).
    With `memory`, the executable runs in the arena, output and static input buffers of a
    `SharedPool`, captures into its graph pool and takes its turns (see `shared_pool`). `previous` is
    the executable of this plan that this one replaces, built for inputs that have since moved: its
    memory and streams are reused (see the module docstring)."""

    def __init__(self, plan: Plan, device: torch.device, inputs: Sequence[torch.Tensor],
                 resident: Sequence[bool], static_outputs: bool = False, memory: SharedPool | None = None,
                 previous: CudaGraphExecutable | None = None):
        self.plan = plan
        self.static_outputs = static_outputs
        self.memory = memory
        self.turns = previous.turns if previous else memory.turns if memory is not None else Turns(device)
        allocated = torch.cuda.memory_allocated(device)
        with self.turns:                       # shared buffers are written from here on: by the warm-up run
            self.bound = (previous.bound if previous else
                          BoundPlan(plan, device, memory.buffer("arena", plan.arena_nbytes) if memory else None))
            self.static_inputs = [tensor if is_resident else self._static_input(i, tensor, device, previous)
                                  for i, (tensor, is_resident) in enumerate(zip(inputs, resident))]
            self.copied = [i for i, is_resident in enumerate(resident) if not is_resident]
            self.resident = [i for i, is_resident in enumerate(resident) if is_resident]
            self.addresses = [tensor.data_ptr() if is_resident else None
                              for tensor, is_resident in zip(inputs, resident)]
            self.written_inputs = plan.written_inputs()
            self.write_back = [i for i in self.written_inputs if not resident[i]]
            self.env = self.bound.new_env(self.static_inputs)
            self.copied_out = self._bind_outputs(previous)
            input_position = {slot: i for i, slot in enumerate(plan.input_slots)}
            self.output_input = [input_position.get(slot) for slot in plan.output_slots]
            bound_bytes = torch.cuda.memory_allocated(device) - allocated
            self._capture(device, inputs, previous)
            weakref.finalize(self, _release_graph, self.graph).atexit = False
            self.held_bytes = bound_bytes + self.pool_bytes
            for i in self.resident:           # read by address: the caller's tensors stay the caller's to free
                self.static_inputs[i] = self.env[plan.input_slots[i]] = None

    def _static_input(self, index: int, tensor: torch.Tensor, device: torch.device,
                      previous: CudaGraphExecutable | None) -> torch.Tensor:
        if previous is not None and previous.static_inputs[index] is not None:
            return previous.static_inputs[index]                   # the plan's layout: the same buffer fits
        if self.memory is not None:
            return self.memory.static_input(index, tensor)
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)

    def _bind_outputs(self, previous: CudaGraphExecutable | None) -> list[tuple[int, torch.Tensor]]:
        """Bind the output buffers (those of `previous`, if given); with shared memory, all of them in
        its output buffer, and the outputs that steps allocate while the graph runs (ops without an out=
        kernel) copied there at the end of the graph, so that no graph keeps memory of its own in the
        shared pool. Returns those (slot, buffer view) pairs."""
        if previous is not None:
            for slot, _ in self.bound.output_slots:
                self.env[slot.index] = previous.env[slot.index]
            return previous.copied_out
        if self.memory is None:
            self.bound.allocate_outputs(self.env)
            return []
        plan = self.plan
        allocated = list(dict.fromkeys(slot for slot in plan.output_slots
                                       if plan.storages[plan.slots[slot].storage].kind is StorageKind.DYNAMIC))
        offsets, nbytes = self.bound.packed_outputs([plan.storages[plan.slots[slot].storage] for slot in allocated])
        buffer = self.memory.buffer("outputs", nbytes)
        self.bound.allocate_outputs(self.env, buffer)
        return [(slot, view_of(buffer, offsets[plan.slots[slot].storage], plan.slots[slot])) for slot in allocated]

    def _capture(self, device: torch.device, inputs: Sequence[torch.Tensor],
                 previous: CudaGraphExecutable | None) -> None:
        """Warm up once outside the graph (lazy library initialization must not be captured), on clones
        of the inputs the plan writes, so the caller's tensors change only when the call really runs;
        then capture, with cuBLAS workspaces allocated inside the graph (see the module docstring).
        Captured again on the thread of `previous`, the warm-up is done already."""
        self.captured_on = threading.get_ident()
        memory = self.memory
        if previous is not None:
            streams, events = previous.streams, previous.events
        else:
            side = [(k, s.priority) for k, s in enumerate(self.plan.streams) if k > 0]
            streams = ([memory.stream(0, 0)] + [memory.stream(k, p) for k, p in side] if memory is not None else
                       [torch.cuda.Stream(device)] + [torch.cuda.Stream(device, priority=p) for _, p in side])
            events = [torch.cuda.Event() for _ in range(self.plan.num_events)]
        self.streams, self.events = streams, events
        capture_stream = streams[0]
        if previous is None or previous.captured_on != self.captured_on:
            self._load_inputs(inputs)
            warm_env = list(self.env)
            for i in self.written_inputs:
                warm_env[self.plan.input_slots[i]] = self.static_inputs[i].clone()
            capture_stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(capture_stream), torch.no_grad():
                self.bound.run(warm_env, streams, events)
            torch.cuda.current_stream(device).wait_stream(capture_stream)
            torch.cuda.synchronize(device)
        self._load_inputs(inputs)
        _kept_from_a_capture.clear()
        self.graph = torch.cuda.CUDAGraph()
        compat.clear_cublas_workspaces()
        try:
            with without_automatic_gc(), torch.no_grad(), \
                    torch.cuda.graph(self.graph, pool=memory.graph_pool if memory is not None else None,
                                     stream=capture_stream, capture_error_mode="thread_local"):
                reserved = torch.cuda.memory_reserved(device)     # entering emptied the allocator's cache
                self.bound.run(self.env, streams, events)
                for slot, buffer in self.copied_out:        # the plan joined every stream into this one
                    buffer.copy_(self.env[slot])
        finally:
            compat.clear_cublas_workspaces()
        for slot, buffer in self.copied_out:                # the allocated outputs return to the pool
            self.env[slot] = buffer
        self.pool_bytes = torch.cuda.memory_reserved(device) - reserved

    def _load_inputs(self, inputs: Sequence[torch.Tensor]) -> None:
        for i in self.copied:
            source = inputs[i]
            if source is not self.static_inputs[i]:
                self.static_inputs[i].copy_(source.detach() if source.requires_grad else source)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> Sequence[Any]:
        if not compat.data_ptrs_equal(inputs, self.addresses, self.resident):
            raise ResidentInputMoved()
        with self.turns:
            self._load_inputs(inputs)
            self.graph.replay()
            if self.write_back:
                with torch.no_grad():
                    for i in self.write_back:
                        inputs[i].copy_(self.static_inputs[i])
            outputs = self.bound.outputs(self.env)
            cloned: dict[int, torch.Tensor] = {}
            results = []
            for tensor, input_index, slot in zip(outputs, self.output_input, self.plan.output_slots):
                if input_index is not None:
                    results.append(inputs[input_index])
                elif self.static_outputs:
                    results.append(tensor)
                else:
                    if slot not in cloned:
                        cloned[slot] = tensor.clone()
                    results.append(cloned[slot])
            return results
