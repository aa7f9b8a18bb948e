"""Where a Dynamo graph holds the batch, for `df.compile_backend(buckets=...)`.

Once torch.compile has seen the batch size change, Dynamo captures one graph whose batch size is a
symbol (`s0`): an input of its own, and dimension 0 of the tensors the model was called with. With
buckets, the backend pads that dimension instead of planning every size: the batched inputs are the
tensors passed by the caller (never model state, `backend._passed_by_the_caller`) whose dimension 0
is the symbol, the size inputs equal to it are bound to the padded size, and the outputs whose
dimension 0 is the symbol are cut back.

That is exact only when the symbol means "rows" everywhere it appears. A graph in which it appears
otherwise (a flattened `[s0 * 128, 64]` input or output, an output of `s0 + 1` rows, a state tensor
of `s0` rows) cannot be padded by cutting dimension 0: `find_batch` says why, and the backend plans
it per size, as without buckets.

The batch may also hide under a second symbol. Dynamo gives each dimension it made dynamic a symbol
of its own, and ties two only where an op needs them equal (a broadcast). An op that does not, such
as transformers' mask indexing `attention_mask[arange(batch)[:, None, None, None], kv_index]`,
leaves the mask's rows as `s1` beside the ids' `s0`, with the same size in the call. Padding the ids
alone would index past the mask's rows at every bucket (on a GPU, a device-side assert). So a tensor
passed by the caller whose dimension 0 is another symbol, appearing nowhere but as a dimension 0, is
padded too where the graph reads its rows as the batch's rows (`_read_by_batch_rows`): through ops
that keep every row where it is (a dtype cast, a slice of later dimensions, padding them) into an
index whose first index is `arange` of the batch size, so that row `b` of what it reads is row `b` of
the tensor. With as many rows as the batch, padding both then reads what the unpadded call reads, in
every real row; a call in which the two sizes differ runs a plan of its own exact sizes
(`Batch.agreeing`). A tensor read any other way is not guessed at, whatever its rows in the call that
made the graph (Dynamo made it for every size): one with as many rows only by chance (image
embeddings averaged over their own rows) would be silently wrong padded, and one left unpadded
beside padded ids may be read by the batch's size (`images[:batch]`, past its rows at a bucket). It
makes the graph planned per size, with a warning. A symbol that also sizes another dimension (a
sequence length equal to the batch by chance) is not a batch.

Padded, the batch size is the bucket's, everywhere the graph reads it. That is right where it shapes
tensors (`view(b, -1)`, `arange(b)`, `zeros(b, d)`) or counts all the rows (`x[:b]`): those are the
padded batch's rows, cut off the outputs later. Read as a number (`x * x.shape[0]`, a fill value,
`x[b - 1]`), it would give the bucket's value in the real rows, so such a graph is planned per size
(`_read_as_a_number`), as is one that mixes rows it makes from the batch size (`made_rows`). What the
graph does with the rows it was passed (a softmax over them, a batch mean) the padding check of df.jit
finds once the graph is traced; for the backend, which chose to pad, that too means planning per size
(`JitOptions.refuse_inexact_padding`).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx

from .. import compat
from ..ir.tree import tensors_in
from ..jitting.state import is_state
from ..transforms.made_rows import made_rows_mixed
from .node_text import op_text, where
from .symbols import SYMBOL, mentions


@dataclass(frozen=True)
class Batch:
    """The batch of one graph: `symbol` (its size, as Dynamo names it), the graph inputs padded along
    dimension 0 (`tensors`), by position; the size inputs, each with the padded tensor whose rows it
    counts (`sizes`: size position -> tensor position); and each output's batch axis (`out_axes`: 0,
    or None for an output without the batch). `agreeing` are the padded tensors under a second symbol
    (see the module docstring): a call pads them only when their rows are the batch's."""

    symbol: str
    tensors: frozenset[int]
    sizes: dict[int, int]
    out_axes: tuple[int | None, ...]
    agreeing: frozenset[int] = frozenset()


