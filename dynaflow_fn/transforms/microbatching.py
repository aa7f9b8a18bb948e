"""`T.microbatch`: run the function on `num` slices of the batch and merge the results.

What a user needs to know is in `microbatch`'s docstring. How it works: the body is traced once per
micro-batch, each inside a micro-batch scope, so every node knows its micro-batch. Inputs are
`narrow` views, and lowering writes each micro-batch's result straight into its slice of the
concatenated output: splitting and merging copy nothing.

Before splitting, one micro-batch body is traced on its own (`microbatch_body`, cached per input
signature) to learn which outputs read no split input (merged by taking the first micro-batch's
value) and which ops micro-batching would change the meaning of (reported as warnings by every
call, traced or eager). The eager call uses the same facts, so it stays the reference the traced
program is tested against.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import optree
import torch
from torch import nn

from ..errors import TransformError, warn
from ..ir.program import Program
from ..ir.scopes import ScopeKind
from ..ir.tree import argument_names, leaf_key, output_path_to_str, path_to_str
from ..tracing.regions import active_recorder
from .base import Pass, apply_transform, retraced
from .microbatch_body import BodyFacts, ran_unsplit, study_body, studying
from .microbatch_merges import merge_warnings

_REDUCTIONS = ("sum", "mean")
_NOT_BATCHED_HINT = ("An int in in_axes for a whole argument (or the default in_axes=0, for all of them) splits every "
                     "tensor inside it, parameters included: give the arguments that are not batched None, e.g. "
                     "in_axes=(None, 0) for fn(params, x).")


class MicrobatchPass(Pass):
    def __init__(self, num: int, in_axes: Any = 0, out_axes: Any = 0):
        if not isinstance(num, int) or isinstance(num, bool) or num < 1:
            raise TransformError(f"microbatch: num must be a positive integer, got {num!r}")
        _check_axes_tree(in_axes, "in_axes", allow_reductions=False)
        _check_axes_tree(out_axes, "out_axes", allow_reductions=True)
        self.num, self.in_axes, self.out_axes = num, in_axes, out_axes
        self._facts: dict[Any, BodyFacts] = {}
        self._wrapped: dict[Callable[..., Any], Callable[..., Any]] = {}

    def describe(self) -> str:
        return f"microbatch(num={self.num}, in_axes={self.in_axes!r}, out_axes={self.out_axes!r})"

    def check_call(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        """Refuse to split an nn.Parameter unless in_axes asks for that very leaf (see `microbatch`)."""
        _check_parameters(self.in_axes, fn, args, kwargs)

    def wrap_body(self, body: Callable[..., Any]) -> Callable[..., Any]:
        """The micro-batched body; one per body, so that an enclosing microbatch keys its facts on it."""
        if body not in self._wrapped:
            self._wrapped[body] = functools.update_wrapper(functools.partial(_run_microbatched, self, body), body,
                                                           updated=())
        return self._wrapped[body]

    def apply(self, program: Program) -> Program:
        """On a Program: trace its source again with micro-batches, then redo the passes it had."""
        if program.is_scheduled():
            raise TransformError("microbatch after overlap: the schedule was made for the unsplit program. "
                                 "Apply microbatch before overlap.")
        new = retraced(program, self, "microbatch")
        return dataclasses.replace(new, provenance=program.provenance + (self.describe(),))

    def body_facts(self, body: Callable[..., Any], tree: optree.PyTreeSpec, leaves: Sequence[Any],
                   paths: Sequence[str], axes: Sequence[int | None], rows: int) -> BodyFacts:
        """`study_body`, once per body and input signature. The key also holds the train/eval mode of
        the module of a `df.pure` function, which changes what the body computes."""
        module = getattr(body, "__dynaflow_module__", None)
        modes = tuple(m.training for m in module.modules()) if module is not None else ()
        key = (body, tree, tuple(map(leaf_key, leaves)), tuple(axes), rows, modes)
        try:
            hash(key)
        except TypeError:        # an unhashable leaf: tracing will refuse it; nothing to cache
            return study_body(body, tree, leaves, paths, axes, rows)
        if key not in self._facts:
            self._facts[key] = study_body(body, tree, leaves, paths, axes, rows)
        return self._facts[key]


def _check_axes_tree(axes: Any, name: str, allow_reductions: bool) -> None:
    for leaf in optree.tree_leaves(axes, none_is_leaf=True):
        ok = leaf is None or (isinstance(leaf, int) and not isinstance(leaf, bool)) or (
            allow_reductions and leaf in _REDUCTIONS)
        if not ok:
            extra = ', "sum" or "mean"' if allow_reductions else ""
            raise TransformError(f"microbatch: {name} leaves must be an int axis, None{extra}; got {leaf!r}")


def _broadcast(prefix: Any, full: Any) -> list[Any] | None:
    """The prefix tree's leaf for every leaf of `full` (in flatten order); None if it is no prefix of it."""
    try:
        broadcast = optree.tree_broadcast_prefix(prefix, full, none_is_leaf=True)
    except ValueError:
        return None
    return optree.tree_leaves(broadcast, none_is_leaf=True)


