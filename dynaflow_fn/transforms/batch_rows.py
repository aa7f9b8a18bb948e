"""Which axis of each value of a traced micro-batch body holds the micro-batch's rows.

Micro-batching computes what the unsplit function computes only when every row of the result
depends on the same row of the split inputs and on nothing else of the batch. This module follows
the rows through one micro-batch body, an aten graph whose split inputs hold `rows` rows along a
known axis, and gives every value one of these states:

- `None`: the value reads no row of the batch (parameters, constants, masks built from shapes);
- `Rows(axis)`: row `b` of the batch lies along `axis` and depends only on row `b` of the inputs;
- `Reduced(by, not_a_sum)`: the value mixes rows of the batch, first at op `by` (a reduction over
  the batch axis, a matrix product contracting it, a pick of one row), and is a sum or mean of one
  term per row unless `not_a_sum` names the op that made it otherwise (a max, a square root);
- `UNKNOWN`: an op the analysis does not model read batch data; nothing downstream is judged.

Pointwise ops broadcast the axis, views and permutes move it, reductions over other axes keep it.
An op that combines a `Reduced` value with `Rows` (a batch mean subtracted from the rows, as in
train-mode batch norm), or that works along the batch axis itself (a softmax over it, a product of
rows with rows), computes something else once the batch is split: it becomes a `Finding`. The
analysis is conservative: an op it does not know stops it quietly, and it reports nothing it
cannot show. Whether a `Reduced` or `Rows` output is merged right is up to the caller, who knows
the merge (`out_axes`).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from ..compat import OpOverload
from ..errors import InternalError
from ..ir import ops
from .row_rules import fills_like, reads_only_shapes, rule_for
from .row_states import (RULE_ARGUMENT_ERRORS, UNKNOWN, Reduced, RowFlow, Rows, RuleCall, State, arange_bounds,
                         describe, each_result, places_rows_into_made, record_finding)
from .sorted_rows import follow_sorted, is_sorted_state, unresolved_output


def follow_rows(graph: fx.Graph, split_axes: dict[str, int], rows: int) -> RowFlow:
    """Follow the batch rows from the placeholders named in `split_axes` (name -> batch axis).

    `rows` is the size of the micro-batch, at least 2 (with one row every axis of size 1 could be it).
    """
    if rows < 2:
        raise InternalError(f"follow_rows needs micro-batches of at least two rows, got {rows}")
    flow = RowFlow({}, [])
    for node in graph.nodes:
        if node.op == "placeholder":
            flow.states[node] = Rows(split_axes[node.name]) if node.name in split_axes else None
        elif node.op == "get_attr":
            flow.states[node] = None
        elif node.op == "call_function":
            flow.states[node] = _transfer(node, flow, rows)
            if flow.states[node] is None and _made_here(node, flow):
                flow.made.add(node)
        elif node.op == "output":
            _settle_sorted_outputs(node, flow)
    return flow


def _settle_sorted_outputs(output: fx.Node, flow: RowFlow) -> None:
    """An output still in a sort's order holds other rows at each position once the batch is split."""
    for node in output.all_input_nodes:
        if is_sorted_state(flow.states.get(node)):
            flow.states[node] = unresolved_output(node, flow)


def _made_here(node: fx.Node, flow: RowFlow) -> bool:
    """Whether a value that reads no row is a tensor the function makes itself (`RowFlow.made`): an op
    that reads no value (`torch.zeros(b, d)`, `x.new_zeros(...)`), or a view of such a tensor."""
    if not isinstance(node.target, OpOverload):
        return False
    if ops.is_view(node.target):
        return isinstance(node.args[0], fx.Node) and node.args[0] in flow.made
    return not reads_values(node)


def reads_values(node: fx.Node) -> list[fx.Node]:
    """The inputs whose values `node` reads: none for ops that read only shapes and dtypes (`zeros_like`)."""
    if isinstance(node.target, OpOverload) and reads_only_shapes(node.target):
        return []
    return node.all_input_nodes


# --- the transfer function ----------------------------------------------------------------------