def find_batch(graph_module: fx.GraphModule, example_inputs: Sequence[Any],
               passed: Sequence[bool | None]) -> Batch | str | None:
    """The graph's `Batch`; None if no tensor the caller passed has a symbolic dimension 0 (nothing to
    pad); or why the symbol found there cannot be padded."""
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    values = [node.meta.get("example_value") for node in placeholders]
    candidates = [i for i, (value, example) in enumerate(zip(values, example_inputs))
                  if i < len(passed) and passed[i] is True and isinstance(value, torch.Tensor) and value.dim()
                  and not is_state(example) and SYMBOL.fullmatch(str(value.shape[0]))]
    if not candidates:
        return None
    symbol = str(values[candidates[0]].shape[0])
    names = [compat.dynamo_input_name(node) for node in placeholders]
    outputs = [result.meta.get("example_value") if isinstance(result, fx.Node) else result
               for result in _output_node(graph_module).args[0]]
    sized = [*values, *outputs]
    agreeing = frozenset(i for i in candidates if str(values[i].shape[0]) != symbol
                         and not any(_sizes_other_than_rows(value, str(values[i].shape[0])) for value in sized)
                         and _read_by_batch_rows(placeholders[i], symbol))
    second = _second_symbol([i for i in candidates if i not in agreeing], values, sized, names)
    if second is not None:
        return second
    tensors = frozenset(i for i in candidates if str(values[i].shape[0]) == symbol) | agreeing
    counted = {str(values[i].shape[0]): i for i in sorted(tensors, reverse=True)}
    sizes = {i: counted[str(value)] for i, value in enumerate(values)
             if isinstance(value, torch.SymInt) and str(value) in counted}
    for i, value in enumerate(values):
        shown = list(value.shape) if isinstance(value, torch.Tensor) else value
        if i not in tensors | sizes.keys() and _mentions(value, symbol, skip_first=False):
            return f"input {names[i]} ({shown}) has the batch size {symbol} in it but is not padded along dimension 0"
        if i in tensors and _mentions(value, symbol, skip_first=True):
            return f"input {names[i]} has the batch size {symbol} in another dimension too ({shown})"
    symbols = {symbol, *(str(values[i].shape[0]) for i in agreeing)}
    read = _read_as_a_number(graph_module, symbols) or made_rows_mixed(
        graph_module.graph, functools.partial(_symbol_axes, symbols=symbols), lambda node: f"{op_text(node)}{where(node)}")
    if read is not None:
        return read
    out_axes = []
    for index, value in enumerate(outputs):
        batched = isinstance(value, torch.Tensor) and value.dim() and str(value.shape[0]) == symbol
        if _mentions(value, symbol, skip_first=bool(batched)):
            shown = list(value.shape) if isinstance(value, torch.Tensor) else value
            return f"output {index} ({shown}) has the batch size {symbol} in it other than as its dimension 0"
        out_axes.append(0 if batched else None)
    return Batch(symbol, tensors, sizes, tuple(out_axes), agreeing)


def _second_symbol(candidates: Sequence[int], values: Sequence[Any], sized: Sequence[Any],
                   names: Sequence[str]) -> str | None:
    """Why the batch may also hide under a second symbol: a candidate whose dimension 0 is another
    symbol, which sizes nothing in `sized` (inputs and outputs) but dimensions 0; None if no candidate
    is one. Its size in this call does not matter: Dynamo made the graph for every size, so a tensor
    with other rows now may have the batch's in the next call."""
    first = candidates[0]
    symbol = str(values[first].shape[0])
    for i in candidates:
        other = str(values[i].shape[0])
        if other != symbol and not any(_sizes_other_than_rows(value, other) for value in sized):
            return (f"input {names[i]} has its rows under another symbol ({other}, not the {symbol} of "
                    f"{names[first]}), and the graph reads them other than as the batch's rows, so whether it holds "
                    f"the batch cannot be told. To pad both, say so: df.jit(step, buckets=..., in_axes=...) pads "
                    f"exactly the arguments in_axes names, e.g. in_axes=(0, 0) for (input_ids, attention_mask)")
    return None


_SIZED_BY_METHODS = frozenset({"view", "reshape", "expand", "new_zeros", "new_ones", "new_empty", "new_full", "repeat",
                               "unflatten", "size"})
"""Tensor methods whose arguments after the tensor are sizes (`new_full`'s fill value excepted)."""

_SIZED_BY_FUNCTIONS = frozenset({torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn,
                                 torch.reshape})
"""Functions whose arguments are sizes (`full`'s fill value excepted); `arange` counts the rows only up
to the size, from 0 by 1 (`_arange_end`)."""

