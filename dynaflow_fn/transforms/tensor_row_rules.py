"""Row rules for tensor ops: pointwise math, views, reductions, joins and matrix products.

Each rule maps a `RuleCall` (an op whose inputs carry the batch rows) to the state of its result;
`row_rules` finds them by the op's packet. The two helpers `same_rows` and `moved` and the fallback
rules `pointwise` and `reduction` are shared with `layer_row_rules`.
"""

from __future__ import annotations

import math
import operator
from typing import Callable, Sequence

from torch import fx

from ..ir.ops import op_info
from .row_states import UNKNOWN, Reduced, Rows, RuleCall, State, places_rows_into_made


def same_rows(states: Sequence[State]) -> State:
    """The one Rows state all of `states` agree on, else UNKNOWN."""
    first = states[0]
    return first if all(s == first for s in states[1:]) else UNKNOWN


def moved(state: Rows, axis: int) -> Rows:
    """`state` with its rows on `axis` instead."""
    return Rows(axis, state.outer, state.inner)


def pointwise(call: RuleCall) -> State:
    """Elementwise with broadcasting: inputs align at their last dimension."""
    rank = call.rank()
    aligned = [moved(s, s.axis + rank - call.rank(n)) for n in call.node.all_input_nodes
               if isinstance(s := call.flow.states[n], Rows)]
    if len({state.axis for state in aligned}) > 1:
        return call.report("pairs every row of the batch with every other (its inputs hold the rows along different "
                           "axes, which broadcasting crosses)")
    return call.result(same_rows(aligned))


def _copy(call: RuleCall) -> State:
    """`copy(self, src)`: src's values broadcast into self's shape."""
    src = call.state("src")
    if not isinstance(src, Rows):
        return call.result(src)
    return call.result(moved(src, src.axis + call.rank() - call.rank(call.bound["src"])))


def reduction(call: RuleCall) -> State:
    """sum, mean, amax, ... over `dim` (all dimensions if None): the batch axis among them mixes the rows."""
    state = call.state("self")
    if not isinstance(state, Rows) or len(call.node.all_input_nodes) != 1:
        return call.result(UNKNOWN)
    rank = call.rank(call.bound["self"])
    dims = call.dims("dim", rank)
    dims = list(range(rank)) if dims is None else dims
    if state.axis in dims:
        packet = op_info(call.node.target).packet
        return call.result(call.reduced(sum_of_rows=packet in _SUMS, mean=packet == "aten.mean"))
    keep = call.bound.get("keepdim", False)
    return call.result(moved(state, state.axis if keep else state.axis - sum(d < state.axis for d in dims)))


_CUMULATIVE = frozenset({"aten.cumsum", "aten.cumprod", "aten.cummax", "aten.cummin", "aten.logcumsumexp"})
"""Ops along a dimension whose element `b` reads elements up to `b` only."""

_SUMS = frozenset({"aten.sum", "aten.mean", "aten.nansum"})
"""Reductions whose value over the batch is a sum or mean of one term per row."""


def _along_dim(call: RuleCall) -> State:
    """softmax, cumsum, sort, ...: each output element reads a whole line along `dim`."""
    node_inputs = call.node.all_input_nodes
    states = [call.flow.states[n] for n in node_inputs]
    if any(not isinstance(s, Rows) for s in states) or any(call.rank(n) != call.rank() for n in node_inputs):
        return call.result(UNKNOWN)
    state = same_rows(states)
    if state is UNKNOWN:
        return call.result(UNKNOWN)
    if call.bound.get("dim", -1) % max(call.rank(), 1) == state.axis:
        causal = op_info(call.node.target).packet in _CUMULATIVE
        reported = call.report("works along the batch axis, so every row reads the other rows", causal=causal)
        return call.result(state) if causal else reported     # a causal result keeps its rows in place
    return call.result(state)


def _reorder(call: RuleCall) -> State:
    """flip, roll: move elements along `dims`; along other axes than the rows', each row stays itself."""
    state, rank = call.state("self"), call.rank()
    dims = call.dims("dims", rank)
    if dims is None or state.axis in dims:
        return call.report(f"works along the batch axis (dims={call.bound.get('dims')}), so rows of the result read "
                           f"or move other rows of the batch")
    return call.result(state)


