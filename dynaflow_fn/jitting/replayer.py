"""Running a bound Plan: its executable (one CUDA graph, or the interpreter), built on first use and
captured again when a resident input moved (the one it replaced kept while residents may move back),
and the `Guard` that lets later calls skip the lookup.

A replayer runs in one of two ways. `call` serves a call that the full cache lookup matched: it runs
the plan and then remembers a guard for calls like it. `replay` serves a call that this guard
admitted, the per-call fast path: nothing but the run. `benchmark` is `call`'s run on copies of the
inputs the plan writes, for timing; `prepare` builds (captures) without running, as the largest batch
bucket is built first. A replayer given a `SharedPool` builds its executable in that shared memory.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from typing import Any, Callable, Sequence

import torch

from .. import compat, distributed
from ..errors import ResidentInputMoved, warn
from ..runtime.cudagraph import CudaGraphExecutable
from ..runtime.eager import EagerExecutable
from ..runtime.shared_pool import SharedPool
from .binding import Binding
from .guard import Guard, WrittenBytes, check_no_aliasing, check_no_inference_writes, check_updates_allowed
from .options import CUDAGRAPH
from .pipeline import ColdStart

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class Replayer:
    """The executable of one `Binding` and the guard of the calls it last served."""

    def __init__(self, binding: Binding, runtime: str, static_outputs: bool, on_capture: Callable[[], None],
                 cold_start: ColdStart | None = None, memory: SharedPool | None = None):
        self.binding = binding
        self.runtime = runtime
        self.static_outputs = static_outputs
        self.on_capture = on_capture
        self.cold_start = cold_start                   # timed until the first executable is built
        self.memory = memory                           # shared with the plans of the other buckets, or None
        self.graph_memory_bytes = 0                    # device memory its CUDA graphs hold (CudaGraphExecutable.held_bytes)
        self.executable: CudaGraphExecutable | EagerExecutable | None = None
        self.spare: CudaGraphExecutable | None = None      # the one it replaced, while residents may move back
        self.keeps_spares = True                           # until residents move to neither one's addresses
        self.guard: Guard | None = None
        self.written_bytes: WrittenBytes | None = None    # of the last call checked in full (see replay)
        self.runs = 0                                  # calls completed, to tell a move per call from one now and then
        self.moved_at: dict[int, int] = {}             # resident inputs that arrived at a new address: when
        self.copied_anyway: set[int] = set()           # ... on two calls in a row: copied in from then on
        self.no_backward = (f"backward through the outputs of df.jit({binding.fn_name}): a compiled plan records "
                            f"no autograd graph. Differentiate inside the jitted function (df.value_and_grad / "
                            f"df.grad return the gradients), or call it under torch.no_grad() when no gradient "
                            f"is needed.").encode()
        self._building = threading.Lock()              # threads arriving at once capture once

    @property
    def plan(self) -> Any:
        return self.binding.plan

    def tensors_of(self, leaves: Sequence[Any]) -> list[torch.Tensor]:
        """The plan's tensor inputs for a call with these leaves: the argument tensors, then the closed-over ones."""
        binding = self.binding
        tensors = list(binding.pick_tensors(leaves))
        if binding.closed_over:
            tensors += binding.closed_over
        return tensors

    # --- the ways to run --------------------------------------------------------------------------

    def call(self, treedef: Any, leaves: Sequence[Any], state: tuple) -> Any:
        """Run on leaves whose full signature, state and modes are this plan's; guard calls like it. The
        guard of the last call stays where it admits this one: a call whose resident input moved (the
        first decoding step on a new KV cache) needs no new guard, only the new bytes of what it writes."""
        tensors = self.tensors_of(leaves)
        outputs = self.run(tensors, rebuild_if_moved=True)
        if self.guard is None or not self.guard.admits(treedef, leaves, state):
            self.guard = Guard(treedef, leaves, state, [m for m, _ in self.binding.module_modes],
                               self.binding.closed_over, watch=self.binding.watch)
        self.written_bytes = self._written_bytes(tensors)
        return outputs

    def replay(self, leaves: Sequence[Any]) -> Any:
        """Run on leaves that `guard` admitted. Raises ResidentInputMoved if a resident input has new
        memory, which may also mean a new layout (`t.data = ...`): the caller checks in full. Where
        every input the plan writes is resident, only the others are compared with the bytes those
        occupied in the last call checked in full (`WrittenBytes`)."""
        return self.run(self.tensors_of(leaves), rebuild_if_moved=False, written_bytes=self.written_bytes,
                        inference_checked=self.guard.refuses_inference_tensors)

    def prepare(self, leaves: Sequence[Any]) -> None:
        """Build the executable (capture its graph) for calls like this one, without running it."""
        if self.executable is None:
            self._build(self.tensors_of(leaves), None, None)

    def benchmark(self, leaves: Sequence[Any]) -> Callable[[], Any]:
        """A call on the given arguments that leaves them unchanged: inputs the plan writes (donated,
        mutated) are replaced by copies, so timing it many times has no effect outside. What is
        resident is decided on the caller's tensors, not on the copies."""
        tensors = self.tensors_of(leaves)
        resident = self.binding.resident(tensors, self.copied_anyway)
        for i in self.binding.written:
            tensors[i] = tensors[i].clone()
        return lambda: self.run(tensors, rebuild_if_moved=True, resident=resident)

    def run(self, tensors: list[torch.Tensor], rebuild_if_moved: bool, resident: Sequence[bool] | None = None,
            written_bytes: WrittenBytes | None = None, inference_checked: bool = False) -> Any:
        """Run the executable (built on first use) on its inputs and return the call's outputs.
        `resident` overrides `binding.resident(tensors)` for stand-ins of the caller's tensors;
        `written_bytes` replaces the full aliasing check (see `replay`); `inference_checked` says that a
        guard admitted the call that refuses inference tensors where its call had none (see `Guard`)."""
        binding, executable = self.binding, self.executable
        if binding.written:
            if written_bytes is not None and written_bytes.executable is executable:
                written_bytes.check(tensors, binding.names)
            else:
                check_no_aliasing(tensors, binding.written, binding.names)
            if not inference_checked and not torch.is_inference_mode_enabled():
                check_no_inference_writes(tensors, binding.written, binding.names, binding.fn_name)
        if binding.updated_under_grad and torch.is_grad_enabled():
            check_updates_allowed(tensors, binding.updated_under_grad, binding.names, binding.fn_name)
        executable = executable or self._build(tensors, None, resident)
        try:
            outputs = executable(tensors)
        except ResidentInputMoved:
            if not rebuild_if_moved:
                raise
            outputs = self._build(tensors, executable, resident)(tensors)
        self.runs += 1                      # once per call: a replay that found a resident moved ran nothing
        if torch.is_grad_enabled() and binding.differentiable and any(map(_REQUIRES_GRAD, tensors)):
            outputs = self._without_backward(outputs, tensors)
        return binding.build_outputs(outputs)

    # --- building ---------------------------------------------------------------------------------

    def _build(self, tensors: Sequence[torch.Tensor], replacing: Any, resident: Sequence[bool] | None) -> Any:
        """The executable, built for these tensors unless another thread built it meanwhile; `replacing`
        is the executable found unfit for them (a resident input moved), or None."""
        with self._building:
            if self.executable is not replacing:
                return self.executable
            plan = self.plan
            if replacing is None and distributed.collective_signature(plan):
                distributed.check_consistent(plan)
            previous = replacing if isinstance(replacing, CudaGraphExecutable) else None
            if previous is not None and self.spare is not None:
                if self.spare.at_captured_addresses(tensors):
                    self.executable, self.spare = self.spare, previous
                    return self.executable
                self.keeps_spares = False
            if previous is not None and resident is None:
                self._note_moved(tensors, previous)
            if self.runtime == CUDAGRAPH:
                with self._cold_start_phase("capture"):
                    self.executable = CudaGraphExecutable(
                        plan, plan.device, tensors, resident or self.binding.resident(tensors, self.copied_anyway),
                        self.static_outputs, self.memory, previous, self._captured_more)
                self._captured_more(self.executable.held_bytes - self._released(previous))
            else:
                self.executable = EagerExecutable(plan, plan.device, self.memory)
            if self.cold_start is not None:
                self.cold_start.finish()
                self.cold_start = None
            return self.executable

    def _released(self, replaced: CudaGraphExecutable | None) -> int:
        """Keep the executable a moved resident replaced as the spare, or let it go; the bytes of those
        let go of. Residents that take turns between two addresses (the activations a training step's
        forward saves for its backward, in the outputs of whichever of its two captures was free) then
        find their capture again instead of capturing once more per call. Residents that move on for
        good (a new KV cache per generate() call) keep no spare: the first move to neither address
        stops keeping them. Private pools go with their graphs; a shared pool stays, held by the other
        buckets."""
        if replaced is None:
            return 0
        kept = replaced if self.keeps_spares else None
        let_go = [executable for executable in (self.spare, replaced)
                  if executable is not None and executable is not kept]
        self.spare = kept
        return sum(executable.private_bytes for executable in let_go)

    def _captured_more(self, nbytes: int) -> None:
        """Count a capture that holds `nbytes` more of device memory."""
        self.graph_memory_bytes += nbytes
        self.on_capture()

    def _note_moved(self, tensors: Sequence[torch.Tensor], moved_from: CudaGraphExecutable) -> None:
        """A resident input that arrives at a new address forces a new capture. State that is replaced
        now and then (a KV cache made anew for each generate() call, then read by a hundred decoding
        steps) is worth it. One that moves on two calls in a row is a per-call tensor in a resident's
        position (a new tensor passed where state was expected): capturing on every call would cost
        far more than copying it, so from then on it is copied in, which computes the same, and a
        warning says how to keep it resident."""
        for i in moved_from.resident:
            if tensors[i].data_ptr() == moved_from.addresses[i]:
                continue
            if self.moved_at.get(i) == self.runs - 1 and i not in self.copied_anyway:
                self.copied_anyway.add(i)
                warn(f"df.jit({self.binding.fn_name}): {self.binding.names[i]} is resident (model state, donated "
                     f"or persistent: read at its own address) but arrived at a new address on two calls in a row, "
                     f"each capturing the CUDA graph again; it is copied in on every call from now on. Pass the "
                     f"same tensor each call to keep it resident.")
            self.moved_at[i] = self.runs

    def _cold_start_phase(self, label: str) -> Any:
        return self.cold_start.phase(label) if self.cold_start is not None else contextlib.nullcontext()

    def _written_bytes(self, tensors: Sequence[torch.Tensor]) -> WrittenBytes | None:
        """What a replay compares its copied-in inputs with, where the plan writes only resident inputs.
        The guard checks every tensor's layout and the executable the resident ones' addresses, so the
        resident inputs of an admitted call occupy the very bytes they did in this call."""
        binding, executable = self.binding, self.executable
        resident = set(getattr(executable, "resident", ()))
        if not binding.written or not set(binding.written) <= resident:
            return None
        return WrittenBytes(tensors, binding.written, [i for i in range(len(tensors)) if i not in resident], executable)

    def _without_backward(self, outputs: list[torch.Tensor], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Outputs that, like eager ones, require grad: those that depend, through ops eager autograd
        records, on an input that requires grad (`tracing.gradients.GradientFlow`); their backward
        raises an error that says why df.jit has none and what to do instead."""
        chosen = [i for i, inputs in self.binding.differentiable if any(tensors[k].requires_grad for k in inputs)
                  and (outputs[i].is_floating_point() or outputs[i].is_complex())]
        if not chosen:
            return outputs
        outputs = list(outputs)
        for i, tensor in zip(chosen, without_backward([outputs[i] for i in chosen], self.no_backward)):
            outputs[i] = tensor
        return outputs


def without_backward(tensors: list[torch.Tensor], message: bytes) -> list[torch.Tensor]:
    """The same tensors (same memory), now requiring grad, whose backward raises `message`
    (`compat.no_backward_node`)."""
    aliases = [tensor.detach().requires_grad_(True) for tensor in tensors]
    results = compat.no_backward_node(message, len(aliases))(*aliases)
    return list(results) if isinstance(results, tuple) else [results]
