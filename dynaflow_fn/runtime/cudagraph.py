"""The cudagraph runtime: capture the whole multi-stream Plan once into one CUDA graph; replay it.

At bind time every tensor the plan touches gets a fixed address: the arena, the output buffers, and a
static buffer per input. Some inputs are *resident*: `nn.Parameter`s, donated and persistent
arguments and the tensors the function closes over; the graph reads (and, for donated ones, writes)
the caller's own tensor at its own address, so they are never copied. The others are *copied in*:
copied into their static buffers before each replay. If a resident tensor later arrives at a
different address, the executable reports it and `jit` captures again. The graph reads resident
inputs by address and keeps no reference to them: memory the caller lets go of (the KV cache of an
earlier transformers generate() call) is freed at once, not when the graph is next captured.

A call is: copy the copied-in inputs in (`copy_in`: one copy per dtype), replay, then hand out the
graph's own output buffers, no copy made (`runtime.handouts`). A replay overwrites those buffers, so
a call replays only a capture whose outputs no caller holds any more. A caller that keeps one call's
results while it makes the next (`loss = step(batch)` in a loop) holds the outputs of the capture it
last ran, so the call captures the plan again, into outputs of its own (`_another_capture`), and the
two alternate; only a caller that keeps more results than that gets copies, from a third capture,
whose outputs are cloned on every call. Outputs that cannot be aliased are cloned from any capture,
and outputs that are inputs are returned as they are. With `static_outputs` the one capture's
buffers are handed out on every call, held or not: the caller asked for them to be overwritten. A
handout read on another stream is safe where that stream is made to wait before the handout is let
go of; `record_stream`, which protects a freed tensor from the caching allocator, does not reach
memory the graph reuses. Calls take turns (`Turns`): the static buffers are shared. Capture
restricts only its own thread's CUDA calls ("thread_local" mode), so other threads keep running CUDA
work while a plan is captured.

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
someone else's capture (torch.compile's, a hand-written one) is destroyed after it (`_release_graphs`).

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
(`previous`): the bound plan, the static input and output buffers and the streams are the same (the
output buffers of its first capture, with their handouts, so that results callers still hold of the
old executable count), and the warm-up run is left out when the previous executable was captured on this thread, since the
libraries and kernels it initializes (cuBLAS handles, Triton modules) are initialized by then. A
transformers generate() call that builds a new KV cache pays for one capture run, not two runs and a
bind.

Executables given a `SharedPool` (the plans of one function's batch buckets) run in its buffers and
capture into its one graph pool instead, taking its turns, captures included: the warm-up run writes
the shared arena and static inputs too (never output buffers: it runs into outputs of its own, since
a caller may hold the graph's). What a graph allocates while it runs and returns (an op without an
out= kernel computing an output) is copied into the shared output buffer at the end of the graph, so
that the pool memory each capture allocated is free again for the next capture. Each capture number
of every bucket plan binds its outputs in one shared buffer per number, handed out through one
`Handouts`: a held result of one bucket keeps every bucket from writing it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import compat, native
from ..errors import ResidentInputMoved
from ..plan.plan import Plan, StorageKind
from .copy_in import CopyIn
from .handouts import Handouts
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
"""Graphs of executables that died while their thread's stream was capturing (see `_release_graphs`)."""


def _release_graphs(graphs: list[torch.cuda.CUDAGraph]) -> None:
    """Let go of a dead executable's graphs: destroyed, unless this thread's stream is capturing now.

    An executable dies when the cyclic collector frees it (a dropped jitted function is always cyclic
    garbage), and the collector also runs inside captures that are not ours: torch.compile's, a
    hand-written torch.cuda.graph. Destroying a graph there invalidates that capture, so the graphs are
    kept instead, until the next graph let go of outside a capture or the next capture of ours."""
    if torch.cuda.is_current_stream_capturing():
        _kept_from_a_capture.extend(graphs)
    else:
        _kept_from_a_capture.clear()


HANDED_OUT_CAPTURES = 2
"""How many captures of a plan hand out their outputs, at most, before one more capture is made whose
outputs are copied out: a caller that keeps each call's results while it makes the next call
(`loss = step(batch)` in a loop) alternates between two, and only one that keeps more needs copies."""


