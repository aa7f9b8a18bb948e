"""Row rules for neural-network layers: embeddings, convolutions, norms, attention and losses.

Each works on one sample per index of dimension 0 (or the batch and head dimensions, for attention),
so rows of the batch stay rows there and rows on any other axis are mixed by the layer.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import torch

from ..ir.ops import op_info
from .row_states import UNKNOWN, Rows, RuleCall, State
from .tensor_row_rules import pointwise, same_rows


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
    return call.result(call.reduced(sum_of_rows=True))


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


def _pool(call: RuleCall) -> State:
    """Pooling, resampling and edge padding over the last 1, 2 or 3 dimensions (the op's name says
    how many): each output position reads a window of positions there, and nothing across the others."""
    name = "self" if "self" in call.bound else "input"
    state = _only_input_at(call, name, range(call.rank(call.bound[name])))
    if state is None:
        return call.result(UNKNOWN)
    spatial = int(re.search(r"(\d)d", op_info(call.node.target).packet)[1])     # max_pool2d_with_indices: 2
    if state.axis >= call.rank(call.bound[name]) - spatial:
        return call.report(f"pools, resamples or pads along the batch axis (axis {state.axis} of its input), so "
                           f"rows of the result read neighbouring rows of the batch")
    return call.result(state)


def _layer_norm(call: RuleCall) -> State:
    """Normalizes over the last `len(normalized_shape)` dimensions, per row of the others."""
    state = _only_input_at(call, "input", range(call.rank(call.bound["input"])))
    if state is None:
        return call.result(UNKNOWN)
    if state.axis >= call.rank(call.bound["input"]) - len(call.bound["normalized_shape"]):
        return call.report("normalizes across the batch axis, so every row reads the other rows")
    return call.result(state)


def _layer_norm_backward(call: RuleCall) -> State:
    """The gradients of a layer norm: of its input per row (from the output's gradient, the input and
    its per-row mean and inverse deviation), of its weight and bias summed over every row."""
    carrying = [n for n in call.node.all_input_nodes if isinstance(call.flow.states[n], Rows)]
    state, rank = same_rows([call.flow.states[n] for n in carrying]), call.rank(call.bound["input"])
    if state is UNKNOWN or any(call.rank(n) != rank for n in carrying):
        return call.result(UNKNOWN)
    if state.axis >= rank - len(call.bound["normalized_shape"]):
        return call.report("normalizes across the batch axis, so every row reads the other rows")
    summed = call.reduced(sum_of_rows=True)
    return tuple(None if not isinstance(value, torch.Tensor) else state if i == 0 else summed
                 for i, value in enumerate(call.node.meta["val"]))


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
    value = call.node.meta["val"]
    return tuple(state if i == 0 else None for i in range(len(value))) if isinstance(value, (tuple, list)) else state


def _attention(call: RuleCall) -> State:
    """Scaled dot-product attention over [batch, heads, sequence, dim]: the batch and head dimensions
    are independent, so rows on dimension 0 or 1 of every operand stay rows of the result. Rows on the
    sequence dimension (nn.MultiheadAttention given the batch as its sequence) attend to each other."""
    state = _attention_rows(call)
    if state is None:
        return call.result(UNKNOWN)
    value = call.node.meta["val"]
    results = value if isinstance(value, (tuple, list)) else (value,)
    per_result = tuple(state if isinstance(v, torch.Tensor) and v.dim() >= 2 else None for v in results)
    return per_result if isinstance(value, (tuple, list)) else per_result[0]


def _attention_backward(call: RuleCall) -> State:
    """The gradients of query, key and value (its first three results), from the forward's operands,
    output, log-sum-exp and the output's gradient: per batch and head as the forward. A further
    result (an attention bias's gradient) sums over whatever the bias was broadcast along: not followed."""
    state = _attention_rows(call)
    if state is None:
        return call.result(UNKNOWN)
    return tuple(state if i < 3 else UNKNOWN for i in range(len(call.node.meta["val"])))


def _attention_rows(call: RuleCall) -> Rows | None:
    """The rows of attention's operands ([batch, heads, sequence, dim], a log-sum-exp [batch, heads,
    sequence]) when they lie on the batch or head dimension; a finding when on the sequence one."""
    carrying = [n for n in call.node.all_input_nodes if isinstance(call.flow.states[n], Rows)]
    state = same_rows([call.flow.states[n] for n in carrying])
    ranks = {call.rank(n) for n in carrying}
    if state is not UNKNOWN and state.axis == 2 and ranks <= {3, 4}:
        call.report("attends across the batch rows (they lie along its sequence axis), so every row reads the "
                    "other rows")
        return None
    if state is UNKNOWN or state.axis not in (0, 1) or 4 not in ranks or not ranks <= {3, 4}:
        return None
    return state


def _loss(call: RuleCall) -> State:
    """mse_loss, l1_loss, ...: elementwise over (self, target), then reduced unless reduction is "none" (0)."""
    if call.bound.get("reduction", 1) != 0:
        return call.result(call.reduced(sum_of_rows=True, mean=call.bound.get("reduction", 1) == 1))
    return pointwise(call)


def _nll_loss(call: RuleCall) -> State:
    """nll_loss over scores [N, C, ...] and targets [N, ...] (cross-entropy's second half): one loss per
    sample, then reduced unless reduction is "none" (0). It also returns the weights' total, a scalar."""
    if call.bound.get("reduction", 1) != 0:
        return call.result(call.reduced(sum_of_rows=True, mean=call.bound.get("reduction", 1) == 1))
    if {call.state("self"), call.state("target")} - {None} == {Rows(0)}:
        return Rows(0), None
    return call.result(UNKNOWN)


LAYER_RULES: dict[str, Callable[[RuleCall], State]] = {
    "aten.max_pool1d": _pool, "aten.max_pool2d": _pool, "aten.max_pool3d": _pool,
    "aten.max_pool1d_with_indices": _pool, "aten.max_pool2d_with_indices": _pool,
    "aten.max_pool3d_with_indices": _pool, "aten.avg_pool1d": _pool, "aten.avg_pool2d": _pool,
    "aten.avg_pool3d": _pool, "aten.adaptive_avg_pool1d": _pool, "aten._adaptive_avg_pool2d": _pool,
    "aten._adaptive_avg_pool3d": _pool, "aten.adaptive_max_pool1d": _pool, "aten.adaptive_max_pool2d": _pool,
    "aten.adaptive_max_pool3d": _pool, "aten.upsample_nearest1d": _pool, "aten.upsample_nearest2d": _pool,
    "aten.upsample_nearest3d": _pool, "aten._upsample_nearest_exact1d": _pool,
    "aten._upsample_nearest_exact2d": _pool, "aten._upsample_nearest_exact3d": _pool,
    "aten.upsample_linear1d": _pool, "aten.upsample_bilinear2d": _pool, "aten.upsample_bicubic2d": _pool,
    "aten.upsample_trilinear3d": _pool, "aten.reflection_pad1d": _pool, "aten.reflection_pad2d": _pool,
    "aten.reflection_pad3d": _pool, "aten.replication_pad1d": _pool, "aten.replication_pad2d": _pool,
    "aten.replication_pad3d": _pool,
    "aten.mse_loss": _loss, "aten.l1_loss": _loss, "aten.smooth_l1_loss": _loss, "aten.huber_loss": _loss,
    "aten.soft_margin_loss": _loss, "aten.binary_cross_entropy": _loss,
    "aten.binary_cross_entropy_with_logits": _loss, "aten.nll_loss_forward": _nll_loss,
    "aten.nll_loss2d_forward": _nll_loss, "aten.mse_loss_backward": pointwise,
    "aten.smooth_l1_loss_backward": pointwise, "aten.huber_loss_backward": pointwise,
    "aten.soft_margin_loss_backward": pointwise, "aten.binary_cross_entropy_backward": pointwise,
    "aten.embedding": _embedding,
    "aten.embedding_dense_backward": _embedding_backward, "aten.convolution": _convolution,
    "aten.native_layer_norm": _layer_norm, "aten.native_layer_norm_backward": _layer_norm_backward,
    "aten.native_group_norm": _group_norm,
    "aten.native_batch_norm": _batch_norm, "aten._native_batch_norm_legit": _batch_norm,
    "aten._native_batch_norm_legit_functional": _batch_norm,
    "aten._native_batch_norm_legit_no_training": _batch_norm, "aten.cudnn_batch_norm": _batch_norm,
    "aten.miopen_batch_norm": _batch_norm, "aten._scaled_dot_product_flash_attention_for_cpu": _attention,
    "aten._scaled_dot_product_flash_attention": _attention,
    "aten._scaled_dot_product_efficient_attention": _attention,
    "aten._scaled_dot_product_cudnn_attention": _attention, "aten._scaled_dot_product_attention_math": _attention,
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": _attention_backward,
    "aten._scaled_dot_product_flash_attention_backward": _attention_backward,
    "aten._scaled_dot_product_efficient_attention_backward": _attention_backward,
    "aten._scaled_dot_product_cudnn_attention_backward": _attention_backward,
}
"""The layer rules, by the op's packet."""
