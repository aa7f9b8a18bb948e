"""Batch buckets: the sizes `df.jit(fn, buckets=...)` plans for, the padding of a call up to its
bucket, and the slicing of the outputs back to the real rows.

A serving loop's batch changes every step. Planned size by size, each new size would trace, lower
and capture a plan of its own, with memory of its own. Serving engines capture a short list of
sizes instead and pad each step's batch up to the next one: vLLM captures
`[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)`, SGLang `[1, 2, 4, 8, 12] + range(16, 257, 8)`.
This module is that padding, in three parts with one job each:

* `BucketTable`: batch size -> bucket, as one list index (a decode step cannot afford a bisect over
  Python objects on every call);
* `BatchLayout`: for one argument structure, which leaves are batched along which axis (`in_axes`,
  a pytree prefix of the positional arguments as `T.microbatch` takes it; keyword tensors along axis
  0) and what their padded rows hold (`pad_value`, zeros by default); `pad` grows them to the bucket
  with one `constant_pad_nd` each, and a call at a bucket's own size is not touched;
* `OutputAxes`: the outputs cut back to the real rows along `out_axes` (views, no copy).

Padded rows must be harmless: values that produce no NaN or Inf (zeros, for most models) and, for a
function that writes shared state from its rows (a KV cache indexed by the rows' slots), values that
write where no real row reads (a dummy cache slot, as SGLang pads). `padding_check` asks whether the
rows of a function are independent at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import optree
import torch

from ..errors import InputError
from ..ir import tree
from .state import is_state

SERVING_BUCKETS = (1, 2, 4, *range(8, 256, 8), 256)
"""`buckets="serving"`: vLLM's default capture sizes up to 256, 35 buckets: 1, 2, 4, then every
multiple of 8. A batch of 5 runs the plan of 8, one of 250 the plan of 256 (at most 7 padded rows,
or one in 32 of a large batch)."""

_SCALARS = (bool, int, float)


def bucket_sizes(value: Any) -> tuple[int, ...] | None:
    """`buckets` as a tuple of sizes ("serving" spelled out), or None; raises InputError on a list
    that is not a strictly increasing sequence of positive ints."""
    if value is None:
        return None
    if isinstance(value, str):
        if value == "serving":
            return SERVING_BUCKETS
        raise InputError(f"buckets takes a sequence of batch sizes or 'serving', got {value!r}")
    try:
        sizes = tuple(value)
    except TypeError:
        raise InputError(f"buckets takes a sequence of batch sizes or 'serving', got {value!r}") from None
    if not sizes:
        raise InputError("buckets is empty: give the batch sizes to plan for, e.g. (1, 2, 4, 8), or 'serving'")
    for size in sizes:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InputError(f"buckets are batch sizes, positive ints; got {size!r} in {value!r}")
    repeated = sorted({size for size in sizes if sizes.count(size) > 1})
    if repeated:
        raise InputError(f"buckets lists {repeated[0]} more than once in {value!r}; give each size once")
    if list(sizes) != sorted(sizes):
        raise InputError(f"buckets must be sorted, smallest first: got {value!r}, e.g. {tuple(sorted(sizes))}")
    return sizes


class BucketTable:
    """The bucket of every batch size up to the largest bucket, precomputed: `table[rows]`."""

    def __init__(self, sizes: Sequence[int]):
        self.sizes = tuple(sizes)
        self.largest = self.sizes[-1]
        table: list[int] = []
        for size in self.sizes:
            table += [size] * (size + 1 - len(table))
        self.table = table

    def bucket(self, rows: int) -> int:
        """The smallest bucket of at least `rows` rows; `rows` itself past the largest bucket."""
        return self.table[rows] if rows < len(self.table) else rows


@dataclass(frozen=True)
class Batched:
    """A leaf of the call that is padded: its position among the leaves, its batch axis, the value of
    its padded rows and its name for messages."""

    position: int
    axis: int
    value: bool | int | float
    name: str


class BatchLayout:
    """Which leaves of calls of one structure are batched, and how they are padded (module docstring)."""

    def __init__(self, batched: Sequence[Batched]):
        self.batched = tuple(batched)
        self.positions = frozenset(b.position for b in self.batched)
        self.first = self.batched[0]

    @classmethod
    def of(cls, fn: Callable[..., Any], in_axes: Any, pad_value: Any, args: tuple, kwargs: dict,
           leaves: Sequence[Any], paths: Sequence[tuple], fixed_args: Sequence[int] = ()) -> "BatchLayout":
        """The layout of calls with these arguments (flattened to `leaves` at `paths`); `fixed_args` are
        the positional arguments that must keep their memory (donated, persistent): never padded."""
        names = tree.argument_names(fn, len(args))
        axes = _per_positional_leaf(in_axes, args, "in_axes")
        values = _per_positional_leaf(pad_value, args, "pad_value")
        batched = []
        for position, (path, leaf) in enumerate(zip(paths, leaves)):
            positional = position < len(axes)
            axis = axes[position] if positional else 0
            if axis is None or not isinstance(leaf, torch.Tensor):
                continue
            name = tree.path_to_str(path, names)
            value = values[position] if positional and values[position] is not None else 0
            _check_padded_leaf(leaf, axis, value, name, positional and path[1] in fixed_args)
            batched.append(Batched(position, axis, value, name))
        if not batched:
            raise InputError(f"in_axes={in_axes!r} gives no tensor argument a batch axis, so buckets have nothing to "
                             f"pad: give the batched arguments an axis, e.g. in_axes=(None, 0) for fn(params, x)")
        layout = cls(batched)
        layout.check_rows(leaves, layout.rows(leaves))
        return layout

    def rows(self, leaves: Sequence[Any]) -> int:
        """The batch size of a call: the first batched leaf's size along its axis."""
        return leaves[self.first.position].shape[self.first.axis]

    def check_rows(self, leaves: Sequence[Any], rows: int) -> None:
        """Raise unless every batched leaf has `rows` rows."""
        sizes = [(b, leaves[b.position].shape[b.axis]) for b in self.batched]
        if any(size != rows for _, size in sizes):
            listed = ", ".join(f"{b.name} along axis {b.axis} (size {size})" for b, size in sizes[:4])
            raise InputError(f"the batched arguments disagree on the batch size: {listed}. in_axes must name the "
                             f"batch axis of each batched argument and None for the others")

    def pad(self, leaves: Sequence[Any], rows: int, bucket: int) -> list[Any]:
        """The leaves with every batched one grown from `rows` to `bucket` rows of its pad value."""
        padded = list(leaves)
        for b in self.batched:
            leaf = leaves[b.position]
            if leaf.shape[b.axis] != rows:
                self.check_rows(leaves, rows)
            trailing = leaf.dim() - 1 - b.axis % leaf.dim()
            padded[b.position] = torch.constant_pad_nd(leaf, [0, 0] * trailing + [0, bucket - rows], b.value)
        return padded