class Capture:
    """One capture of an executable's plan: its graph, and how a replay's results are made from what
    the graph wrote, per output: the input returned as it is (`from_input`: its index, or None), a
    handout of the graph's own buffer (`makers`), or a clone. `handouts` is what hands out the memory
    the graph writes, None for a capture whose outputs are all copied out. A capture of a bucket plan
    keeps its pool's `handouts` even if it hands out nothing itself: other buckets' results in the
    buffer it writes count."""

    def __init__(self, graph: torch.cuda.CUDAGraph, outputs: Sequence[torch.Tensor], slots: Sequence[int],
                 from_input: Sequence[int | None], pool_bytes: int, handouts: Handouts | None,
                 makers: Sequence[Callable[[], torch.Tensor] | None]):
        self.graph, self.outputs, self.pool_bytes, self.handouts = graph, list(outputs), pool_bytes, handouts
        self.results_from = list(zip(self.outputs, slots, from_input, makers))

    def free(self) -> bool:
        """Whether a replay may write this capture's outputs now: no caller holds any of its handouts."""
        return self.handouts is None or not self.handouts.held()

    def results(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A replay's results: one tensor per output slot, however often the plan returns it."""
        made: dict[int, torch.Tensor] = {}
        results = []
        for tensor, slot, input_index, maker in self.results_from:
            if input_index is not None:
                results.append(inputs[input_index])
                continue
            if slot not in made:
                made[slot] = maker() if maker is not None else tensor.clone()
            results.append(made[slot])
        return results


class CudaGraphExecutable:
    """A Plan captured into CUDA graphs for inputs of fixed layouts (see the module docstring).

    `resident` says per input whether the graphs read it at its own address (else it is copied in).
    With `memory`, the executable runs in the arena, output and static input buffers of a
    `SharedPool`, captures into its graph pool and takes its turns (see `shared_pool`). `previous` is
    the executable of this plan that this one replaces, built for inputs that have since moved: its
    memory and streams are reused (see the module docstring). `on_capture` hears of each capture made
    after the first (when a call finds the outputs of every capture held), with the bytes it holds."""

    def __init__(self, plan: Plan, device: torch.device, inputs: Sequence[torch.Tensor],
                 resident: Sequence[bool], static_outputs: bool = False, memory: SharedPool | None = None,
                 previous: CudaGraphExecutable | None = None, on_capture: Callable[[int], None] | None = None):
        self.plan = plan
        self.device = device
        self.static_outputs = static_outputs
        self.memory = memory
        self.on_capture = on_capture
        self.turns = previous.turns if previous else memory.turns if memory is not None else Turns(device)
        allocated = torch.cuda.memory_allocated(device)
        with self.turns:                       # shared buffers are written from here on: by the warm-up run
            self.bound = (previous.bound if previous else
                          BoundPlan(plan, device, memory.buffer("arena", plan.arena_nbytes) if memory else None))
            self.static_inputs = [tensor if is_resident else self._static_input(i, tensor, device, previous)
                                  for i, (tensor, is_resident) in enumerate(zip(inputs, resident))]
            self.copied = [i for i, is_resident in enumerate(resident) if not is_resident]
            self.copy_in = CopyIn(self.static_inputs, self.copied, inputs, device)
            self.resident = [i for i, is_resident in enumerate(resident) if is_resident]
            self.addresses = [tensor.data_ptr() if is_resident else None
                              for tensor, is_resident in zip(inputs, resident)]
            self.at_captured_addresses = _address_check(self.addresses, self.resident)
            self.written_inputs = plan.written_inputs()
            self.write_back = [i for i in self.written_inputs if not resident[i]]
            input_position = {slot: i for i, slot in enumerate(plan.input_slots)}
            self.output_input = [input_position.get(slot) for slot in plan.output_slots]
            self.env = self.bound.new_env(self.static_inputs)
            copied_out = self._bind_outputs(self.env, _output_role(0), previous)
            bound_bytes = torch.cuda.memory_allocated(device) - allocated
            self._set_streams(device, previous)
            if previous is None or previous.captured_on != threading.get_ident():
                self._warm_up(inputs, self.env)
            self.captured_on = threading.get_ident()
            first = self._capture(self.env, copied_out, _output_role(0),
                                  previous.captures[0].handouts if previous is not None else None)
            self.copied_out = copied_out
            self.captures = [first]
            self._graphs = [first.graph]
            weakref.finalize(self, _release_graphs, self._graphs).atexit = False
            self.held_bytes = bound_bytes + first.pool_bytes
            self.private_bytes = first.pool_bytes if memory is None else 0
            for i in self.resident:           # read by address: the caller's tensors stay the caller's to free
                self.static_inputs[i] = self.env[plan.input_slots[i]] = None

    def _static_input(self, index: int, tensor: torch.Tensor, device: torch.device,
                      previous: CudaGraphExecutable | None) -> torch.Tensor:
        if previous is not None and previous.static_inputs[index] is not None:
            return previous.static_inputs[index]                   # the plan's layout: the same buffer fits
        if self.memory is not None:
            return self.memory.static_input(index, tensor)
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)

    def _bind_outputs(self, env: list, role: str, previous: CudaGraphExecutable | None,
                      ) -> list[tuple[int, torch.Tensor]]:
        """Bind the output buffers in `env` (those of `previous`'s first capture, if given); with shared
        memory, all of them in its output buffer for `role`, and the outputs that steps allocate while
        the graph runs (ops without an out= kernel) copied there at the end of the graph, so that no
        graph keeps memory of its own in the shared pool. Returns those (slot, buffer view) pairs."""
        if previous is not None:
            for slot, _ in self.bound.output_slots:
                env[slot.index] = previous.env[slot.index]
            return previous.copied_out
        if self.memory is None:
            self.bound.allocate_outputs(env)
            return []
        plan = self.plan
        allocated = list(dict.fromkeys(slot for slot in plan.output_slots
                                       if plan.storages[plan.slots[slot].storage].kind is StorageKind.DYNAMIC))
        offsets, nbytes = self.bound.packed_outputs([plan.storages[plan.slots[slot].storage] for slot in allocated])
        buffer = self.memory.buffer(role, nbytes, sized_like=_output_role(0))
        self.bound.allocate_outputs(env, buffer)
        return [(slot, view_of(buffer, offsets[plan.slots[slot].storage], plan.slots[slot])) for slot in allocated]

    def _set_streams(self, device: torch.device, previous: CudaGraphExecutable | None) -> None:
        if previous is not None:
            self.streams, self.events = previous.streams, previous.events
            return
        memory = self.memory
        side = [(k, s.priority) for k, s in enumerate(self.plan.streams) if k > 0]
        self.streams = ([memory.stream(0, 0)] + [memory.stream(k, p) for k, p in side] if memory is not None else
                        [torch.cuda.Stream(device)] + [torch.cuda.Stream(device, priority=p) for _, p in side])
        self.events = [torch.cuda.Event() for _ in range(self.plan.num_events)]

    def _warm_up(self, inputs: Sequence[torch.Tensor], env: list) -> None:
        """Run once outside a graph (lazy library initialization must not be captured), on clones of the
        inputs the plan writes, so the caller's tensors change only when the call really runs, and into
        outputs of its own: a caller may hold the graph's (those of the executable this one replaces)."""
        self.copy_in(inputs)
        warm_env = list(env)
        self.bound.allocate_outputs(warm_env)
        for i in self.written_inputs:
            slot = self.plan.input_slots[i]
            warm_env[slot] = warm_env[slot].clone()
        capture_stream = self.streams[0]
        capture_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(capture_stream), torch.no_grad():
            self.bound.run(warm_env, self.streams, self.events)
        torch.cuda.current_stream(self.device).wait_stream(capture_stream)
        torch.cuda.synchronize(self.device)

    def _capture(self, env: list, copied_out: Sequence[tuple[int, torch.Tensor]], role: str,
                 inherited: Handouts | None, hand_out: bool = True) -> Capture:
        """Capture the plan's run on `env` into a new graph, with cuBLAS workspaces allocated inside it
        (see the module docstring), and say how its results are made (`Capture`): handed out unless the
        executable returns its static outputs or `hand_out` is off. `inherited`: the handouts of the
        capture whose output memory `env` reuses (see `Handouts.makers`)."""
        memory = self.memory
        _kept_from_a_capture.clear()
        graph = torch.cuda.CUDAGraph()
        compat.clear_cublas_workspaces()
        try:
            with without_automatic_gc(), torch.no_grad(), \
                    torch.cuda.graph(graph, pool=memory.graph_pool if memory is not None else None,
                                     stream=self.streams[0], capture_error_mode="thread_local"):
                reserved = torch.cuda.memory_reserved(self.device)     # entering emptied the allocator's cache
                self.bound.run(env, self.streams, self.events)
                for slot, buffer in copied_out:             # the plan joined every stream into this one
                    buffer.copy_(env[slot])
        finally:
            compat.clear_cublas_workspaces()
        for slot, buffer in copied_out:                     # the allocated outputs return to the pool
            env[slot] = buffer
        pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        outputs = self.bound.outputs(env)
        makers: list[Callable[[], torch.Tensor] | None] = [None] * len(outputs)
        handouts = None
        if hand_out and not self.static_outputs:
            handouts = memory.handouts(role) if memory is not None else Handouts()
            written = [k for k, slot in enumerate(self.plan.output_slots)
                       if self.output_input[k] is None and self.plan.storages[self.plan.slots[slot].storage].kind
                       in (StorageKind.OUTPUT, StorageKind.DYNAMIC)]
            for k, maker in zip(written, handouts.makers([outputs[k] for k in written], inherited)):
                makers[k] = maker
        return Capture(graph, outputs, self.plan.output_slots, self.output_input, pool_bytes, handouts, makers)

    def _another_capture(self, inputs: Sequence[torch.Tensor]) -> None:
        """Capture the plan once more, writing outputs of its own, for a call that found every capture's
        outputs held: handed out while fewer than HANDED_OUT_CAPTURES captures are, else copied out."""
        allocated = torch.cuda.memory_allocated(self.device)
        role = _output_role(len(self.captures))
        hand_out = sum(capture.handouts is not None for capture in self.captures) < HANDED_OUT_CAPTURES
        env = self.bound.new_env([inputs[i] if tensor is None else tensor
                                  for i, tensor in enumerate(self.static_inputs)])
        copied_out = self._bind_outputs(env, role, None)
        bound_bytes = torch.cuda.memory_allocated(self.device) - allocated
        if self.captured_on != threading.get_ident():
            self._warm_up(inputs, env)
        capture = self._capture(env, copied_out, role, None, hand_out)
        self.captures.append(capture)
        self._graphs.append(capture.graph)
        if self.memory is None:
            self.private_bytes += bound_bytes + capture.pool_bytes
        if self.on_capture is not None:
            self.on_capture(bound_bytes + capture.pool_bytes)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> Sequence[Any]:
        if not self.at_captured_addresses(inputs):
            raise ResidentInputMoved()
        with self.turns:
            capture = self._free_capture(inputs)
            self.copy_in(inputs)
            capture.graph.replay()
            if self.write_back:
                with torch.no_grad():
                    for i in self.write_back:
                        inputs[i].copy_(self.static_inputs[i])
            if self.static_outputs:
                return [tensor if i is None else inputs[i] for tensor, i in zip(capture.outputs, self.output_input)]
            return capture.results(inputs)

    def _free_capture(self, inputs: Sequence[torch.Tensor]) -> Capture:
        """The first capture whose outputs no caller holds (with static outputs: the one there is), made
        if need be (`_another_capture`). A new capture may be held at once: in a shared pool its output
        buffer is every bucket's, and a result of another bucket may hold it. The capture whose outputs
        are copied out is always free, so at most that one more is made."""
        if self.static_outputs:
            return self.captures[0]
        while True:
            for capture in self.captures:
                if capture.free():
                    return capture
            self._another_capture(inputs)


def _address_check(addresses: Sequence[int | None], resident: Sequence[int]) -> Callable[[Sequence[torch.Tensor]], bool]:
    """Whether a call's inputs (a list) have every resident one at its captured address: one C++ call,
    dynaflow_fn's own where it is built, else torch's."""
    check = native.address_checker(resident, [addresses[i] for i in resident])
    return check if check is not None else lambda inputs: compat.data_ptrs_equal(inputs, addresses, resident)


def _output_role(index: int) -> str:
    """The shared-pool buffer that the outputs of an executable's capture number `index` are bound in."""
    return "outputs" if index == 0 else f"outputs of capture {index}"
