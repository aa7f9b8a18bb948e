"""`T.microbatch`: run the function on `num` slices of the batch and merge the results.

`in_axes` and `out_axes` follow `jax.vmap`: a pytree prefix of the positional arguments (or of the
result) whose leaves are an axis, or None for "not split" (parameters, say). Tensors passed by keyword
are split along axis 0. A result leaf's `out_axes` is an axis to concatenate along, "sum", or "mean"
(the batch-weighted mean, so a mean loss over micro-batches equals the mean over the whole batch).
The batch is cut like `torch.tensor_split`: when `num` does not divide it, the first micro-batches
get one row more than the last ones.

The body is traced once per micro-batch, each inside a micro-batch scope, so every node knows its
micro-batch. Inputs are `narrow` views, and lowering writes each micro-batch's result straight into
its slice of the concatenated output: splitting and merging copy nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import optree
import torch

from ..errors import TransformError
from ..program import Program
from ..regions import active_recorder
from ..trace import trace_function
from ..tree import argument_names, output_path_to_str, path_to_str
from .base import Pass, apply_transform

Reduction = str
_REDUCTIONS = ("sum", "mean")


class MicrobatchPass(Pass):
    def __init__(self, num: int, in_axes: Any = 0, out_axes: Any = 0):
        if not isinstance(num, int) or isinstance(num, bool) or num < 1:
            raise TransformError(f"microbatch: num must be a positive integer, got {num!r}")
        _check_axes_tree(in_axes, "in_axes", allow_reductions=False)
        _check_axes_tree(out_axes, "out_axes", allow_reductions=True)
        self.num, self.in_axes, self.out_axes = num, in_axes, out_axes

    def describe(self) -> str:
        return f"microbatch(num={self.num}, in_axes={self.in_axes!r}, out_axes={self.out_axes!r})"

    def wrap_body(self, body: Callable[..., Any]) -> Callable[..., Any]:
        return functools.update_wrapper(functools.partial(_run_microbatched, self, body), body, updated=())

    def apply(self, program: Program) -> Program:
        """On a Program: trace its source again with micro-batches, then redo the passes it had."""
        if program.is_scheduled():
            raise TransformError("microbatch after overlap: the schedule was made for the unsplit program. "
                                 "Apply microbatch before overlap.")
        source = program.source
        if source is None:
            raise TransformError("microbatch needs the function a Program was traced from; this Program has none")
        new = trace_function(source.fn, source.args, source.kwargs, body=self.wrap_body(source.body))
        for p in program.passes:
            new = p.apply(new)
        return dataclasses.replace(new, provenance=program.provenance + (self.describe(),))


def _check_axes_tree(axes: Any, name: str, allow_reductions: bool) -> None:
    for leaf in optree.tree_leaves(axes, none_is_leaf=True):
        ok = leaf is None or (isinstance(leaf, int) and not isinstance(leaf, bool)) or (
            allow_reductions and leaf in _REDUCTIONS)
        if not ok:
            extra = ', "sum" or "mean"' if allow_reductions else ""
            raise TransformError(f"microbatch: {name} leaves must be an int axis, None{extra}; got {leaf!r}")


def _broadcast(prefix: Any, full: Any, what: str) -> list[Any]:
    """The prefix tree's leaf for every leaf of `full` (in flatten order)."""
    try:
        broadcast = optree.tree_broadcast_prefix(prefix, full, none_is_leaf=True)
    except ValueError as error:
        raise TransformError(f"microbatch: {what} does not match the structure it describes: {error}") from None
    return optree.tree_leaves(broadcast, none_is_leaf=True)


def split_sizes(total: int, num: int) -> list[int]:
    """Micro-batch sizes, as torch.tensor_split cuts: the first `total % num` get one row more."""
    base, extra = divmod(total, num)
    return [base + (1 if i < extra else 0) for i in range(num)]


