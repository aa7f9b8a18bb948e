"""One cache entry of `df.jit`: a Plan for one input signature and program state, and its executable.

An entry is run in one of two ways. `call` serves a call that the full cache lookup matched: it runs
the plan, capturing again if a tensor read in place moved, and then remembers a `Guard` for calls like
it. `replay` serves a call that this guard admitted, the per-call fast path: nothing but the run.
`benchmark` is `call`'s run on copies of the inputs the plan writes, for timing.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from typing import Any, Callable, Sequence

import torch

from .. import compat, distributed
from ..errors import InPlaceInputMoved, warn
from ..ir.tree import TensorSpec
from ..plan.plan import Plan
from ..runtime.cudagraph import CudaGraphExecutable
from ..runtime.eager import EagerExecutable
from ..tracing.gradients import GradientFlow
from .cold_start import ColdStart
from .guard import Guard, check_no_aliasing, check_updates_allowed, picker
from .inputs import TensorInputs
from .object_watch import ObjectWatch
from .state import is_state

_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class Entry:
    """A plan, the state it was traced in, and its executable, built on the first run.

    The executable's tensor inputs are the argument tensors (flat, in order) and then the tensors
    the function closes over, which are read in place like the donated and persistent arguments."""

    def __init__(self, plan: Plan, module_modes: Sequence[tuple[torch.nn.Module, bool]], inputs: TensorInputs,
                 backend: str, static_outputs: bool, on_capture: Callable[[], None], fn_name: str,
                 cold_start: ColdStart | None = None, watch: ObjectWatch | None = None,
                 gradient_flow: GradientFlow | None = None):
        self.plan = plan
        self.module_modes = tuple(module_modes)
        self.watch = watch or ObjectWatch(())         # the hooks, submodules and attributes it was traced under
        self.tensor_positions = inputs.positions
        self.pick_tensors = picker(inputs.positions)
        self.captured = [c.tensor for c in plan.captured]
        self.captured_specs = [TensorSpec.of(t) for t in self.captured]
        arguments = len(inputs.positions)
        self.in_place = inputs.donated | inputs.persistent | set(range(arguments, arguments + len(self.captured)))
        self.names = list(inputs.names) + [c.name for c in plan.captured]
        self.written = plan.written_inputs()
        returned_inputs = set(plan.input_slots)
        known = gradient_flow is not None and len(gradient_flow.outputs) == len(plan.output_slots)
        depends = gradient_flow.outputs if known else [tuple(range(len(self.names)))] * len(plan.output_slots)
        self.differentiable = [(i, depends[i]) for i, slot in enumerate(plan.output_slots)
                               if slot not in returned_inputs and depends[i]]   # output, the inputs it comes from
        self.updated_under_grad = gradient_flow.updated if gradient_flow is not None else ()
        self.only_output = plan.out_tree.is_leaf() and len(plan.outputs) == 1 and plan.outputs[0].tensor_index == 0
        self.fn_name = fn_name
        self.no_backward = (f"backward through the outputs of df.jit({fn_name}): a compiled plan records no "
                            f"autograd graph. Differentiate inside the jitted function (df.value_and_grad / "
                            f"df.grad return the gradients), or call it under torch.no_grad() when no gradient "
                            f"is needed.").encode()
        self.backend = backend
        self.static_outputs = static_outputs
        self.on_capture = on_capture
        self.cold_start = cold_start                   # timed until the first executable is built
        self.executable: CudaGraphExecutable | EagerExecutable | None = None
        self.guard: Guard | None = None
        self.moved: set[int] = set()                   # inputs read in place that arrived at a new address
        self.copied_anyway: set[int] = set()           # ... twice: copied in from then on
        self._building = threading.Lock()              # threads arriving at once capture once

    def stale(self) -> bool:
        """Whether a closed-over tensor has changed layout, or a hook it was traced with is gone: this
        entry can never run again."""
        return any(TensorSpec.of(t) != spec for t, spec in zip(self.captured, self.captured_specs)) or self.watch.dead()

    # --- the ways to run --------------------------------------------------------------------------

    def call(self, treedef: Any, leaves: Sequence[Any], state: tuple) -> Any:
        """Run on leaves whose full signature, state and modes are this entry's; guard calls like it."""
        outputs = self.run(self.inputs_of(leaves), rebuild_if_moved=True)
        self.guard = self._guard(treedef, leaves, state)
        return outputs

    def replay(self, leaves: Sequence[Any]) -> Any:
        """Run on leaves that `guard` admitted. Raises InPlaceInputMoved if a tensor read in place has
        new memory, which may also mean a new layout (`t.data = ...`): the caller checks in full."""
        return self.run(self.inputs_of(leaves), rebuild_if_moved=False)

    def benchmark(self, leaves: Sequence[Any]) -> Callable[[], Any]:
        """A call of this entry on the given arguments that leaves them unchanged: inputs the plan writes
        (donated, mutated) are replaced by copies, so timing it many times has no effect outside."""
        tensors = self.inputs_of(leaves)
        read_in_place = self.reads_in_place(tensors)
        for i in self.written:
            tensors[i] = tensors[i].clone()
        return lambda: self.run(tensors, rebuild_if_moved=True, read_in_place=read_in_place)

    def inputs_of(self, leaves: Sequence[Any]) -> list[torch.Tensor]:
        """The executable's inputs: the argument tensors, then the closed-over ones."""
        tensors = list(self.pick_tensors(leaves))
        if self.captured:
            tensors += self.captured
        return tensors

    def reads_in_place(self, tensors: Sequence[torch.Tensor]) -> list[bool]:
        """Per input, whether a CUDA graph reads it at its own address: the state (`state.is_state`),
        donated, persistent and closed-over tensors on the plan's device, unless it keeps moving."""
        return [(i in self.in_place or is_state(t)) and t.device == self.plan.device and i not in self.copied_anyway
                for i, t in enumerate(tensors)]

    def _note_moved(self, tensors: Sequence[torch.Tensor], moved_from: CudaGraphExecutable) -> None:
        """An input read in place that arrives at a new address forces a new capture. One that does so
        a second time is a per-call tensor in a resident's position (a new tensor passed where state
        was expected): capturing on every call would cost far more than copying it, so from then on
        it is copied in, which computes the same, and a warning says how to keep it in place."""
        for i in moved_from.in_place:
            if tensors[i].data_ptr() == moved_from.addresses[i]:
                continue
            if i in self.moved and i not in self.copied_anyway:
                self.copied_anyway.add(i)
                warn(f"df.jit({self.fn_name}): {self.names[i]} is read in place (model state, donated or "
                     f"persistent) but arrived at a new address again, which captured the CUDA graph again; it "
                     f"is copied in on every call from now on. Pass the same tensor each call to read it in "
                     f"place.")
            self.moved.add(i)

    def run(self, tensors: list[torch.Tensor], rebuild_if_moved: bool,
            read_in_place: Sequence[bool] | None = None) -> Any:
        """Run the executable (built on first use) on its inputs and return the call's outputs.
        `read_in_place` overrides `reads_in_place(tensors)` for stand-ins of the caller's tensors."""
        if self.written:
            check_no_aliasing(tensors, self.written, self.names)
        if self.updated_under_grad and torch.is_grad_enabled():
            check_updates_allowed(tensors, self.updated_under_grad, self.names, self.fn_name)
        executable = self.executable or self._build(tensors, None, read_in_place)
        try:
            outputs = executable(tensors)
        except InPlaceInputMoved:
            if not rebuild_if_moved:
                raise
            outputs = self._build(tensors, executable, read_in_place)(tensors)
        if torch.is_grad_enabled() and self.differentiable and any(map(_REQUIRES_GRAD, tensors)):
            outputs = self._without_backward(outputs, tensors)
        return outputs[0] if self.only_output else self.plan.unflatten_outputs(outputs)

    # --- building ---------------------------------------------------------------------------------

    def _build(self, tensors: Sequence[torch.Tensor], replacing: Any, read_in_place: Sequence[bool] | None) -> Any:
        """The executable, built for these tensors unless another thread built it meanwhile; `replacing`
        is the executable found unfit for them (its inputs read in place moved), or None."""
        with self._building:
            if self.executable is not replacing:
                return self.executable
            if replacing is None and distributed.collective_signature(self.plan):
                distributed.check_consistent(self.plan)
            if isinstance(replacing, CudaGraphExecutable) and read_in_place is None:
                self._note_moved(tensors, replacing)
            if self.backend == "cudagraph":
                with self._cold_start_phase("capture"):
                    self.executable = CudaGraphExecutable(self.plan, self.plan.device, tensors,
                                                          read_in_place or self.reads_in_place(tensors),
                                                          self.static_outputs)
                self.on_capture()
            else:
                self.executable = EagerExecutable(self.plan, self.plan.device)
            if self.cold_start is not None:
                self.cold_start.finish()
                self.cold_start = None
            return self.executable

    def _cold_start_phase(self, label: str) -> Any:
        return self.cold_start.phase(label) if self.cold_start is not None else contextlib.nullcontext()

    def _guard(self, treedef: Any, leaves: Sequence[Any], state: tuple) -> Guard:
        """A guard for calls like this one: the executable's versioned inputs are known by identity and
        version, every other leaf by its full signature."""
        versioned = set(self.executable.versioned_inputs)
        arguments = len(self.tensor_positions)
        return Guard(treedef, leaves, [self.tensor_positions[i] for i in versioned if i < arguments], state,
                     [m for m, _ in self.module_modes],
                     captured_in_place=[self.captured[i - arguments] for i in versioned if i >= arguments],
                     captured_compared=[t for k, t in enumerate(self.captured) if arguments + k not in versioned],
                     watch=self.watch)

    def _without_backward(self, outputs: list[torch.Tensor], tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Outputs that, like eager ones, require grad: those that depend, through ops eager autograd
        records, on an input that requires grad (`gradients.GradientFlow`); their backward raises an
        error that says why df.jit has none and what to do instead."""
        chosen = [i for i, inputs in self.differentiable if any(tensors[k].requires_grad for k in inputs)
                  and (outputs[i].is_floating_point() or outputs[i].is_complex())]
        if not chosen:
            return outputs
        outputs = list(outputs)
        for i, tensor in zip(chosen, compat.without_backward([outputs[i] for i in chosen], self.no_backward)):
            outputs[i] = tensor
        return outputs
