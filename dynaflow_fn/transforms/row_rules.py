"""The per-op rules of `batch_rows`: how each aten op moves, keeps or mixes the rows of the batch.

A rule maps a `RuleCall` (an op whose inputs carry rows) to the state of its result. Ops are found
by their packet (`aten.mm`, `OpInfo.packet`) in `_RULES`; ops without an entry fall back to the
pointwise rule when torch tags them pointwise and to the reduction rule when it tags them a
reduction (`rule_for`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import fx

from ..compat import OpOverload
from ..ir.ops import op_info
from .row_states import UNKNOWN, Reduced, Rows, RuleCall, State


def rule_for(op: OpOverload) -> Callable[[RuleCall], State] | None:
    """The rule of `op`, or None when the analysis does not model it."""
    info = op_info(op)
    rule = _RULES.get(info.packet)
    if rule is None and torch.Tag.pointwise in info.tags:
        return _pointwise
    if rule is None and _is_reduction(op):
        return _reduction
    return rule


def reads_only_shapes(op: OpOverload) -> bool:
    """Whether `op` reads only the shapes, dtypes and devices of its tensor arguments (`zeros_like`)."""
    return op_info(op).packet in _SHAPE_ONLY


def _is_reduction(op: OpOverload) -> bool:
    tag = getattr(torch.Tag, "reduction", None)
    return tag is not None and tag in op_info(op).tags


def _value(node: fx.Node) -> Any:
    return node.meta["val"]


def _same(states: Sequence[State]) -> State:
    """The one Rows state all of `states` agree on, else UNKNOWN."""
    first = states[0]
    return first if all(s == first for s in states[1:]) else UNKNOWN


def _moved(state: Rows, axis: int) -> Rows:
    return Rows(axis, state.outer, state.inner)


# --- rules ----------------------------------------------------------------------------------------


def _pointwise(call: RuleCall) -> State:
    """Elementwise with broadcasting: inputs align at their last dimension."""
    rank = call.rank()
    moved = [_moved(s, s.axis + rank - call.rank(n)) for n in call.node.all_input_nodes
             if isinstance(s := call.flow.states[n], Rows)]
    return call.result(_same(moved))


def _copy(call: RuleCall) -> State:
    """`copy(self, src)`: src's values broadcast into self's shape."""
    src = call.state("src")
    if not isinstance(src, Rows):
        return call.result(src)
    return call.result(_moved(src, src.axis + call.rank() - call.rank(call.bound["src"])))


def _reduction(call: RuleCall) -> State:
    state = call.state("self")
    if not isinstance(state, Rows) or len(call.node.all_input_nodes) != 1:
        return call.result(UNKNOWN)
    rank = call.rank(call.bound["self"])
    dims = call.dims("dim", rank)
    dims = list(range(rank)) if dims is None else dims
    if state.axis in dims:
        return call.result(call.reduced())
    keep = call.bound.get("keepdim", False)
    return call.result(_moved(state, state.axis if keep else state.axis - sum(d < state.axis for d in dims)))


def _along_dim(call: RuleCall) -> State:
    """softmax, cumsum, sort, ...: each output element reads a whole line along `dim`."""
    node_inputs = call.node.all_input_nodes
    states = [call.flow.states[n] for n in node_inputs]
    if any(not isinstance(s, Rows) for s in states) or any(call.rank(n) != call.rank() for n in node_inputs):
        return call.result(UNKNOWN)
    state = _same(states)
    if state is UNKNOWN:
        return call.result(UNKNOWN)
    if call.bound.get("dim", -1) % max(call.rank(), 1) == state.axis:
        return call.report("works along the batch axis, so every row reads the other rows")
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
    return call.result(_moved(state, state.axis + call.rank() - call.rank(call.bound["self"])))


def _permute(call: RuleCall) -> State:
    state = call.state("self")
    dims = [d % call.rank() for d in call.bound["dims"]]
    return call.result(_moved(state, dims.index(state.axis)))


def _transpose(call: RuleCall) -> State:
    state = call.state("self")
    rank = max(call.rank(), 1)
    first, second = call.bound["dim0"] % rank, call.bound["dim1"] % rank
    swap = {first: second, second: first}
    return call.result(_moved(state, swap.get(state.axis, state.axis)))


def _t(call: RuleCall) -> State:
    state = call.state("self")
    return call.result(_moved(state, 1 - state.axis) if call.rank() == 2 else state)


def _select(call: RuleCall) -> State:
    state = call.state("self")
    dim = call.bound["dim"] % call.rank(call.bound["self"])
    if dim == state.axis:
        return call.result(call.reduced())
    return call.result(_moved(state, state.axis - (dim < state.axis)))


def _slice(call: RuleCall) -> State:
    state = call.state("self")
    dim = call.bound.get("dim", 0) % call.rank()
    if dim == state.axis and call.shape()[dim] != call.shape(call.bound["self"])[dim]:
        return call.result(call.reduced())
    return call.result(state)


def _cat(call: RuleCall) -> State:
    tensors = call.bound["tensors"]
    dim = call.bound.get("dim", 0) % call.rank()
    states = [call.flow.states[t] for t in tensors if isinstance(call.flow.states[t], Rows)]
    state = _same(states)
    if state is UNKNOWN or state.axis == dim or any(call.rank(t) != call.rank() for t in tensors):
        return call.result(UNKNOWN)
    return call.result(state)


def _stack(call: RuleCall) -> State:
    states = [call.flow.states[t] for t in call.bound["tensors"] if isinstance(call.flow.states[t], Rows)]
    state = _same(states)
    if state is UNKNOWN:
        return call.result(UNKNOWN)
    dim = call.bound.get("dim", 0) % call.rank()
    return call.result(_moved(state, state.axis + (dim <= state.axis)))


def _split(call: RuleCall) -> State:
    state = call.state("self")
    dim = call.bound.get("dim", 0) % call.rank(call.bound["self"])
    return call.result(UNKNOWN if dim == state.axis else state)


def _unbind(call: RuleCall) -> State:
    state = call.state("self")
    dim = call.bound.get("dim", 0) % call.rank(call.bound["self"])
    return call.result(UNKNOWN if dim == state.axis else _moved(state, state.axis - (dim < state.axis)))


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
        return call.reduced() if role == "summed" else state
    (a, a_role), (b, b_role) = roles
    if a_role == b_role == "shared":
        return _same([a, b])
    if a_role == b_role == "summed":
        return call.reduced() if a == _moved(b, a.axis) else UNKNOWN
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
    bias = _moved(bias, bias.axis + rank - call.rank(call.bound["self"]))
    return bias if product is None else _same([product, bias])


def _mm(call: RuleCall) -> State:
    return _matmul(call, "self", "mat2", batched=False)


def _addmm(call: RuleCall) -> State:
    return _with_bias(call, _matmul(call, "mat1", "mat2", batched=False), 2)


def _bmm(call: RuleCall) -> State:
    return _matmul(call, "self", "mat2", batched=True)


def _baddbmm(call: RuleCall) -> State:
    return _with_bias(call, _matmul(call, "batch1", "batch2", batched=True), 3)


def _only_input_at(call: RuleCall, name: str, axes: Sequence[int]) -> Rows | None:
    """The Rows state of argument `name` if it is the only batch-carrying argument and lies on one of `axes`."""
    state = call.state(name)
    carrying = [n for n in call.node.all_input_nodes if isinstance(call.flow.states[n], Rows)]
    if not isinstance(state, Rows) or carrying != [call.bound[name]] or state.axis not in axes:
        return None
    return state


def _embedding(call: RuleCall) -> State:
    """Row `b` of the indices looks up row `b` of the result; the table reads no batch row."""
    state = _only_input_at(call, "indices", range(call.rank(call.bound["indices"])))
    return call.result(UNKNOWN if state is None else state)


def _embedding_backward(call: RuleCall) -> State:
    """The gradient of an embedding table sums the rows of the batch."""
    return call.result(call.reduced())


def _convolution(call: RuleCall) -> State:
    """Convolves each sample (dimension 0) over its channels and positions: batch rows on any other
    axis are mixed by the kernel or its window."""
    return _per_sample(call, "convolves")


def _per_sample(call: RuleCall, verb: str) -> State:
    """An op that computes each sample (dimension 0 of `input`) from all of that sample's other axes."""
    state = _only_input_at(call, "input", range(call.rank(call.bound["input"])))
    if state is None:
        return call.result(UNKNOWN)
    if state.axis != 0:
        return call.report(f"{verb} across the batch axis (axis {state.axis} of its input), so every row reads "
                           f"other rows")
    return call.result(state if state == Rows(0) else UNKNOWN)


