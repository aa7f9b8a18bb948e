"""Training through torch.compile: AOTAutograd's forward and backward graphs, each planned by df.jit.

A graph Dynamo captures with gradients enabled goes to AOTAutograd (the part of torch.compile that
differentiates it ahead of time, as for torch's own "cudagraphs" backend), which hands over two
functional aten graphs: the forward, returning the outputs, the new values of the buffers it
updates (batch norm's statistics: AOTAutograd writes them back) and the tensors saved for the
backward pass; and the backward, from those saved tensors and the outputs' gradients to the inputs'
gradients. AOTAutograd wraps them in an autograd.Function, so `loss.backward()` and an optimizer
step outside work as in eager PyTorch. Its contracts, and how each is kept:

* saved tensors are read by a later call: df.jit never overwrites an output a caller still holds
  (never `static_outputs`, whose buffers the next forward overwrites; see `runtime.handouts`), and
  outputs that are views are real views (`views`);
* the graphs take one list of arguments (`compat.boxed`) and may take sizes (`Specialized`);
* gradients may arrive with any strides: df.jit plans per layout, as for any input.

On CUDA, the tensors the forward saves for the backward are the forward plan's own output buffers,
handed out (`runtime.handouts`): at the same addresses on every step, those of whichever of its
captures was free (two take turns where the caller holds the loss over the next step). The backward
reads them in place, as persistent inputs, and keeps a capture for each of the two address sets
(`Replayer.spare`). Copying them into static buffers of the backward's own would hold every
activation twice (12 GB more at the peak of a transformers Llama step of 8 x 2048 tokens) and copy
them all on every step. What is not handed out (the outputs' gradients, the step's batch, a view of
it, an output copied out) is copied in.

A graph df cannot plan (an op it refuses) runs with aten kernels, op by op, after a warning, and
its gradient is AOTAutograd's own. The graphs are functional (AOTAutograd writes the buffer updates
back itself), so a call that failed before being served can run again from the same inputs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import fx

from ..errors import warn
from ..jitting.jitted import Jitted
from ..runtime.handouts import is_handout
from .specializing import Specialized
from .views import split_views


class TrainingGraph:
    """A forward or backward graph of AOTAutograd (`name`), planned by df.jit per concrete signature
    with `plan`, or run by aten kernels once df could not plan it."""

    def __init__(self, graph_module: fx.GraphModule, example_inputs: Sequence[Any], name: str,
                 plan: Callable[[Callable[..., Any], tuple[int, ...]], Jitted]):
        self.graph_module, self.name = graph_module, name
        split = split_views(graph_module)
        self.assemble = split.assemble
        names = [node.name for node in graph_module.graph.nodes if node.op == "placeholder"]

        def planned(fn: Callable[..., Any], tensors: Sequence[Any]) -> Jitted:
            if name != "backward":
                return plan(fn, ())
            return plan(fn, tuple(i for i, tensor in enumerate(tensors) if is_handout(tensor)))
        self.specialized = Specialized(split.computed, names, example_inputs, name, planned)
        self.planned = split.computes_anything
        self.by_aten = False

    def __call__(self, *args: Any) -> Any:
        if self.by_aten:
            return self.graph_module(*args)
        if not self.planned:                             # every output is an input or a view of one
            return self.assemble(*args)
        jitted = self.specialized.jitted_for(args)
        served = _served(jitted)
        try:
            computed = jitted(*self.specialized.tensors_of(args))
        except Exception as error:
            if _served(jitted) != served:                # planned and ran: the run's own error
                raise
            self._fall_back(error)
            return self.graph_module(*args)
        return self.assemble(*args, *computed)

    def _fall_back(self, error: Exception) -> None:
        self.by_aten = True
        reason = " ".join(str(error).split())
        warn(f"df.compile_backend cannot plan this {self.name} graph of a training step ({type(error).__name__}: "
             f"{reason[:400]}); it runs with aten kernels, op by op, from now on. Its gradients are exact; only "
             f"its speed is eager PyTorch's.")


def _served(jitted: Jitted) -> tuple[int, int]:
    """Calls a jitted function has served, planned or from its cache: unchanged by a call that failed
    while planning, so that nothing of it ran."""
    info = jitted.cache_info()
    return info.hits, info.misses