def _run_microbatched(p: MicrobatchPass, body: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    arg_names = argument_names(body, len(args))
    paths, leaves, tree = optree.tree_flatten_with_path((args, kwargs), none_is_leaf=True)
    positional_axes = _broadcast(p.in_axes, args, "in_axes") if args else []
    axes = positional_axes + [0] * (len(leaves) - len(positional_axes))
    splits = []
    for path, leaf, axis in zip(paths, leaves, axes):
        if axis is None or not isinstance(leaf, torch.Tensor):
            continue
        where = path_to_str(path, arg_names)
        if not -leaf.dim() <= axis < leaf.dim():
            raise TransformError(f"microbatch: in_axes gives axis {axis} for {where}, which has {leaf.dim()} "
                                 f"dimensions (shape {list(leaf.shape)})")
        splits.append((where, axis % leaf.dim(), leaf.shape[axis]))
    if not splits:
        raise TransformError("microbatch: in_axes splits no tensor argument; give the batched arguments an axis")
    sizes = {size for _, _, size in splits}
    if len(sizes) > 1:
        listed = ", ".join(f"{where} along axis {axis} (size {size})" for where, axis, size in splits)
        raise TransformError(f"microbatch: the split inputs disagree on the batch size: {listed}")
    batch = sizes.pop()
    if p.num > batch:
        raise TransformError(f"microbatch(num={p.num}) needs at least {p.num} rows to split, but the batch has "
                             f"{batch} ({splits[0][0]} along axis {splits[0][1]})")
    chunk_sizes = split_sizes(batch, p.num)
    results, start = [], 0
    recorder = active_recorder()
    for index, size in enumerate(chunk_sizes):
        def slice_leaf(leaf: Any, axis: Any) -> Any:
            if axis is None or not isinstance(leaf, torch.Tensor):
                return leaf
            return leaf.narrow(axis % leaf.dim(), start, size)

        if recorder is None:
            results.append(_call_slice(body, tree, leaves, axes, slice_leaf))
        else:
            with recorder.scope("microbatch", f"mb{index}", index=index):
                results.append(_call_slice(body, tree, leaves, axes, slice_leaf))
        start += size
    return _merge(p.out_axes, results, chunk_sizes)


def _call_slice(body: Callable[..., Any], tree: Any, leaves: Sequence[Any], axes: Sequence[Any],
                slice_leaf: Callable[[Any, Any], Any]) -> Any:
    call_args, call_kwargs = optree.tree_unflatten(tree, [slice_leaf(leaf, axis) for leaf, axis in zip(leaves, axes)])
    return body(*call_args, **call_kwargs)


def _merge(out_axes: Any, results: Sequence[Any], sizes: Sequence[int]) -> Any:
    paths, first, tree = optree.tree_flatten_with_path(results[0], none_is_leaf=True)
    per_micro_batch = [first]
    for result in results[1:]:
        leaves, other = optree.tree_flatten(result, none_is_leaf=True)
        if other != tree:
            raise TransformError(f"microbatch: micro-batches returned different structures ({tree} vs {other})")
        per_micro_batch.append(leaves)
    axes = _broadcast(out_axes, results[0], "out_axes")
    merged = [_merge_leaf(output_path_to_str(path), axis, [leaves[i] for leaves in per_micro_batch], sizes)
              for i, (path, axis) in enumerate(zip(paths, axes))]
    return optree.tree_unflatten(tree, merged)


def _merge_leaf(where: str, axis: Any, values: Sequence[Any], sizes: Sequence[int]) -> Any:
    if not isinstance(values[0], torch.Tensor) or axis is None:
        return values[0]
    if axis == "sum":
        return functools.reduce(torch.add, values)
    if axis == "mean":
        if len(set(sizes)) == 1:
            return functools.reduce(torch.add, values) / len(values)
        total = sum(sizes)
        return functools.reduce(torch.add, [v * (n / total) for v, n in zip(values, sizes)])
    rank = values[0].dim()
    if not -rank <= axis < rank or rank == 0:
        raise TransformError(f"microbatch: out_axes gives axis {axis} for {where}, which has {rank} dimensions; "
                             f"use \"sum\" or \"mean\" to reduce it across micro-batches, or None to keep the "
                             f"first micro-batch's value")
    return torch.cat(list(values), dim=axis)


def microbatch(fn: Any = None, num: int = 2, in_axes: Any = 0, out_axes: Any = 0) -> Any:
    """Split the batch into `num` micro-batches; see the module docstring.

    >>> step = T.microbatch(fn, num=2, in_axes=(None, 0), out_axes=0)
    """
    return apply_transform(fn, MicrobatchPass(num, in_axes, out_axes))
