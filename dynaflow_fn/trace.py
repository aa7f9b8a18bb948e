"""`df.trace`: run a function once on fake tensors and record the aten ops it performs.

The function is traced with `make_fx` on `FakeTensor`s built from the shapes, strides, dtypes and
devices of the arguments, so tracing never touches real data or device memory: a 7B-parameter model
whose parameters live on the `meta` device traces on a laptop. When the traced ops
mutate anything, the recorded graph is traced once more through `torch.func.functionalize`, which
removes in-place ops; a mutation of an input survives as a final `aten.copy_` into that input.

Model code that branches on tensor values cannot be traced; the error points at the user's line.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import optree
import torch
from torch import fx
from . import ops, tree
from .compat import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
    fx_tracing_flag_cleared,
    get_proxy_mode,
    make_fx,
)
from .errors import InputError, TraceError
from .program import InputSpec, NodeInfo, OutputSpec, Program
from .tree import TensorSpec
from .regions import ScopeRecorder, last_node, nodes_after, recording


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
    staged = getattr(fn, "__dynaflow_trace__", None)
    if staged is not None:
        return staged(*args, **kwargs)
    return trace_function(fn, args, kwargs)


def trace_function(fn: Callable[..., Any], args: tuple, kwargs: dict, *,
                   body: Callable[..., Any] | None = None, provenance: Sequence[str] = ()) -> Program:
    """Trace `body` (default: `fn`) on the abstract values of (args, kwargs).

    `fn` supplies names (argument names, the module for qualified module names); `body` is what runs.
    Transforms that rewrite the function itself (microbatch) pass the rewritten body here, and the
    lines to add to the provenance after "trace".
    """
    body = fn if body is None else body
    arg_names = tree.argument_names(fn, len(args))
    paths, leaves, in_tree = tree.flatten((args, kwargs))
    kinds = tree.classify_leaves(paths, leaves, arg_names)
    path_strs = [tree.path_to_str(p, arg_names) for p in paths]
    specs = {i: TensorSpec.of(leaves[i]) for i in kinds.tensor_positions}
    _check_one_device(specs, path_strs)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [specs[i].fake(fake_mode) for i in kinds.tensor_positions]
    static_leaves = {i: leaves[i] for i in kinds.static_positions}
    module = getattr(fn, "__dynaflow_module__", None)
    module_names = {id(m): n for n, m in reversed(list(module.named_modules(remove_duplicate=False)))} \
        if module is not None else {}

    captured: dict[str, Any] = {}

    def flat_body(*tensors: torch.Tensor) -> list[torch.Tensor]:
        full = list(leaves)
        for position, tensor in zip(kinds.tensor_positions, tensors):
            full[position] = tensor
        call_args, call_kwargs = optree.tree_unflatten(in_tree, full)
        recorder = ScopeRecorder(get_proxy_mode().tracer.graph, module_names)
        captured["recorder"] = recorder
        with recording(recorder), fx_tracing_flag_cleared():
            result = body(*call_args, **call_kwargs)
        out_paths, out_leaves, out_tree = tree.flatten(result)
        captured["out"] = (out_paths, out_leaves, out_tree)
        return [leaf for leaf in out_leaves if isinstance(leaf, torch.Tensor)]

    with torch.no_grad(), _translate_errors(getattr(fn, "__name__", "fn")):
        traced = make_fx(flat_body, tracing_mode="fake")(*fakes)
    scopes = captured["recorder"].finish()
    if any(ops.is_mutating(node.target) for node in traced.graph.nodes):
        fresh = FakeTensorMode(allow_non_fake_inputs=True)
        traced, scopes = _functionalize(traced, scopes, [specs[i].fake(fresh) for i in kinds.tensor_positions])

    out_paths, out_leaves, out_tree = captured["out"]
    outputs = _output_specs(out_paths, out_leaves)
    input_names = [tree.identifier(path_strs[i]) for i in kinds.tensor_positions]
    graph_module = _rebuild(traced, input_names, scopes)
    placeholder_names = [n.name for n in graph_module.graph.nodes if n.op == "placeholder"]
    tensor_names = dict(zip(kinds.tensor_positions, placeholder_names))
    inputs = tuple(InputSpec(path_strs[i], tensor_names.get(i), static_leaves.get(i)) for i in range(len(leaves)))
    abstract_args, abstract_kwargs = optree.tree_unflatten(in_tree, [specs.get(i, leaf) for i, leaf in enumerate(leaves)])
    return Program(
        graph_module=graph_module,
        name=getattr(fn, "__name__", "fn"),
        inputs=inputs,
        in_tree=in_tree,
        outputs=outputs,
        out_tree=out_tree,
        provenance=("trace", *provenance),
        source=TraceSource(fn, body, abstract_args, abstract_kwargs),
    )


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
        elif tree.is_static_leaf(leaf):
            specs.append(OutputSpec(where, None, leaf))
        else:
            raise TraceError(f"the function returned a {type(leaf).__qualname__} at {where}; outputs must be tensors, "
                             f"Python scalars, or tuples/lists/dicts of them. Return its tensor fields instead, or "
                             f"register the type with optree.register_pytree_node.")
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


def eliminate_dead_code(graph: fx.Graph) -> None:
    """Drop nodes nobody uses, keeping mutations (the `copy_` write-backs into inputs)."""
    for node in reversed(list(graph.nodes)):
        if node.op not in ("call_function", "get_attr") or node.users:
            continue
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            continue
        graph.erase_node(node)


class _ScopeCarrier(fx.Interpreter):
    """Replays a traced graph under a new trace, giving each new node the scopes of the node it came from."""

    def __init__(self, graph_module: fx.GraphModule, scopes: dict[fx.Node, tuple]):
        super().__init__(graph_module)
        self.scopes = scopes
        self.carried: dict[fx.Node, tuple] = {}

    def run_node(self, node: fx.Node) -> Any:
        graph = get_proxy_mode().tracer.graph
        start = last_node(graph)
        result = super().run_node(node)
        for new in nodes_after(graph, start):
            self.carried[new] = self.scopes.get(node, ())
        return result


def _functionalize(traced: fx.GraphModule, scopes: dict[fx.Node, tuple],
                   fakes: Sequence[torch.Tensor]) -> tuple[fx.GraphModule, dict[fx.Node, tuple]]:
    """Trace the recorded aten graph once more through functionalization: in-place ops become
    out-of-place ones, and a mutation of an input a final `copy_` into it.

    The model itself is traced without functionalization, so library code sees plain FakeTensors and
    takes the same paths as in eager PyTorch (transformers, for one, checks for fake tensors).
    """
    carrier = _ScopeCarrier(traced, scopes)
    with torch.no_grad():
        functional = make_fx(torch.func.functionalize(carrier.run, remove="mutations"), tracing_mode="fake")(*fakes)
    return functional, carrier.carried


_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, optree)) + (os.path.dirname(__file__) + os.sep,)


def user_frame(tb: Any) -> traceback.FrameSummary | None:
    """The innermost frame of a traceback that belongs to neither torch nor dynaflow_fn."""
    frames = [f for f in traceback.extract_tb(tb)
              if not f.filename.startswith(_LIBRARY_DIRS) and not f.filename.startswith("<")]
    return frames[-1] if frames else None


def _where(error: BaseException) -> str:
    frame = user_frame(error.__traceback__)
    if frame is None:
        return "in the traced function"
    return f"at {frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`"


@contextlib.contextmanager
def _translate_errors(fn_name: str) -> Iterator[None]:
    """Turn tracing failures into TraceErrors that point at the user's line and say what to do."""
    try:
        yield
    except DynamicOutputShapeException as error:
        raise TraceError(
            f"{fn_name} calls {error.func} {_where(error)}, whose output shape depends on tensor data (boolean-mask "
            f"indexing, nonzero, unique, ...). A Plan has fixed shapes: keep the shape static with torch.where, "
            f"masked_fill or a fixed-size top-k instead.") from error
    except DataDependentOutputException as error:
        raise TraceError(
            f"{fn_name} reads the value of a tensor {_where(error)} ({error.func}). A traced program has one fixed "
            f"sequence of ops, so Python control flow cannot depend on tensor data. Compute both branches and "
            f"select with torch.where, or pass the deciding value as a Python scalar (a static argument: each "
            f"distinct value is traced once).") from error
    except UnsupportedOperatorException as error:
        raise TraceError(
            f"{fn_name} calls {error.func} {_where(error)}, which has no fake-tensor (meta) implementation. Register "
            f"one with torch.library.register_fake, or keep that op outside the jitted function.") from error
    except RuntimeError as error:
        if "fake impl" in str(error) or "fake kernel" in str(error):
            raise TraceError(f"{fn_name} calls an op {_where(error)} that cannot run on fake tensors: {error}") from error
        raise
