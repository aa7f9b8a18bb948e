"""Replace a subgraph of a Program by the traced graph of another function, in place.

A `T.Region` match is a set of nodes traced inside one `with df.region(...)` block. Its inputs are
the values it reads from outside, in the order it first reads them (the order of the block's code),
its outputs the values read after it, in the order they are computed. The replacement is `impl(*inputs)` traced on the inputs' shapes; its
nodes take the region's place and its outputs take over every use of the region's outputs, which
must have the same shapes, dtypes and strides.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import fx

from ..errors import TransformError
from ..ir import ops
from ..ir.formatting import op_name, type_str
from ..ir.program import NodeInfo, Program, info
from ..ir.scopes import Scope
from ..ir.tree import TensorSpec
from ..tracing.tracer import trace_function

DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7), torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}
"""(rtol, atol) per dtype for `check=True`: loose enough for another order of summation (a fused or
split-K kernel) on random inputs, tight enough to catch a different computation. Integer and bool
outputs must be equal."""


class RegionMatch:
    """One match of a `T.Region` rule (the rule is `partition_rules.Region`): its nodes in graph
    order, the values it reads from outside, the values read after it."""

    def __init__(self, nodes: Sequence[fx.Node]):
        self.nodes = list(nodes)
        inside = set(self.nodes)
        self.inputs = list(dict.fromkeys(arg for node in self.nodes for arg in node.all_input_nodes
                                         if arg not in inside))
        self.outputs = [node for node in self.nodes if any(user not in inside for user in node.users)]
        self.inside = inside

    def input_specs(self, rule: str) -> list[TensorSpec]:
        specs = []
        for node in self.inputs:
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor):
                raise TransformError(f"{rule} matched a region that reads {node.name}, which is not a tensor "
                                     f"({type(value).__name__}); substitution passes the region's tensor inputs only")
            specs.append(TensorSpec.of(value))
        return specs

    def scopes(self) -> tuple[Scope, ...]:
        """The scopes every node of the region shares (outermost first): the region's own among them."""
        common = list(info(self.nodes[0]).scopes)
        for node in self.nodes[1:]:
            scopes = info(node).scopes
            length = 0
            while length < min(len(common), len(scopes)) and common[length] == scopes[length]:
                length += 1
            del common[length:]
        return tuple(common)


def trace_impl(impl: Callable[..., Any], match: RegionMatch, rule: str) -> Program:
    """`impl` traced on the region's inputs, refused where it could not stand in for the region."""
    for node in match.nodes:
        if ops.is_mutating(node.target):
            raise TransformError(f"{rule} matched a region that writes {_format_target(node)} in place; only "
                                 f"regions without side effects can be substituted")
    replacement = trace_function(impl, tuple(match.input_specs(rule)), {})
    if replacement.closed_over:
        names = ", ".join(c.name for c in replacement.closed_over)
        raise TransformError(f"the implementation for {rule} closes over tensors ({names}); pass what it reads "
                             f"through the region's inputs instead")
    if any(ops.is_mutating(node.target) for node in replacement.ops()):
        raise TransformError(f"the implementation for {rule} writes one of its inputs in place; it must return "
                             f"new tensors and leave its inputs unchanged")
    produced = list(replacement.output_node().args[0])
    if len(produced) != len(match.outputs) or len(replacement.outputs) != len(produced):
        raise TransformError(f"the implementation for {rule} returns {len(replacement.outputs)} values, but the "
                             f"region produces {len(match.outputs)} ({_listing(match.outputs)})")
    for index, (old, new) in enumerate(zip(match.outputs, produced)):
        check_layout(rule, index, old.meta["val"], new.meta["val"], "the region produces", old.name)
    return replacement


def check_layout(rule: str, index: int, expected: torch.Tensor, got: Any, original: str, name: str = "") -> None:
    """Refuse an implementation whose output `index` is not laid out as the original's: later code was
    traced for that shape, dtype and those strides. `original` says what the original is."""
    if not isinstance(got, torch.Tensor) or TensorSpec.of(expected) != TensorSpec.of(got):
        where = f" ({name})" if name else ""
        raise TransformError(f"the implementation for {rule} returns {type_str(got)} as output {index}, where "
                             f"{original} {type_str(expected)}{where}; shapes, dtypes and strides must match")