_FILL_POSITIONS = {"new_full": 2, torch.full: 1}


def _symbol_axes(node: fx.Node, symbols: set[str]) -> list[list[int]]:
    """The dimensions of each tensor `node` gives that hold one of `symbols` (`transforms.made_rows.BatchAxes`)."""
    return [[axis for axis, size in enumerate(tensor.shape) if mentions(size, symbols)]
            for tensor in tensors_in(node.meta.get("example_value"))]


def _read_as_a_number(graph_module: fx.GraphModule, symbols: set[str]) -> str | None:
    """Why the graph cannot be padded if it reads a size of the batch (one of `symbols`, or an expression
    of one) as a number: `x * x.shape[0]`, `torch.full(shape, float(b))`, `x[b - 1]`. Padded, the size
    is the bucket's, so such a value would be too. Sizes that only shape tensors (`view(b, -1)`,
    `arange(b)`, `zeros(b, d)`) or count all the rows (`x[:b]`) are the padded batch's rows, which the
    outputs are cut back to. None if every read is such."""
    for node in graph_module.graph.nodes:
        value = node.meta.get("example_value")
        if not mentions(value, symbols):
            continue
        for user in node.users:
            if not _reads_as_a_size(user, node, str(value) in symbols):
                return (f"it reads the batch size ({value}) as a number in {op_text(user)}{where(user)}, and padded, "
                        f"that number would be the bucket's")
    return None


def _reads_as_a_size(user: fx.Node, size: fx.Node, whole_batch: bool) -> bool:
    """Whether `user` reads `size` only as a size: in arithmetic on sizes, as a size argument of a call
    that makes or reshapes a tensor, or (`whole_batch`, the batch size itself) as the end of a slice of
    all the rows (`x[:b]`)."""
    value = user.meta.get("example_value")
    if isinstance(value, torch.SymInt) or (isinstance(value, (tuple, list)) and value
                                           and all(isinstance(v, (int, torch.SymInt)) for v in value)):
        return True
    if user.op == "output":
        return True                                       # the output checks say whether it can be cut
    if user.op == "call_function" and user.target is torch.arange:
        return _arange_end(user) is size              # the rows' numbers; as a start or a step, a value
    sized = ((user.op == "call_method" and user.target in _SIZED_BY_METHODS)
             or (user.op == "call_function" and user.target in _SIZED_BY_FUNCTIONS))
    if sized:
        fill = _FILL_POSITIONS.get(user.target)
        fills = [*user.args[fill:fill + 1], user.kwargs.get("fill_value")] if fill is not None else []
        return not any(size in _nodes_in(f) for f in fills)
    if user.op == "call_function" and user.target is operator.getitem and whole_batch:
        index = _index_tuple(user.args[1])
        return (isinstance(index[0], slice) and index[0].start in (None, 0) and index[0].stop is size
                and index[0].step in (None, 1) and not any(size in _nodes_in(i) for i in index[1:]))
    return False


def _arange_end(arange: fx.Node) -> Any:
    """The end of an `arange` node that counts from 0 by 1; None for any other."""
    bounds = [*arange.args, *(arange.kwargs[k] for k in ("start", "end", "step") if k in arange.kwargs)]
    if len(bounds) == 1:
        bounds = [0, bounds[0], 1]
    start, end, step = (*bounds, 1)[:3] if len(bounds) in (2, 3) else (None, None, None)
    return end if start == 0 and step == 1 else None