def _per_positional_leaf(prefix: Any, args: tuple, option: str) -> list[Any]:
    """The entry of `prefix`, a pytree prefix of the positional arguments, for each of their leaves in
    the order df.jit flattens them (a None argument is no leaf)."""
    try:
        full = optree.tree_broadcast_prefix(prefix, args, none_is_leaf=True)
    except ValueError:
        raise InputError(f"{option}={prefix!r} is no pytree prefix of the positional arguments, whose structure is "
                         f"{optree.tree_structure(args, none_is_leaf=True)}: give one entry per argument (a tuple "
                         f"of {len(args)}), or one value for all of them") from None
    entries = optree.tree_leaves(full, none_is_leaf=True)
    return [entry for entry, leaf in zip(entries, optree.tree_leaves(args, none_is_leaf=True)) if leaf is not None]


def _check_padded_leaf(leaf: torch.Tensor, axis: Any, value: Any, name: str, fixed: bool) -> None:
    """Refuse to pad what padding would break: model state, a donated or persistent argument (its
    padded copy is another tensor), an axis the tensor lacks, a pad value of the wrong kind."""
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise InputError(f"in_axes leaves are an int (the batch axis) or None (not batched); got {axis!r} for {name}")
    if isinstance(leaf, torch.nn.Parameter) or is_state(leaf):
        raise InputError(f"in_axes pads {name} along axis {axis}, but it is model state (a parameter or buffer), "
                         f"shared by every row: give it None in in_axes, e.g. in_axes=(None, 0) for fn(params, x)")
    if fixed:
        raise InputError(f"in_axes pads {name}, which donate_argnums or persistent_argnums names: a padded "
                         f"argument is a new tensor on every call. Give it None in in_axes, or pass it unnamed")
    if not -leaf.dim() <= axis < leaf.dim() or leaf.dim() == 0:
        raise InputError(f"in_axes gives axis {axis} for {name}, which has {leaf.dim()} dimensions (shape "
                         f"{list(leaf.shape)}); give the arguments that are not batched None")
    if not isinstance(value, _SCALARS):
        raise InputError(f"pad_value leaves are Python scalars (or None for zeros); got {value!r} for {name}")
    if isinstance(value, float) and not (leaf.is_floating_point() or leaf.is_complex()):
        raise InputError(f"pad_value {value!r} for {name} is a float, but {name} holds {leaf.dtype}: give an int")
    if value is not None and not _fits(value, leaf.dtype):
        raise InputError(f"pad_value {value!r} for {name} does not fit its dtype {leaf.dtype}: padded rows would hold "
                         f"another value (or Inf). Give a value the dtype holds")