@dataclass(frozen=True)
class _AxisLeaf:
    """An in_axes leaf and where it sits in in_axes: an axis given for this very argument leaf, or one
    broadcast over a whole subtree (an argument, or every argument)."""

    axis: int | None
    path: tuple


def _positional_axes(in_axes: Any, args: tuple) -> list[tuple[int | None, bool]]:
    """Per leaf of `args` (None as a leaf): its in_axes entry, and whether in_axes reaches that leaf itself."""
    if not args:
        return []
    marked = optree.tree_map_with_path(lambda path, axis: _AxisLeaf(axis, path), in_axes, none_is_leaf=True)
    paths = optree.tree_paths(args, none_is_leaf=True)
    covering = _broadcast(marked, args)
    if covering is None:
        raise TransformError(f"microbatch: in_axes={in_axes!r} does not match the positional arguments, whose "
                             f"structure is {optree.tree_structure(args, none_is_leaf=True)}: give one entry per "
                             f"argument (a tuple of {len(args)}), or one int for all of them")
    return [(leaf.axis, leaf.path == path) for leaf, path in zip(covering, paths)]


def _check_parameters(in_axes: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    """An nn.Parameter is split only when in_axes gives an int at that very leaf: parameters are shared
    by all micro-batches, and the default in_axes=0 reaches them only by broadcasting."""
    arg_names = argument_names(fn, len(args))
    paths, leaves, _ = optree.tree_flatten_with_path(args, none_is_leaf=True)
    broadcast = [(path, leaf, axis) for path, leaf, (axis, explicit) in zip(paths, leaves, _positional_axes(in_axes, args))
                 if isinstance(leaf, nn.Parameter) and axis is not None and not explicit]
    if broadcast:
        path, leaf, axis = broadcast[0]
        where = path_to_str((0, *path), arg_names)
        others = f" (and {len(broadcast) - 1} more parameters)" if len(broadcast) > 1 else ""
        suggestion = _sharing(in_axes, args, {p[0] for p, _, _ in broadcast})
        fix = f"pass in_axes={suggestion!r}" if suggestion is not None else "give them None in in_axes"
        raise TransformError(
            f"microbatch: in_axes={in_axes!r} splits {where}{others} along axis {axis}, but it is an nn.Parameter. "
            f"An int given for a whole argument (or the default in_axes=0, for all of them) splits every tensor "
            f"inside it; parameters are shared by all micro-batches: {fix}. To split a parameter on purpose, give "
            f"it its own int in in_axes, in a tree that reaches that leaf.")
    keyword_paths, keyword_leaves, _ = optree.tree_flatten_with_path(kwargs, none_is_leaf=True)
    for path, leaf in zip(keyword_paths, keyword_leaves):
        if isinstance(leaf, nn.Parameter):
            raise TransformError(
                f"microbatch: {path_to_str((1, *path), arg_names)} is an nn.Parameter passed by keyword, and "
                f"tensors passed by keyword are split along axis 0. Pass it positionally, with None for it in "
                f"in_axes to share it across micro-batches.")


def _sharing(in_axes: Any, args: tuple, shared_args: set[int]) -> tuple | None:
    """in_axes with None for the arguments in `shared_args`, when in_axes is one int or one entry per argument."""
    if isinstance(in_axes, int):
        entries = [in_axes] * len(args)
    elif isinstance(in_axes, tuple) and all(e is None or isinstance(e, int) for e in in_axes):
        entries = list(in_axes)
    else:
        return None
    return tuple(None if i in shared_args else entry for i, entry in enumerate(entries))


def split_sizes(total: int, num: int) -> list[int]:
    """Micro-batch sizes, as torch.tensor_split cuts: the first `total % num` get one row more."""
    base, extra = divmod(total, num)
    return [base + (1 if i < extra else 0) for i in range(num)]


@dataclass(frozen=True)
class _Split:
    """A tensor leaf that is split: its path, batch axis and batch size, and whether it came by keyword."""

    where: str
    axis: int
    size: int
    keyword: bool


def _split_axes(in_axes: Any, args: tuple, paths: Sequence[tuple], leaves: Sequence[Any],
                names: Sequence[str]) -> tuple[list[int | None], list[_Split]]:
    """Each leaf's batch axis (None if not split), and the split leaves. Keyword tensors split along axis 0."""
    positional = _positional_axes(in_axes, args)
    axes: list[int | None] = []
    splits = []
    for index, (path, leaf) in enumerate(zip(paths, leaves)):
        keyword = index >= len(positional)
        axis, explicit = (0, False) if keyword else positional[index]
        if axis is None or not isinstance(leaf, torch.Tensor):
            axes.append(None)
            continue
        where = path_to_str(path, names)
        if keyword and leaf.dim() == 0:
            raise TransformError(f"microbatch: {where} is passed by keyword and has no dimensions, but tensors passed "
                                 f"by keyword are split along axis 0. Pass it positionally, with None for it in "
                                 f"in_axes to share it across micro-batches.")
        if not -leaf.dim() <= axis < leaf.dim():
            broadcast = not explicit and (len(path) > 2 or len(args) > 1)   # onto this leaf among others
            hint = f" {_NOT_BATCHED_HINT}" if broadcast else ""
            raise TransformError(f"microbatch: in_axes gives axis {axis} for {where}, which has {leaf.dim()} "
                                 f"dimensions (shape {list(leaf.shape)}).{hint}")
        axes.append(axis % leaf.dim())
        splits.append(_Split(where, axis % leaf.dim(), leaf.shape[axis], keyword))
    return axes, splits


def _batch_size(splits: Sequence[_Split]) -> int:
    """The batch size every split input agrees on: the positional ones decide, keyword tensors must follow."""
    if not splits:
        raise TransformError("microbatch: in_axes splits no tensor argument; give the batched arguments an axis")
    deciding = [s for s in splits if not s.keyword] or list(splits)
    sizes = {s.size for s in deciding}
    if len(sizes) > 1:
        raise TransformError(f"microbatch: the split inputs disagree on the batch size: {_listing(splits)}. "
                             f"{_NOT_BATCHED_HINT}")
    batch = sizes.pop()
    keywords = [s.where for s in splits if s.keyword and s.size != batch]
    if keywords:
        them = "it" if len(keywords) == 1 else "them"
        raise TransformError(f"microbatch: the split inputs disagree on the batch size: {_listing(splits)}. "
                             f"{', '.join(keywords)} {'is' if len(keywords) == 1 else 'are'} passed by keyword, and "
                             f"tensors passed by keyword are split along axis 0: pass {them} positionally with an "
                             f"in_axes entry instead (None to share {them} across micro-batches).")
    return batch


def _listing(splits: Sequence[_Split], per_size: int = 2) -> str:
    """`x along axis 0 (size 8), params['w'] along axis 0 (size 32)`: at most `per_size` per size."""
    shown, hidden, count = [], 0, {}
    for s in splits:
        count[s.size] = count.get(s.size, 0) + 1
        if count[s.size] <= per_size:
            shown.append(f"{s.where} along axis {s.axis} (size {s.size})")
        else:
            hidden += 1
    return ", ".join(shown) + (f" and {hidden} more" if hidden else "")


def _run_microbatched(p: MicrobatchPass, body: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if studying():                  # a trace that studies what the function computes: the body's result
        ran_unsplit()
        return body(*args, **kwargs)
    names = argument_names(body, len(args))
    paths, leaves, tree = optree.tree_flatten_with_path((args, kwargs), none_is_leaf=True)
    axes, splits = _split_axes(p.in_axes, args, paths, leaves, names)
    batch = _batch_size(splits)
    if p.num > batch:
        raise TransformError(f"microbatch(num={p.num}) needs at least {p.num} rows to split, but the batch has "
                             f"{batch} ({splits[0].where} along axis {splits[0].axis})")
    chunk_sizes = split_sizes(batch, p.num)
    facts = BodyFacts()
    if p.num > 1:
        facts = p.body_facts(body, tree, leaves, [path_to_str(path, names) for path in paths], axes, chunk_sizes[0])
    recorder = active_recorder()
    for text in facts.warnings:
        warn(text)
    results, start = [], 0
    for index, size in enumerate(chunk_sizes):
        if recorder is None:
            results.append(_call_slice(body, tree, leaves, axes, start, size))
        else:
            with recorder.scope(ScopeKind.MICROBATCH, f"mb{index}", index=index):
                results.append(_call_slice(body, tree, leaves, axes, start, size))
        start += size
    return _merge(p.out_axes, results, chunk_sizes, facts)


def _call_slice(body: Callable[..., Any], tree: Any, leaves: Sequence[Any], axes: Sequence[int | None],
                start: int, size: int) -> Any:
    """Run `body` on rows `start:start + size` of the split leaves (`narrow` views)."""
    sliced = [leaf if axis is None else leaf.narrow(axis, start, size) for leaf, axis in zip(leaves, axes)]
    call_args, call_kwargs = optree.tree_unflatten(tree, sliced)
    return body(*call_args, **call_kwargs)


def _merge(out_axes: Any, results: Sequence[Any], sizes: Sequence[int], facts: BodyFacts) -> Any:
    paths, first, tree = optree.tree_flatten_with_path(results[0], none_is_leaf=True)
    per_micro_batch = [first]
    for result in results[1:]:
        leaves, other = optree.tree_flatten(result, none_is_leaf=True)
        if other != tree:
            raise TransformError(f"microbatch: micro-batches returned different structures ({tree} vs {other})")
        per_micro_batch.append(leaves)
    axes = _broadcast(out_axes, results[0])
    if axes is None:
        raise TransformError(f"microbatch: out_axes={out_axes!r} does not match the function's result, whose "
                             f"structure is {tree}")
    wheres = [output_path_to_str(path) for path in paths]
    merged = []
    for i, (where, axis) in enumerate(zip(wheres, axes)):
        values = [leaves[i] for leaves in per_micro_batch]
        merged.append(values[0] if where in facts.shared else _merge_leaf(where, axis, values, sizes))
    for text in merge_warnings(facts, list(zip(wheres, axes, first)), len(results)):
        warn(text)
    return optree.tree_unflatten(tree, merged)


def _merge_leaf(where: str, axis: Any, values: Sequence[Any], sizes: Sequence[int]) -> Any:
    if not isinstance(values[0], torch.Tensor) or axis is None:
        return values[0]
    shapes = {tuple(value.shape) for value in values}
    if axis in _REDUCTIONS and len(shapes) > 1:
        raise TransformError(f"microbatch: out_axes \"{axis}\" adds up {where} across micro-batches, but its shapes "
                             f"differ between them ({', '.join(str(list(shape)) for shape in sorted(shapes))}): it has "
                             f"rows of the batch. Give it the axis of those rows in out_axes (0, say) to concatenate it")
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
    """Split the batch into `num` micro-batches, run `fn` on each, and merge the results.

    The micro-batched function computes what `fn` computes on the whole batch (within the dtype's
    tolerance: sums are grouped differently), and its traced, scheduled program computes what calling
    it eagerly computes, bit for bit. Micro-batches run one after another when called eagerly; traced,
    `T.overlap` can run them side by side.

    `in_axes` says which arguments are split, following `jax.vmap`: a pytree prefix of the positional
    arguments whose leaves are an int (the batch axis) or None (not split: parameters, masks shared by
    all rows). An int for a whole argument applies to every tensor inside it; a single int applies to
    every argument. So for `fn(params, x)` write `in_axes=(None, 0)`: the default `in_axes=0` would
    split the parameters too. Splitting an `nn.Parameter` is refused unless in_axes asks for it
    explicitly, with an int at that very leaf: `in_axes=({"w": 0, "b": None}, 0)`, or `in_axes=(0, 0)`
    for `fn(w, x)` with `w` a Parameter; an int broadcast over a dict of parameters (or the default
    0) is not explicit. Every split input must have the same size along its axis, the batch size.

    Tensors passed by keyword are split along axis 0, like `jax.vmap` does with keyword arguments.
    A keyword tensor whose axis 0 is not the batch size, or that has no dimensions, or that is an
    nn.Parameter, is an error: pass it positionally with an in_axes entry (None to share it across
    micro-batches).

    `out_axes`, a pytree prefix of the result, says how each output leaf is merged: an int
    concatenates the micro-batches' values along that axis; "sum" adds them; "mean" averages them
    weighted by micro-batch size, so a mean loss over micro-batches equals the full-batch mean loss,
    and `T.microbatch(df.value_and_grad(loss_fn), num, in_axes=(None, 0), out_axes="mean")` is
    gradient accumulation; None keeps the first micro-batch's value. An output that reads no split
    input (`w * 2` beside the batch outputs) is the same in every micro-batch: it comes back as the
    unsplit function's value whatever its out_axes (never `num` copies, never `num` times too large).

    The batch is cut like `torch.tensor_split`: when `num` does not divide it, the first
    micro-batches get one row more than the last ones (7 rows in 3: 3, 2, 2). `num` may not exceed
    the batch size.

    Some computations mean something else on a part of the batch: an op that mixes rows (train-mode
    BatchNorm, a mean over the batch subtracted from the rows, a similarity matrix of rows against
    rows), an output reduced over the batch but concatenated by out_axes, an inplace update of a
    shared input (it runs once per micro-batch). Tracing the micro-batched function warns about
    each (a UserWarning naming the op and its module) when it can tell; put such layers in eval mode,
    merge losses with "mean" or "sum", or keep those computations outside the micro-batched function.
    Telling shared outputs and these cases apart costs one trace of a micro-batch (on abstract values,
    no data), once per input signature.

    >>> fn, params = df.pure(model)
    >>> step = T.microbatch(fn, num=2, in_axes=(None, 0))               # params shared, x split on axis 0
    >>> y = step(params, x)                                            # == fn(params, x)
    >>> accumulate = T.microbatch(df.value_and_grad(loss_fn), num=4, in_axes=(None, 0, 0), out_axes="mean")
    >>> loss, grads = df.jit(accumulate)(params, x, labels)           # == the full-batch loss and gradients

    Called without `fn`, returns the transform, for `T.compose`. Applied to a Program, it traces the
    Program's source again (the nn.Parameter check needs the real arguments, so it runs only when the
    transformed function is called or traced).
    """
    return apply_transform(fn, MicrobatchPass(num, in_axes, out_axes))
