"""Outputs of an AOTAutograd graph that are views, rebuilt as views of the real tensors.

df.jit returns fresh tensors, which is right for what a graph computes and wrong for an output that
is a view: of an input (an argument or parameter returned as it is, or reshaped) or of another
output. AOTAutograd rebuilds each aliasing output the user sees from the tensor it aliases, and
where it cannot replay the view (symbolic sizes) it reads the view's strides and offset from the
graph's output: a fresh copy would give a view of the wrong elements, silently. And every input
returned as a fresh copy costs a copy per step, kept alive until the backward pass reads it.

So `split_views` splits a graph in two: `computed`, the graph returning only what it computes, which
df plans, and `assemble`, which runs the view ops (they launch no kernel) on the real inputs and the
computed results and returns every output in the graph's order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from ..ir import ops
from ..ir.analyses import eliminate_dead_code


@dataclass(frozen=True)
class SplitGraph:
    """`computed(*inputs)` returns the `computes` computed outputs; `assemble(*inputs, *computed)`
    returns all outputs."""

    computed: fx.GraphModule
    assemble: fx.GraphModule
    computes: int


_SIZES = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
"""What a node computing a view's sizes returns (sym_size, arithmetic on sizes)."""


def _is_plain_view(node: fx.Node) -> bool:
    """A view op's node (view, t, slice, detach, ...), not a collective's wait (ops.is_view counts it)."""
    return node.op == "call_function" and ops.is_view(node.target) and not ops.is_collective_wait(node.target)


def _rebuildable(result: fx.Node, computed: set[fx.Node]) -> set[fx.Node] | None:
    """The nodes that rebuild `result` (an input, or a chain of views of inputs and computed outputs,
    with the sizes the views take), or None if rebuilding it would need a kernel."""
    needed, pending = set(), [result]
    while pending:
        node = pending.pop()
        if node in needed or node in computed:
            continue
        if node.op != "placeholder" and not _is_plain_view(node) and not isinstance(node.meta.get("val"), _SIZES):
            return None
        needed.add(node)
        pending.extend(node.all_input_nodes)
    return needed


def split_views(graph_module: fx.GraphModule) -> SplitGraph:
    """Split an aten graph returning a flat sequence into its computed outputs and its views."""
    graph = graph_module.graph
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    (output,) = [node for node in graph.nodes if node.op == "output"]
    results = list(output.args[0])
    nodes = list(dict.fromkeys(r for r in results if isinstance(r, fx.Node)))
    computed = {n for n in nodes if n.op != "placeholder" and not _is_plain_view(n)}
    rebuilt: set[fx.Node] = set()
    for node in nodes:
        if node not in computed:
            needed = _rebuildable(node, computed)
            if needed is None:
                computed.add(node)
            else:
                rebuilt |= needed
    ordered = [n for n in nodes if n in computed]
    return SplitGraph(_returning(graph_module, ordered),
                      _assembling(graph_module, placeholders, ordered, rebuilt, results), len(ordered))


def _returning(graph_module: fx.GraphModule, returned: list[fx.Node]) -> fx.GraphModule:
    """The graph with these nodes as its outputs and what they do not need removed."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph_module.graph.nodes:
        if node.op != "output":
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[n] for n in returned))
    eliminate_dead_code(graph)
    return fx.GraphModule(graph_module, graph)


def _assembling(graph_module: fx.GraphModule, placeholders: list[fx.Node], computed: list[fx.Node],
                rebuilt: set[fx.Node], results: list) -> fx.GraphModule:
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
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[r] if isinstance(r, fx.Node) else r for r in results))
    return fx.GraphModule(graph_module, graph)
