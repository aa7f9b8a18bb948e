"""`CompileBackend`: what torch.compile calls with each graph Dynamo captures.

A graph captured without gradients (under torch.no_grad() or inference_mode, or with nothing that
requires grad) goes to df.jit as it is, less the outputs that are views, which are rebuilt on the real
tensors as eager PyTorch returns them (`views`). A graph captured with gradients goes through AOTAutograd
first (`training`), which splits it into a forward and a backward graph, and each goes to df.jit.
Either way a graph whose sizes are symbolic is planned per concrete signature (`specializing`), and
a graph whose sizes depend on tensor data cannot be planned at all (`check_sizes_known`).
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, Sequence

import torch
from torch import fx

from .. import compat
from ..errors import InputError, TraceError, warn
from ..jitting.buckets import bucket_sizes
from ..jitting.jitted import Jitted
from ..jitting.options import JitOptions
from ..jitting.state import is_state
from .batching import Batch, find_batch
from .node_text import op_text, where
from .specializing import Specialized, has_symbolic_inputs, lift_item_reads
from .training import TrainingGraph
from .views import DYNAMO, split_views

_INFERENCE_ONLY_OPTIONS = ("static_outputs", "persistent_argnums", "donate_argnums")
"""df.jit options that apply to inference graphs only: a training graph's outputs must outlive the
next call, and its inputs are AOTAutograd's, not the positions the caller sees."""

_PASSED_ON_OPTIONS = ("progress", *_INFERENCE_ONLY_OPTIONS)
"""The df.jit options compile_backend passes on as given; it sets the others itself per graph."""