def _nodes_in(argument: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(argument, found.append)
    return found


_KEEPING_ROWS = frozenset({"to", "bool", "float", "half", "bfloat16", "double", "long", "int", "contiguous", "clone",
                           "detach"})
"""Tensor methods that read each element where it is: a dtype or device cast, a copy."""

_LATER_INDICES = (slice, int, type(None), type(Ellipsis))


def _read_by_batch_rows(tensor: fx.Node, symbol: str) -> bool:
    """Whether the graph reads every row of a graph input as the batch's row of that number: each path
    from it goes through ops that keep every row where it is (`_keeps_rows`) into an index whose first
    index is `arange` of the batch size `symbol` (`_indexes_by_batch_rows`), and the input is each op's
    first argument alone."""
    frontier, seen = [tensor], {tensor}
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if not _only_first_argument(user, node):
                return False
            if _indexes_by_batch_rows(user, symbol):
                continue
            if not _keeps_rows(user):
                return False
            if user not in seen:
                seen.add(user)
                frontier.append(user)
    return True


def _only_first_argument(user: fx.Node, node: fx.Node) -> bool:
    others: list[fx.Node] = []
    fx.node.map_arg((user.args[1:], user.kwargs), others.append)
    return bool(user.args) and user.args[0] is node and node not in others


def _keeps_rows(user: fx.Node) -> bool:
    """Whether row `b` of what `user` makes of its first argument is that argument's row `b`, made from
    it alone: a cast (`_KEEPING_ROWS`), an index of later dimensions (`x[:, 1:]`, `x[:, None]`), or
    padding of later dimensions."""
    if user.op == "call_method":
        return user.target in _KEEPING_ROWS and not any(isinstance(a, fx.Node) for a in (*user.args[1:], *user.kwargs.values()))
    if user.op != "call_function":
        return False
    if user.target is operator.getitem:
        index = _index_tuple(user.args[1])
        return bool(index) and index[0] == slice(None) and all(isinstance(i, _LATER_INDICES) for i in index[1:])
    if user.target is torch.nn.functional.pad:
        pad = user.args[1] if len(user.args) > 1 else user.kwargs.get("pad")
        return (isinstance(pad, (list, tuple)) and all(type(p) is int for p in pad)
                and len(pad) <= 2 * (_rank(user.args[0]) - 1))
    return False


def _indexes_by_batch_rows(user: fx.Node, symbol: str) -> bool:
    """Whether `user` indexes its first argument `x` as `x[rows, ...]`, where `rows` counts the batch's
    rows (`_counts_batch_rows`) and no other index tensor has rows of its own: row `b` of the result
    is then read from row `b` of `x`."""
    if user.op != "call_function" or user.target is not operator.getitem:
        return False
    index = _index_tuple(user.args[1])
    if not index or not _counts_batch_rows(index[0], symbol):
        return False
    rank = _rank(index[0])
    for other in index[1:]:
        value = other.meta.get("example_value") if isinstance(other, fx.Node) else None
        if isinstance(value, torch.Tensor):
            first = value.shape[0] if value.dim() else None
            if value.dtype == torch.bool or value.dim() > rank or (value.dim() == rank and not (type(first) is int and first == 1)):
                return False
        elif not isinstance(other, _LATER_INDICES):
            return False
    return True


def _counts_batch_rows(index: Any, symbol: str) -> bool:
    """Whether `index` is `arange(batch)`, with dimensions of size 1 added after its first
    (`arange(batch)[:, None, None]`): the numbers of the batch's rows, in order."""
    while (isinstance(index, fx.Node) and index.op == "call_function" and index.target is operator.getitem
           and (shape := _index_tuple(index.args[1])) and shape[0] == slice(None) and all(i is None for i in shape[1:])):
        index = index.args[0]
    if not isinstance(index, fx.Node) or index.op != "call_function" or index.target is not torch.arange:
        return False
    end = _arange_end(index)
    return (isinstance(end, fx.Node) and isinstance(value := end.meta.get("example_value"), torch.SymInt)
            and str(value) == symbol)


def _index_tuple(index: Any) -> tuple:
    return index if isinstance(index, tuple) else (index,)


def _rank(node: Any) -> int:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value.dim() if isinstance(value, torch.Tensor) else 0


def _output_node(graph_module: fx.GraphModule) -> fx.Node:
    (output,) = [node for node in graph_module.graph.nodes if node.op == "output"]
    return output


def _sizes_other_than_rows(value: Any, symbol: str) -> bool:
    """Whether `symbol` sizes anything in `value` but a dimension 0: a tensor's other dimensions, or a size
    input that is an expression of it (`s1 * 4`); the size input `symbol` itself does not count."""
    if isinstance(value, torch.SymInt) and str(value) == symbol:
        return False
    return _mentions(value, symbol, skip_first=isinstance(value, torch.Tensor))


def _mentions(value: Any, symbol: str, skip_first: bool) -> bool:
    """Whether a tensor's shape (from dimension 1 with `skip_first`) or a size mentions `symbol`."""
    sizes = list(value.shape)[1 if skip_first else 0:] if isinstance(value, torch.Tensor) else [value]
    return any(mentions(size, {symbol}) for size in sizes)
