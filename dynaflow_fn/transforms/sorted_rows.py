"""Rows sorted along the batch axis and put back: the token dispatch of mixture-of-experts layers.

transformers' MoE experts (Mixtral, Qwen3-MoE, and every model on its grouped-mm path) sort the
tokens' expert ids along the batch, gather the tokens in that order, run one grouped matrix product
whose groups are the ids' counts, and gather the results back through the inverse order:

    ids, order = torch.sort(expert_ids)              # expert_ids: [tokens * k], k experts per token
    picked = hidden[order // k]                      # the tokens, grouped by expert
    out = F.grouped_mm(picked, w, offs=torch.cumsum(torch.histc(ids, ...), 0))
    inverse = torch.empty_like(order); inverse[order] = torch.arange(len(order))
    out = out[inverse]                               # each token's results at its own place again

The sort reads every row, yet each result row depends on its own token only: a part of the batch
sorts its own tokens and gets the same rows back. This module follows such values through states of
their own, tied to the sort (`Sorting`) that ordered them. An op it does not model on one of them,
or a sorted value returned as it is, gives the finding the sort would give: it works along the
batch axis, so every row reads the other rows.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import fx

from ..compat import OpOverload
from ..ir import ops
from .row_states import (RULE_ARGUMENT_ERRORS, UNKNOWN, Reduced, RowFlow, Rows, RuleCall, State, arange_bounds,
                         describe, each_result, record_finding)
from .tensor_row_rules import TENSOR_RULES, pointwise


@dataclass(frozen=True)
class Sorting:
    """A sort along the batch axis of a 1-D value whose rows each hold `inner` consecutive elements
    (a token's k expert ids): the order every sorted state below refers to."""

    node: fx.Node
    inner: int


@dataclass(frozen=True)
class Sorted:
    """Elements of the sort's input, in the sort's order along `axis` (the sorted values, tokens gathered
    in that order, anything computed from them element by element): each depends on its own row only.
    `keys`: the ascending sorted values themselves (or a cast of them), whose counts per bin group
    the sorted rows by their own values."""

    sorting: Sorting
    axis: int = 0
    keys: bool = False


@dataclass(frozen=True)
class SortOrder:
    """The sort's indices, divided to count `per_row` positions per row (`order // k` numbers tokens):
    gathering a value whose rows each hold `per_row` elements by it gives a `Sorted` value."""

    sorting: Sorting
    per_row: int


@dataclass(frozen=True)
class GroupOffsets:
    """How many sorted elements fall into each bin (histc of the sorted values), summed up
    with `cumulative` (cumsum): the offsets that group sorted rows by their own values."""

    sorting: Sorting
    cumulative: bool = False


@dataclass(frozen=True)
class Unsorting:
    """The inverse of the sort's order (`inverse[order] = arange(n)`, `argsort(order)`): gathering a
    `Sorted` value by it puts every element back at its row."""

    sorting: Sorting


SORT_STATES = (Sorted, SortOrder, GroupOffsets, Unsorting)


def is_sorted_state(state: State) -> bool:
    """Whether `state` (or one of an op's several) is one of this module's."""
    return any(isinstance(s, SORT_STATES) for s in (state if isinstance(state, tuple) else (state,)))


def sort_rows(call: RuleCall) -> State:
    """sort, argsort: along the batch axis of a 1-D value whose rows each hold `inner` elements (and
    no other copies of the batch), the sorted states; otherwise the finding of any op along it."""
    state = call.state("self")
    if not (isinstance(state, Rows) and state.outer == 1 and call.rank(call.bound["self"]) == 1
            and len(call.node.all_input_nodes) == 1):
        return TENSOR_RULES[ops.op_info(call.node.target).packet](call)
    sorting = Sorting(call.node, state.inner)
    order = SortOrder(sorting, state.inner)
    if not isinstance(call.node.meta["val"], (tuple, list)):
        return order
    return Sorted(sorting, keys=not call.bound.get("descending", False)), order


def follow_sorted(node: fx.Node, inputs: list[fx.Node], flow: RowFlow,
                  rows_rule: Callable[[RuleCall], State] | None) -> State:
    """The state of an op that reads a sorted state (of `inputs`, the values it reads): one of the
    dispatch steps below, or an op that works element by element along the sorted axis."""
    states = [flow.states[n] for n in inputs]
    sortings = {s.sorting for s in states if isinstance(s, SORT_STATES)}
    if len(sortings) == 1 and not any(isinstance(s, tuple) or s is UNKNOWN for s in states):
        (sorting,) = sortings
        bound = ops.bind_arguments(node.target, node.args, node.kwargs)
        step = _DISPATCH_STEPS.get(ops.op_info(node.target).packet)
        state = step(node, bound, flow, sorting) if step is not None else None
        if state is None and rows_rule is not None:
            state = _element_by_element(node, bound, inputs, flow, sorting, rows_rule)
        if state is not None:
            return state
    for sorting in sortings:
        unresolved(sorting, flow)
    return each_result(node, UNKNOWN)


def unresolved(sorting: Sorting, flow: RowFlow) -> None:
    """The sort's finding, once: its order reached an op this module cannot follow, or an output."""
    if not any(finding.node is sorting.node for finding in flow.findings):
        record_finding(sorting.node, flow, "works along the batch axis, so every row reads the other rows")


def unresolved_output(node: fx.Node, flow: RowFlow) -> State:
    """The state of an output still in a sort's order (the sorted values, rows gathered by it): the
    sort's finding, and nothing to follow."""
    state = flow.states[node]
    for part in state if isinstance(state, tuple) else (state,):
        if isinstance(part, SORT_STATES):
            unresolved(part.sorting, flow)
    return each_result(node, UNKNOWN)


def _element_by_element(node: fx.Node, bound: dict[str, Any], inputs: list[fx.Node], flow: RowFlow,
                        sorting: Sorting, rows_rule: Callable[[RuleCall], State]) -> State | None:
    """Run the op's rule with each `Sorted` input standing as rows of their own along its axis. Where the
    rule keeps them rows, unmixed and in place (a pointwise op, a view, a split along another axis, a
    product with a weight), the result is sorted the same way. An input that reads no row must not
    meet the sorted elements position by position (broadcast or joined to them) unless it is the same
    along their axis: one that varies there would meet each element at its sorted position."""
    stand_ins = {n: Rows(flow.states[n].axis) for n in inputs if isinstance(flow.states[n], Sorted)}
    if any(flow.states[n] is not None for n in inputs if n not in stand_ins):
        return None                                   # the order's indices, offsets, or unsorted rows
    by_position = rows_rule is pointwise or ops.op_info(node.target).packet in ("aten.cat", "aten.stack")
    if by_position and not all(_constant_along(n, stand_ins) for n in inputs if n not in stand_ins):
        return None
    lengths = {_shape(n)[state.axis] for n, state in stand_ins.items()}
    if len(lengths) != 1:
        return None
    shadow = RowFlow({**{n: flow.states[n] for n in node.all_input_nodes}, **stand_ins}, [], flow.made)
    try:
        result = rows_rule(RuleCall(node, bound, shadow, lengths.pop()))
    except RULE_ARGUMENT_ERRORS:
        return None
    results = result if isinstance(result, tuple) else (result,)
    if shadow.findings or any(r is not None and not (isinstance(r, Rows) and r == Rows(r.axis)) for r in results):
        return None
    keys = _keeps_order(node) and any(flow.states[n].keys for n in stand_ins)
    back = tuple(None if r is None else Sorted(sorting, r.axis, keys) for r in results)
    return back if isinstance(result, tuple) else back[0]


def _keeps_order(node: fx.Node) -> bool:
    """Whether `node` keeps the sorted values in ascending order: the same values, or a cast of them to
    a floating type or a wide integer (not one that wraps them around, as uint8 would)."""
    dtype = node.kwargs.get("dtype")
    return _packet(node) in _SAME_VALUES and (dtype is None or dtype.is_floating_point or dtype in _WIDE)


_SAME_VALUES = frozenset({"aten._to_copy", "aten.clone", "aten.alias", "aten.detach"})
_WIDE = (torch.int32, torch.int64)


def _constant_along(value: fx.Node, stand_ins: dict[fx.Node, Rows]) -> bool:
    """Whether `value`, aligned with the sorted inputs at their last dimension, has size 1 (or no
    dimension) along every axis a sorted input holds its elements on."""
    shape = _shape(value)
    for sorted_input, state in stand_ins.items():
        axis = state.axis - len(_shape(sorted_input)) + len(shape)
        if 0 <= axis < len(shape) and shape[axis] != 1:
            return False
    return True


# --- the dispatch steps ------------------------------------------------------------------------------


def _divide(node: fx.Node, bound: dict[str, Any], flow: RowFlow, sorting: Sorting) -> State | None:
    """`order // k`: positions of k per row become the rows' own numbers."""
    order, divisor = flow.states.get(bound.get("self")), bound.get("other")
    floor = ops.op_info(node.target).packet == "aten.floor_divide" or bound.get("rounding_mode") == "floor"
    if (floor and isinstance(order, SortOrder) and isinstance(divisor, int) and divisor > 0
            and order.per_row % divisor == 0):
        return SortOrder(sorting, order.per_row // divisor)
    return None


def _gather(node: fx.Node, bound: dict[str, Any], flow: RowFlow, sorting: Sorting) -> State | None:
    """`x[index]` or `x.index_select(0, index)`, one 1-D index: rows gathered in the sort's order, sorted
    values put back by the inverse order, or a table read at the sorted values (an expert's bias)."""
    indices = bound["indices"] if "indices" in bound else [bound["index"]] if bound["dim"] == 0 else []
    if len(indices) != 1 or not isinstance(indices[0], fx.Node) or len(_shape(indices[0])) != 1:
        return None
    taken, index = flow.states[bound["self"]], flow.states[indices[0]]
    if isinstance(index, SortOrder) and taken == Rows(0, 1, index.per_row):
        return Sorted(sorting)
    if isinstance(index, Unsorting) and _sorted_along_0(taken):
        return Rows(0, 1, sorting.inner)
    if _sorted_along_0(index) and taken is None:
        return Sorted(sorting)
    return None


def _count(node: fx.Node, bound: dict[str, Any], flow: RowFlow, sorting: Sorting) -> State | None:
    """histc of the ascending sorted values: how many fall into each bin, the bins in the
    values' order. histc leaves out values past its range; past `max`, they sort after every counted
    one and are left out at the end, but one under `min` would shift every group: so histc counts
    only values no smaller than its `min` can be (indices, as top-k's expert ids are)."""
    counted = node.all_input_nodes[0]
    state = flow.states[counted]
    if not (_sorted_along_0(state) and state.keys and len(node.all_input_nodes) == 1 and len(_shape(counted)) == 1):
        return None
    nonnegative = bound.get("min", 0) <= 0 and _indices(sorting.node.args[0])
    if ops.op_info(node.target).packet == "aten.histc" and not nonnegative:
        return None
    return GroupOffsets(sorting)


def _accumulate(node: fx.Node, bound: dict[str, Any], flow: RowFlow, sorting: Sorting) -> State | None:
    """cumsum of the counts along their one axis: where each group of sorted rows ends."""
    counts = flow.states[bound["self"]]
    if counts == GroupOffsets(sorting) and bound["dim"] in (0, -1):
        return GroupOffsets(sorting, cumulative=True)
    return None


def _grouped_product(node: fx.Node, bound: dict[str, Any], flow: RowFlow, sorting: Sorting) -> State | None:
    """A grouped matrix product of sorted rows [n, k] with one weight per group [groups, k, m], its groups
    ending at the sorted values' cumulative counts: each row meets the weight of its own value, so
    rows stay rows, in the sort's order. The weights' gradient, sorted rows transposed [k, n] times
    sorted rows [n, m], sums each group's rows: the parts of a batch add up to it."""
    rows, weights = bound.get("self", bound.get("input")), bound.get("mat2", bound.get("weight"))
    offsets = bound.get("offs")
    if not all(isinstance(v, fx.Node) for v in (rows, weights, offsets)):
        return None
    extra = [n for n in node.all_input_nodes if n not in (rows, weights, offsets)]
    if (flow.states[offsets] != GroupOffsets(sorting, cumulative=True) or len(_shape(rows)) != 2
            or any(flow.states[n] is not None for n in extra)):
        return None
    if _sorted_along_0(flow.states[rows]) and flow.states[weights] is None and len(_shape(weights)) == 3:
        return Sorted(sorting)
    if flow.states[rows] == Sorted(sorting, 1) and _sorted_along_0(flow.states[weights]) and len(_shape(weights)) == 2:
        return Reduced(describe(node))           # [k, n] @ [n, m] per group: each group's sum over its rows
    return None


def _put_back(node: fx.Node, bound: dict[str, Any], flow: RowFlow, sorting: Sorting) -> State | None:
    """`into[order] = values` into a tensor the function makes: the numbers 0..n-1 make the inverse
    order; sorted values land back at their rows (added up where `order // k` names a row k times).
    `into[inverse] = rows` places rows at their sorted positions."""
    into, indices, values = bound["self"], bound["indices"], bound["values"]
    if not _filled(into, flow) or len(indices) != 1 or not isinstance(indices[0], fx.Node):
        return None
    index, length = flow.states[indices[0]], _shape(sorting.node.args[0])[0]
    if _shape(indices[0]) != (length,):
        return None
    if isinstance(index, Unsorting):             # rows placed at their sorted positions (`out[inverse]`'s gradient)
        rows = flow.states[values] == Rows(0, 1, sorting.inner) and _shape(into)[0] == length
        return Sorted(sorting) if rows else None
    if not isinstance(index, SortOrder):
        return None
    if index.per_row == sorting.inner and _shape(into)[0] == length and _numbers_positions(values, length):
        return Unsorting(sorting)
    return _placed_rows(into, index, flow.states[values], sorting)


def _add_back(node: fx.Node, bound: dict[str, Any], flow: RowFlow, sorting: Sorting) -> State | None:
    """`into.index_add(0, order // k, values)`, index_copy: sorted values added (copied) back to their rows."""
    into, index = bound["self"], flow.states[bound["index"]]
    if not _filled(into, flow) or bound["dim"] != 0 or not isinstance(index, SortOrder):
        return None
    return _placed_rows(into, index, flow.states[bound["source"]], sorting)


def _placed_rows(into: fx.Node, index: SortOrder, values: State, sorting: Sorting) -> State | None:
    """Sorted values written into `into` at the rows `index` names: rows of `into`'s axis 0, each
    holding `index.per_row` elements, when that axis has as many as the index can name."""
    rows = _shape(sorting.node.args[0])[0] // sorting.inner
    if _sorted_along_0(values) and _shape(into)[0] == rows * index.per_row:
        return Rows(0, 1, index.per_row)
    return None


def _invert(node: fx.Node, bound: dict[str, Any], flow: RowFlow, sorting: Sorting) -> State | None:
    """argsort of the order (sort's indices of it): the inverse order."""
    order = flow.states[bound["self"]]
    if order != SortOrder(sorting, sorting.inner) or bound.get("dim", -1) not in (0, -1) or bound.get("descending"):
        return None
    return (None, Unsorting(sorting)) if isinstance(node.meta["val"], (tuple, list)) else Unsorting(sorting)


def _filled(into: Any, flow: RowFlow) -> bool:
    """Whether `into` is a tensor the function makes filled with one value (`zeros`, `empty_like`), or a
    view of one: written at the rows' places, it adds nothing that differs from row to row (as
    `arange(n)` would, numbered from 0 by every part of the batch)."""
    while isinstance(into, fx.Node) and into in flow.made and ops.is_view(into.target):
        into = into.args[0]
    return isinstance(into, fx.Node) and into in flow.made and _packet(into) in _FILLS


_FILLS = frozenset(f"aten.{name}" for name in (
    "zeros", "zeros_like", "ones", "ones_like", "empty", "empty_like", "empty_strided", "full", "full_like",
    "new_zeros", "new_ones", "new_empty", "new_empty_strided", "new_full", "scalar_tensor"))
"""Ops that make a tensor filled with one value (or left unwritten)."""


def _sorted_along_0(state: State) -> bool:
    return isinstance(state, Sorted) and state.axis == 0


def _indices(value: Any) -> bool:
    """Whether `value` is, through views and casts, the indices a search returns (top-k's, argmax's):
    numbers no smaller than 0."""
    while isinstance(value, fx.Node) and value.op == "call_function":
        if value.target is operator.getitem:
            return value.args[1] == 1 and _packet(value.args[0]) in _SEARCHES
        if _packet(value) in _ARG_SEARCHES:
            return True
        if _packet(value) not in _KEEPS_VALUES:
            return False
        value = value.args[0]
    return False


_SEARCHES = frozenset({"aten.topk", "aten.sort", "aten.max", "aten.min", "aten.kthvalue", "aten.mode", "aten.median"})
"""Ops whose second result is indices."""

_ARG_SEARCHES = frozenset({"aten.argmax", "aten.argmin", "aten.argsort"})

_KEEPS_VALUES = frozenset({"aten.view", "aten._unsafe_view", "aten.reshape", "aten.flatten", "aten.squeeze",
                           "aten.unsqueeze", "aten.clone", "aten._to_copy", "aten.alias", "aten.detach"})
"""Views and casts: the same values (of an integer tensor), in another shape or dtype."""


def _packet(node: Any) -> str:
    if not isinstance(node, fx.Node) or not isinstance(node.target, OpOverload):
        return ""
    return ops.op_info(node.target).packet


def _numbers_positions(value: Any, length: int) -> bool:
    """Whether `value` is `arange(length)`: the numbers of the positions an order permutes."""
    return arange_bounds(value) == (0, length, 1)


def _shape(node: fx.Node) -> tuple[int, ...]:
    """The shape of a node's tensor (its first, for an op returning several); () for a number."""
    value = node.meta.get("val")
    value = next((v for v in value if isinstance(v, torch.Tensor)), None) if isinstance(value, (tuple, list)) else value
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


_DISPATCH_STEPS: dict[str, Callable[..., State | None]] = {
    "aten.floor_divide": _divide, "aten.div": _divide, "aten.index": _gather, "aten.index_select": _gather,
    "aten.histc": _count, "aten.cumsum": _accumulate, "aten._grouped_mm": _grouped_product,
    "transformers.grouped_mm_fallback": _grouped_product, "aten.index_put": _put_back,
    "aten.index_add": _add_back, "aten.index_copy": _add_back, "aten.sort": _invert, "aten.argsort": _invert,
}
"""The steps of a sorted dispatch, by the op's packet; each gives None where its arguments are not
the step's (the op is then followed element by element, or ends the analysis of the order)."""


SORTED_RULES: dict[str, Callable[[RuleCall], State]] = {"aten.sort": sort_rows, "aten.argsort": sort_rows}
"""The rules that start a sorted dispatch, by the op's packet (they replace `TENSOR_RULES`' own)."""