class CompileBackend:
    """A `torch.compile` backend that runs each captured graph through `df.jit`.

    `graphs` lists the jitted functions, in the order they were made: one per captured graph and
    concrete signature, and for training one per forward and per backward graph. Their plans can
    be inspected: `backend.graphs[0].plans()`.
    """

    def __init__(self, strategy: str | None, transforms: Callable[[Callable], Callable] | None, backend: str,
                 in_axes: str | None, jit_options: dict[str, Any], buckets: Any = None):
        if in_axes not in (None, "arguments"):
            raise InputError(f"compile_backend takes in_axes=None or 'arguments', got {in_axes!r}")
        if in_axes is not None and strategy != "auto":
            raise InputError("in_axes='arguments' tells strategy='auto' what to micro-batch; pass strategy='auto'")
        _check_passed_on(jit_options)
        JitOptions(backend=backend, strategy=strategy, **jit_options)   # bad values fail here, not at the first call
        self.strategy = strategy
        self.transforms = transforms
        self.backend = backend
        self.in_axes = in_axes
        self.jit_options = jit_options
        self.buckets = bucket_sizes(buckets)
        self.graphs: list[Jitted] = []

    def __repr__(self) -> str:
        return f"df.compile_backend(strategy={self.strategy!r}, backend={self.backend!r})"

    def __deepcopy__(self, memo: dict) -> "CompileBackend":
        """The backend itself: a copy would plan the graphs into a `graphs` list the caller never sees.
        transformers deep-copies its `CompileConfig(backend=...)` before it calls torch.compile."""
        return self

    def __call__(self, graph_module: fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None,
                 options: dict | None = None) -> Callable[..., Any]:
        check_compile_arguments(mode, options)
        check_sizes_known(graph_module)
        if torch.is_grad_enabled() and any(isinstance(value, torch.Tensor) and value.requires_grad
                                           for value in example_inputs):
            return self._training(graph_module, example_inputs)
        return self._inference(graph_module, example_inputs)

    # --- inference: the captured graph itself ----------------------------------------------------

    def _inference(self, graph_module: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """The graph planned by df.jit, its outputs that are views of inputs or of other outputs rebuilt
        on the real tensors, as eager PyTorch returns them (`views`)."""
        split = split_views(graph_module, DYNAMO)
        if split.rebuilds_nothing:
            return self._planned(graph_module, example_inputs)
        if not split.computes_anything:
            return split.assemble
        return _assembled(self._planned(split.computed, example_inputs), split.assemble)

    def _planned(self, graph_module: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        passed = _passed_by_the_caller(graph_module)
        graph_module, reads = lift_item_reads(graph_module)
        if not reads and not has_symbolic_inputs(example_inputs):
            return self._jit(graph_module.forward, passed, list(map(is_state, example_inputs)))
        placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
        example_inputs = [*example_inputs, *(node.meta.get("example_value") for node in placeholders[len(passed):])]
        tensors = [i for i, value in enumerate(example_inputs[:len(passed)]) if isinstance(value, torch.Tensor)]
        batch = self._batch(graph_module, example_inputs, passed)
        padding = {} if batch is None else {"buckets": self.buckets, "out_axes": batch.out_axes,
                                            "in_axes": tuple(0 if i in batch.tensors else None for i in tensors)}
        # What each plan needs of the example inputs, read now: a plan made later keeps none of them alive
        # (they are the tensors of the call Dynamo compiled for, a KV cache perhaps).
        passed, states = [passed[i] for i in tensors], [is_state(example_inputs[i]) for i in tensors]
        return Specialized(graph_module.forward, [node.name for node in placeholders], example_inputs, "forward",
                           lambda fn, _: self._jit(fn, passed, states, padding), reads, batch,
                           lambda fn, _: self._jit(fn, passed, states))

    def _batch(self, graph_module: fx.GraphModule, example_inputs: Sequence[Any],
               passed: Sequence[bool | None]) -> Batch | None:
        """With buckets, where the graph holds a symbolic batch (`batching`); None without buckets, without
        a symbolic batch, or where the graph cannot be padded (it is then planned per size, after a warning)."""
        if self.buckets is None:
            return None
        batch = find_batch(graph_module, example_inputs, passed)
        if isinstance(batch, str):
            warn(f"df.compile_backend(buckets=...) cannot pad this graph: {batch}. It is planned for each batch "
                 f"size instead, as without buckets.")
            return None
        return batch

    def _jit(self, fn: Callable[..., Any], passed: Sequence[bool | None], states: Sequence[bool],
             padding: dict[str, Any] | None = None) -> Jitted:
        """df.jit of an inference graph's function of its tensor inputs, `passed` saying per input whether
        it was reached from an argument of the compiled function and `states` whether it is model state
        (`is_state` of Dynamo's example). What in_axes="arguments" splits is what was passed and is no
        model state (a parameter reached through `self` is passed too). `padding` holds the bucket
        options of a graph with a batch."""
        options = dict(self.jit_options)
        if self.in_axes == "arguments":
            batched = [p is True and not state for p, state in zip(passed, states)]
            options["in_axes"] = tuple(0 if b else None for b in batched) if any(batched) else None
        options.setdefault("persistent_argnums", tuple(i for i, p in enumerate(passed) if p is False))
        options.update(padding or {})
        return self._jitted(fn, options)

    def _jitted(self, fn: Callable[..., Any], options: dict[str, Any]) -> Jitted:
        if self.transforms is not None:
            fn = self.transforms(fn)
        jitted = Jitted(fn, JitOptions(backend=self.backend, strategy=self.strategy, refuse_inexact_padding=True,
                                       **options))
        self.graphs.append(jitted)
        return jitted

    # --- training: AOTAutograd's forward and backward graphs ---------------------------------------

    def _training(self, graph_module: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        aot_autograd = compat.aot_autograd_backend(self._compiler("forward"), self._compiler("backward"))
        if aot_autograd is None:
            warn("df.compile_backend trains through AOTAutograd, which this torch lacks: the graph runs as "
                 "Dynamo captured it, op by op, with eager autograd.")
            return graph_module.forward
        return aot_autograd(graph_module, example_inputs)

    def _compiler(self, name: str) -> Callable[[fx.GraphModule, Sequence[Any]], Callable[[list], Any]]:
        options = {k: v for k, v in self.jit_options.items() if k not in _INFERENCE_ONLY_OPTIONS}

        def compile_graph(graph_module: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[[list], Any]:
            return compat.boxed(TrainingGraph(graph_module, example_inputs, name, lambda fn, persistent: self._jitted(
                fn, {**options, "persistent_argnums": persistent})))
        return compile_graph


def _check_passed_on(jit_options: dict[str, Any]) -> None:
    """Refuse an option compile_backend does not take when the backend is made: Dynamo would report
    it only at the first compiled call, wrapped in BackendCompilerFailed."""
    unknown = [name for name in jit_options if name not in _PASSED_ON_OPTIONS]
    if not unknown:
        return
    taken = ("strategy", "transforms", "backend", "in_axes", "buckets", *_PASSED_ON_OPTIONS)
    close = difflib.get_close_matches(unknown[0], taken, n=1)
    raise InputError(f"compile_backend got an unexpected option {unknown[0]!r}"
                     f"{f' (did you mean {close[0]!r}?)' if close else ''}; it takes {', '.join(taken)}")


def _assembled(computed: Callable[..., Any], assemble: fx.GraphModule) -> Callable[..., Any]:
    """A call of the graph: its computed outputs, then every output assembled from them and the inputs."""
    def call(*args: Any) -> Any:
        return assemble(*args, *computed(*args))
    return call


def check_compile_arguments(mode: str | None, options: dict | None) -> None:
    """Refuse what torch.compile passes on to a backend that df cannot honour. `mode="reduce-overhead"`
    asks for CUDA graphs, which every df plan on CUDA is: it is accepted (transformers' CompileConfig
    passes it by default). The other modes and `options` are Inductor's settings."""
    if mode not in (None, "default", "reduce-overhead"):
        raise InputError(f"torch.compile(..., backend=df.compile_backend(), mode={mode!r}): the modes other than "
                         f"'reduce-overhead' (which df plans are on CUDA: one CUDA graph each) set Inductor's "
                         f"autotuning, which df does not run. Leave mode out; strategy='auto' times df's "
                         f"candidates instead.")
    if options:
        raise InputError(f"torch.compile(..., backend=df.compile_backend(), options={options!r}): options are "
                         f"Inductor's settings and df takes none of them. Pass df's own to "
                         f"df.compile_backend(...) (strategy, backend, buckets, progress, ...).")


def check_sizes_known(graph_module: fx.GraphModule) -> None:
    """Refuse a graph with a size known only from tensor data (an unbacked SymInt): no concrete call
    fixes it, so no static plan can hold it."""
    node = compat.first_unbacked_node(graph_module)
    if node is None:
        return
    raise TraceError(
        f"{op_text(node)}{where(node)} gives a result whose size or value depends on tensor data, which "
        f"Dynamo captured because torch._dynamo.config.capture_dynamic_output_shape_ops or "
        f"capture_scalar_outputs is set. dynaflow_fn plans have static "
        f"shapes: leave both off (the default), so that Dynamo runs that op outside the graph, or keep the "
        f"size static (torch.where or masked_fill instead of indexing with a mask or nonzero).")


def _passed_by_the_caller(graph_module: fx.GraphModule) -> list[bool | None]:
    """Per input of a Dynamo graph, from Dynamo's record of where it came from: True if it was reached
    from an argument of the compiled function, False if from elsewhere (globals, closures: read in
    place, like the state df.jit reads in place anyway), None where no record says.

    Reached from an argument means per call: the token ids, positions and masks of every decoding
    step are new tensors, so they are copied in. A model's state reached through `self` or an argument
    is read in place all the same, because it is marked: parameters are, Dynamo marks the other
    tensors of modules static, and transformers marks its static KV caches."""
    return [compat.dynamo_input_origin(node) for node in graph_module.graph.nodes if node.op == "placeholder"]


def compile_backend(strategy: str | None = None, transforms: Callable[[Callable], Callable] | None = None,
                    backend: str = "auto", in_axes: str | None = None, buckets: Sequence[int] | str | None = None,
                    **jit_options: Any) -> CompileBackend:
    """A backend for `torch.compile(model, backend=df.compile_backend(...))`.

    Every graph Dynamo captures is planned by `df.jit`, for inference and for training:

    * dynamic shapes (torch.compile's default): a graph with symbolic sizes is planned once per
      concrete signature, on its first call with it; a call at a size seen before replays that plan,
      costing what it costs with `dynamic=False`. Many distinct sizes warn, as df.jit does: pad
      inputs to a few fixed lengths. A size that depends on tensor data (`nonzero` captured with
      `capture_dynamic_output_shape_ops`) is a TraceError.
    * training: with gradients enabled, AOTAutograd splits each graph into a forward and a backward
      aten graph, each planned by df.jit; `loss.backward()` and an optimizer step outside work as in
      eager PyTorch, batch norm's buffer updates included. A graph df cannot plan runs with aten
      kernels after a warning. Under torch.no_grad() the captured graph is planned as it is.
    * hooks: those registered before the first call are in the graph. Dynamo does not guard on
      module hooks by default (`torch._dynamo.config.skip_nnmodule_hook_guards`, for every backend),
      so one registered or removed later goes unseen; with the flag off it re-traces, and the new
      graph is planned like any other.

    strategy: None, or "auto" to time candidate strategies per graph (see `df.jit`).
    in_axes: "arguments" lets strategy="auto" try micro-batching inference graphs: the tensors the
        model is called with are split along dimension 0, parameters and buffers are shared. Use it
        when every tensor argument is batch-major ([batch, ...]); by default only candidates without
        splitting are tried.
    transforms: a transform applied to each graph's function before jit, e.g.
        `T.overlap(strategy="branches")`. The function takes the graph's flat tensor inputs
        (parameters and buffers included), so micro-batching needs `in_axes` over those.
    backend: "auto", "eager", "cudagraph" or "inductor" (Inductor kernels per stage).
    buckets: batch sizes (or "serving"), as for `df.jit`: an inference graph whose batch size is
        symbolic (Dynamo's dynamic shapes: after the batch changed once, or with `dynamic=True` or
        `torch._dynamo.mark_dynamic(x, 0)`) pads dimension 0 of the tensors the model is called with
        (never its parameters and buffers) to the next bucket and cuts its outputs back, instead of
        planning every size; its bucket plans share one memory pool. A graph with a static batch (the
        first size, before Dynamo made it dynamic) is planned as it is; one whose batch symbol also
        appears elsewhere (a flattened `[s0 * L]` tensor) is planned per size, after a warning.
    jit_options: passed on to `df.jit` (progress, ...); static_outputs, persistent_argnums and
        donate_argnums apply to inference graphs only.

    torch.compile's `mode="reduce-overhead"` is accepted (df plans on CUDA are CUDA graphs), as
    transformers' `CompileConfig(backend=df.compile_backend())` passes it; its other modes and
    `options=` are Inductor's settings and raise an InputError.

    >>> model = torch.compile(model, backend=df.compile_backend())
    >>> model(x).sum().backward()
    """
    return CompileBackend(strategy, transforms, backend, in_axes, jit_options, buckets)
