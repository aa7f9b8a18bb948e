"""Fresh random inputs shaped like a call's example arguments, and the batch sizes worth trying.

A test that only ever runs the example it was written with proves little: a transform that is right
for a batch of 8 may mis-merge a batch of 7 (uneven micro-batches) or 2 (one row each). `draw_like`
makes new values with the examples' structure, dtypes and devices, optionally with another size
along each leaf's batch axis; `batch_axes` and `edge_batch_sizes` say which axes and sizes.
"""

from __future__ import annotations

from typing import Any, Sequence

import optree
import torch
from torch import nn

from ..errors import InputError


def batch_axes(in_axes: Any, args: tuple, kwargs: dict) -> list[int | None]:
    """The batch axis of every leaf of `(args, kwargs)` (None where it is not split), following
    `T.microbatch`'s conventions: `in_axes` is a pytree prefix of the positional arguments, None
    means "not split", and tensors passed by keyword are split along axis 0."""
    try:
        positional = optree.tree_leaves(optree.tree_broadcast_prefix(in_axes, args, none_is_leaf=True),
                                        none_is_leaf=True)
    except ValueError as error:
        raise InputError(f"in_axes={in_axes!r} is no pytree prefix of the positional arguments: {error}") from None
    axes = [axis if isinstance(leaf, torch.Tensor) else None
            for axis, leaf in zip(positional, optree.tree_leaves(args, none_is_leaf=True))]
    axes += [0 if isinstance(leaf, torch.Tensor) and leaf.dim() else None for leaf in optree.tree_leaves(kwargs)]
    return axes


def edge_batch_sizes(rows: int, num: int) -> list[int]:
    """The batch sizes a `num`-way split must get right, besides the example's `rows`: one row per
    micro-batch (`num`; a batch of one without splitting) and an uneven split (`num + 1`)."""
    sizes = [rows, num] + ([num + 1] if num > 1 else [])
    return list(dict.fromkeys(sizes))


def draw_like(example: Any, generator: torch.Generator, axes: Sequence[int | None] | None = None,
              rows: int | None = None) -> Any:
    """A pytree like `example` with fresh random tensors; static leaves are kept.

    Floating tensors are normal with the example's mean and standard deviation (so weights keep
    their initialization's scale and activations stay in range), integer tensors uniform over the example's range (token ids
    stay valid ids), booleans fair coins. `nn.Parameter` leaves stay parameters (with the example's
    `requires_grad`). With `axes` (one entry per leaf, as `batch_axes` returns) and `rows`, every leaf
    that has a batch axis gets `rows` entries along it."""
    leaves, tree = optree.tree_flatten(example, none_is_leaf=True)
    axes = list(axes) if axes is not None else [None] * len(leaves)
    if len(axes) != len(leaves):
        raise InputError(f"draw_like: {len(axes)} batch axes for {len(leaves)} leaves")
    fresh = [_fresh_leaf(leaf, generator, axis, rows) for leaf, axis in zip(leaves, axes)]
    return optree.tree_unflatten(tree, fresh)


def _fresh_leaf(leaf: Any, generator: torch.Generator, axis: int | None, rows: int | None) -> Any:
    if not isinstance(leaf, torch.Tensor):
        return leaf
    shape = list(leaf.shape)
    if axis is not None and rows is not None:
        if not -leaf.dim() <= axis < leaf.dim():
            raise InputError(f"draw_like: batch axis {axis} for a tensor of shape {shape}, which has "
                             f"{leaf.dim()} dimensions; give the leaves that are not batched None")
        shape[axis] = rows
    value = _random(leaf, shape, generator).to(leaf.device)
    if isinstance(leaf, nn.Parameter):
        return nn.Parameter(value, requires_grad=leaf.requires_grad)
    return value


def _random(leaf: torch.Tensor, shape: list[int], generator: torch.Generator) -> torch.Tensor:
    """Random values drawn on the CPU (one generator serves every device), like `leaf` in kind; the
    example's statistics are read as Python numbers, so a leaf on any device serves."""
    if leaf.dtype == torch.bool:
        return torch.rand(shape, generator=generator) < 0.5
    if leaf.dtype.is_floating_point or leaf.dtype.is_complex:
        return _random_float(leaf, shape, generator)
    low, high = (int(leaf.min()), int(leaf.max())) if leaf.numel() else (0, 1)
    top = torch.iinfo(leaf.dtype).max
    if high == top:                             # randint's bound is exclusive and must fit the dtype
        low, high = max(low, -top), top - 1
    return torch.randint(low, high + 1, shape, generator=generator, dtype=leaf.dtype)


def _random_float(leaf: torch.Tensor, shape: list[int], generator: torch.Generator) -> torch.Tensor:
    """Normal values with the mean and spread of the example's finite values. Statistics over all of
    them would be NaN for an attention mask holding -inf, and an all-NaN input makes any two functions
    agree (NaN equals NaN in the comparison), so a test would pass whatever it tested. Dtypes that
    randn cannot fill (float8) are drawn in float32 and rounded."""
    drawn = leaf.dtype if leaf.dtype.is_complex or leaf.dtype.itemsize >= 2 else torch.float32
    value = torch.randn(shape, generator=generator, dtype=drawn)
    if leaf.numel() >= 2 and leaf.device.type != "meta":
        example = leaf.detach().to(torch.complex128 if leaf.dtype.is_complex else torch.float64)
        finite = example[torch.isfinite(example)]
        if finite.numel() >= 2:
            std, mean = finite.std(), finite.mean()
            value = value * (float(std) if not std.is_complex() else std.abs().item()) + (
                mean.item() if leaf.dtype.is_complex else float(mean))
    return value.to(leaf.dtype)