def _view(call: RuleCall) -> State:
    """A view or reshape keeps the element order; find the output axis the batch rows land on. Where
    no axis holds them (`x.T.reshape(batch, -1)`: each row of the result takes parts of several rows),
    the rows are mixed."""
    state = call.state("self")
    in_shape, out_shape = call.shape(call.bound["self"]), call.shape()
    if 0 in in_shape or 0 in out_shape:
        return call.result(UNKNOWN)
    mapped = _view_axis(in_shape, out_shape, state, call.rows)
    if mapped is None:
        return call.report("reshapes the batch rows across other axes, so a row of the result holds parts of "
                           "several rows of the batch")
    return call.result(mapped)


def _view_axis(in_shape: Sequence[int], out_shape: Sequence[int], state: Rows, rows: int) -> Rows | None:
    """In row-major order, row `b` starts `step` elements after row `b - 1` and the rows span
    `rows * step` elements; the output axis whose elements cover that span holds them."""
    step = state.inner * math.prod(in_shape[state.axis + 1:])
    span = step * rows
    stride = 1
    for axis in reversed(range(len(out_shape))):
        low, high = stride, stride * out_shape[axis]
        if low <= step and span <= high and step % low == 0 and high % span == 0:
            inner = step // low
            return Rows(axis, out_shape[axis] // (rows * inner), inner)
        stride = high
    return None


def _expand(call: RuleCall) -> State:
    state = call.state("self")
    return call.result(moved(state, state.axis + call.rank() - call.rank(call.bound["self"])))


def _permute(call: RuleCall) -> State:
    state = call.state("self")
    dims = [d % call.rank() for d in call.bound["dims"]]
    return call.result(moved(state, dims.index(state.axis)))


def _transpose(call: RuleCall) -> State:
    state = call.state("self")
    rank = max(call.rank(), 1)
    first, second = call.bound["dim0"] % rank, call.bound["dim1"] % rank
    swap = {first: second, second: first}
    return call.result(moved(state, swap.get(state.axis, state.axis)))


def _t(call: RuleCall) -> State:
    state = call.state("self")
    return call.result(moved(state, 1 - state.axis) if call.rank() == 2 else state)


def _select(call: RuleCall) -> State:
    """`x[i]` along the batch axis picks one row. `x[0]` of an axis that holds the batch once is the
    first real row of a padded batch too; `x[-1]` is a padded row, and `x[3]` of a batch of three
    rows, which eager PyTorch refuses, would be one as well."""
    state = call.state("self")
    dim = call.bound["dim"] % call.rank(call.bound["self"])
    if dim == state.axis:
        first = call.bound["index"] == 0 and state == Rows(state.axis)
        return call.result(call.reduced(sum_of_rows=False, picked=first))
    return call.result(moved(state, state.axis - (dim < state.axis)))


def _slice(call: RuleCall) -> State:
    state = call.state("self")
    dim = call.bound.get("dim", 0) % call.rank()
    size = call.shape(call.bound["self"])[dim]
    if dim != state.axis or call.shape()[dim] == size:
        return call.result(state)
    start = call.bound.get("start") or 0
    start = (start + size if start < 0 else start) % size
    block = _block(state, call.rows, call.bound.get("step", 1), start, call.shape()[dim])
    if block is not None:
        return call.result(block)
    first = start == 0 and call.shape()[dim] == 1 and state == Rows(state.axis)     # `x[:1]`, as `x[0]`
    return call.result(call.reduced(sum_of_rows=False, picked=first))               # some rows picked


def _slice_backward(call: RuleCall) -> State:
    """A slice's gradient, placed into zeros of the input's shape: rows stay (sliced along the rows: not followed)."""
    state = call.state("grad_output")
    return call.result(UNKNOWN if call.bound["dim"] % call.rank() == state.axis else state)


def _block(state: Rows, rows: int, step: int, start: int, length: int) -> Rows | None:
    """The rows of elements `start:start + length` along the axis of `state`, when they are whole
    copies of the batch's rows (`cat([u, c])[b:]`, a `chunk` of it): the axis holds `state.outer`
    such copies, each `rows * inner` long."""
    copy = rows * state.inner
    if state.outer == 1 or step != 1 or not length or start % copy or length % copy:
        return None
    return Rows(state.axis, length // copy, state.inner)


def _cat(call: RuleCall) -> State:
    """Along another axis than the rows', each row joins its own row. Along the rows' axis, tensors
    with the same rows make an axis holding several copies of the batch (`cat([x, x])` or
    `cat([zeros_like(c), c])`, classifier-free guidance), which `chunk` and slices take apart again.
    cat skips 1-D empty tensors (a cache's first `torch.tensor([])`), whatever the others' rank."""
    tensors = [t for t in call.bound["tensors"] if call.shape(t) != (0,)]
    dim = call.bound.get("dim", 0) % call.rank()
    states = [call.flow.states[t] for t in tensors if isinstance(call.flow.states[t], Rows)]
    state = same_rows(states)
    if state is not UNKNOWN and state.axis == dim and len(states) == len(tensors) > 1:
        return call.result(Rows(dim, state.outer * len(tensors), state.inner))
    if state is not UNKNOWN and state.axis == dim and _shifted(call, tensors, dim):
        return call.report("concatenates along the batch axis after other values, so rows of the result sit at "
                           "other positions than the batch's rows")
    if state is UNKNOWN or state.axis == dim or any(call.rank(t) != call.rank() for t in tensors):
        return call.result(UNKNOWN)
    return call.result(state)


def _shifted(call: RuleCall, tensors: Sequence[fx.Node], dim: int) -> bool:
    """Whether values come before the first batched tensor along `dim` (`cat([zeros(1, d), x])`): a
    batched tensor first (`cat([x, tail])`, decode rows before a prefill chunk) keeps its rows in
    place, and what follows is left to the ops that read it."""
    for tensor in tensors:
        if isinstance(call.flow.states[tensor], Rows):
            return False
        if call.rank(tensor) != call.rank() or call.shape(tensor)[dim]:
            return True
    return False


def _stack(call: RuleCall) -> State:
    states = [call.flow.states[t] for t in call.bound["tensors"] if isinstance(call.flow.states[t], Rows)]
    state = same_rows(states)
    if state is UNKNOWN:
        return call.result(UNKNOWN)
    dim = call.bound.get("dim", 0) % call.rank()
    return call.result(moved(state, state.axis + (dim <= state.axis)))


def _split(call: RuleCall) -> State:
    state = call.state("self")
    dim = call.bound.get("dim", 0) % call.rank(call.bound["self"])
    if dim != state.axis:
        return call.result(state)
    pieces, start = [], 0
    for piece in call.node.meta["val"]:
        pieces.append(_block(state, call.rows, 1, start, piece.shape[dim]))
        start += piece.shape[dim]
    if None not in pieces:
        return tuple(pieces)                         # whole copies of the batch, taken apart
    return _cut_into_pieces(call, state, dim) if len(pieces) > 1 else call.result(UNKNOWN)


def _unbind(call: RuleCall) -> State:
    state = call.state("self")
    dim = call.bound.get("dim", 0) % call.rank(call.bound["self"])
    if dim == state.axis:
        return _cut_into_pieces(call, state, dim)
    return call.result(moved(state, state.axis - (dim < state.axis)))


def _cut_into_pieces(call: RuleCall, state: Rows, dim: int) -> State:
    """Pieces of the batch axis hold other rows for a part of the batch than for the whole, but where
    only the first is used and it is the first row (`x.unbind(0)[0]`, `x.split(1)[0]`), it is `x[0]`."""
    pieces = call.node.meta["val"]
    first_row = state == Rows(state.axis) and (len(pieces[0].shape) < call.rank(call.bound["self"])
                                               or pieces[0].shape[dim] == 1)
    if first_row and all(user.target is operator.getitem and user.args[1] == 0 for user in call.node.users):
        return (call.reduced(sum_of_rows=False, picked=True), *[UNKNOWN] * (len(pieces) - 1))
    return call.report("cuts the batch axis into pieces, so a piece holds other rows of a part of the batch than "
                       "of the whole")


def _pad(call: RuleCall) -> State:
    """constant_pad_nd: `pad` holds (before, after) pairs for the last dimensions, the last first."""
    state, rank, pad = call.state("self"), call.rank(), list(call.bound["pad"])
    padded = {rank - 1 - i // 2 for i, amount in enumerate(pad) if amount}
    if state.axis in padded:
        return call.report("pads the batch axis, so rows of the result sit at other positions than the batch's "
                           "rows, or read the padding")
    return call.result(state)


def _scatter(call: RuleCall) -> State:
    """scatter, scatter_add, scatter_reduce: write `src` into `self` at the positions `index` holds
    along `dim`. Along another axis than the rows', each row writes into its own row. Along the rows'
    axis into a value that reads no row, rows land in slots that data chooses: added up (scatter_add,
    a "sum" reduce) they make a sum over the rows, reduced otherwise something else. Into the rows
    themselves (`zeros_like(x).scatter(0, index, x)`), data picks which row takes which: a part of the
    batch picks among its own rows only. A plain write at such positions into a tensor the function
    makes (`zeros(b, d)`) mixes the rows the same way; into an input (a cache update) it stops the
    analysis."""
    states = [call.flow.states[n] for n in call.node.all_input_nodes if isinstance(call.flow.states[n], Rows)]
    state, rank = same_rows(states), call.rank()
    if state is UNKNOWN or any(call.rank(n) != rank for n in call.node.all_input_nodes):
        return call.result(UNKNOWN)
    dim = call.bound["dim"] % rank
    if dim != state.axis and call.shape()[state.axis] == call.shape(call.bound["index"])[state.axis]:
        return call.result(state)
    added = op_info(call.node.target).packet == "aten.scatter_add" or call.bound.get("reduce") in ("sum", "add")
    if dim == state.axis and call.state("self") is None and (added or "reduce" in call.bound):
        return call.result(call.reduced(sum_of_rows=added))
    if dim == state.axis and isinstance(call.state("self"), Rows):
        return _written_at_chosen_rows(call)
    if places_rows_into_made(call.bound, call.flow):
        return call.result(call.reduced(sum_of_rows=False))      # `zeros(b, d).scatter(0, index, x)`
    return call.result(UNKNOWN)


def _index_add(call: RuleCall) -> State:
    """index_add, index_reduce: add (or reduce: prod, mean, amax, amin) the rows of `source` along
    `dim` into the rows of `self` that `index` names. With the batch rows along `dim` and a `self`
    that reads no row, the rows land in slots that data chooses: added up, a sum over the rows. Into
    the rows themselves, data picks which row takes which (see `_scatter`)."""
    source, index, into = call.state("source"), call.state("index"), call.state("self")
    dim = call.bound["dim"] % call.rank()
    if into is None and isinstance(source, Rows) and source.axis == dim and index in (None, Rows(0)):
        return call.result(call.reduced(sum_of_rows=op_info(call.node.target).packet == "aten.index_add"))
    if isinstance(into, Rows) and into.axis == dim:
        return _written_at_chosen_rows(call)
    return call.result(UNKNOWN)


def _written_at_chosen_rows(call: RuleCall) -> State:
    return call.report("writes along the batch axis at positions an index tensor holds, so a row of the result "
                       "takes the value of whichever row the index names, and a part of the batch numbers its "
                       "rows from 0")


def _matmul(call: RuleCall, first: str, second: str, batched: bool) -> State:
    """`a @ b` for matrices ([i, k] @ [k, j]) or batches of them ([n, i, k] @ [n, k, j]): the shared
    dimension n, a's rows i and b's columns j carry rows through; the summed dimension k mixes them."""
    offset = 1 if batched else 0
    roles = []
    for name, kept in ((first, offset), (second, offset + 1)):
        state = call.state(name)
        if isinstance(state, Rows):
            role = "shared" if batched and state.axis == 0 else "kept" if state.axis == kept else "summed"
            roles.append((state, role))
    if not roles:
        return None
    if len(roles) == 1:
        state, role = roles[0]
        return call.reduced(sum_of_rows=True) if role == "summed" else state
    (a, a_role), (b, b_role) = roles
    if a_role == b_role == "shared":
        return same_rows([a, b])
    if a_role == b_role == "summed":
        return call.reduced(sum_of_rows=True) if a == moved(b, a.axis) else UNKNOWN
    return call.report("multiplies rows of the batch with other rows of the batch (a matrix product of two "
                       "batch operands)")


def _with_bias(call: RuleCall, product: State, rank: int) -> State:
    """`bias + a @ b` (addmm, baddbmm): the product's state broadcast with the bias's."""
    bias = call.state("self")
    if not isinstance(bias, Rows) or product is UNKNOWN:
        return product
    if isinstance(product, Reduced):
        return call.report(f"combines a value mixed across the batch rows (by {product.by}) with "
                           f"per-row data")
    bias = moved(bias, bias.axis + rank - call.rank(call.bound["self"]))
    return bias if product is None else same_rows([product, bias])


def _mm(call: RuleCall) -> State:
    return _matmul(call, "self", "mat2", batched=False)


def _addmm(call: RuleCall) -> State:
    return _with_bias(call, _matmul(call, "mat1", "mat2", batched=False), 2)


def _bmm(call: RuleCall) -> State:
    return _matmul(call, "self", "mat2", batched=True)


def _baddbmm(call: RuleCall) -> State:
    return _with_bias(call, _matmul(call, "batch1", "batch2", batched=True), 3)


def _same_as(name: str) -> Callable[[RuleCall], State]:
    """Ops whose results carry the rows of argument `name` unchanged (same shape)."""
    return lambda call: call.result(call.state(name))


TENSOR_RULES: dict[str, Callable[[RuleCall], State]] = {
    "aten._to_copy": _same_as("self"), "aten.detach": _same_as("self"), "aten.alias": _same_as("self"),
    "aten.lift_fresh_copy": _same_as("self"), "aten.native_dropout": _same_as("input"), "aten.copy": _copy,
    "_c10d_functional.all_reduce": _same_as("input"), "_c10d_functional.wait_tensor": _same_as("tensor"),
    "aten.view": _view, "aten._unsafe_view": _view, "aten.reshape": _view, "aten.squeeze": _view,
    "aten.unsqueeze": _view, "aten.flatten": _view, "aten.unflatten": _view, "aten.expand": _expand,
    "aten.permute": _permute, "aten.transpose": _transpose, "aten.t": _t, "aten.select": _select,
    "aten.slice": _slice, "aten.slice_backward": _slice_backward, "aten.cat": _cat, "aten.stack": _stack,
    "aten.split": _split, "aten.split_with_sizes": _split, "aten.unsafe_split": _split, "aten.chunk": _split,
    "aten.unsafe_split_with_sizes": _split, "aten.unbind": _unbind, "aten._log_softmax_backward_data": _along_dim,
    "aten._softmax": _along_dim, "aten._log_softmax": _along_dim, "aten._softmax_backward_data": _along_dim,
    "aten.cumsum": _along_dim, "aten.cumprod": _along_dim, "aten.logcumsumexp": _along_dim, "aten.sort": _along_dim,
    "aten.argsort": _along_dim, "aten.topk": _along_dim, "aten.cummax": _along_dim, "aten.cummin": _along_dim,
    "aten.kthvalue": reduction, "aten.median": reduction, "aten.nanmedian": reduction, "aten.mode": reduction,
    "aten.flip": _reorder, "aten.roll": _reorder, "aten.constant_pad_nd": _pad, "aten.scatter": _scatter,
    "aten.scatter_add": _scatter, "aten.scatter_reduce": _scatter, "aten.index_add": _index_add,
    "aten.index_reduce": _index_add, "aten.mm": _mm, "aten.addmm": _addmm, "aten.bmm": _bmm, "aten.baddbmm": _baddbmm,
}
"""The tensor-op rules, by the op's packet."""