def _fits(value: Any, dtype: torch.dtype) -> bool:
    """Whether a Python scalar is held by `dtype` as it is: within an integer dtype's range (0 or 1 for
    bool), within a floating dtype's finite range unless it is infinite or NaN itself."""
    if dtype == torch.bool:
        return value in (0, 1)
    if dtype.is_floating_point:
        return not math.isfinite(value) or abs(value) <= torch.finfo(dtype).max
    if dtype.is_complex:
        return True
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max


class OutputAxes:
    """`out_axes`, a pytree prefix of the function's outputs, and the slicing of padded outputs."""

    def __init__(self, out_axes: Any):
        self.out_axes = out_axes
        self.single = out_axes if isinstance(out_axes, int) and not isinstance(out_axes, bool) else None
        self._axes: dict[Any, list[Any]] = {}

    def unpad(self, outputs: Any, rows: int, bucket: int) -> Any:
        """The outputs of a call padded from `rows` to `bucket` rows, cut back to `rows` (views)."""
        if self.single is not None and type(outputs) is torch.Tensor:
            return _narrowed(outputs, self.single, rows, bucket, lambda: "the output")
        leaves, treedef = optree.tree_flatten(outputs)
        axes = self.axes(treedef, outputs)
        cut = [leaf if axis is None or not isinstance(leaf, torch.Tensor)
               else _narrowed(leaf, axis, rows, bucket, lambda i=i: tree.output_path_to_str(treedef.paths()[i]))
               for i, (leaf, axis) in enumerate(zip(leaves, axes))]
        return optree.tree_unflatten(treedef, cut)

    def axes(self, treedef: Any, outputs: Any) -> list[Any]:
        """The out_axes entry of each output leaf, for outputs of this structure."""
        axes = self._axes.get(treedef)
        if axes is None:
            try:
                full = optree.tree_broadcast_prefix(self.out_axes, outputs, none_is_leaf=True)
            except ValueError:
                raise InputError(f"out_axes={self.out_axes!r} is no pytree prefix of the outputs, whose structure is "
                                 f"{treedef}: give one entry per output, or one int for all of them") from None
            entries = optree.tree_leaves(full, none_is_leaf=True)
            axes = [e for e, leaf in zip(entries, optree.tree_leaves(outputs, none_is_leaf=True)) if leaf is not None]
            self._axes[treedef] = axes
        return axes


def _narrowed(tensor: torch.Tensor, axis: int, rows: int, bucket: int, where: Callable[[], str]) -> torch.Tensor:
    """`tensor` cut to its first `rows` rows along `axis`, which must hold the `bucket` padded rows."""
    size = tensor.shape[axis] if -tensor.dim() <= axis < tensor.dim() else None
    if size != bucket:
        what = f"its size along it is {size}" if size is not None else f"it has {tensor.dim()} dimensions"
        raise InputError(f"out_axes gives axis {axis} for {where()}, but {what}, not the padded batch of {bucket} "
                         f"rows: give it None in out_axes (returned as it is), or the axis that holds its batch rows")
    return tensor.narrow(axis, 0, rows)
