"""`df.compile_backend`: dynaflow_fn behind `torch.compile`, for unmodified modules.

TorchDynamo reads the model's Python, keeps its control flow on non-tensor values as guards and
hands each straight-line graph it captures to a backend, with graph breaks where it cannot follow.
This backend gives every captured graph to `df.jit`: the graph is traced to aten, transformed,
lowered to a static plan and replayed (one CUDA graph on CUDA), exactly as a function written for
dynaflow_fn would be.

    model = torch.compile(model, backend=df.compile_backend(backend="inductor"), dynamic=False)
    with torch.no_grad():
        logits = model(input_ids)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import fx

from . import compat
from .errors import InputError
from .jitting.jitted import Jitted, jit
from .jitting.state import is_state


class CompileBackend:
    """A `torch.compile` backend that runs each captured graph through `df.jit`.

    `graphs` lists the jitted function of every graph Dynamo handed over, in order, so their plans
    can be inspected: `backend.graphs[0].plans()`.
    """

    def __init__(self, strategy: str | None, transforms: Callable[[Callable], Callable] | None, backend: str,
                 in_axes: str | None, jit_options: dict[str, Any]):
        if in_axes not in (None, "arguments"):
            raise InputError(f"compile_backend takes in_axes=None or 'arguments', got {in_axes!r}")
        if in_axes is not None and strategy != "auto":
            raise InputError("in_axes='arguments' tells strategy='auto' what to micro-batch; pass strategy='auto'")
        self.strategy = strategy
        self.transforms = transforms
        self.backend = backend
        self.in_axes = in_axes
        self.jit_options = jit_options
        self.graphs: list[Jitted] = []

    def __call__(self, graph_module: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        _check_inputs(example_inputs)
        fn = graph_module.forward
        if self.transforms is not None:
            fn = self.transforms(fn)
        options = dict(self.jit_options)
        passed = _passed_by_the_caller(graph_module)
        if self.in_axes == "arguments":
            batched = [p is True and isinstance(x, torch.Tensor) and x.dim() > 0 and not is_state(x)
                       for p, x in zip(passed, example_inputs)]
            options["in_axes"] = tuple(0 if b else None for b in batched) if any(batched) else None
        options.setdefault("persistent_argnums", tuple(i for i, p in enumerate(passed) if p is False))
        jitted = jit(fn, backend=self.backend, strategy=self.strategy, **options)
        self.graphs.append(jitted)
        return jitted


def _passed_by_the_caller(graph_module: fx.GraphModule) -> list[bool | None]:
    """Per input of a Dynamo graph, from Dynamo's record of where it came from: True if it was reached
    from an argument of the compiled function, False if from elsewhere (globals, closures: resident,
    like the state df.jit keeps resident anyway), None where no record says.

    Reached from an argument means per call: the token ids, positions and masks of every decoding
    step are new tensors, so they are copied in. A model's state reached through `self` or an argument
    is resident all the same, because it is marked: parameters are, Dynamo marks the other
    tensors of modules static, and transformers marks its static KV caches."""
    return [compat.dynamo_input_origin(node) for node in graph_module.graph.nodes if node.op == "placeholder"]


def _check_inputs(example_inputs: Sequence[Any]) -> None:
    dynamic = [type(value).__name__ for value in example_inputs if not isinstance(value, torch.Tensor)]
    if dynamic:
        raise InputError(f"Dynamo passed symbolic sizes ({', '.join(dynamic)}); dynaflow_fn plans are static: "
                         f"compile with torch.compile(..., dynamic=False)")
    if torch.is_grad_enabled() and any(value.requires_grad for value in example_inputs):
        raise InputError("compile_backend runs inference graphs, but this graph was captured with gradients "
                         "enabled; call the model under torch.no_grad() or torch.inference_mode(), or write the "
                         "training step as a function with df.value_and_grad and df.jit it")


def compile_backend(strategy: str | None = None, transforms: Callable[[Callable], Callable] | None = None,
                    backend: str = "auto", in_axes: str | None = None, **jit_options: Any) -> CompileBackend:
    """A backend for `torch.compile(model, backend=df.compile_backend(...), dynamic=False)`.

    strategy: None, or "auto" to time candidate strategies per captured graph (see `df.jit`).
    in_axes: "arguments" lets strategy="auto" try micro-batching: the tensors the model is called with
        are split along dimension 0, parameters and buffers are shared. Use it when every tensor
        argument is batch-major ([batch, ...]); by default only candidates without splitting are tried.
    transforms: a transform applied to each captured graph's function before jit, e.g.
        `T.overlap(strategy="branches")`. The function takes the graph's flat inputs (parameters and
        buffers included), so micro-batching needs `in_axes` over those.
    backend: "auto", "eager", "cudagraph" or "inductor" (Inductor kernels per stage).
    jit_options: passed on to `df.jit` (static_outputs, progress, ...).

    >>> model = torch.compile(model, backend=df.compile_backend(backend="inductor"), dynamic=False)
    """
    return CompileBackend(strategy, transforms, backend, in_axes, jit_options)