def _layer_norm(call: RuleCall) -> State:
    """Normalizes over the last `len(normalized_shape)` dimensions, per row of the others."""
    state = _only_input_at(call, "input", range(call.rank(call.bound["input"])))
    if state is None:
        return call.result(UNKNOWN)
    if state.axis >= call.rank(call.bound["input"]) - len(call.bound["normalized_shape"]):
        return call.report("normalizes across the batch axis, so every row reads the other rows")
    return call.result(state)


def _group_norm(call: RuleCall) -> State:
    """Normalizes each sample (dimension 0) over its channel groups and positions."""
    return _per_sample(call, "normalizes")


def _batch_norm(call: RuleCall) -> State:
    """In train mode, normalizes with the mean and variance over every dimension but the channels (1)."""
    state = _only_input_at(call, "input", range(call.rank(call.bound["input"])))
    if state is None:
        return call.result(UNKNOWN)
    default = op_info(call.node.target).packet != "aten._native_batch_norm_legit_no_training"
    training = call.bound.get("training", default)
    if training and state.axis != 1:
        return call.report("is batch norm in train mode: it normalizes with the mean and variance of the batch, "
                           "so every row reads the other rows")
    if training:
        return call.result(UNKNOWN)
    value = _value(call.node)
    return tuple(state if i == 0 else None for i in range(len(value))) if isinstance(value, (tuple, list)) else state