def _transfer(node: fx.Node, flow: RowFlow, rows: int) -> State:
    target = node.target
    if target is operator.getitem:
        whole = flow.states[node.args[0]]
        return whole[node.args[1]] if isinstance(whole, tuple) else whole
    if not isinstance(target, OpOverload):
        return each_result(node, UNKNOWN)
    if fills_like(target) and isinstance(flow.states[node.args[0]], Rows):
        return flow.states[node.args[0]]           # a filled copy of the rows' layout (CFG's zeros_like(cond))
    read = reads_values(node)
    inputs = [flow.states[n] for n in read]
    if any(is_sorted_state(state) for state in inputs):      # a mixture of experts' token dispatch
        return follow_sorted(node, read, flow, rule_for(target))
    if any(_has(state, UNKNOWN) for state in inputs):
        return each_result(node, UNKNOWN)
    carrying = [state for state in inputs if isinstance(state, Rows)]
    reduced = [state for state in inputs if isinstance(state, Reduced)]
    if not carrying:
        return each_result(node, _carried(node, flow, reduced) if reduced else None)
    rule = rule_for(target)
    if any(isinstance(state, tuple) for state in inputs) or (rule is None and reduced):
        return each_result(node, UNKNOWN)
    if reduced:                      # rows picked at fixed positions (`x - x[0]`) stay rows for padding
        picked = all(state.picked for state in reduced)
        found = record_finding(node, flow, f"combines a value mixed across the batch rows (by {reduced[0].by}) "
                                           f"with per-row data", causal=picked)
        if not picked:
            return found
    bound = ops.bind_arguments(target, node.args, node.kwargs)
    if rule is None:
        return _unmodelled(node, bound, flow)
    try:
        return rule(RuleCall(node, bound, flow, rows))
    except RULE_ARGUMENT_ERRORS:
        return each_result(node, UNKNOWN)


def _carried(node: fx.Node, flow: RowFlow, reduced: list[Reduced]) -> Reduced:
    """A value computed from values mixed across the rows, and from no rows themselves, mixes them
    too. It stops being a sum of one term per row at an op that is not linear in such sums (a square
    root, a max, a product of two of them, a quotient by one); views, adds, scaling by values that
    read no row, and the backward ops of a gradient (linear in the gradient they are given: the
    micro-batches' gradients of a weight add up to the batch's) keep it one."""
    broken = next((state.not_a_sum for state in reduced if state.not_a_sum), None)
    if broken is None and _breaks_sums(node, flow):
        broken = describe(node)
    return Reduced(reduced[0].by, broken, broken is None and all(state.mean for state in reduced),
                   all(state.picked for state in reduced))


def _breaks_sums(node: fx.Node, flow: RowFlow) -> bool:
    packet = ops.op_info(node.target).packet
    if packet in _NOT_LINEAR:
        return True
    if packet not in _SCALING:
        return False
    mixed = [n for n in reads_values(node) if isinstance(flow.states[n], Reduced)]
    return len(mixed) > 1 or (packet == "aten.div" and node.args[0] is not mixed[0])


_NOT_LINEAR = frozenset({f"aten.{name}" for name in (
    "sqrt", "rsqrt", "pow", "square", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "abs", "sign",
    "reciprocal", "tanh", "sigmoid", "sin", "cos", "tan", "atan", "atan2", "erf", "erfinv", "relu", "gelu", "silu",
    "softplus", "elu", "leaky_relu", "hardtanh", "clamp", "clamp_min", "clamp_max", "maximum", "minimum", "fmax",
    "fmin", "floor", "ceil", "round", "trunc", "frac", "remainder", "fmod", "_softmax", "_log_softmax", "logsumexp",
    "amax", "amin", "max", "min", "var", "std", "var_mean", "std_mean", "linalg_vector_norm", "norm", "prod",
    "median", "nanmedian", "mode", "kthvalue", "sort", "topk", "argmax", "argmin", "gt", "lt", "ge", "le", "eq",
    "ne", "logical_and", "logical_or", "logical_not", "isnan", "isinf", "all", "any")})
"""Ops that are not linear in their input: a sum over the rows passed through one is no sum."""

_SCALING = frozenset({"aten.mul", "aten.div", "aten.mm", "aten.bmm", "aten.mv", "aten.dot", "aten.addmm"})
"""Ops linear in each input apart: a sum stays one when it is their only input that mixes the rows,
and is not a divisor."""


