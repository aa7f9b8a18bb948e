"""Rows a graph makes itself from the batch size, which padding or splitting the batch changes where
the graph mixes them.

Padding a batch to a bucket (`df.jit(buckets=...)`, `df.compile_backend(buckets=...)`) adds rows of
zeros to the tensors the caller passed, and micro-batching (`T.microbatch`) runs the graph on part of
them. The row analysis (`transforms.batch_rows`) follows the passed rows through the traced graph: it
sees every op that mixes them. It cannot see rows the graph makes from the batch size, since the
graph is traced at the bucket's (or micro-batch's) size, where the batch size is only a number. Padded:

* a tensor with the batch size in two dimensions, sized by it (`x.repeat(1, b)`,
  `x[:, None].expand(b, b, d)`, `torch.ones(b, b)`; rows times rows, `x @ x.T`, the row analysis
  reports): padded, the second dimension holds the bucket's count too, and whatever is
  reduced over it takes in the padded rows;
* rows made in the graph (`torch.ones(b)`, `x.new_ones(b)`, `torch.arange(b)`, `w.expand(b, d)`):
  padded, they hold the bucket's rows, whose values are not zeros (`ones`) or not the padded inputs'
  rows at all (`arange`). Used row by row, as transformers' masks and rotary tables use them, the real
  rows read what they read unpadded. Reduced over the rows (`torch.ones(b).sum()`), indexed by a row
  number (`arange(b)[-1]`), or reordered or accumulated along them (`flip(0)`, `cumsum(0)`), they read
  the padded rows.

Split into micro-batches, each micro-batch makes rows of its own count, and the same ops read that
count, not the batch's.

Which dimensions hold the batch size is the caller's to say (`BatchAxes`): Dynamo's graphs name it
by a symbol (`s0`), and a graph traced at two batch sizes shows it as the dimensions that changed.
What is computed from made rows alone is made rows too (`arange(b).flip(0)[:, None] * 2`). Once
made rows meet the padded inputs' rows (`x + arange(b)[:, None]`, a mask read by `arange(b)`), the
result is rows the row analysis follows: whatever mixes them from there, it sees.
"""

from __future__ import annotations

from typing import Callable

from torch import fx

BatchAxes = Callable[[fx.Node], list[list[int]]]
"""A node's dimensions that hold the batch size (of the batch, or a size computed from it: `s0*s1`,
rows flattened with a sequence, are still the rows, each where it was), one list per tensor it gives;
empty for a node that gives no tensor."""

_MAKES_ITS_VALUES = frozenset({
    "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "zeros_like", "ones_like", "empty_like",
    "full_like", "rand_like", "randn_like", "randint_like", "new_zeros", "new_ones", "new_empty", "new_full",
    "new_tensor", "scalar_tensor", "empty_strided"})
"""Calls whose result's values come from nowhere but the call: their rows are made, whatever they take."""

_ALONG_ONE_DIMENSION = {
    "flip": (0, None), "roll": (1, None), "cumsum": (0, None), "cumprod": (0, None), "cummax": (0, None),
    "cummin": (0, None), "logcumsumexp": (0, None), "softmax": (0, None), "log_softmax": (0, None),
    "_softmax": (0, None), "_log_softmax": (0, None), "sort": (0, -1), "argsort": (0, -1), "topk": (1, -1),
    "msort": (None, 0), "flipud": (None, 0), "fliplr": (None, 1), "diff": (1, -1)}
"""Calls (as written, or as aten ops) that read each element with others along one dimension, keeping
it: the position of that dimension among the arguments after the tensor (None: fixed) and its default
(None: all of them)."""


def made_rows_mixed(graph: fx.Graph, batch_axes: BatchAxes, describe: Callable[[fx.Node], str]) -> str | None:
    """Where the graph mixes rows it makes from the batch size (module docstring), in the words of a
    finding, naming ops by `describe`; None if it does not."""
    made: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        axes = batch_axes(node)
        arguments = [argument for argument in node.all_input_nodes if any(batch_axes(argument))]
        for result_axes in axes:
            if len(result_axes) > 1 and len(arguments) < 2:    # rows times rows: the row analysis reports those
                return (f"{describe(node)} makes a tensor with the batch size in dimensions {result_axes}: the rows "
                        f"of one meet every row of the other")
        batched = any(axes)
        if batched and (_name(node) in _MAKES_ITS_VALUES or not arguments):
            made.add(node)
        elif arguments and all(argument in made for argument in arguments) and axes:
            if not batched:
                return (f"{describe(node)} reduces or indexes rows that the graph makes from the batch size (by "
                        f"{describe(arguments[0])})")
            if _along_the_rows(node, arguments[0], batch_axes):
                return (f"{describe(node)} reads rows that the graph makes from the batch size (by "
                        f"{describe(arguments[0])}) along the rows")
            made.add(node)
    return None


def _along_the_rows(node: fx.Node, argument: fx.Node, batch_axes: BatchAxes) -> bool:
    """Whether `node` (one of `_ALONG_ONE_DIMENSION`) works along the batch axis of `argument`, its
    first argument."""
    if _name(node) not in _ALONG_ONE_DIMENSION or not node.args or node.args[0] is not argument:
        return False
    argument_axes = batch_axes(argument)
    rank = _rank(argument)
    if len(argument_axes) != 1 or rank is None:
        return False
    position, default = _ALONG_ONE_DIMENSION[_name(node)]
    if position is None:
        dims = default
    elif len(node.args) > position + 1:
        dims = node.args[position + 1]
    else:
        dims = node.kwargs.get("dims", node.kwargs.get("dim", default))
    if dims is None:
        return True                                            # all of them: the rows too
    dims = dims if isinstance(dims, (tuple, list)) else (dims,)
    return any(isinstance(dim, int) and dim % max(rank, 1) in argument_axes[0] for dim in dims)


def _name(node: fx.Node) -> str:
    """The call's name as written (`flip`, `Tensor.flip`'s `flip`) or as its aten op's (`aten.flip.default`'s)."""
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(getattr(target, "overloadpacket", target), "__name__", "")


def _rank(node: fx.Node) -> int | None:
    value = node.meta.get("val", node.meta.get("example_value"))
    return value.dim() if hasattr(value, "dim") else None