def _attention(call: RuleCall) -> State:
    """Scaled dot-product attention over [batch, heads, sequence, dim]: the batch and head dimensions
    are independent, so rows on dimension 0 or 1 of every operand stay rows of the result."""
    states = [call.flow.states[n] for n in call.node.all_input_nodes if isinstance(call.flow.states[n], Rows)]
    state = _same(states)
    ranks = {call.rank(n) for n in call.node.all_input_nodes if isinstance(call.flow.states[n], Rows)}
    if state is UNKNOWN or state.axis not in (0, 1) or ranks != {4}:
        return call.result(UNKNOWN)
    value = _value(call.node)
    results = value if isinstance(value, (tuple, list)) else (value,)
    per_result = tuple(state if isinstance(v, torch.Tensor) and v.dim() >= 2 else None for v in results)
    return per_result if isinstance(value, (tuple, list)) else per_result[0]


def _loss(call: RuleCall) -> State:
    """mse_loss, l1_loss, ...: elementwise over (self, target), then reduced unless reduction is "none" (0)."""
    if call.bound.get("reduction", 1) != 0:
        return call.result(call.reduced())
    return _pointwise(call)


def _same_as(name: str) -> Callable[[RuleCall], State]:
    """Ops whose results carry the rows of argument `name` unchanged (same shape)."""
    return lambda call: call.result(call.state(name))


_SHAPE_ONLY = frozenset({
    "aten.empty_like", "aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.rand_like",
    "aten.randn_like", "aten.randint_like", "aten.new_empty", "aten.new_empty_strided", "aten.new_zeros",
    "aten.new_ones", "aten.new_full",
})
"""Ops that read only the shape, dtype and device of their tensor arguments, never their values."""

_RULES: dict[str, Callable[[RuleCall], State]] = {
    "aten._to_copy": _same_as("self"), "aten.detach": _same_as("self"), "aten.alias": _same_as("self"),
    "aten.lift_fresh_copy": _same_as("self"), "aten.native_dropout": _same_as("input"),
    "aten.copy": _copy,
    "_c10d_functional.all_reduce": _same_as("input"), "_c10d_functional.wait_tensor": _same_as("tensor"),
    "aten.view": _view, "aten._unsafe_view": _view, "aten.reshape": _view, "aten.squeeze": _view,
    "aten.unsqueeze": _view, "aten.flatten": _view, "aten.unflatten": _view,
    "aten.expand": _expand, "aten.permute": _permute, "aten.transpose": _transpose, "aten.t": _t,
    "aten.select": _select, "aten.slice": _slice,
    "aten.cat": _cat, "aten.stack": _stack,
    "aten.split": _split, "aten.split_with_sizes": _split, "aten.unsafe_split": _split,
    "aten.unsafe_split_with_sizes": _split, "aten.chunk": _split, "aten.unbind": _unbind,
    "aten._softmax": _along_dim, "aten._log_softmax": _along_dim, "aten._softmax_backward_data": _along_dim,
    "aten._log_softmax_backward_data": _along_dim, "aten.cumsum": _along_dim, "aten.cumprod": _along_dim,
    "aten.logcumsumexp": _along_dim, "aten.sort": _along_dim, "aten.argsort": _along_dim, "aten.topk": _along_dim,
    "aten.cummax": _along_dim, "aten.cummin": _along_dim,
    "aten.kthvalue": _reduction, "aten.median": _reduction, "aten.nanmedian": _reduction, "aten.mode": _reduction,
    "aten.mse_loss": _loss, "aten.l1_loss": _loss, "aten.smooth_l1_loss": _loss, "aten.huber_loss": _loss,
    "aten.soft_margin_loss": _loss, "aten.binary_cross_entropy": _loss,
    "aten.binary_cross_entropy_with_logits": _loss,
    "aten.mse_loss_backward": _pointwise, "aten.smooth_l1_loss_backward": _pointwise,
    "aten.huber_loss_backward": _pointwise, "aten.soft_margin_loss_backward": _pointwise,
    "aten.binary_cross_entropy_backward": _pointwise,
    "aten.mm": _mm, "aten.addmm": _addmm, "aten.bmm": _bmm, "aten.baddbmm": _baddbmm,
    "aten.embedding": _embedding, "aten.embedding_dense_backward": _embedding_backward,
    "aten.convolution": _convolution,
    "aten.native_layer_norm": _layer_norm, "aten.native_group_norm": _group_norm,
    "aten.native_batch_norm": _batch_norm, "aten._native_batch_norm_legit": _batch_norm,
    "aten._native_batch_norm_legit_functional": _batch_norm, "aten._native_batch_norm_legit_no_training": _batch_norm,
    "aten.cudnn_batch_norm": _batch_norm, "aten.miopen_batch_norm": _batch_norm,
    "aten._scaled_dot_product_flash_attention_for_cpu": _attention,
    "aten._scaled_dot_product_flash_attention": _attention,
    "aten._scaled_dot_product_efficient_attention": _attention,
    "aten._scaled_dot_product_cudnn_attention": _attention,
    "aten._scaled_dot_product_attention_math": _attention,
}