def _unmodelled(node: fx.Node, bound: dict[str, Any], flow: RowFlow) -> State:
    """An op no rule models stops the analysis (UNKNOWN), unless its arguments name the batch axis of
    the tensor it works on: `flip(x, [0])`, `roll`, `gather`, `index_select`, `x[idx]`, `repeat` reorder,
    pick or copy rows of the batch, so a micro-batch or a padded batch gives other rows than the whole
    one. Staying quiet there would leave such a function computing something else without a word. A
    write into a tensor the function makes (`RowFlow.made`) at positions the rows' data holds places
    the rows where data says: a value mixed across them (added up with `accumulate`)."""
    into = bound.get("self", bound.get("input"))
    state = flow.states.get(into) if isinstance(into, fx.Node) else None
    if places_rows_into_made(bound, flow):
        by = describe(node)                          # `out = zeros(b, d); out[index] = x`: data places the rows
        return each_result(node, Reduced(by, None if bound.get("accumulate") else by))
    if not isinstance(state, Rows):
        return each_result(node, UNKNOWN)
    packet = ops.op_info(node.target).packet
    if packet in _FLAT_POSITIONS:
        return record_finding(node, flow, "indexes the tensor as one flat vector, so its positions number the "
                                          "elements of all the rows, and a part of the batch numbers its own")
    if packet == "aten.masked_scatter":
        states = [flow.states.get(n) for n in node.all_input_nodes]
        in_order = all(s == Rows(0) for s in states if isinstance(s, Rows))
        return record_finding(node, flow, "takes the source's elements in the order of the mask's positions across "
                                          "all the rows, so a part of the batch starts at the source's first",
                              causal=in_order)     # rows along axis 0: a row takes elements after the rows before it
    rank = max(_rank(into), 1)
    named = _named_axes(bound, rank)
    if state.axis in named:
        return record_finding(node, flow, f"works along the batch axis ({named[state.axis]}), so rows of the "
                                          f"result read or move other rows of the batch")
    return each_result(node, _rows_read_in_order(bound, flow) if packet == "aten.index" else UNKNOWN)


def _rows_read_in_order(bound: dict[str, Any], flow: RowFlow) -> State:
    """`x[arange(b)[:, None, None], positions]`, as transformers' mask builders index each row: the
    rows' own numbers index the batch axis (0), and indices that read no row pick positions within a
    row, constant along the rows. Row `b` of the result reads row `b` alone, on the axis where the
    numbers lie once the indices broadcast."""
    source, indices = bound["self"], [index for index in bound["indices"] if index is not None]
    if (flow.states[source] != Rows(0) or not indices or bound["indices"][:len(indices)] != indices
            or not _counts_rows_in_order(indices[0], source, 0)
            or any(flow.states.get(index) is not None for index in indices[1:])):
        return UNKNOWN
    shapes = [tuple(index.meta["val"].shape) for index in indices]
    rank = max(len(shape) for shape in shapes)
    axis = rank - len(shapes[0])
    if any(0 <= len(shape) - rank + axis and shape[len(shape) - rank + axis] != 1 for shape in shapes[1:]):
        return UNKNOWN                            # positions that differ from row to row
    return Rows(axis)


_FLAT_POSITIONS = frozenset({"aten.put", "aten.take"})
"""Ops that index their input as one flat vector: an index names positions across all its rows."""


def _named_axes(bound: dict[str, Any], rank: int) -> dict[int, str]:
    """The axes of an op's input that its arguments name (`dim=0`, `dims=[0]`, an index tensor at
    position 0 of `indices`, `repeats` above 1), each with the argument that names it."""
    named: dict[int, str] = {}
    for key in ("dim", "dims", "dimension"):
        value = bound.get(key)
        values = (value,) if isinstance(value, int) else value if isinstance(value, (list, tuple)) else ()
        named.update({d % rank: f"{key}={value}" for d in values if isinstance(d, int)})
    indices = bound.get("indices")
    if isinstance(indices, (list, tuple)):
        source = bound.get("self", bound.get("input"))
        named.update({i: f"an index tensor at position {i}" for i, v in enumerate(indices)
                      if v is not None and not _counts_rows_in_order(v, source, i)})
    repeats = bound.get("repeats")
    if isinstance(repeats, (list, tuple)):
        offset = len(repeats) - rank
        named.update({i - offset: f"repeats={list(repeats)}" for i, r in enumerate(repeats)
                      if isinstance(r, int) and r != 1 and i >= offset})
    return named


def _counts_rows_in_order(index: Any, source: Any, axis: int) -> bool:
    """Whether `index`, an index tensor for `axis` of `source`, is `arange(n)` over that axis's n rows,
    unsqueezed after its first dimension: `x[torch.arange(batch)[:, None, None], ...]`, as transformers'
    mask builders index per row. Row `b` of the result then reads row `b`, so it works along the batch
    without moving rows. Anything else (another order, a subset, a repeat) is not recognized."""
    while isinstance(index, fx.Node) and index.target is _UNSQUEEZE and index.args[1] not in (0, -index.args[0].meta["val"].dim() - 1):
        index = index.args[0]
    if not isinstance(source, fx.Node):
        return False
    return arange_bounds(index) == (0, source.meta["val"].shape[axis], 1)


_UNSQUEEZE = torch.ops.aten.unsqueeze.default


def _rank(node: Any) -> int:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value.dim() if hasattr(value, "dim") else 0


def _has(state: State, wanted: Any) -> bool:
    return any(_has(s, wanted) for s in state) if isinstance(state, tuple) else state is wanted
