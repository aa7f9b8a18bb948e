"""Outputs of a graph that are views, rebuilt as views of the real tensors.

df.jit returns fresh tensors, which is right for what a graph computes and wrong for an output that
is a view: of an input (an argument or parameter returned as it is, or reshaped) or of another
output. Eager PyTorch hands out the view, and a caller may write through it (`row = f(x)[0];
row.add_(1)` changes `x`) or test it (`out is x`). AOTAutograd rebuilds each aliasing output the user
sees from the tensor it aliases, and where it cannot replay the view (symbolic sizes) it reads the
view's strides and offset from the graph's output: a fresh copy would give a view of the wrong
elements, silently. And every input returned as a fresh copy costs a copy per step, kept alive until
the backward pass reads it.

So `split_views` splits a graph in two: `computed`, the graph returning only what it computes, which
df plans, and `assemble`, which runs the view ops (they launch no kernel) on the real inputs and the
computed results and returns every output in the graph's order. Two kinds of graph come here, and
`Aliasing` says for each which nodes are views:

* AOTAutograd's functional aten graphs (training): a view op by its schema (`ATEN`);
* Dynamo's own graphs of torch-level calls (inference): a call of a known view function or method
  whose example value shares its storage with a tensor it takes (`DYNAMO`). Dynamo's graphs also
  write in place (`x.mul_(2); return x`): an output that is an in-place op's result is its first
  argument, once the computed graph has written it.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from ..compat import StorageWeakRef
from ..ir import ops


@dataclass(frozen=True)
class SplitGraph:
    """`computed(*inputs)` returns the computed outputs; `assemble(*inputs, *computed)` returns all
    outputs. `rebuilds_nothing`: every output is computed, once, in order, so `computed` is the graph
    itself. `computes_anything`: `computed` runs any op (none, when every output is rebuilt and
    nothing is written in place)."""

    computed: fx.GraphModule
    assemble: fx.GraphModule
    rebuilds_nothing: bool
    computes_anything: bool


_SIZES = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
"""What a node computing a view's sizes returns (sym_size, arithmetic on sizes)."""


@dataclass(frozen=True)
class Aliasing:
    """How one kind of graph shows its aliases: `is_view(node)`, a node whose result aliases a tensor it
    takes, which run again on the real tensors gives eager's view and launches no kernel; `returns_self(node)`,
    an in-place op whose result is its first argument, as it is; `value(node)`, the node's example value."""

    is_view: Callable[[fx.Node], bool]
    returns_self: Callable[[fx.Node], bool]
    value: Callable[[fx.Node], Any]


def _is_plain_view(node: fx.Node) -> bool:
    """A view op's node (view, t, slice, detach, ...), not a collective's wait (ops.is_view counts it)."""
    return node.op == "call_function" and ops.is_view(node.target) and not ops.is_collective_wait(node.target)


ATEN = Aliasing(_is_plain_view, lambda node: False, lambda node: node.meta.get("val"))
"""AOTAutograd's graphs: functional aten ops, views by their schema."""


_VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "t", "permute", "unsqueeze", "squeeze", "flatten",
    "unflatten", "expand", "expand_as", "narrow", "select", "detach", "contiguous", "split", "chunk", "unbind",
    "movedim", "moveaxis", "swapaxes", "swapdims", "diagonal", "unfold", "as_strided", "__getitem__", "to",
    "float", "half", "bfloat16", "double", "int", "long", "bool", "type_as"})
"""Tensor methods that return a view of their tensor, or the tensor itself, when their example value
says so (`reshape` of a contiguous tensor, `to` its own dtype); otherwise they computed a new tensor."""

_VIEW_FUNCTIONS = frozenset({
    operator.getitem, torch.reshape, torch.transpose, torch.t, torch.permute, torch.unsqueeze, torch.squeeze,
    torch.flatten, torch.unflatten, torch.narrow, torch.select, torch.detach, torch.split, torch.chunk,
    torch.unbind, torch.movedim, torch.moveaxis, torch.swapaxes, torch.swapdims, torch.diagonal,
    torch.as_strided})
"""The same as functions. `operator.getitem` is a view for basic indexing only, which its example
value tells (advanced indexing copies)."""


def _storages(value: Any) -> set[StorageWeakRef]:
    """The storages of a tensor, or of the tensors in a tuple or list (what `split` returns)."""
    tensors = value if isinstance(value, (tuple, list)) else (value,)
    return {StorageWeakRef(t.untyped_storage()) for t in tensors if isinstance(t, torch.Tensor)}


def _example(node: fx.Node) -> Any:
    return node.meta.get("example_value")


def _is_dynamo_view(node: fx.Node) -> bool:
    """A call of a view function or method in a Dynamo graph whose result shares its storage with a tensor
    it takes. Anything else, or a node with no example value, counts as computed (df.jit copies it)."""
    if node.op == "call_method":
        known = node.target in _VIEW_METHODS
    else:
        known = node.op == "call_function" and node.target in _VIEW_FUNCTIONS
    if not known:
        return False
    produced = _storages(_example(node))
    return bool(produced) and any(produced & _storages(_example(arg)) for arg in node.all_input_nodes)


