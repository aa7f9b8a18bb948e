"""Replace a subgraph of a Program by the traced graph of another function, in place.

A `T.Region` match is a set of nodes traced inside one `with df.region(...)` block. Its inputs are
the values it reads from outside, in the order it first reads them (the order of the block's code),
its outputs the values read after it, in the order they are computed. The replacement is `impl(*inputs)` traced on the inputs' shapes; its
nodes take the region's place and its outputs take over every use of the region's outputs, which
must have the same shapes, dtypes and strides.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
from torch import fx

from ..compat import FakeTensorMode, fake_mode_of
from ..errors import KERNEL_ERRORS, TransformError
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
"""(rtol, atol) per dtype for `check=True`, which runs the region and the implementation on the same
random inputs and judges each floating output against the region run again in float64 (its floating
inputs and the floating dtypes its ops name widened): the implementation may err by `ERROR_SLACK`
times what the region itself errs plus `rtol` times the output's largest magnitude. Another order of
summation (a fused, split-K or chunked kernel) errs about as much as the original, however long the
reduction, which an absolute atol cannot follow; the magnitude term covers an original that happens
to round exactly or sums more accurately (sequential float32 accumulation of n terms errs by about
1e-7 * sqrt(n) of the output's magnitude, within 1e-4 up to n ~ 1e6). A different computation (a
missing scale, a wrong mask, a transposed operand) errs by a fraction of that magnitude. Where the
region cannot run in float64 (an op without a float64 kernel), each element of the implementation's
output is compared with the region's, `|got - want| <= atol + rtol * |want|`; so is an output the
region over- or underflows (or makes NaN) where float64 does not. A float64 region is its own
reference: the implementation may differ by rtol of the output's magnitude. Integer and bool outputs
must be equal."""

ERROR_SLACK = 4.0
"""How many times the region's own error (against float64) an implementation may err: two correct
orders of summation differ in error by a small factor, a different computation by orders of magnitude."""


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

    def fake_mode(self) -> FakeTensorMode | None:
        """The FakeTensorMode of the Program's values (read off the region's inputs and nodes), which the
        replacement must be traced in: spliced in with values of a mode of its own, it would hand Inductor
        graphs whose inputs come from two modes, which it refuses to compile."""
        return fake_mode_of(node.meta.get("val") for node in (*self.inputs, *self.nodes))

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
    specs = match.input_specs(rule)
    _check_arity(impl, match, specs, rule)
    replacement = trace_function(impl, tuple(specs), {}, fake_mode=match.fake_mode())
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


def call_mismatch(impl: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """Why `impl(*args, **kwargs)` cannot bind its arguments (Python's words), or None: read before
    the call, so that the error can say what the implementation is called with, which Python's own
    TypeError, raised from inside a trace, would not."""
    try:
        inspect.signature(impl).bind(*args, **kwargs)
    except TypeError as error:
        return str(error)
    except ValueError:              # no signature to read (a builtin): the call itself will tell
        pass
    return None


def _check_arity(impl: Callable[..., Any], match: RegionMatch, specs: Sequence[TensorSpec], rule: str) -> None:
    """Refuse an implementation that cannot take the region's inputs, naming them."""
    mismatch = call_mismatch(impl, specs, {})
    if mismatch is not None:
        inputs = ", ".join(f"{node.name} {type_str(node.meta['val'])}" for node in match.inputs) or "none"
        count = f"{len(specs)} input{'' if len(specs) == 1 else 's'}"
        raise TransformError(f"the implementation for {rule} cannot take the region's {count} ({mismatch}); "
                             f"it is called with the tensors the region reads from outside, in the order it first "
                             f"reads them: {inputs}")


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
    """Run the region and `impl` on random inputs of the traced shapes, and the region again in float64
    as the exact answer; raise unless `impl` comes as close to it as DEFAULT_TOLERANCES says."""
    inputs = [_random_like(node.meta["val"], graph_module, node) for node in match.inputs]
    with torch.no_grad():
        expected = list(_extract(graph_module, match)(*inputs))
        got = impl(*inputs)
        exact = _in_float64(_extract(graph_module, match, widen=True), inputs)
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    for index, (want, have) in enumerate(zip(expected, got)):
        rtol, atol = tolerances.get(want.dtype, (0.0, 0.0))
        problem = _disagreement(want, have, exact[index] if exact is not None else None, rtol, atol)
        if problem:
            raise TransformError(f"the implementation for {rule} disagrees with the region it replaces on random "
                                 f"inputs: output {index} ({type_str(want)}) differs by up to {problem}")


def _disagreement(want: torch.Tensor, have: torch.Tensor, exact: torch.Tensor | None, rtol: float,
                  atol: float) -> str | None:
    """How far output `have` is off, where the region computed `want` (and `exact` in float64, None
    where it could not), and what was allowed; None when it is close enough."""
    if want.numel() == 0:
        return None
    if not (want.dtype.is_floating_point or want.dtype.is_complex):
        bad = have != want
        error = (have.double() - want.double()).abs()
        return f"{_at_worst(error, bad, want, have)}; integer and bool outputs must be equal)" if bad.any() else None
    if exact is not None and exact.dtype in (torch.float64, torch.complex128):
        own = float(_error(want, exact).max())
        if own < float("inf"):                     # else the region overflows (or is NaN) where float64 is not
            return _against_exact(want, have, exact, own, rtol)
    error = _error(have, want)
    bad = error > atol + rtol * _finite(want).abs()
    if not bad.any():
        return None
    return (f"{_at_worst(error, bad, want, have)}; tolerance rtol={rtol}, atol={atol}, elementwise: the region "
            f"has no float64 run to compare with)")


def _against_exact(want: torch.Tensor, have: torch.Tensor, exact: torch.Tensor, own: float,
                   rtol: float) -> str | None:
    """`have` judged by its error against the float64 `exact`, where the region errs by `own`."""
    magnitude = float(_finite(exact).abs().max())
    allowed = ERROR_SLACK * own + rtol * magnitude
    error = _error(have, exact)
    bad = error > allowed
    if not bad.any():
        return None
    return (f"{_at_worst(error, bad, want, have, exact)}) from the region run in float64, which allows "
            f"{ERROR_SLACK:g} x {own:.3g} (the region's own error) + rtol {rtol} x {magnitude:.3g} (the output's "
            f"largest magnitude) = {allowed:.3g}")


def _at_worst(error: torch.Tensor, bad: torch.Tensor, want: torch.Tensor, have: torch.Tensor,
              exact: torch.Tensor | None = None) -> str:
    """`X (at index [i, j]: ` and what was computed there, for the largest error X of the `bad` elements."""
    worst = int(torch.argmax(torch.where(bad, error, -1.0)))
    position = [int(i) for i in torch.unravel_index(torch.tensor(worst), want.shape)]
    head = f"{float(error[bad].max()):.3g} (at index {position}: "
    want_value, have_value, exact_value = (f"{value.flatten()[worst].item():.6g}" if value is not None else ""
                                           for value in (want, have, exact))
    if exact is None:
        return f"{head}{want_value} expected, {have_value} returned"
    return f"{head}{have_value} returned; the region computes {want_value}, in float64 {exact_value}"


def _error(got: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """|got - reference| per element, in double precision: 0 where both are equal (infinities too) or
    NaN, infinite where only one of them is NaN or infinite."""
    got, reference = _wide(got), _wide(reference)
    error = (got - reference).abs()
    same = (got == reference) | (torch.isnan(got) & torch.isnan(reference))
    return torch.where(same, 0.0, torch.where(torch.isnan(error), float("inf"), error))


def _finite(value: torch.Tensor) -> torch.Tensor:
    """`value` with its infinities and NaNs as 0: they have no magnitude to scale a tolerance by."""
    return torch.where(torch.isfinite(value), value, 0)


def _in_float64(widened: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """The widened region's outputs on `inputs` taken to float64; None where one of its ops has no
    kernel for the wider dtype (a custom op, a kernel for half precision only)."""
    try:
        return list(widened(*[_wide(value) for value in inputs]))
    except KERNEL_ERRORS:
        return None


def _wide(value: Any) -> Any:
    """float64 (complex128) for a floating (complex) dtype or tensor; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(_wide(value.dtype))
    if isinstance(value, torch.dtype) and value.is_complex:
        return torch.complex128
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return torch.float64
    return value


def _extract(graph_module: fx.GraphModule, match: RegionMatch, widen: bool = False) -> fx.GraphModule:
    """The region alone, as a module taking its inputs and returning its outputs. `widen`: every
    floating dtype its ops name (a cast, a factory's dtype) becomes float64, so that on float64 inputs
    it computes in float64 throughout; a view of the bits as another dtype stays as it is."""
    graph = fx.Graph()
    env = {node: graph.placeholder(node.name) for node in match.inputs}
    for node in match.nodes:
        env[node] = copied = graph.node_copy(node, lambda arg: env[arg])
        if widen and copied.target != torch.ops.aten.view.dtype:
            copied.args = tuple(_wide(arg) for arg in copied.args)
            copied.kwargs = {key: _wide(value) for key, value in copied.kwargs.items()}
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
