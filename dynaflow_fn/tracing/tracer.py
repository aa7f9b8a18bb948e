"""`df.trace`: run a function once on fake tensors and record the aten ops it performs.

The function is traced with `make_fx` on `FakeTensor`s built from the shapes, strides, dtypes and
devices of the arguments, so tracing never touches real data or device memory: a 7B-parameter model
whose parameters live on the `meta` device traces on a laptop. When the traced ops
mutate anything, the recorded graph is traced once more through `torch.func.functionalize`, which
removes inplace ops; a mutation of an input survives as a final `aten.copy_` into that input.

A trace steps out of whatever trace or dispatch mode is active when it starts, so traces nest: a
function traced inside another traced function (a transform's body, `df.trace` in model code) gets a
Program of its own, which the outer trace then records as it runs.

Model code that branches on tensor values cannot be traced; the error points at the user's line.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import optree
import torch
from torch import fx

from ..compat import (
    FakeTensorMode,
    FakeTensorModeWithFallback,
    current_trace_graph,
    fx_tracing_flag_cleared,
    make_fx,
    outside_current_trace,
    quiet_meta_failures,
)
from ..errors import InputError, TraceError
from ..ir import ops, tree
from ..ir.analyses import eliminate_dead_code
from ..ir.program import NodeInfo, Program
from ..ir.signature import ClosedOver, InputSpec, OutputSpec, Signature, device_of
from ..ir.tree import TensorSpec
from .attribute_writes import refusing_attribute_rebinds
from .closure import closed_over_objects, lift_closed_over
from .dropped_checks import warn_dropped_checks
from .escapes import refuse_escaped_tensors
from .gradients import GradientFlow, gradient_flow, recording_grad_modes
from .layout_writes import refuse_layout_writes
from .mode_reads import recording_mode_reads, shadows_flag
from .regions import ScopeRecorder, last_node, nodes_after, recording
from .reseeding import refusing_own_generators, refusing_reseeds
from .trace_errors import refusing_outside_value_reads, translating_errors

_TRACING = threading.RLock()
"""make_fx and FX keep process-wide state while they trace (the patcher, the fx-tracing flag), so
two threads tracing at once corrupt each other: traces take turns."""


def no_trace_running() -> threading.RLock:
    """The lock a trace holds while it runs. A trace changes shared Python state meanwhile (`df.pure`
    swaps a module's parameters for fake tensors), so another thread that reads that state, to
    fingerprint the module, takes it first: it sees the module as it is between traces."""
    return _TRACING


@dataclass(frozen=True)
class TraceSource:
    """What a Program was traced from, so a transform that changes the trace (microbatch) can trace again.

    `body` is the function that ran (the user's function, possibly wrapped by body-rewriting
    transforms); `fn` supplies names. Tensors in args/kwargs are kept as TensorSpecs, not data.
    """

    fn: Callable[..., Any]
    body: Callable[..., Any]
    args: tuple
    kwargs: dict


def trace(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Program:
    """Trace `fn(*args, **kwargs)` into a Program.

    Tensor arguments may be real tensors, `meta` tensors or FakeTensors; only their shapes, strides,
    dtypes and devices are used. Non-tensor leaves (ints, floats, strings, ...) are static: they are
    baked into the program. Functions returned by transforms are traced and then transformed.

    >>> prog = df.trace(fn, params, x)
    >>> print(prog)
    """
    return trace_flat(fn, tree.Flat.of(args, kwargs))


def trace_flat(fn: Callable[..., Any], flat: tree.Flat) -> Program:
    """`trace` of arguments flattened already (df.jit flattens each call once). A transformed function
    traces itself (`__dynaflow_trace__`: its passes run on the trace)."""
    staged = getattr(fn, "__dynaflow_trace__", None)
    if staged is not None:
        return staged(flat)
    return trace_function(fn, flat.args, flat.kwargs, flat=flat)


def trace_function(fn: Callable[..., Any], args: tuple, kwargs: dict, *,
                   body: Callable[..., Any] | None = None, provenance: Sequence[str] = (),
                   flat: tree.Flat | None = None, fake_mode: FakeTensorMode | None = None) -> Program:
    """Trace `body` (default: `fn`) on the abstract values of (args, kwargs).

    `fn` supplies names (argument names, the module for qualified module names); `body` is what runs.
    Transforms that rewrite the function itself (microbatch) pass the rewritten body here, and the
    lines to add to the provenance after "trace". `flat` is (args, kwargs) flattened, if it is at hand.
    `fake_mode` is the FakeTensorMode to trace in, by default a new one: a trace whose nodes go into
    another Program (a substitution's) traces in that Program's mode (`compat.fake_mode_of`), so that
    the Program's fake values keep one mode, which Inductor requires of the graphs it compiles.
    """
    body = fn if body is None else body
    arg_names = tree.argument_names(fn, len(args))
    flat = flat or tree.Flat.of(args, kwargs)
    paths, leaves, in_tree = flat.paths, flat.leaves, flat.treedef
    kinds = tree.classify_leaves(paths, leaves, arg_names)
    path_strs = [tree.path_to_str(p, arg_names) for p in paths]
    specs = {i: TensorSpec.of(leaves[i]) for i in kinds.tensor_positions}
    _check_one_device(specs, path_strs)

    if fake_mode is None:
        fake_mode = FakeTensorModeWithFallback(allow_non_fake_inputs=True)
    fakes = [specs[i].fake(fake_mode) for i in kinds.tensor_positions]
    static_leaves = {i: leaves[i] for i in kinds.static_positions}

    observed: dict[str, Any] = {}
    name = getattr(fn, "__name__", "fn")
    flat_body = _flat_body(body, leaves, in_tree, kinds.tensor_positions, observed, name)
    called = lambda: observed["recorder"].called_modules() if "recorder" in observed else ()   # noqa: E731
    with _TRACING, outside_current_trace(), torch.no_grad(), quiet_meta_failures(), translating_errors(name), \
            refusing_reseeds(name):
        with refusing_attribute_rebinds(fn, name, called), fake_mode.recording_results() as produced:
            traced = make_fx(flat_body, tracing_mode="fake")(*fakes)
        out_paths, out_leaves, out_tree = observed["out"]
        outputs = _output_specs(out_paths, out_leaves)    # before the escape check: a returned holder is no escape
        _refuse_what_no_plan_replays(traced, produced, observed, fakes, [path_strs[i] for i in kinds.tensor_positions],
                                     fn, name)
        traced, scopes, closed_over, flow = _functional(traced, fn, observed,
                                                        [specs[i] for i in kinds.tensor_positions], fake_mode)
    recorder = observed["recorder"]

    input_names = [tree.identifier(path_strs[i]) for i in kinds.tensor_positions]
    input_names += [n.name for n in traced.graph.nodes if n.op == "placeholder"][len(input_names):]
    warn_dropped_checks(traced.graph, name)
    graph_module = _rebuild(traced, input_names, scopes)
    placeholder_names = [n.name for n in graph_module.graph.nodes if n.op == "placeholder"]
    tensor_names = dict(zip(kinds.tensor_positions, placeholder_names))
    inputs = tuple(InputSpec(path_strs[i], tensor_names.get(i), static_leaves.get(i)) for i in range(len(leaves)))
    abstract_args, abstract_kwargs = optree.tree_unflatten(in_tree, [specs.get(i, leaf) for i, leaf in enumerate(leaves)])
    device = device_of([*(specs[i] for i in kinds.tensor_positions), *(c.tensor for c in closed_over)])
    return Program(
        graph_module=graph_module,
        signature=Signature(getattr(fn, "__name__", "fn"), inputs, in_tree, outputs, out_tree, device, closed_over),
        provenance=("trace", *provenance),
        source=TraceSource(fn, body, abstract_args, abstract_kwargs),
        module_modes=_module_modes(observed["mode_reads"], recorder.called_modules()),
        objects_read=tuple({id(o): o for o in (*recorder.called_modules(), *closed_over_objects(fn))}.values()),
        gradient_flow=flow,
    )


def _refuse_what_no_plan_replays(traced: fx.GraphModule, produced: list, observed: dict[str, Any],
                                 fakes: Sequence[torch.Tensor], tensor_paths: Sequence[str], fn: Callable[..., Any],
                                 name: str) -> None:
    """The checks that need the finished trace: tensors the function kept outside itself (op results
    and the arguments it saw), layouts of arguments changed in place."""
    arguments = [(ref, f"its argument {path}") for ref, path in zip(observed["inputs"], tensor_paths)]
    refuse_escaped_tensors([*produced, *arguments], traced.graph, fakes, observed["out"][1], fn, name)
    refuse_layout_writes(traced.graph, name, tensor_paths)


def _functional(traced: fx.GraphModule, fn: Callable[..., Any], observed: dict[str, Any],
                specs: Sequence[TensorSpec], fake_mode: FakeTensorMode
                ) -> tuple[fx.GraphModule, dict, tuple[ClosedOver, ...], GradientFlow]:
    """The traced graph with closed-over tensors lifted to inputs and, if it mutates anything, made
    functional (traced again in the trace's `fake_mode`, whose values the Program keeps); its nodes'
    scopes, the tensors lifted, and its gradient flow."""
    scopes = observed["recorder"].finish()
    closed_over = lift_closed_over(traced, fn)
    flow = gradient_flow(traced.graph, observed["grad_recorded"])
    if any(ops.is_mutating(node.target) for node in traced.graph.nodes):
        traced, scopes = _functionalize(traced, scopes, [spec.fake(fake_mode) for spec in specs] +
                                        [TensorSpec.of(c.tensor).fake(fake_mode) for c in closed_over])
    return traced, scopes, closed_over, flow


def _flat_body(body: Callable[..., Any], leaves: Sequence[Any], in_tree: optree.PyTreeSpec,
               tensor_positions: Sequence[int], observed: dict[str, Any],
               name: str) -> Callable[..., list[torch.Tensor]]:
    """`body` as a function of the tensor leaves alone, the form make_fx traces. The static leaves
    are put back in their places; what only the run can tell (the scope recorder, the training flags
    read, the output pytree, the fake inputs the function saw) is left in `observed`. `name` (the
    function's) is for the errors of what it runs inside the trace."""

    def flat_body(*tensors: torch.Tensor) -> list[torch.Tensor]:
        observed["inputs"] = [weakref.ref(tensor) for tensor in tensors]     # the fakes the function sees
        full = list(leaves)
        for position, tensor in zip(tensor_positions, tensors):
            full[position] = tensor
        call_args, call_kwargs = optree.tree_unflatten(in_tree, full)
        recorder = ScopeRecorder(current_trace_graph())
        observed["recorder"] = recorder
        with recording(recorder), recording_mode_reads() as mode_reads, fx_tracing_flag_cleared(), \
                recording_grad_modes(recorder.graph) as observed["grad_recorded"], refusing_own_generators(name), \
                refusing_outside_value_reads():
            result = body(*call_args, **call_kwargs)
        observed["mode_reads"] = dict(mode_reads)
        out_paths, out_leaves, out_tree = tree.flatten(result)
        observed["out"] = (out_paths, out_leaves, out_tree)
        return [leaf for leaf in out_leaves if isinstance(leaf, torch.Tensor)]

    return flat_body


def _module_modes(reads: dict[int, tuple[torch.nn.Module, bool]],
                  called: Sequence[torch.nn.Module]) -> tuple[tuple[torch.nn.Module, bool], ...]:
    """The modules whose train/eval mode the trace depends on, with the mode it saw: those whose flag
    was read, and called modules whose class defines `training` itself (their reads are not seen)."""
    modes = dict(reads)
    for module in called:
        if id(module) not in modes and shadows_flag(module):
            modes[id(module)] = (module, module.training)
    return tuple(modes.values())


def _check_one_device(specs: dict[int, TensorSpec], path_strs: Sequence[str]) -> None:
    """All tensors must live on one device (0-dim CPU tensors excepted, as in PyTorch)."""
    first: tuple[str, torch.device] | None = None
    for i, spec in specs.items():
        if spec.device.type == "cpu" and not spec.shape:
            continue
        if first is None:
            first = (path_strs[i], spec.device)
        elif spec.device != first[1]:
            raise InputError(f"arguments live on different devices: {first[0]} on {first[1]}, {path_strs[i]} on "
                             f"{spec.device}. Move them to one device before calling.")


def _output_specs(paths: Sequence[tuple], leaves: Sequence[Any]) -> tuple[OutputSpec, ...]:
    specs, index = [], 0
    for path, leaf in zip(paths, leaves):
        where = tree.output_path_to_str(path)
        if isinstance(leaf, torch.Tensor):
            specs.append(OutputSpec(where, index))
            index += 1
        elif tree.is_static_leaf(leaf) and tree.tensor_inside(leaf) is None:
            specs.append(OutputSpec(where, None, leaf))
        else:
            fields = ("`dict(result)` (its fields as a plain dict: a transformers ModelOutput's, say), or its "
                      "tensors" if isinstance(leaf, Mapping) else "its tensor fields")
            raise TraceError(f"the function returned a {type(leaf).__qualname__} at {where}; outputs must be tensors, "
                             f"Python scalars, or tuples, lists, dicts and namedtuples of them. Return {fields} "
                             f"instead, or register the type with optree.register_pytree_node.")
    return tuple(specs)


def _rebuild(traced: fx.GraphModule, input_names: Sequence[str], scopes: dict[fx.Node, tuple]) -> fx.GraphModule:
    """Copy the traced graph with readable placeholder names, scope annotations and no dead nodes."""
    eliminate_dead_code(traced.graph)
    graph = fx.Graph()
    node_map: dict[fx.Node, fx.Node] = {}
    old_placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for old, name in zip(old_placeholders, input_names):
        new = graph.placeholder(name)
        new.meta = dict(old.meta)
        node_map[old] = new
    graph.output(graph.graph_copy(traced.graph, node_map))
    for old, new in node_map.items():
        new.meta["df"] = NodeInfo(scopes=scopes.get(old, ()))
    return fx.GraphModule(traced, graph)


class _ScopeCarrier(fx.Interpreter):
    """Replays a traced graph under a new trace, giving each new node the scopes of the node it came from."""

    def __init__(self, graph_module: fx.GraphModule, scopes: dict[fx.Node, tuple]):
        super().__init__(graph_module)
        self.scopes = scopes
        self.carried: dict[fx.Node, tuple] = {}

    def run_node(self, node: fx.Node) -> Any:
        graph = current_trace_graph()
        start = last_node(graph)
        result = super().run_node(node)
        for new in nodes_after(graph, start):
            self.carried[new] = self.scopes.get(node, ())
        return result


def _functionalize(traced: fx.GraphModule, scopes: dict[fx.Node, tuple],
                   fakes: Sequence[torch.Tensor]) -> tuple[fx.GraphModule, dict[fx.Node, tuple]]:
    """Trace the recorded aten graph once more through functionalization: inplace ops become
    out-of-place ones, and a mutation of an input a final `copy_` into it.

    The model itself is traced without functionalization, so library code sees plain FakeTensors and
    takes the same paths as in eager PyTorch (transformers, for one, checks for fake tensors).
    """
    carrier = _ScopeCarrier(traced, scopes)
    with torch.no_grad():
        functional = make_fx(torch.func.functionalize(carrier.run, remove="mutations"), tracing_mode="fake")(*fakes)
    return functional, carrier.carried
