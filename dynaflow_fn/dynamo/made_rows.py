"""Rows a Dynamo graph makes itself, which padding changes where the graph mixes them.

`df.compile_backend(buckets=...)` pads the batch the caller passed with zeros, and df.jit's padding
check (`transforms.batch_rows`) follows those rows through the traced graph: it sees every op that
mixes them. It cannot see rows the graph makes from the batch size, since it traces at the bucket's
size, where the batch size is only a number:

* a tensor with the batch size in two dimensions (`x.repeat(1, b)`, `x[:, None].expand(b, b, d)`,
  `torch.ones(b, b)`): padded, the second dimension holds the bucket's count too, and whatever is
  reduced over it takes in the padded rows;
* rows made in the graph (`torch.ones(b)`, `x.new_ones(b)`, `torch.arange(b)`, `w.expand(b, d)`):
  padded, they hold the bucket's rows, whose values are not zeros (`ones`) or not the padded inputs'
  rows at all (`arange`). Used row by row, as transformers' masks and rotary tables use them, the real
  rows read what they read unpadded. Reduced over the rows (`torch.ones(b).sum()`), indexed by a row
  number (`arange(b)[-1]`), or reordered or accumulated along them (`flip(0)`, `cumsum(0)`), they read
  the padded rows.

Here the batch size is a symbol (`s0`), so both can be told exactly from the shapes Dynamo recorded:
`rows_padding_would_change` says why a graph does either, and the backend then plans it per size.
What is computed from made rows alone is made rows too (`arange(b).flip(0)[:, None] * 2`). Once
made rows meet the padded inputs' rows (`x + arange(b)[:, None]`, a mask read by `arange(b)`), the
result is rows the padding check follows: whatever mixes them from there, it sees.
"""

from __future__ import annotations

import torch
from torch import fx

from ..ir.tree import tensors_in
from .node_text import op_text, where
from .symbols import mentions

_MAKES_ITS_VALUES = frozenset({
    "zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "zeros_like", "ones_like", "empty_like",
    "full_like", "rand_like", "randn_like", "randint_like", "new_zeros", "new_ones", "new_empty", "new_full",
    "new_tensor"})
"""Calls whose result's values come from nowhere but the call: their rows are made, whatever they take."""

_ALONG_ONE_DIMENSION = {
    "flip": (0, None), "roll": (1, None), "cumsum": (0, None), "cumprod": (0, None), "cummax": (0, None),
    "cummin": (0, None), "logcumsumexp": (0, None), "softmax": (0, None), "log_softmax": (0, None),
    "sort": (0, -1), "argsort": (0, -1), "topk": (1, -1), "msort": (None, 0), "flipud": (None, 0),
    "fliplr": (None, 1), "diff": (1, -1)}
"""Calls that read each element with others along one dimension, keeping it: the position of that
dimension among the arguments after the tensor (None: fixed) and its default (None: all of them)."""


def rows_padding_would_change(graph_module: fx.GraphModule, symbols: set[str]) -> str | None:
    """Why padding the batch (of the size `symbols` name) would change the real rows' results through a
    tensor the graph makes from the batch size (module docstring); None if it does not."""
    made: set[fx.Node] = set()
    for node in graph_module.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        results = tensors_in(node.meta.get("example_value"))
        for result in results:
            if sum(mentions(size, symbols) for size in result.shape) > 1:
                return (f"{op_text(node)}{where(node)} makes a tensor with the batch size in two dimensions "
                        f"({list(result.shape)}), and padded, the bucket's rows would enter the real rows' results")
        batched_results = [result for result in results if _batch_axes(result, symbols)]
        arguments = [argument for argument in node.all_input_nodes
                     if any(_batch_axes(value, symbols) for value in tensors_in(argument.meta.get("example_value")))]
        if batched_results and (_name(node) in _MAKES_ITS_VALUES or not arguments):
            made.add(node)
        elif arguments and all(argument in made for argument in arguments) and results:
            if not batched_results:
                return (f"{op_text(node)}{where(node)} reduces or indexes rows that the graph makes from the batch "
                        f"size (by {_origin(arguments[0])}), and padded, it would read the bucket's rows")
            if _along_the_rows(node, arguments[0], symbols):
                return (f"{op_text(node)}{where(node)} reads rows that the graph makes from the batch size (by "
                        f"{_origin(arguments[0])}) along the rows, and padded, it would read the bucket's rows")
            made.add(node)
    return None


def _origin(node: fx.Node) -> str:
    return f"{op_text(node)}{where(node)}"


def _along_the_rows(node: fx.Node, argument: fx.Node, symbols: set[str]) -> bool:
    """Whether `node` (one of `_ALONG_ONE_DIMENSION`) works along the batch axis of `argument`, its
    first argument."""
    if _name(node) not in _ALONG_ONE_DIMENSION or not node.args or node.args[0] is not argument:
        return False
    value = argument.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return False
    axes = _batch_axes(value, symbols)
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
    return any(isinstance(dim, int) and dim % value.dim() in axes for dim in dims)


def _name(node: fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _batch_axes(value: torch.Tensor, symbols: set[str]) -> list[int]:
    """The dimensions of `value` that hold the batch's rows: of the batch size, or of a size computed
    from it (`s0*s1`, rows flattened with a sequence: still the rows, each where it was)."""
    return [axis for axis, size in enumerate(value.shape) if mentions(size, symbols)]
