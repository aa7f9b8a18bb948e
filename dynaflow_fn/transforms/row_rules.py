"""The per-op rules of `batch_rows`: how each aten op moves, keeps or mixes the rows of the batch.

A rule maps a `RuleCall` (an op whose inputs carry rows) to the state of its result. Ops are found
by their packet (`aten.mm`, `OpInfo.packet`) in `_RULES`; ops without an entry fall back to the
pointwise rule when torch tags them pointwise and to the reduction rule when it tags them a
reduction (`rule_for`).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..compat import OpOverload
from ..ir.ops import op_info
from .layer_row_rules import LAYER_RULES
from .row_states import RuleCall, State
from .sorted_rows import SORTED_RULES
from .tensor_row_rules import TENSOR_RULES, pointwise, reduction


def rule_for(op: OpOverload) -> Callable[[RuleCall], State] | None:
    """The rule of `op`, or None when the analysis does not model it."""
    info = op_info(op)
    rule = _RULES.get(info.packet)
    if rule is None and torch.Tag.pointwise in info.tags:
        return pointwise
    if rule is None and _is_reduction(op):
        return reduction
    return rule


def reads_only_shapes(op: OpOverload) -> bool:
    """Whether `op` reads only the shapes, dtypes and devices of its tensor arguments (`zeros_like`)."""
    return op_info(op).packet in _SHAPE_ONLY


def fills_like(op: OpOverload) -> bool:
    """Whether `op` makes a tensor of its first argument's shape filled with one value (`zeros_like`):
    laid out as that argument's rows, each row the same as every other."""
    return op_info(op).packet in _FILLED_LIKE


def _is_reduction(op: OpOverload) -> bool:
    tag = getattr(torch.Tag, "reduction", None)
    return tag is not None and tag in op_info(op).tags


_SHAPE_ONLY = frozenset({
    "aten.empty_like", "aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.rand_like",
    "aten.randn_like", "aten.randint_like", "aten.new_empty", "aten.new_empty_strided", "aten.new_zeros",
    "aten.new_ones", "aten.new_full",
})
"""Ops that read only the shape, dtype and device of their tensor arguments, never their values."""

_FILLED_LIKE = frozenset({"aten.empty_like", "aten.zeros_like", "aten.ones_like", "aten.full_like"})

_RULES: dict[str, Callable[[RuleCall], State]] = {**TENSOR_RULES, **LAYER_RULES, **SORTED_RULES}
"""Every op the analysis models, by its packet."""