def _returns_self(node: fx.Node) -> bool:
    """A call in a Dynamo graph, other than a view function, whose result is its first argument as it is:
    the same storage, shape, strides and offset. Such a call writes its argument in place (`x.mul_(2)`,
    `leaky_relu(x, 0.5, True)`, `x += 1`), or returns it untouched (`x.requires_grad_()`): either way
    its result is the argument, once the computed graph has run the call."""
    if node.op not in ("call_method", "call_function") or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    value, argument = _example(node), _example(node.args[0])
    return (isinstance(value, torch.Tensor) and isinstance(argument, torch.Tensor) and not _is_dynamo_view(node)
            and _storages(value) == _storages(argument) and value.shape == argument.shape
            and value.stride() == argument.stride() and value.storage_offset() == argument.storage_offset())


DYNAMO = Aliasing(_is_dynamo_view, _returns_self, _example)
"""Dynamo's graphs: torch-level calls, views by name and example value."""


def _is_size(value: Any) -> bool:
    """What a node computing a view's sizes returns: a size, or a shape (`x.size()`)."""
    return isinstance(value, _SIZES) or (isinstance(value, tuple) and all(isinstance(v, _SIZES) for v in value))


def _rebuildable(result: fx.Node, computed: set[fx.Node], aliasing: Aliasing) -> set[fx.Node] | None:
    """The nodes that rebuild `result` (an input, or a chain of views of inputs and computed outputs,
    with the sizes the views take), or None if rebuilding it would need a kernel."""
    needed, pending = set(), [result]
    while pending:
        node = pending.pop()
        if node in needed or node in computed:
            continue
        if aliasing.returns_self(node):
            needed.add(node)
            pending.append(node.args[0])
            continue
        if node.op != "placeholder" and not aliasing.is_view(node) and not _is_size(aliasing.value(node)):
            return None
        needed.add(node)
        pending.extend(node.all_input_nodes)
    return needed


def split_views(graph_module: fx.GraphModule, aliasing: Aliasing = ATEN) -> SplitGraph:
    """Split a graph returning a flat sequence into its computed outputs and its views."""
    graph = graph_module.graph
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    (output,) = [node for node in graph.nodes if node.op == "output"]
    results = list(output.args[0])
    nodes = list(dict.fromkeys(r for r in results if isinstance(r, fx.Node)))
    computed = {n for n in nodes if n.op != "placeholder" and not aliasing.is_view(n) and not aliasing.returns_self(n)}
    rebuilt: set[fx.Node] = set()
    for node in nodes:
        if node not in computed:
            needed = _rebuildable(node, computed, aliasing)
            if needed is None:
                computed.add(node)
            else:
                rebuilt |= needed
    ordered = [n for n in nodes if n in computed]
    returning = _returning(graph_module, ordered, aliasing)
    return SplitGraph(returning, _assembling(graph_module, placeholders, ordered, rebuilt, results, aliasing),
                      rebuilds_nothing=ordered == results,
                      computes_anything=any(node.op not in ("placeholder", "output") for node in returning.graph.nodes))


def _returning(graph_module: fx.GraphModule, returned: list[fx.Node], aliasing: Aliasing) -> fx.GraphModule:
    """The graph with these nodes as its outputs, less the views and sizes nothing reads any more
    (only those: a Dynamo graph's in-place writes have no users, and must stay)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph_module.graph.nodes:
        if node.op != "output":
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in returned))
    originals = {copy: node for node, copy in env.items()}
    for node in reversed(list(graph.nodes)):
        original = originals.get(node)
        if (original is not None and not node.users and original.op != "placeholder"
                and (aliasing.is_view(original) or _is_size(aliasing.value(original)))):
            graph.erase_node(node)
    return fx.GraphModule(graph_module, graph)


def _assembling(graph_module: fx.GraphModule, placeholders: list[fx.Node], computed: list[fx.Node],
                rebuilt: set[fx.Node], results: list, aliasing: Aliasing) -> fx.GraphModule:
    """A graph of (inputs..., computed outputs...) that rebuilds the views and returns every output."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in placeholders:
        env[node] = graph.node_copy(node, env.__getitem__)
    for index, node in enumerate(computed):
        env[node] = graph.placeholder(f"computed_{index}")
        env[node].meta = dict(node.meta)
    for node in graph_module.graph.nodes:
        if node in rebuilt and node not in env:
            env[node] = (env[node.args[0]] if aliasing.returns_self(node)       # written by the computed graph
                         else graph.node_copy(node, env.__getitem__))
    graph.output(tuple(env[r] if isinstance(r, fx.Node) else r for r in results))
    return fx.GraphModule(graph_module, graph)
