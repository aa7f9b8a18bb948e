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

Nor can a graph in which the batch may hide under a second symbol. Dynamo gives each dimension it
made dynamic a symbol of its own, and ties two only where an op needs them equal (a broadcast). An
op that does not, such as transformers' mask indexing `attention_mask[arange(batch)]`, leaves the
mask's rows as `s1` beside the ids' `s0`, with the same size in the call. Padding the ids alone
would index past the mask's rows at every bucket (on a GPU, a device-side assert); padding both
would be a guess, and wrong for a tensor that only has as many rows by chance (image embeddings
scattered into the batch). So a tensor passed by the caller whose dimension 0 is another symbol of
the same size, appearing nowhere but as a dimension 0, makes the graph planned per size. A symbol
that also sizes another dimension (a sequence length equal to the batch by chance) is not a batch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx

from .. import compat
from ..jitting.state import is_state

_NAME = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class Batch:
    """The batch of one graph: `symbol` (its size, as Dynamo names it), the graph inputs padded along
    dimension 0 (`tensors`) and bound to the padded size (`sizes`), by position, and each output's
    batch axis (`out_axes`: 0, or None for an output without the batch)."""

    symbol: str
    tensors: frozenset[int]
    sizes: frozenset[int]
    out_axes: tuple[int | None, ...]


def find_batch(graph_module: fx.GraphModule, example_inputs: Sequence[Any],
               passed: Sequence[bool | None]) -> Batch | str | None:
    """The graph's `Batch`; None if no tensor the caller passed has a symbolic dimension 0 (nothing to
    pad); or why the symbol found there cannot be padded."""
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    values = [node.meta.get("example_value") for node in placeholders]
    candidates = [i for i, (value, example) in enumerate(zip(values, example_inputs))
                  if i < len(passed) and passed[i] is True and isinstance(value, torch.Tensor) and value.dim()
                  and not is_state(example) and _NAME.fullmatch(str(value.shape[0]))]
    if not candidates:
        return None
    symbol = str(values[candidates[0]].shape[0])
    tensors = frozenset(i for i in candidates if str(values[i].shape[0]) == symbol)
    names = [compat.dynamo_input_name(node) for node in placeholders]
    outputs = [result.meta.get("example_value") if isinstance(result, fx.Node) else result
               for result in _output_node(graph_module).args[0]]
    second = _second_symbol(candidates, values, [*values, *outputs], example_inputs, names)
    if second is not None:
        return second
    sizes = frozenset(i for i, value in enumerate(values) if isinstance(value, torch.SymInt) and str(value) == symbol)
    for i, value in enumerate(values):
        shown = list(value.shape) if isinstance(value, torch.Tensor) else value
        if i not in tensors | sizes and _mentions(value, symbol, skip_first=False):
            return f"input {names[i]} ({shown}) has the batch size {symbol} in it but is not padded along dimension 0"
        if i in tensors and _mentions(value, symbol, skip_first=True):
            return f"input {names[i]} has the batch size {symbol} in another dimension too ({shown})"
    out_axes = []
    for index, value in enumerate(outputs):
        batched = isinstance(value, torch.Tensor) and value.dim() and str(value.shape[0]) == symbol
        if _mentions(value, symbol, skip_first=bool(batched)):
            shown = list(value.shape) if isinstance(value, torch.Tensor) else value
            return f"output {index} ({shown}) has the batch size {symbol} in it other than as its dimension 0"
        out_axes.append(0 if batched else None)
    return Batch(symbol, tensors, sizes, tuple(out_axes))


def _second_symbol(candidates: Sequence[int], values: Sequence[Any], sized: Sequence[Any],
                   example_inputs: Sequence[Any], names: Sequence[str]) -> str | None:
    """Why the batch may also hide under a second symbol: a candidate whose dimension 0 is another
    symbol with as many rows in this call, which sizes nothing in `sized` (inputs and outputs) but
    dimensions 0; None if no candidate is one."""
    first = candidates[0]
    symbol, rows = str(values[first].shape[0]), _concrete(example_inputs[first].shape[0])
    for i in candidates:
        other = str(values[i].shape[0])
        size = _concrete(example_inputs[i].shape[0])
        if (other != symbol and (size is None or rows is None or size == rows)
                and not any(_sizes_other_than_rows(value, other) for value in sized)):
            return (f"input {names[i]} has as many rows as {names[first]} ({rows}) under another symbol ({other}, "
                    f"not {symbol}): Dynamo did not tie the two sizes, so whether it holds the batch cannot be told. "
                    f"To pad both, say so: df.jit(step, buckets=..., in_axes=...) pads exactly the arguments "
                    f"in_axes names, e.g. in_axes=(0, 0) for (input_ids, attention_mask)")
    return None


def _output_node(graph_module: fx.GraphModule) -> fx.Node:
    (output,) = [node for node in graph_module.graph.nodes if node.op == "output"]
    return output


def _concrete(size: Any) -> int | None:
    """A size of an example input as an int; None where it is symbolic (its value unknown here, so any
    two sizes may be equal)."""
    return size if type(size) is int else None


def _sizes_other_than_rows(value: Any, symbol: str) -> bool:
    """Whether `symbol` sizes anything in `value` but a dimension 0: a tensor's other dimensions, or a size
    input that is an expression of it (`s1 * 4`); the size input `symbol` itself does not count."""
    if isinstance(value, torch.SymInt) and str(value) == symbol:
        return False
    return _mentions(value, symbol, skip_first=isinstance(value, torch.Tensor))


def _mentions(value: Any, symbol: str, skip_first: bool) -> bool:
    """Whether a tensor's shape (from dimension 1 with `skip_first`) or a size mentions `symbol`."""
    sizes = list(value.shape)[1 if skip_first else 0:] if isinstance(value, torch.Tensor) else [value]
    return any(symbol in _NAME.findall(str(size)) for size in sizes if isinstance(size, torch.SymInt))