def splice(graph_module: fx.GraphModule, match: RegionMatch, replacement: Program, marker: Scope) -> None:
    """Put the replacement's nodes where the region's were and remove the region."""
    graph = graph_module.graph
    env: dict[fx.Node, fx.Node] = dict(zip(replacement.placeholders(), match.inputs))
    scopes = match.scopes() + (marker,)
    anchor = match.nodes[-1]
    for node in replacement.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            name = _fresh_attribute(graph_module, node.target)
            setattr(graph_module, name, getattr(replacement.graph_module, node.target))
            with graph.inserting_after(anchor):
                copied = graph.get_attr(name)
        else:
            with graph.inserting_after(anchor):
                copied = graph.node_copy(node, lambda arg: env[arg])
        copied.meta = {**node.meta, "df": NodeInfo(scopes=scopes + info(node).scopes)}
        env[node] = anchor = copied
    for old, new in zip(match.outputs, replacement.output_node().args[0]):
        old.replace_all_uses_with(env[new], delete_user_cb=lambda user: user not in match.inside)
    for node in reversed(match.nodes):
        graph.erase_node(node)


def check_agrees(graph_module: fx.GraphModule, match: RegionMatch, impl: Callable[..., Any], rule: str,
                 tolerances: dict[torch.dtype, tuple[float, float]]) -> None:
    """Run the region and `impl` on random inputs of the traced shapes; raise unless they agree."""
    original = _extract(graph_module, match)
    inputs = [_random_like(node.meta["val"], graph_module, node) for node in match.inputs]
    with torch.no_grad():
        expected = original(*inputs)
        got = impl(*inputs)
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    for index, (want, have) in enumerate(zip(expected, got)):
        rtol, atol = tolerances.get(want.dtype, (0.0, 0.0))
        if want.dtype.is_floating_point or want.dtype.is_complex:
            difference = (have.double() - want.double()).abs()
            allowed = atol + rtol * want.double().abs()
            bad = ~(difference <= allowed) & ~(torch.isnan(want) & torch.isnan(have))
        else:
            difference = (have != want).to(torch.float64)
            bad = difference > 0
        if bad.any():
            worst = int(torch.argmax(torch.where(bad, difference, torch.zeros_like(difference))))
            position = [int(i) for i in torch.unravel_index(torch.tensor(worst), want.shape)]
            raise TransformError(
                f"the implementation for {rule} disagrees with the region it replaces on random inputs: output "
                f"{index} ({type_str(want)}) differs by up to {float(difference[bad].max()):.3g} (at index "
                f"{position}: {want.flatten()[worst].item():.6g} expected, {have.flatten()[worst].item():.6g} "
                f"returned; tolerance rtol={rtol}, atol={atol})")


def _extract(graph_module: fx.GraphModule, match: RegionMatch) -> fx.GraphModule:
    """The region alone, as a module taking its inputs and returning its outputs."""
    graph = fx.Graph()
    env = {node: graph.placeholder(node.name) for node in match.inputs}
    for node in match.nodes:
        env[node] = graph.node_copy(node, lambda arg: env[arg])
    graph.output([env[node] for node in match.outputs])
    return fx.GraphModule(graph_module, graph)


def _random_like(value: torch.Tensor, graph_module: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    """A constant's own value; otherwise fresh random values of the node's layout."""
    if node.op == "get_attr":
        return getattr(graph_module, node.target)
    if value.dtype.is_floating_point or value.dtype.is_complex:
        data = torch.randn(value.shape, dtype=value.dtype, device=value.device)
    elif value.dtype == torch.bool:
        data = torch.rand(value.shape, device=value.device) < 0.5
    else:
        data = torch.randint(0, 8, value.shape, dtype=value.dtype, device=value.device)
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device).copy_(data)


def _fresh_attribute(graph_module: fx.GraphModule, name: str) -> str:
    candidate, count = f"substituted_{name}", 0
    while hasattr(graph_module, candidate):
        count += 1
        candidate = f"substituted_{name}_{count}"
    return candidate


def _format_target(node: fx.Node) -> str:
    return f"{node.name} ({op_name(node.target)})"


def _listing(nodes: Sequence[fx.Node]) -> str:
    return ", ".join(node.name for node in nodes) or "nothing"
